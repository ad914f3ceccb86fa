"""Merge search (run key ``merge_search``): the method's parameters searched with Optuna on the validation
split, the best trial's parameters then merged as any run's are. Beside greedy soup, the other fusion
that looks at validation data; both score on the shared scorer (shardfuse.scoring.scorer.Scorer), so the
test split is never opened here.

The search, as Optuna users know it:

  space       run key -> ``[low, high]`` (a float uniform in the range, Optuna's ``suggest_float``; an
              integer parameter's ``suggest_int``), ``[v1, v2, ...]`` with three or more values or
              booleans (``suggest_categorical``), or ``simplex`` for ``merge_weights`` (one weight per
              rank uniform in [0, 1], normalised by the method; Dirichlet-like)
  sampler     ``tpe`` (TPESampler, the default), ``cmaes`` (CmaEsSampler; no categorical parameter),
              ``random`` (RandomSampler), ``grid`` (GridSampler over ``grid_points`` values per range)
  objective   ``val_<score>`` (the task's: accuracy, loss, mse) or ``val_loss``; its direction is the
              metric's (lower loss is better)
  trials      the number of COMPLETE trials the study holds when the merge ends

Resumable: the study lives in an RDB storage (SQLite, ``results/runs/<run>/search.db``) under a name that
is a digest of the search's settings but not of ``trials``; each finished trial is written to it whole
(the sampler works on a copy in memory): a killed merge resumes it (the trial the kill interrupted was
never stored; none complete is repeated), a larger ``trials``
continues it, another space or sampler starts another study. Reproducible: each trial is sampled by a
sampler seeded with ``seed`` plus the number of complete trials before it (and of those the method
refused), from those trials, so a resumed study samples what an uninterrupted one would, and the same
seed gives the same trials.

Cheap trials: the ranks (and base) are read once per study into float64 arrays when they fit in
``MEMORY_BUDGET``, each trial merges them in memory tensor by tensor with the method's plan
(:func:`shardfuse.fusion.engine.merge_arrays`); a larger model streams each trial through the engine. The
validation batches are those of one Scorer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardfuse.io import UserError, sha256_file

SAMPLERS = ("tpe", "cmaes", "random", "grid")
MEMORY_BUDGET = 2 << 30  # bytes of float64 inputs held for in-memory trials
SIMPLEX = "simplex"


@dataclass(frozen=True)
class Dimension:
    key: str  # the run key, merge_<param>
    param: str
    kind: str  # float | int | categorical | simplex
    low: float | None = None
    high: float | None = None
    choices: tuple[Any, ...] = ()


@dataclass(frozen=True)
class SearchSpec:
    trials: int
    sampler: str
    seed: int
    objective: str
    space: tuple[Dimension, ...]
    grid_points: int = 5
    granularity: str = "model"  # model: one value per parameter; layer: one per layer (a gradient)

    def study_name(self, method: str, inputs: Mapping[str, Any] | None = None) -> str:
        """The study's name: a digest of everything but ``trials`` (more trials continue the study) and of
        ``inputs``, what a trial's value depends on besides its parameters (the ranks' and base's digests,
        the validation split's, the parameters not searched): a re-trained run starts a new study."""
        settings = {"method": method, "sampler": self.sampler, "seed": self.seed, "objective": self.objective}
        settings["inputs"] = dict(inputs or {})
        settings["space"] = [d.__dict__ for d in self.space]
        settings["grid_points"] = self.grid_points
        if self.granularity != "model":
            settings["granularity"] = self.granularity
        digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=list).encode()).hexdigest()
        return f"{method}-{digest[:12]}"


