"""mergekit's YAML read as a shardfuse merge: one record per mergekit method that shardfuse implements,
translating its parameters into the shardfuse method's (mergekit 0.1.5's ``MergeConfiguration``).

What is read: ``merge_method``, ``base_model``, ``models`` (each ``model``, a local folder or safetensors
file, and its ``parameters``), the top-level ``parameters`` (mergekit's shared ones, ``lambda``,
``normalize``, ``rescale``, ``int8_mask``, ``t``, ..., and defaults of the per-model ones), ``dtype``,
``out_dtype`` and ``tokenizer_source`` (``base`` or one of the models). A parameter may be a number, a
gradient or a filter list, with mergekit's semantics (:mod:`shardfuse.fusion.methods.settings`).
Everything else is one line naming the field: ``slices``/``modules`` (frankenmerges), ``tokenizer``
(union vocabularies), ``chat_template``, a Hub id (nothing is downloaded), a LoRA ``model+adapter``
reference, a method shardfuse lacks, or a combination whose result shardfuse's method cannot give.

The translations (mergekit's generalised task arithmetic: base + lambda * sum_i w_i tau_i, divided by
sum_i w_i where ``normalize``; shardfuse's task-vector methods take the mean, times ``scale``):

  linear            weighted, merge_weights = the models' weights (normalize: true, mergekit's default)
  task_arithmetic   task_arithmetic, scale = lambda * w * N (normalize: true: lambda); one w for all
  ties              ties, scale = lambda (normalize: true, its default); one density and weight for all
  dare_ties         dare with sign_election, scale = lambda (normalize: true needed)
  dare_linear       dare, scale = lambda * w * N (normalize: true: lambda)
  breadcrumbs       breadcrumbs, scale = lambda * w * N (normalize: true: lambda)
  breadcrumbs_ties  breadcrumbs_ties, scale = lambda (normalize: true needed)
  della             della, scale = lambda (normalize: true, its default)
  della_linear      della without sign_election, scale = lambda * w * N (normalize: true: lambda)
  sce               sce, topk = select_topk
  slerp             slerp of [base_model, the other model], t
  nuslerp           nuslerp (nuslerp_flatten: true, no base), t = w_1 / (w_0 + w_1)
  multislerp        multislerp (no base), merge_weights = the weights
  karcher           karcher (no base), max_iter, tol
  model_stock       model_stock (filter_wise: false)

Where shardfuse's result differs from mergekit's, the translation says so in ``notes`` (merge.json keeps
them): TIES keeps round(density n) entries where mergekit keeps int(density n), and where an entry's kept
values sum to exactly 0 keeps the base (mergekit elects + there); DARE and DELLA rescale
kept entries by 1 / p (the papers') where mergekit's ``rescale`` restores the L1 norm, and draw from
shardfuse's seeded streams; shardfuse computes in float64 whatever ``dtype`` says. Torch-free. By hand::

    python -c "from shardfuse.fusion.methods.mergekit import read; print(read('merge.yml'))"
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardfuse.io import MAX_EXPANDED_VALUES, UserError, find_record, yaml_values

FIX = "fix the mergekit YAML"
TOP_FIELDS = ("merge_method", "base_model", "models", "parameters", "dtype", "out_dtype", "tokenizer_source")
REFUSED_FIELDS = {
    "slices": "slices (frankenmerges, passthrough of layer ranges) are not a shardfuse merge; list whole "
    "models under models",
    "modules": "modules (per-module slices) are not a shardfuse merge; list whole models under models",
    "tokenizer": "tokenizer (a union or mapped vocabulary) is not implemented; use tokenizer_source: base "
    "or one of the models",
    "chat_template": "chat_template is not implemented; put the template in the tokenizer_source folder",
}
DTYPES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float64": "float64", "fp64": "float64", "double": "float64",
}  # fmt: skip
REQUIRED = object()  # a per-model parameter without a default (mergekit's weight)
TIES_ROUNDING = (
    "TIES keeps round(density x numel) entries of each task vector where mergekit keeps int(density x "
    "numel): one entry more where the fraction is >= 0.5"
)
SIGN_TIES = (
    "where an entry's kept values sum to exactly 0, shardfuse elects no sign and keeps the base there; "
    "mergekit elects + and averages the positive values"
)
RANDOM_RESCALE = (
    "random drops from shardfuse's seeded stream (merge_seed 0), kept entries rescaled by 1/p (the "
    "paper's) where mergekit's rescale restores the L1 norm: equal in distribution, not bitwise"
)


@dataclass(frozen=True)
class Given:
    """What a translation reads: the method's shared parameters and each model's own (defaults filled)."""

    mergekit_method: str
    shared: dict[str, Any]
    models: list[dict[str, Any]]  # one per non-base model, in order

    def same(self, name: str, target: str) -> Any:
        """The one value every model gives ``name``; one line where they differ."""
        values = [m[name] for m in self.models]
        if any(v != values[0] for v in values[1:]):
            raise UserError(
                f"mergekit config: {self.mergekit_method} gives the models different {name} values "
                f"({', '.join(json.dumps(v) for v in values)}), but shardfuse's {target} takes one {name} "
                f"for every model; give every model the same {name}"
            )
        return values[0]

    def flag(self, name: str, needed: bool, why: str) -> None:
        if self.shared[name] is not needed:
            raise UserError(
                f"mergekit config: {self.mergekit_method} with {name}: {str(self.shared[name]).lower()} "
                f"{why}; set {name}: {str(needed).lower()} under parameters"
            )


Translate = Callable[[Given], tuple[str, dict[str, Any], list[str]]]  # -> (method, params, notes)


@dataclass(frozen=True)
class Translation:
    name: str  # mergekit's merge_method
    base: str  # "required", "none" (refused), "one_of_two" (slerp: the base is model 0)
    shared: dict[str, Any]  # mergekit's shared parameters and their defaults
    per_model: dict[str, Any]  # per-model parameters and defaults (REQUIRED: none)
    translate: Translate
    min_models: int = 1
    max_models: int | None = None


def times(setting: Any, factor: float) -> Any:
    """A setting (number, gradient, filter list) with every value multiplied by ``factor``."""
    if isinstance(setting, list):
        return [
            {**e, "value": times(e["value"], factor)} if isinstance(e, dict) else times(e, factor)
            for e in setting
        ]
    if isinstance(setting, (int, float)) and not isinstance(setting, bool):
        return setting * factor
    return setting  # not a number: the shardfuse check names it


def _scale(given: Given, target: str) -> Any:
    """shardfuse's scale for a method that sums the weighted task vectors (normalize off) or takes
    their weighted mean (normalize on): lambda x w x N, or lambda."""
    weight = given.same("weight", target)
    if given.shared["normalize"]:
        return given.shared["lambda"]
    return times(weight, given.shared["lambda"] * len(given.models))


def _consensus_scale(given: Given, target: str) -> Any:
    """TIES-style methods: the disjoint mean of the agreeing task vectors needs normalize on; one
    weight for all cancels."""
    given.same("weight", target)
    given.flag(
        "normalize",
        True,
        f"sums the agreeing task vectors, but shardfuse's {target} averages them (the TIES paper's "
        "disjoint mean)",
    )
    return given.shared["lambda"]


def _random_rescale(given: Given, target: str) -> None:
    given.flag(
        "rescale", True, f"leaves kept entries unscaled, but shardfuse's {target} rescales them by 1/p"
    )


def _no_rescale(given: Given, target: str) -> None:
    given.flag(
        "rescale",
        False,
        f"restores each sparsified task vector's L1 norm, which shardfuse's {target} does not",
    )


def _linear(g: Given):
    g.flag("normalize", True, "sums the weighted models, but shardfuse's weighted normalises the weights")
    return "weighted", {"weights": [m["weight"] for m in g.models]}, []


def _task_arithmetic(g: Given):
    return "task_arithmetic", {"scale": _scale(g, "task_arithmetic")}, []


def _ties(g: Given):
    _no_rescale(g, "ties")
    params = {"density": g.same("density", "ties"), "scale": _consensus_scale(g, "ties")}
    return "ties", params, [TIES_ROUNDING, SIGN_TIES]


def _dare(sign_election: bool) -> Translate:
    def translate(g: Given):
        _random_rescale(g, "dare")
        scale = _consensus_scale(g, "dare") if sign_election else _scale(g, "dare")
        params = {"density": g.same("density", "dare"), "sign_election": sign_election, "scale": scale}
        return "dare", params, [RANDOM_RESCALE, *([SIGN_TIES] if sign_election else [])]

    return translate


def _breadcrumbs(ties: bool) -> Translate:
    target = "breadcrumbs_ties" if ties else "breadcrumbs"

    def translate(g: Given):
        _no_rescale(g, target)
        scale = _consensus_scale(g, target) if ties else _scale(g, target)
        params = {"density": g.same("density", target), "gamma": g.same("gamma", target), "scale": scale}
        return target, params, [SIGN_TIES] if ties else []

    return translate


def _della(sign_election: bool) -> Translate:
    def translate(g: Given):
        _random_rescale(g, "della")
        scale = _consensus_scale(g, "della") if sign_election else _scale(g, "della")
        params = {
            "density": g.same("density", "della"),
            "epsilon": g.same("epsilon", "della"),
            "sign_election": sign_election,
            "scale": scale,
        }
        return "della", params, [RANDOM_RESCALE, *([SIGN_TIES] if sign_election else [])]

    return translate


def _sce(g: Given):
    return "sce", {"topk": g.shared["select_topk"]}, []


def _slerp(g: Given):
    return "slerp", {"t": g.shared["t"]}, []


def _nuslerp(g: Given):
    g.flag("nuslerp_flatten", True, "interpolates row by row, but shardfuse's nuslerp flattens each tensor")
    g.flag("nuslerp_row_wise", False, "interpolates row by row, which shardfuse's nuslerp does not")
    w0, w1 = (m["weight"] for m in g.models)
    if not all(isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0 for w in (w0, w1)):
        raise UserError(
            "mergekit config: nuslerp's weights must be numbers >= 0 here (shardfuse's nuslerp takes one t "
            "= w1 / (w0 + w1) per tensor); give each model a number"
        )
    if w0 + w1 <= 0:
        raise UserError("mergekit config: nuslerp's weights sum to 0; give a model a weight > 0")
    return "nuslerp", {"t": w1 / (w0 + w1)}, []


def _multislerp(g: Given):
    g.flag(
        "normalize_weights", True, "leaves the weights as given, but shardfuse's multislerp normalises them"
    )
    if g.shared["eps"] != 1e-8:
        raise UserError("mergekit config: multislerp's eps is 1e-8 in shardfuse; remove eps")
    return "multislerp", {"weights": [m["weight"] for m in g.models]}, []


def _karcher(g: Given):
    return "karcher", {"max_iter": g.shared["max_iter"], "tol": g.shared["tol"]}, []


MODEL_STOCK_CLAMP = (
    "model_stock clamps the mean cosine between task vectors to [0, 1] (t in [0, 1]), where mergekit "
    "extrapolates beyond the models for a negative cosine: the two differ only there"
)


def _model_stock(g: Given):
    g.flag("filter_wise", False, "computes one ratio per row, but shardfuse's model_stock one per tensor")
    return "model_stock", {}, [MODEL_STOCK_CLAMP]


TASK_ARITHMETIC = {"int8_mask": False, "lambda": 1.0}
SPARSE = {"density": 1.0, "weight": REQUIRED}


def _gta(normalize: bool, rescale: bool) -> dict[str, Any]:
    return {**TASK_ARITHMETIC, "normalize": normalize, "rescale": rescale}


RECORDS: tuple[Translation, ...] = (
    Translation("linear", "none", {"normalize": True}, {"weight": REQUIRED}, _linear),
    Translation("task_arithmetic", "required", _gta(False, False), {"weight": REQUIRED}, _task_arithmetic),
    Translation("ties", "required", _gta(True, False), SPARSE, _ties),
    Translation("dare_ties", "required", _gta(False, True), SPARSE, _dare(True)),
    Translation("dare_linear", "required", _gta(False, True), SPARSE, _dare(False)),
    Translation(
        "breadcrumbs", "required", _gta(False, False), {**SPARSE, "gamma": 0.01}, _breadcrumbs(False)
    ),
    Translation(
        "breadcrumbs_ties", "required", _gta(False, False), {**SPARSE, "gamma": 0.01}, _breadcrumbs(True)
    ),
    Translation("della", "required", _gta(True, True), {**SPARSE, "epsilon": 0.15}, _della(True)),
    Translation("della_linear", "required", _gta(False, True), {**SPARSE, "epsilon": 0.15}, _della(False)),
    Translation("sce", "required", {"int8_mask": False, "select_topk": 1.0}, {}, _sce),
    Translation("slerp", "one_of_two", {"t": REQUIRED}, {}, _slerp, min_models=1, max_models=1),
    Translation(
        "nuslerp",
        "none",
        {"nuslerp_flatten": True, "nuslerp_row_wise": False},
        {"weight": REQUIRED},
        _nuslerp,
        min_models=2,
        max_models=2,
    ),
    Translation(
        "multislerp", "none", {"normalize_weights": True, "eps": 1e-8}, {"weight": REQUIRED}, _multislerp
    ),
    Translation("karcher", "none", {"max_iter": 10, "tol": 1e-5}, {}, _karcher),
    Translation("model_stock", "required", {"filter_wise": False}, {}, _model_stock, min_models=2),
)


def names() -> tuple[str, ...]:
    return tuple(record.name for record in RECORDS)


@dataclass(frozen=True)
class MergekitConfig:
    """A mergekit YAML as shardfuse runs it: the shardfuse method and params, the input models in rank
    order, the base, and what the YAML asked of the output."""

    path: Path
    sha256: str
    text: str
    mergekit_method: str
    method: str
    params: dict[str, Any]
    models: tuple[str, ...]
    base: str | None
    dtype: str | None
    out_dtype: str | None
    tokenizer_source: str | None  # the folder whose tokenizer the output carries
    notes: tuple[str, ...] = field(default=())

    def logged_params(self) -> dict[str, str]:
        """The YAML's settings as flat MLflow params (``mergekit.<field>``)."""
        raw = _load(self.path, self.text)
        flat = {"mergekit.merge_method": self.mergekit_method}
        for key, value in (raw.get("parameters") or {}).items():
            flat[f"mergekit.parameters.{key}"] = json.dumps(value)
        for index, entry in enumerate(raw.get("models") or []):
            for key, value in (entry.get("parameters") or {}).items():
                flat[f"mergekit.models.{index}.{key}"] = json.dumps(value)
        for key in ("dtype", "out_dtype", "tokenizer_source"):
            if raw.get(key) is not None:
                flat[f"mergekit.{key}"] = str(raw[key])
        return {k: v[:6000] for k, v in flat.items()}


