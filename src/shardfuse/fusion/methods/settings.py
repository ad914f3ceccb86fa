"""Per-layer and per-tensor merge parameters: a parameter's setting, resolved for each tensor from its
name alone, with mergekit's semantics (0.1.5).

  value        0.5: every tensor. Where every parameter is one value nothing is resolved here: the
               engine merges as it always has, bit for bit.
  gradient     [0.0, 0.5, 1.0]: numbers spread evenly over the layers. A tensor of layer i of L sits at
               t = i / (L - 1) (t = 1 when L = 1); a tensor outside the layers (embeddings, final
               norm, read-out) at t = 0, so it takes the first value. With n values, s = t (n - 1) falls
               between values floor(s) and the next, and the value is (1 - f) v[floor(s)] + f v[next],
               f = s - floor(s).
  filter list  [{filter: mlp, value: 0.8}, {filter: attn, value: [0.2, 0.6]}, {value: 0.5}]: the first
               entry whose filter is a substring of the tensor's name gives the value (itself a value
               or a gradient); the last entry, without a filter, is the default.

mergekit's sources: ``mergekit.config.evaluate_setting`` (filters, first match wins, ``filter`` absent
or ``"*"`` matches everything; the interpolation above), ``mergekit.plan.MergePlanner.plan_slice`` (t
of each layer) and ``plan_module`` (``pre_weights`` and ``post_weights`` planned at t = 0), and
``mergekit.parameter_resolver.resolve_parameter`` (a model's ``weight`` resolved with that model's
tensor name). Where shardfuse differs (config/README.md, "Per-layer and per-tensor parameters"):
mergekit knows each tensor's layer from its architecture files, shardfuse from the name
(:data:`LAYER`: ``layers.N.``, ``layer.N.``, ``blocks.N.``, ``block.N.``, ``h.N.``; L is the largest
N + 1 among the tensors merged); a gradient longer than L, a filter list without a final default, a
default before the last entry and a gradient of integers or booleans are refused, where mergekit
samples, falls back to the method's default, ignores the rest, or interpolates (integers) and picks
(booleans); a filter that matches no tensor is a warning.

By hand::

    python -c "from shardfuse.fusion.methods import settings as s; \\
        names = ['embed.weight', 'layers.0.w', 'layers.1.w', 'layers.2.w']; \\
        print([s.evaluate([0.0, 1.0], n, s.position(n, 3)) for n in names])"
    # [0.0, 0.0, 0.5, 1.0]
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from shardfuse.fusion.methods.plan import Param
from shardfuse.io import UserError

# A tensor's layer: the number after one of these name components (the first such in the name).
LAYER = re.compile(r"(?:^|\.)(?:layers|layer|blocks|block|h)\.(\d+)(?=\.|$)")
LAYER_NAMES = "'layers.N.', 'layer.N.', 'blocks.N.', 'block.N.' or 'h.N.'"
# A value inside a rank's gradient or filter list of merge_weights: a rank may fade out over the layers
# (every tensor still needs some rank's weight > 0); a rank's one weight for every tensor stays > 0.
RANK_WEIGHT = Param(None, "number", "a number >= 0", lambda v: v >= 0)
POSITIVE_WEIGHT = Param(None, "number", "a number > 0", lambda v: v > 0)
DEFAULT_FILTERS = (None, "*")  # mergekit: an entry without a filter, or with "*", matches every tensor


def is_filter_list(setting: Any) -> bool:
    return isinstance(setting, list) and bool(setting) and all(isinstance(e, dict) for e in setting)


def layer_index(name: str) -> int | None:
    """The layer of tensor ``name`` (``model.layers.3.mlp.weight``: 3), None outside the layers."""
    match = LAYER.search(name)
    return int(match.group(1)) if match else None


def count_layers(names: Iterable[str]) -> int:
    """L: the largest layer index among ``names`` + 1 (0 when no name has one)."""
    return max((i + 1 for i in map(layer_index, names) if i is not None), default=0)


def position(name: str, num_layers: int) -> float:
    """mergekit's t of tensor ``name`` in a model of ``num_layers`` layers."""
    index = layer_index(name)
    if index is None:
        return 0.0
    return index / (num_layers - 1) if num_layers > 1 else 1.0


def interpolate(values: Sequence[float], t: float) -> float:
    """A gradient's value at ``t`` in [0, 1], by mergekit's arithmetic (so the same float comes out)."""
    scaled = t * (len(values) - 1)
    low = int(scaled)
    high = min(len(values) - 1, low + 1)
    fraction = scaled - low
    return (1 - fraction) * values[low] + fraction * values[high]