def parse(search: Mapping[str, Any], method: str, param_kinds: Mapping[str, str], where: str) -> SearchSpec:
    """A ``merge_search`` mapping checked against the method's parameters (``param_kinds``: name ->
    number | integer | boolean | weights); one line naming the key otherwise."""
    fix = "fix merge_search (config/README.md, 'Merge search')"
    if not isinstance(search, Mapping):
        raise UserError(
            f"{where} must be a mapping {{trials, space, ...}}, got {type(search).__name__}; {fix}"
        )
    trials = search.get("trials")
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
        raise UserError(f"{where}.trials must be an integer >= 1, got {trials!r}; {fix}")
    sampler = search.get("sampler", "tpe")
    if sampler not in SAMPLERS:
        raise UserError(f"{where}.sampler {sampler!r} is not one of {', '.join(SAMPLERS)}; {fix}")
    seed = search.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**31:
        raise UserError(f"{where}.seed must be an integer from 0 to 2^31 - 1, got {seed!r}; {fix}")
    space = search.get("space")
    if not isinstance(space, Mapping) or not space:
        raise UserError(f"{where}.space must name at least one parameter, e.g. {{merge_scale: [0.1, 2.0]}}")
    dimensions = []
    for key, value in space.items():
        param = key[len("merge_") :] if isinstance(key, str) and key.startswith("merge_") else None
        if param not in param_kinds:
            takes = ", ".join(f"merge_{p}" for p in param_kinds) or "none"
            raise UserError(
                f"{where}.space.{key}: merge method {method} has no such parameter (it takes {takes})"
            )
        dimensions.append(_dimension(f"{where}.space.{key}", key, param, param_kinds[param], value))
    if sampler == "cmaes" and any(d.kind == "categorical" for d in dimensions):
        name = next(d.key for d in dimensions if d.kind == "categorical")
        raise UserError(
            f"{where}.sampler cmaes searches continuous ranges, but {name} is categorical; use sampler tpe "
            "or give a range"
        )
    grid_points = search.get("grid_points", 5)
    if not isinstance(grid_points, int) or isinstance(grid_points, bool) or grid_points < 2:
        raise UserError(f"{where}.grid_points must be an integer >= 2, got {grid_points!r}; {fix}")
    if sampler == "grid" and any(d.kind == "simplex" for d in dimensions):
        raise UserError(f"{where}.sampler grid cannot enumerate merge_weights: simplex; use tpe or random")
    objective = search.get("objective")
    if objective is not None and not (isinstance(objective, str) and objective.startswith("val_")):
        raise UserError(
            f"{where}.objective must be val_<score> (e.g. val_accuracy, val_loss), got {objective!r}"
        )
    granularity = search.get("granularity", "model")
    if granularity not in ("model", "layer"):
        raise UserError(f"{where}.granularity must be model or layer, got {granularity!r}")
    if granularity == "layer" and sampler == "grid":
        raise UserError(
            f"{where}.granularity layer has one value per layer: use sampler tpe, cmaes or random"
        )
    if granularity == "layer" and not any(d.kind in ("float", "simplex") for d in dimensions):
        raise UserError(f"{where}.granularity layer searches ranges per layer; give a [low, high] range")
    keys = {"trials", "sampler", "seed", "space", "objective", "grid_points", "granularity"}
    unknown = set(search) - keys
    if unknown:
        raise UserError(f"{where}: unknown key {sorted(unknown)[0]!r}; {fix}")
    return SearchSpec(trials, sampler, seed, objective or "", tuple(dimensions), grid_points, granularity)


def _dimension(where: str, key: str, param: str, kind: str, value: Any) -> Dimension:
    if kind == "weights":
        if value != SIMPLEX:
            raise UserError(f"{where} must be simplex (one weight per rank, searched and normalised)")
        return Dimension(key, "weights", "simplex")
    if not isinstance(value, list) or len(value) < 2:
        raise UserError(f"{where} must be [low, high] or a list of 3 or more values, got {value!r}")
    if kind == "boolean" or len(value) > 2:
        if kind != "boolean" and not all(_number(v) for v in value):
            raise UserError(f"{where} lists values that are not numbers: {value!r}")
        if kind == "boolean" and not all(isinstance(v, bool) for v in value):
            raise UserError(f"{where} must list true and/or false, got {value!r}")
        return Dimension(key, param, "categorical", choices=tuple(value))
    low, high = value
    if not (_number(low) and _number(high)):
        raise UserError(f"{where} must be [low, high] of numbers, got {value!r}")
    if not low < high:
        raise UserError(f"{where} [{low}, {high}] is empty or inverted; give low < high")
    if kind == "integer":
        if not (isinstance(low, int) and isinstance(high, int)):
            raise UserError(f"{where} is an integer parameter: give [low, high] of integers")
        return Dimension(key, param, "int", low, high)
    return Dimension(key, param, "float", float(low), float(high))


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ---------------------------------------------------------------- the study


