"""Every merge method, one record each: its plan, its parameters with their defaults, whether it needs the
base weights, how it weighs the ranks, how it selects ranks on the validation split (greedy soup), its
cross-parameter check (the config's too), whether it consolidates identical ranks, its reference, and
how it fuses LoRA updates (``update_coefficients``, ``not_on_updates``). Nothing outside these records
decides by a method's name (tests/contracts/test_name_decisions.py).

The merge stage's ``--method`` choices, the config schema's ``merge_method`` enum, the config's
``merge_<param>`` keys and their checks all derive from ``RECORDS`` (tests/contracts hold them equal).
Every lookup reads ``RECORDS`` when it is called (:func:`method_record`, :func:`names`), never a table
frozen at import, so a test that extends ``RECORDS`` extends every stage
(tests/contracts/test_extension_merge_method.py).
Adding a method is its plan in a family module (linear, sparse, spherical) and one record here.
Any parameter may also be given per layer or per tensor, as mergekit's gradients and filter lists
(:mod:`shardfuse.fusion.methods.settings`): :func:`resolve_params` checks them value by value and
:func:`tensor_params` resolves them for each tensor name before the merge reads a tensor.
No command line; by hand::

    python -c "import numpy as np; from shardfuse.fusion.methods import registry; \\
        from shardfuse.fusion import engine; \\
        p = registry.resolve_params('ties', {'density': 0.5}, [10, 10]); \\
        print(engine.merge_arrays('ties', p, [np.ones(4), -np.ones(4)], base=np.zeros(4))[0])"
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shardfuse.fusion.methods import settings
from shardfuse.fusion.methods.linear import (
    ConsolidatePlan,
    ModelStockPlan,
    TaskArithmeticPlan,
    UniformPlan,
    WeightedPlan,
    mean_coefficients,
    scaled_mean_coefficients,
    weight_coefficients,
)
from shardfuse.fusion.methods.plan import (
    SCALE,
    UNIT_DENSITY,
    WEIGHTS,
    Param,
    Plan,
    TensorJob,
    is_running_statistic,
    normalised_list,
)
from shardfuse.fusion.methods.sparse import (
    BreadcrumbsPlan,
    BreadcrumbsTiesPlan,
    DarePlan,
    DellaPlan,
    ScePlan,
    TiesPlan,
)
from shardfuse.fusion.methods.spherical import KarcherPlan, MultislerpPlan, NuslerpPlan, SlerpPlan
from shardfuse.fusion.soup import Select, greedy_soup
from shardfuse.io import MAX_SEED, UserError, find_record

Check = Callable[[str, dict[str, Any], int], None]  # (method, resolved params, number of ranks)
# (resolved params, number of ranks, rank weights or None) -> c_i of merged ΔW = sum_i c_i ΔW_i
Coefficients = Callable[[dict[str, Any], int, list[float] | None], list[float]]


@dataclass(frozen=True)
class Method:
    name: str
    plan: type[Plan]
    reference: str
    params: dict[str, Param] = field(default_factory=dict)
    uses_base: bool = False  # reads the run's base weights (task vectors)
    # Chooses the ranks that go in by scoring candidate merges on the validation split (greedy soup:
    # shardfuse.fusion.soup); the method's plan then merges the chosen ones. None: every rank goes in.
    select: Select | None = None
    check: Check | None = None  # checks across parameters and ranks, after each parameter passed its own
    # Why the method is no function of the ranks' updates theta_i - base alone, and what to use instead
    # (shardfuse.fusion.lora refuses it on LoRA adapters with this); None: merging the updates and adding
    # the result to the base gives what merging the models gives.
    not_on_updates: str | None = None
    # The method is linear in the ranks' updates, with these coefficients (fusion.methods.linear): LoRA's
    # merge_adapter cat (the ranks' factors side by side) is exact for it. None: it is not.
    update_coefficients: Coefficients | None = None
    # The rank weights its plan reads (``job.weights``, summing to 1; merge.json records them): "equal",
    # or "rows": merge_weights where given, else each rank's shard rows (FedAvg). None: it reads none.
    # Running statistics follow: "rows" fuses them by the weighted mean, every other method by the mean.
    weighing: str | None = None
    # Keeps rank 0's weights after checking the ranks agree: it needs a strategy whose ranks end
    # identical, takes a sharded DCP checkpoint (--dcp-dir), has nothing to align, and keeps its own
    # rule for running statistics.
    consolidates: bool = False

    @property
    def uses_val(self) -> bool:
        """Reads the validation split: the merge stage needs ``--val-split`` and the model spec."""
        return self.select is not None


def _two_ranks(fallback: str) -> Check:
    def check(method: str, params: dict[str, Any], num_ranks: int) -> None:
        if num_ranks > 2:
            raise UserError(
                f"{method} interpolates exactly 2 models but the run has {num_ranks} ranks; use world_size 2 "
                f"or {fallback}"
            )

    return check


def _exactly_two_ranks(method: str, params: dict[str, Any], num_ranks: int) -> None:
    if num_ranks != 2:
        raise UserError(
            f"{method} interpolates exactly 2 models but the run has {num_ranks} ranks; use world_size 2 "
            "or another merge method"
        )


def _della_window(method: str, params: dict[str, Any], num_ranks: int) -> None:
    if params["density"] < 1:
        low, high = params["density"] - params["epsilon"], params["density"] + params["epsilon"]
        if not (low > 0 and high < 1):
            raise UserError(
                f"merge method della: density +- epsilon must lie in (0, 1) but is [{low:g}, {high:g}]; "
                "lower merge_epsilon or move merge_density towards 0.5"
            )


MAX_KARCHER_ITER = 10_000  # each iteration is a few vector operations on an N x N Gram matrix
KARCHER_ITER = f"an integer from 1 to {MAX_KARCHER_ITER}"
TIES_DENSITY = Param(0.2, "number", "a number in (0, 1]", lambda v: 0 < v <= 1)
DARE_DENSITY = Param(0.5, "number", "a number in (0, 1]", lambda v: 0 < v <= 1)
SEED = Param(0, "integer", f"an integer from 0 to {MAX_SEED}", lambda v: 0 <= v <= MAX_SEED)
T = Param(0.5, "number", "a number in [0, 1]", lambda v: 0 <= v <= 1)
BREADCRUMBS = {
    "density": UNIT_DENSITY,
    "gamma": Param(0.01, "number", "a number in [0, 1)", lambda v: 0 <= v < 1),
    "scale": SCALE,
}

SPHERICAL = (
    "interpolates the whole weights on a sphere, and their angles and norms move with the frozen base, "
    "not only with the updates; use weighted or task_arithmetic"
)


def _one_rank(method: str, params: dict[str, Any], num_ranks: int) -> None:
    if num_ranks != 1:
        raise UserError(
            f"merge method {method} keeps one model as it is but the run has {num_ranks} ranks; use it on a "
            "run over one checkpoint, or merge the ranks (e.g. uniform)"
        )


RECORDS: tuple[Method, ...] = (
    Method(
        "consolidate",
        ConsolidatePlan,
        "rank 0 after checking the ranks agree (synchronous training)",
        {"tolerance": Param(1e-6, "number", "a number >= 0", lambda v: v >= 0)},
        consolidates=True,
    ),
    Method(
        "uniform",
        UniformPlan,
        "Wortsman et al. 2022, model soups (uniform)",
        update_coefficients=mean_coefficients,
        weighing="equal",
    ),
    Method(
        "none",
        UniformPlan,
        "no merge: a run over one checkpoint, evaluated as it is",
        check=_one_rank,
        weighing="equal",
    ),
    Method(
        "weighted",
        WeightedPlan,
        "McMahan et al. 2017, FedAvg",
        {"weights": WEIGHTS},
        update_coefficients=weight_coefficients,
        weighing="rows",
    ),
    Method(
        "greedy_soup",
        UniformPlan,
        "Wortsman et al. 2022, model soups (greedy)",
        select=greedy_soup,
        not_on_updates="scores candidate soups as whole models on the validation split; use uniform",
    ),
    Method(
        "task_arithmetic",
        TaskArithmeticPlan,
        "Ilharco et al. 2023",
        {"scale": SCALE},
        uses_base=True,
        update_coefficients=scaled_mean_coefficients,
    ),
    Method("ties", TiesPlan, "Yadav et al. 2023", {"density": TIES_DENSITY, "scale": SCALE}, uses_base=True),
    Method(
        "dare",
        DarePlan,
        "Yu et al. 2024",
        {
            "density": DARE_DENSITY,
            "seed": SEED,
            "sign_election": Param(False, "boolean", "true or false"),
            "scale": SCALE,
        },
        uses_base=True,
    ),
    Method(
        "slerp",
        SlerpPlan,
        "Shoemake 1985; mergekit's slerp",
        {"t": T},
        check=_exactly_two_ranks,
        not_on_updates=SPHERICAL,
    ),
    Method("model_stock", ModelStockPlan, "Jang et al. 2024", uses_base=True),
    Method("breadcrumbs", BreadcrumbsPlan, "Davari & Belilovsky 2023", BREADCRUMBS, uses_base=True),
    Method(
        "breadcrumbs_ties",
        BreadcrumbsTiesPlan,
        "Davari & Belilovsky 2023 + TIES",
        BREADCRUMBS,
        uses_base=True,
    ),
    Method(
        "della",
        DellaPlan,
        "Deep et al. 2024",
        {
            "density": UNIT_DENSITY,
            "epsilon": Param(0.15, "number", "a number in [0, 0.5)", lambda v: 0 <= v < 0.5),
            "seed": SEED,
            "sign_election": Param(True, "boolean", "true or false"),
            "scale": SCALE,
        },
        uses_base=True,
        check=_della_window,
    ),
    Method(
        "sce", ScePlan, "Wan et al. 2025, FuseChat-2", {"topk": UNIT_DENSITY, "scale": SCALE}, uses_base=True
    ),
    Method(
        "nuslerp",
        NuslerpPlan,
        "mergekit's nuslerp",
        {"t": T},
        check=_two_ranks("multislerp/karcher"),
        not_on_updates=SPHERICAL,
    ),
    Method(
        "multislerp", MultislerpPlan, "mergekit's multislerp", {"weights": WEIGHTS}, not_on_updates=SPHERICAL
    ),
    Method(
        "karcher",
        KarcherPlan,
        "mergekit's karcher (Karcher 1977)",
        {
            "weights": WEIGHTS,
            "max_iter": Param(
                10,
                "integer",
                f"an integer from 1 to {MAX_KARCHER_ITER}",
                lambda v: 1 <= v <= MAX_KARCHER_ITER,
            ),
            "tol": Param(1e-5, "number", "a number > 0", lambda v: v > 0),
        },
        not_on_updates=SPHERICAL,
    ),
)


def names() -> tuple[str, ...]:
    """Every method's name, in the records' order (the stage's ``--method`` choices, the schema's enum)."""
    return tuple(record.name for record in RECORDS)


def method_record(name: str) -> Method:
    """The record of merge method ``name``; a one-line UserError listing the methods otherwise."""
    return find_record(RECORDS, name, "merge method")


def uses_base(name: str) -> bool:
    return method_record(name).uses_base


def weighted_names() -> tuple[str, ...]:
    """The methods that take per-rank weights (``merge_weights``)."""
    return tuple(record.name for record in RECORDS if "weights" in record.params)


def linear_names() -> tuple[str, ...]:
    """The methods linear in the ranks' updates (LoRA's merge_adapter cat is exact for these only)."""
    return tuple(record.name for record in RECORDS if record.update_coefficients is not None)


def consolidating_names() -> tuple[str, ...]:
    return tuple(record.name for record in RECORDS if record.consolidates)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _valid_type(param: Param, value: Any, num_ranks: int) -> bool:
    if param.kind == "number":
        return _is_number(value)
    if param.kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if param.kind == "boolean":
        return isinstance(value, bool)
    return value is None or (
        isinstance(value, list) and len(value) == num_ranks and all(_is_number(w) and w > 0 for w in value)
    )


def _kinds(method: str) -> dict[str, str]:
    return {name: param.kind for name, param in method_record(method).params.items()}


def resolve_params(method: str, params: Any, rows: list[int]) -> dict[str, Any]:
    """Check ``params`` of ``method`` for a run whose ranks have ``rows`` rows; fill in defaults.

    A parameter given as a gradient or a filter list (:mod:`shardfuse.fusion.methods.settings`) is
    checked value by value and kept as given; the method's own check then runs on the values of a tensor
    outside the layers that no filter names (each tensor's are checked when the merge resolves them)."""
    record = method_record(method)
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise UserError(
            f"merge parameters must be a JSON object, got {type(params).__name__}; "
            "pass e.g. --params-json '{\"density\": 0.2}'"
        )
    unknown = sorted(set(params) - set(record.params))
    if unknown:
        valid = f"valid: {', '.join(record.params)}" if record.params else "it takes none"
        raise UserError(
            f"merge method {method} has no parameter {', '.join(map(repr, unknown))} ({valid}); "
            "remove it from --params-json"
        )
    num_ranks = len(rows)
    resolved = {}
    for name, param in record.params.items():
        value = params.get(name, param.default)
        if settings.per_tensor(param.kind, value):
            what = f"merge method {method}: parameter {name!r}"
            fix = f"fix it in --params-json (run key merge_{name})"
            if param.kind == "weights":
                resolved[name] = settings.checked_weights(value, num_ranks, param.describe, what, fix)
            else:
                resolved[name] = settings.checked(value, param, what, fix)
            continue
        if not (_valid_type(param, value, num_ranks) and (value is None or param.accept(value))):
            need = (
                f"{param.describe} (the run has {num_ranks} ranks)"
                if param.kind == "weights"
                else param.describe
            )
            raise UserError(
                f"merge method {method}: parameter {name!r} must be {need}, got {value!r}; "
                f"fix it in --params-json (run key merge_{name})"
            )
        resolved[name] = float(value) if param.kind == "number" else value
    changing = settings.varying(resolved, _kinds(method))
    if not changing:
        _check_values(method, resolved, num_ranks)
        return resolved
    outside = settings.resolve(resolved, _kinds(method), "", 0.0, changing)
    try:
        _check_values(method, outside, num_ranks)
    except UserError as exc:
        raise UserError(f"{exc} (at a tensor outside the layers that no filter names)") from None
    return resolved


def _check_values(method: str, values: dict[str, Any], num_ranks: int) -> None:
    """The checks across ``method``'s parameters (each one value): its record's, and weights that do not
    all vanish."""
    weights = values.get("weights")
    if isinstance(weights, list) and not sum(weights) > 0:
        raise UserError(
            f"merge method {method}: merge_weights are all 0 here (no rank to merge); give some rank a "
            "weight > 0 for every tensor"
        )
    check = method_record(method).check
    if check is not None:
        check(method, values, num_ranks)


def tensor_params(
    method: str, params: dict[str, Any], names: list[str], num_ranks: int, *, warn: bool = True
) -> settings.TensorParams | None:
    """Each of tensors ``names``'s values of ``params`` (from resolve_params), checked by the method,
    or None where every parameter is one value (:func:`settings.resolve_tensors`)."""

    def check(name: str, values: dict[str, Any]) -> None:
        try:
            _check_values(method, values, num_ranks)
        except UserError as exc:
            raise UserError(f"tensor {name!r}: {exc}") from None

    return settings.resolve_tensors(params, _kinds(method), names, check, warn=warn)


def rank_weights(method: str, params: dict[str, Any], rows: list[int]) -> list[float] | None:
    """The normalised rank weights ``method``'s plan reads (its record's ``weighing``): equal, or the
    explicit weights else the shard rows; None where it reads none."""
    weighing = method_record(method).weighing
    if weighing is None:
        return None
    if weighing == "equal":
        return [1.0 / len(rows)] * len(rows)
    if "weights" in settings.varying(params, _kinds(method)):
        return None  # each tensor's: tensor_weights
    raw = params["weights"] if params["weights"] is not None else rows
    if float(sum(raw)) <= 0:
        raise UserError(f"{method} merge needs ranks with rows > 0; use merge_method uniform")
    return normalised_list(raw)


def tensor_weights(method: str, values: dict[str, Any], weights: list[float] | None) -> list[float] | None:
    """The rank weights ``method``'s plan reads for a tensor whose merge_weights vary per tensor (its
    ``values``): those normalised where the method weighs by them, else ``weights``."""
    if method_record(method).weighing != "rows":
        return weights
    return normalised_list(values["weights"])


def refuse_per_tensor_cat(method: str, params: dict[str, Any]) -> None:
    """LoRA's merge_adapter cat scales each rank's factors once for every module: refuse parameters
    that vary per tensor, in one line."""
    changing = settings.varying(params, _kinds(method))
    if changing:
        raise UserError(
            f"merge_adapter cat scales each rank's factors by one coefficient for every module, but "
            f"merge_{changing[0]} varies per tensor; give it one value or use merge_adapter svd"
        )


def default_weights(method: str, num_ranks: int, weights: list[float] | None) -> list[float] | None:
    """``weights``, or equal weights where ``method``'s plan reads weights and none were given (the
    in-memory entry points, which know no shard rows)."""
    if weights is None and method_record(method).weighing is not None:
        return [1.0 / num_ranks] * num_ranks
    return weights


def make_plan(name: str, params: dict[str, Any], job: TensorJob) -> Plan:
    record = method_record(name)
    if record.consolidates or not is_running_statistic(job.name):
        return record.plan(job, params)
    # Statistics of activations, not weights: their "task vector" means nothing, so trimming, dropping,
    # scaling or a spherical path would give statistics that no rank measured. The (weighted) mean is
    # what a soup of the ranks would carry.
    by_rows = record.weighing == "rows"
    plan = (WeightedPlan if by_rows else UniformPlan)(job, params)
    plan.stats["running_statistic"] = "weighted mean" if by_rows else "mean"
    return plan