def evaluate(setting: Any, name: str, t: float) -> Any:
    """The value of a checked ``setting`` for tensor ``name`` at layer position ``t``."""
    if is_filter_list(setting):
        entry = next(e for e in setting if e.get("filter") in DEFAULT_FILTERS or e["filter"] in name)
        return evaluate(entry["value"], name, t)
    if isinstance(setting, list):
        return interpolate(setting, t)
    return setting


def gradients(setting: Any) -> Iterator[list]:
    """Every gradient in a checked ``setting`` (itself, or its filter entries' values)."""
    for value in (e["value"] for e in setting) if is_filter_list(setting) else (setting,):
        if isinstance(value, list):
            yield value


def filters(setting: Any) -> list[str]:
    return (
        [e["filter"] for e in setting if e.get("filter") not in DEFAULT_FILTERS]
        if is_filter_list(setting)
        else []
    )


# ---------------------------------------------------------------- checks (no tensor needed)


def per_tensor(kind: str, value: Any) -> bool:
    """Whether a parameter of ``kind`` given as ``value`` varies per tensor: a gradient or a filter list
    (for the weights, one per rank: some rank's)."""
    if kind == "weights":
        return isinstance(value, list) and any(isinstance(w, (list, dict)) for w in value)
    return isinstance(value, list)


def checked_weights(value: list, num_ranks: int, describe: str, what: str, fix: str) -> list:
    """merge_weights with some rank's weight a gradient or a filter list, checked rank by rank: each
    rank's is a number > 0, or a gradient or filter list of numbers >= 0."""
    if len(value) != num_ranks:
        raise UserError(
            f"{what} must be {describe} (the run has {num_ranks} ranks), got {len(value)} entries; {fix}"
        )
    checked_ranks = []
    for rank, weight in enumerate(value):
        where = f"{what} rank {rank}"
        if isinstance(weight, dict):
            raise UserError(
                f"{where} is a mapping; a rank's filter list is a list [{{filter: SUBSTRING, value: ...}}, "
                f"..., {{value: ...}}]; {fix}"
            )
        leaf = RANK_WEIGHT if isinstance(weight, list) else POSITIVE_WEIGHT
        checked_ranks.append(checked(weight, leaf, where, fix))
    return checked_ranks


def checked(setting: Any, param: Param, what: str, fix: str) -> Any:
    """``setting`` of ``param`` checked, its numbers as floats; a one-line UserError starting with
    ``what`` and ending with ``fix`` otherwise. Every value is checked, so every interpolated value is
    in range too (each parameter's range is an interval)."""
    if not isinstance(setting, list):
        return _value(setting, param, what, fix)
    if not setting:
        raise UserError(
            f"{what} is an empty list; give a value, a gradient [first, ..., last] or a filter list "
            f"ending with {{value: ...}}; {fix}"
        )
    if is_filter_list(setting):
        return _filter_list(setting, param, what, fix)
    if any(isinstance(e, (dict, list)) for e in setting):
        raise UserError(
            f"{what} mixes values and lists or {{filter, value}} entries: a gradient is a list of numbers, "
            f"a filter list a list of {{filter: SUBSTRING, value: ...}} entries ending with {{value: ...}}; "
            f"{fix}"
        )
    if param.kind != "number":
        raise UserError(
            f"{what} is {param.describe}: a gradient interpolates numbers only; give one value or a filter "
            f"list [{{filter: SUBSTRING, value: ...}}, ..., {{value: ...}}]; {fix}"
        )
    return [_value(value, param, what, fix) for value in setting]


def _value(value: Any, param: Param, what: str, fix: str) -> Any:
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    fits = {
        "number": numeric,
        "integer": isinstance(value, int) and numeric,
        "boolean": isinstance(value, bool),
    }
    if not (fits[param.kind] and param.accept(value)):
        raise UserError(f"{what} must be {param.describe} (each value of a list), got {value!r}; {fix}")
    return float(value) if param.kind == "number" else value


def _filter_list(setting: list[dict], param: Param, what: str, fix: str) -> list[dict]:
    entries = []
    for index, entry in enumerate(setting):
        where = f"{what}: filter entry {index}"
        if "value" not in entry or set(entry) - {"filter", "value"}:
            raise UserError(f"{where} must be {{filter: SUBSTRING, value: ...}}, got {entry!r}; {fix}")
        rule = entry.get("filter")
        if rule is not None and not (isinstance(rule, str) and rule):
            raise UserError(f"{where}'s filter must be a non-empty string, got {rule!r}; {fix}")
        last = index == len(setting) - 1
        if rule in DEFAULT_FILTERS and not last:
            raise UserError(
                f"{where} has no filter, so the entries after it are never used; put the default "
                f"{{value: ...}} last; {fix}"
            )
        if last and rule not in DEFAULT_FILTERS:
            raise UserError(
                f"{what}: a filter list ends with a default {{value: ...}} (no filter) for the tensors no "
                f"filter names, but its last entry filters {rule!r}; add the default; {fix}"
            )
        if is_filter_list(entry["value"]) or isinstance(entry["value"], dict):
            raise UserError(f"{where}'s value must be a value or a gradient, not filters; {fix}")
        entries.append({**entry, "value": checked(entry["value"], param, where, fix)})
    return entries