def _load(path: Path, text: str) -> dict[str, Any]:
    import yaml

    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        if root is not None and (size := yaml_values(root)) > MAX_EXPANDED_VALUES:
            raise UserError(
                f"mergekit config {path}: writes out to {size:,} values through its aliases (*name of an "
                f"&name anchor), more than {MAX_EXPANDED_VALUES:,}; write the values out or use fewer aliases"
            )
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"mergekit config {path}: not valid YAML{where}; {FIX}") from None
    if not isinstance(raw, dict):
        raise UserError(f"mergekit config {path}: expected a mapping with merge_method and models; {FIX}")
    return raw


def _reference(path: Path, what: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise UserError(f"mergekit config {path}: {what} must be a local path, got {value!r}; {FIX}")
    if "+" in value and not Path(value).exists():
        raise UserError(
            f"mergekit config {path}: {what} {value!r} is a model+LoRA reference, which shardfuse does not "
            "read; merge the adapter into the model first (or fuse adapters in a shardfuse run)"
        )
    if not Path(value).exists():
        raise UserError(
            f"mergekit config {path}: {what} {value!r} is not a local folder or file (shardfuse never "
            "downloads from the Hub); give the path of a save_pretrained folder or safetensors file"
        )
    return value


def _parameters(path: Path, where: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UserError(f"mergekit config {path}: {where} must be a mapping of name: value; {FIX}")
    return value


def read(path: Path | str) -> MergekitConfig:
    """Read and translate mergekit YAML ``path``: one line naming the field for anything shardfuse does not
    run as mergekit would (the model paths must exist; their tensors are checked where they are read)."""
    path = Path(path)
    if not path.is_file():  # a folder, a FIFO (reading one would wait for a writer) or nothing
        raise UserError(f"mergekit config {path} is not a file; give a mergekit YAML file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UserError(
            f"mergekit config {path} cannot be read ({exc.strerror}); give a mergekit YAML file"
        ) from None
    text = data.decode("utf-8", errors="replace")
    raw = _load(path, text)
    for key in raw:
        if key in REFUSED_FIELDS:
            raise UserError(f"mergekit config {path}: {REFUSED_FIELDS[key]}")
        if key not in TOP_FIELDS:
            raise UserError(
                f"mergekit config {path}: unknown field {key!r} (the mergekit 0.1.5 fields shardfuse "
                f"reads: {', '.join(TOP_FIELDS)}); remove it"
            )
    mk_method = raw.get("merge_method")
    if mk_method not in names():
        raise UserError(
            f"mergekit config {path}: merge_method {mk_method!r} is not one shardfuse implements (it reads "
            f"{', '.join(names())}); choose one of them"
        )
    record = find_record(RECORDS, mk_method, "mergekit merge method")
    shared_given = _parameters(path, "parameters", raw.get("parameters"))
    entries = raw.get("models")
    if not isinstance(entries, list) or not entries:
        raise UserError(
            f"mergekit config {path}: models must list the models to merge ({{model: PATH}}); {FIX}"
        )
    base = raw.get("base_model")
    if base is not None:
        base = _reference(path, "base_model", base)
        if record.base == "none":
            raise UserError(
                f"mergekit config {path}: shardfuse's {mk_method} takes no base_model (it merges the models "
                "themselves); remove base_model"
            )
    elif record.base != "none":
        raise UserError(f"mergekit config {path}: {mk_method} needs base_model; add base_model: PATH")
    known = {**record.shared, **record.per_model}
    for key in shared_given:
        if key not in known:
            raise UserError(
                f"mergekit config {path}: {mk_method} has no parameter {key!r} (it takes "
                f"{', '.join(known) or 'none'}); remove it"
            )
    models, per_model = [], []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict) or "model" not in entry or set(entry) - {"model", "parameters"}:
            raise UserError(
                f"mergekit config {path}: models[{index}] must be {{model: PATH, parameters: {{...}}}}; {FIX}"
            )
        model = _reference(path, f"models[{index}].model", entry["model"])
        own = _parameters(path, f"models[{index}].parameters", entry.get("parameters"))
        for key in own:
            if key in record.shared:
                raise UserError(
                    f"mergekit config {path}: models[{index}].parameters.{key} is one value for the whole "
                    f"merge in mergekit; move {key} to the top-level parameters"
                )
            if key not in record.per_model:
                raise UserError(
                    f"mergekit config {path}: {mk_method} has no per-model parameter {key!r} (it takes "
                    f"{', '.join(record.per_model) or 'none'}); remove it"
                )
        if base is not None and Path(model).resolve() == Path(base).resolve() and record.base == "required":
            continue  # mergekit takes a listed base as the base only
        models.append(model)
        values = {}
        for key, default in record.per_model.items():
            value = own.get(key, shared_given.get(key, default))
            if value is REQUIRED:
                raise UserError(
                    f"mergekit config {path}: models[{index}] has no {key}; give parameters.{key}"
                )
            values[key] = value
        per_model.append(values)
    shared = {}
    for key, default in record.shared.items():
        value = shared_given.get(key, default)
        if value is REQUIRED:
            raise UserError(f"mergekit config {path}: {mk_method} needs parameters.{key}; add it")
        if isinstance(default, bool) and not isinstance(value, bool):
            raise UserError(f"mergekit config {path}: parameters.{key} must be true or false, got {value!r}")
        shared[key] = value
    if record.base == "one_of_two":  # slerp: the base and one other model, the base first (t = 0)
        if len(models) != 2 or Path(base).resolve() not in {Path(m).resolve() for m in models}:
            others = [m for m in models if Path(m).resolve() != Path(base).resolve()]
            if len(others) != 1:
                raise UserError(
                    f"mergekit config {path}: {mk_method} interpolates base_model and exactly one other "
                    f"model, but models lists {len(others)} other(s); list base_model and one model"
                )
        other = next(m for m in models if Path(m).resolve() != Path(base).resolve())
        models, per_model, base = [base, other], [{}, {}], None
    elif len(models) < record.min_models or (record.max_models and len(models) > record.max_models):
        want = (
            record.min_models if record.max_models == record.min_models else f"at least {record.min_models}"
        )
        raise UserError(
            f"mergekit config {path}: {mk_method} merges {want} models besides the base, got {len(models)}; "
            f"{FIX}"
        )
    method, params, notes = record.translate(Given(mk_method, shared, per_model))
    dtypes = {}
    for key in ("dtype", "out_dtype"):
        value = raw.get(key)
        if value is not None and value not in DTYPES:
            raise UserError(
                f"mergekit config {path}: {key} {value!r} is not a float dtype (use float32, float16, "
                "bfloat16 or float64)"
            )
        dtypes[key] = None if value is None else DTYPES[value]
    if dtypes["dtype"] not in (None, "float64"):
        notes = [
            *notes,
            f"shardfuse computes in float64 and rounds once to the output dtype, not in {raw['dtype']}",
        ]
    tokenizer = raw.get("tokenizer_source")
    if tokenizer == "union":
        raise UserError(
            f"mergekit config {path}: tokenizer_source: union (a merged vocabulary) is not implemented; use "
            "base or one of the models"
        )
    if tokenizer == "base":
        if raw.get("base_model") is None:
            raise UserError(f"mergekit config {path}: tokenizer_source: base needs base_model; {FIX}")
        tokenizer = raw["base_model"]
    elif tokenizer is not None:
        tokenizer = _reference(path, "tokenizer_source", tokenizer)
    return MergekitConfig(
        path=path,
        sha256=hashlib.sha256(data).hexdigest(),
        text=text,
        mergekit_method=mk_method,
        method=method,
        params=params,
        models=tuple(models),
        base=base,
        dtype=dtypes["dtype"],
        out_dtype=dtypes["out_dtype"] or dtypes["dtype"],
        tokenizer_source=tokenizer,
        notes=tuple(notes),
    )