@dataclass(frozen=True)
class Trial:
    number: int
    params: dict[str, Any]  # the method's parameters this trial merged with
    value: float | None
    state: str


def _sampler(spec: SearchSpec, seed: int):
    import optuna

    if spec.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if spec.sampler == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=seed)
    if spec.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    grid = {}
    for d in spec.space:
        if d.kind == "categorical":
            grid[d.key] = list(d.choices)
        elif d.kind == "int":
            grid[d.key] = sorted(
                {
                    round(d.low + (d.high - d.low) * i / (spec.grid_points - 1))
                    for i in range(spec.grid_points)
                }
            )
        else:
            grid[d.key] = [
                d.low + (d.high - d.low) * i / (spec.grid_points - 1) for i in range(spec.grid_points)
            ]

    class Grid(optuna.samplers.GridSampler):
        def after_trial(self, study, trial, state, values) -> None:
            pass  # Optuna's stops an optimize() loop once every point ran; run_study asks is_exhausted

    return Grid(grid, seed=spec.seed)


def _suggest(trial, spec: SearchSpec, num_ranks: int, num_layers: int = 0) -> dict[str, Any]:
    """One trial's parameters. With granularity layer, a float range and each rank's simplex weight take
    one value per layer: a gradient of ``num_layers`` values, so layer i gets value i exactly and the
    tensors outside the layers (embeddings, read-out) layer 0's, mergekit's t = 0."""
    layers = range(num_layers) if spec.granularity == "layer" else None

    def floats(name: str, low: float, high: float) -> Any:
        if layers is None:
            return trial.suggest_float(name, low, high)
        return [trial.suggest_float(f"{name}_layer{i}", low, high) for i in layers]

    params: dict[str, Any] = {}
    for d in spec.space:
        if d.kind == "float":
            params[d.param] = floats(d.key, d.low, d.high)
        elif d.kind == "int":
            params[d.param] = trial.suggest_int(d.key, int(d.low), int(d.high))
        elif d.kind == "categorical":
            params[d.param] = trial.suggest_categorical(d.key, list(d.choices))
        else:  # simplex: one weight per rank in [0.001, 1]; the method normalises them
            params["weights"] = [floats(f"merge_weights_{r}", 1e-3, 1.0) for r in range(num_ranks)]
    return params