# ---------------------------------------------------------------- per tensor (the names known)


@dataclass(frozen=True)
class TensorParams:
    """Each merged tensor's parameters (every one a value), resolved from its name before its merge."""

    num_layers: int
    varying: tuple[str, ...]  # the parameters given as a gradient or a filter list (a rank's weight too)
    by_tensor: dict[str, dict[str, Any]]
    unmatched: tuple[str, ...]  # "merge_density filter 'mlp'": filters that match no tensor

    def recorded(self, name: str) -> dict[str, Any]:
        """What merge.json's tensor_stats say of tensor ``name``: its layer and the varying values."""
        values = self.by_tensor[name]
        return {"layer": layer_index(name), "params": {param: values[param] for param in self.varying}}

    def summary(self) -> dict[str, Any]:
        """merge.json's ``per_tensor_params``."""
        return {
            "num_layers": self.num_layers,
            "varying": list(self.varying),
            "unmatched_filters": list(self.unmatched),
        }


def slots(name: str, kind: str, setting: Any) -> list[tuple[str, Any]]:
    """(config key, setting) of each setting of parameter ``name``: one per rank for the weights."""
    if kind == "weights":
        return [(f"merge_weights rank {rank}", s) for rank, s in enumerate(setting or [])]
    return [(f"merge_{name}", setting)]


def varying(params: dict[str, Any], kinds: dict[str, str]) -> tuple[str, ...]:
    """The parameters of ``params`` given as a gradient or a filter list (for a rank, for the weights)."""
    return tuple(name for name, value in params.items() if per_tensor(kinds.get(name, ""), value))


def resolve(
    params: dict[str, Any], kinds: dict[str, str], name: str, t: float, names: Sequence[str]
) -> dict[str, Any]:
    """``params`` with the parameters ``names`` evaluated for tensor ``name`` at position ``t``."""
    resolved = dict(params)
    for param in names:
        setting = params[param]
        resolved[param] = (
            [evaluate(s, name, t) for s in setting]
            if kinds[param] == "weights"
            else evaluate(setting, name, t)
        )
    return resolved


def resolve_tensors(
    params: dict[str, Any],
    kinds: dict[str, str],
    names: Sequence[str],
    check: Callable[[str, dict[str, Any]], None],
    *,
    warn: bool = True,
) -> TensorParams | None:
    """Every tensor's parameters from its name (``check(name, values)`` each), or None where every
    parameter is one value (the engine's path of old). A gradient longer than the layer count is a
    one-line UserError naming its key; a filter that matches no tensor a warning (``warn``)."""
    changing = varying(params, kinds)
    if not changing:
        return None
    num_layers = count_layers(names)
    keyed = [slot for param in changing for slot in slots(param, kinds[param], params[param])]
    for key, setting in keyed:
        for gradient in gradients(setting):
            if len(gradient) > num_layers:
                raise too_long(key, len(gradient), num_layers)
    by_tensor = {}
    for name in names:
        by_tensor[name] = resolve(params, kinds, name, position(name, num_layers), changing)
        check(name, by_tensor[name])
    unmatched = tuple(
        f"{key} filter {rule!r}"
        for key, s in keyed
        for rule in filters(s)
        if not any(rule in n for n in names)
    )
    for what in unmatched if warn else ():
        print(
            f"shardfuse.merge: warning: {what} matches no tensor merged (no name contains it); check it "
            "against the tensor names in merge.json's tensor_stats",
            file=sys.stderr,
            flush=True,
        )
    return TensorParams(num_layers, changing, by_tensor, unmatched)


def too_long(key: str, length: int, num_layers: int) -> UserError:
    layers = f"{num_layers} layers" if num_layers else "no layers"
    fix = f"give at most {num_layers} values" if num_layers else "give one value or a filter list"
    return UserError(
        f"{key} is a gradient of {length} values but the tensors merged have {layers} (a tensor's layer is "
        f"the N of {LAYER_NAMES} in its name); {fix}"
    )
