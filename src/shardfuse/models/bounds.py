"""A checkpoint's model spec against the tensors it holds, without torch: the built-in mlp's exact state
dict, and for the other built-ins no size argument beyond the file, so a header saying
``hidden_sizes: [2e9]`` is refused, never allocated (the trust checks of the stages that rebuild a
model: evaluate, track, merge's alignment, the model registry). A library module; by hand::

    python -c "from shardfuse.models.bounds import check_spec_bounds; \
        print(check_spec_bounds('x', {'model': 'mlp', 'description': {'task': 'classification', \
        'num_features': 4, 'num_outputs': 3}}, {'net.0.weight': (64, 4)}, 'fix it'))"
"""

from __future__ import annotations

import math
from typing import Any

from shardfuse.io import UserError
from shardfuse.models.catalog import MLP_HIDDEN_SIZES, Shapes, builtin
from shardfuse.models.spec import normalized_spec


def shape_mismatch(expected: Shapes, held: Shapes) -> str | None:
    """How the model's state dict (``expected``) differs from the tensors held; None if it does not."""
    for name in expected:
        if name not in held:
            return f"the model has a tensor {name!r} that the file lacks"
        if tuple(expected[name]) != tuple(held[name]):
            return f"tensor {name!r} is {list(expected[name])} in the model, {list(held[name])} in the file"
    extra = sorted(set(held) - set(expected))
    return f"the file has a tensor {extra[0]!r} that the model lacks" if extra else None


def _oversized_argument(value: Any, name: str, num_values: int, num_tensors: int) -> str | None:
    """A built-in's size argument beyond the file: each unit of a width, a depth or a channel count adds
    at least one value (each list entry at least one tensor) to the model."""
    if isinstance(value, dict):
        items = [(f"{name}.{key}", item) for key, item in value.items()]
    elif isinstance(value, list):
        if len(value) > num_tensors:
            return f"{name} has {len(value)} entries, more than the file's {num_tensors} tensors"
        items = [(f"{name}[{index}]", item) for index, item in enumerate(value)]
    else:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > num_values:
            return f"{name} is {value!r}, more than the {num_values} values the file holds"
        return None
    for item_name, item in items:
        if found := _oversized_argument(item, item_name, num_values, num_tensors):
            return found
    return None


def spec_error(
    source: str, ref: str, held: Shapes, detail: str, rerun: str, expected: Shapes | None = None
) -> UserError:
    size = f", {sum(math.prod(s) for s in expected.values())} values" if expected is not None else ""
    return UserError(
        f"the model spec in {source} ({ref}{size}) does not fit the tensors in the file "
        f"({sum(math.prod(s) for s in held.values())} values): {detail}; {rerun}"
    )


def check_spec_bounds(source: str, spec: Any, held: Shapes, rerun: str) -> dict[str, Any]:
    """Refuse, without torch, a spec whose model cannot be the tensors ``held``: the built-in mlp's
    exact state dict; for cnn and transformer, no size argument beyond the file. Returns the normalized
    spec. ``source`` names where the spec was read (e.g. "the header of PATH")."""
    try:
        spec = normalized_spec(spec)
    except UserError as exc:
        raise UserError(f"{source}: {exc}") from None
    try:
        ref = str(spec["model"])
        record = builtin(ref)
        if record is not None and record.state_shapes is not None:
            hidden = spec["args"].get("hidden_sizes", MLP_HIDDEN_SIZES)
            if isinstance(hidden, list) and 2 * (len(hidden) + 1) > len(held):
                detail = f"hidden_sizes has {len(hidden)} layers, the file {len(held)} tensors"
                raise spec_error(source, ref, held, detail, rerun)
            expected = record.state_shapes(spec)
            if detail := shape_mismatch(expected, held):
                raise spec_error(source, ref, held, detail, rerun, expected)
        elif record is not None:
            num_values = sum(math.prod(shape) for shape in held.values())
            if detail := _oversized_argument(spec["args"], "model_args", num_values, len(held)):
                raise spec_error(source, ref, held, detail, rerun)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UserError(f"the model spec in {source} is malformed ({exc!r}); {rerun}") from None
    return spec