def run_study(
    spec: SearchSpec,
    method: str,
    storage_path: Path,
    fixed: dict[str, Any],
    evaluate: Callable[[dict[str, Any]], float],
    lower_is_better: bool,
    num_ranks: int,
    num_layers: int = 0,
    inputs: Mapping[str, Any] | None = None,
) -> tuple[list[Trial], str]:
    """Complete the study to ``spec.trials`` COMPLETE trials; returns every trial (in number order) and the
    study's name. ``evaluate(params)`` merges with ``fixed`` | the trial's params and returns the score."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    states = optuna.trial.TrialState
    storage_path.parent.mkdir(parents=True, exist_ok=True)
    storage = optuna.storages.RDBStorage(f"sqlite:///{storage_path}")
    name = spec.study_name(method, inputs)
    direction = "minimize" if lower_is_better else "maximize"
    study = optuna.create_study(study_name=name, storage=storage, direction=direction, load_if_exists=True)
    for stale in study.get_trials(deepcopy=False, states=(states.RUNNING,)):  # another writer's, killed
        storage.set_trial_state_values(stale._trial_id, states.FAIL)
    # The sampler works on a copy in memory; each finished trial goes to the SQLite study whole, in one
    # transaction (add_trial): a kill loses the trial it interrupted and nothing else, and a trial costs
    # one write instead of the ask/suggest/tell round trips (bench/RESULTS.md, "Merge search").
    work = optuna.create_study(direction=direction)
    work.add_trials(study.get_trials(deepcopy=False, states=(states.COMPLETE, states.FAIL)))
    done = len(work.get_trials(deepcopy=False, states=(states.COMPLETE,)))
    refused = sum("error" in t.user_attrs for t in work.get_trials(deepcopy=False))
    attempts = 0
    while done < spec.trials and attempts < 3 * spec.trials:  # every trial failing ends it too
        attempts += 1
        # Seeded by what came before that a re-run also has: the complete trials and those the method
        # refused (a trial a kill interrupted was never stored, so a resumed study samples as a whole one).
        work.sampler = _sampler(spec, spec.seed + done + 1_000_003 * refused)
        if spec.sampler == "grid" and work.sampler.is_exhausted(work):
            break
        trial = work.ask()
        params = {**fixed, **_suggest(trial, spec, num_ranks, num_layers)}
        trial.set_user_attr("params", params)
        try:
            value = evaluate(params)
        except UserError as exc:  # parameters the method refuses at some tensor: a failed trial
            trial.set_user_attr("error", str(exc))
            value = None
        if value is not None and not math.isfinite(value):
            trial.set_user_attr("error", f"the objective is {value}")
            value = None
        if value is None:
            work.tell(trial, state=states.FAIL)
            refused += 1
        else:
            work.tell(trial, value)
            done += 1
        study.add_trial(work.get_trials(deepcopy=False)[-1])
    trials = [
        Trial(t.number, t.user_attrs.get("params", {}), t.value, t.state.name)
        for t in study.get_trials(deepcopy=False)
    ]
    return trials, name


# ---------------------------------------------------------------- trials on a training's ranks

IN_MEMORY = ("F16", "F32", "F64")  # float dtypes numpy holds: merged in memory, trial after trial


class TrialMerger:
    """The ranks (and base) of one training merged again and again with other parameters: read once into
    float64 arrays when they fit in MEMORY_BUDGET and numpy holds their dtype (each merge then runs the
    method's plan tensor by tensor in memory), else each merge streams through the engine. Open it with
    ``with``; :meth:`tensors` gives the merged weights as torch tensors (the scorer's input)."""

    def __init__(self, gather, method: str) -> None:
        self.gather, self.method = gather, method
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> TrialMerger:
        import numpy as np

        from shardfuse.checkpoints.stream import SafetensorsReader, decode_float, file_order
        from shardfuse.fusion.methods import registry
        from shardfuse.fusion.methods.settings import count_layers

        stack, gather = self._stack, self.gather
        self.readers = [stack.enter_context(SafetensorsReader(r.path)) for r in gather.ranks]
        uses_base = registry.method_record(self.method).uses_base
        self.base = stack.enter_context(SafetensorsReader(gather.base)) if uses_base else None
        self.info = self.readers[0].tensors
        self.names = file_order({name: (t.dtype.name, list(t.shape)) for name, t in self.info.items()})
        inputs = len(self.readers) + (self.base is not None)
        size = sum(t.numel for t in self.info.values()) * 8 * inputs
        self.in_memory = size <= MEMORY_BUDGET and all(
            t.dtype.name in IN_MEMORY or not t.dtype.is_float for t in self.info.values()
        )
        self.num_layers = count_layers(name for name, t in self.info.items() if t.dtype.is_float)

        def read(reader: SafetensorsReader, name: str) -> np.ndarray:
            info = reader.tensors[name]
            raw = reader.read_array(info)
            if not info.dtype.is_float:
                return raw
            flat = raw.reshape(-1).view(np.uint8)
            return decode_float(flat, info.dtype, np.empty(info.numel)).reshape(info.shape)

        self.held = [{n: read(r, n) for n in self.names} for r in self.readers] if self.in_memory else None
        self.held_base = None
        if self.in_memory and self.base is not None:
            self.held_base = {n: read(self.base, n) for n in self.names}
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def tensors(self, params: dict[str, Any]) -> dict[str, Any]:
        """The merge with ``params`` (the method's, checked by its record), as torch tensors."""
        import numpy as np
        import torch

        from shardfuse.fusion.engine import Engine, MemorySink, merge_arrays
        from shardfuse.fusion.methods import registry

        method, rows = self.method, self.gather.rows_trained
        resolved = registry.resolve_params(method, params, rows)
        weights = registry.rank_weights(method, resolved, rows)
        if self.held is None:
            sink = MemorySink(self.info)
            numbers = self.gather.rank_numbers
            Engine(self.readers, self.base, method, resolved, numbers, weights).run(self.names, sink)
            return sink.tensors_for_torch()
        floats = [name for name in self.names if self.info[name].dtype.is_float]
        table = registry.tensor_params(method, resolved, floats, len(self.readers), warn=False)
        out = {}
        for name in self.names:
            info = self.info[name]
            values, rank_weights = resolved, weights
            if table is not None and name in table.by_tensor:  # per layer or per tensor
                values = table.by_tensor[name]
                if "weights" in table.varying:
                    rank_weights = registry.tensor_weights(method, values, weights)
            arrays = [h[name] for h in self.held]
            base = None if self.held_base is None else self.held_base[name]
            merged, _ = merge_arrays(method, values, arrays, base, name, rank_weights)
            if info.dtype.is_float:
                merged = merged.astype(np.dtype(info.dtype.holder))
            out[name] = torch.from_numpy(np.ascontiguousarray(merged))
        return out


def objective_of(spec: SearchSpec, task) -> tuple[str, bool]:
    """(the metric the study optimises, whether lower is better)."""
    metric = spec.objective[len("val_") :] if spec.objective else task.score
    if metric not in (task.score, "loss"):
        raise UserError(
            f"merge_search objective val_{metric} is not one this task scores on the validation split; use "
            f"val_{task.score}{' or val_loss' if task.score != 'loss' else ''}"
        )
    return metric, task.lower_is_better if metric == task.score else True


def search_merge(
    gather,
    method: str,
    given: dict[str, Any],
    spec: SearchSpec,
    val_split: Path,
    batch_size: int,
    storage_path: Path,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Search ``method``'s parameters on the validation split for the ranks gather.json lists; returns
    (the best trial's parameters, merge.json's ``search`` record). ``given`` are the run's own merge
    parameters: the ones not searched stay at them, and their validation score is recorded beside the
    best one."""
    from shardfuse.fusion.methods.settings import LAYER_NAMES
    from shardfuse.scoring.scorer import Scorer
    from shardfuse.scoring.split import load_split

    fix = "merge_search scores trials on the validation split — set the dataset's val_fraction > 0 (e.g. 0.1)"
    split = load_split(val_split, "val").require_rows("validation", fix)
    scorer = Scorer(split, gather.model or {}, batch_size)
    metric, lower_is_better = objective_of(spec, scorer.task)
    with TrialMerger(gather, method) as merger:
        if spec.granularity == "layer" and merger.num_layers < 2:
            raise UserError(
                "merge_search granularity layer needs a model whose tensor names show two or more layers "
                f"({LAYER_NAMES}); use granularity model"
            )

        def evaluate(params: dict[str, Any]) -> float:
            return float(scorer.score(merger.tensors(params))[metric])

        default_value = evaluate(dict(given))
        inputs = {
            "ranks": [r.sha256 for r in gather.ranks],
            "base": None if merger.base is None else merger.base.hexdigest(),
            "val_split": sha256_file(split.path),
            "given": given,
        }
        trials, study = run_study(
            spec, method, storage_path, dict(given), evaluate, lower_is_better, len(merger.readers),
            merger.num_layers, inputs,
        )  # fmt: skip
        num_layers, in_memory = merger.num_layers, merger.in_memory
    complete = [t for t in trials if t.state == "COMPLETE"]
    if not complete:
        raise UserError(
            f"merge_search: no trial of {len(trials)} completed (the method refused every parameter set "
            "sampled); narrow merge_search.space"
        )
    best = min(complete, key=lambda t: (t.value if lower_is_better else -t.value, t.number))
    search_record = {
        "study": study,
        "storage": str(storage_path),
        "sampler": spec.sampler,
        "seed": spec.seed,
        "objective": f"val_{metric}",
        "direction": "minimize" if lower_is_better else "maximize",
        "space": {
            d.key: (
                d.kind if d.kind == "simplex" else [d.low, d.high] if d.low is not None else list(d.choices)
            )
            for d in spec.space
        },
        "trials_requested": spec.trials,
        "trials_done": len(complete),
        "trials_failed": sum(t.state == "FAIL" for t in trials),
        "granularity": spec.granularity,
        "num_layers": num_layers,
        "in_memory": in_memory,
        "val_split": str(split.path),
        "val_rows": split.rows,
        "best_trial": best.number,
        "best_params": best.params,
        "best_value": best.value,
        "default_params": dict(given),
        "default_value": default_value,
        "trials": [
            {"number": t.number, "params": t.params, "value": t.value, "state": t.state} for t in trials
        ],
    }
    return dict(best.params), search_record
