"""Runs over checkpoints you already have (run key ``checkpoints``): checked and resolved before any job.

Each entry is one input model, the run's "rank" of its position: a safetensors file, a Hugging Face
``save_pretrained`` folder (never ``pytorch_model.bin``: nothing is unpickled), ``run:NAME``, the merged
model of run NAME of this experiment (a DAG edge: NAME merges first), or ``run:NAME/rank-R``, rank R of
run NAME's training. ``base`` (optional, the same
forms) is what task vectors are measured from; by default the model as the run's model keys build it
(``model: hf``: its pretrained folder's weights). Such a run has no partition and no training: its
world size is the number of checkpoints, its training keys are not read (its strategy is recorded as
independent ranks, ``localsgd`` with ``sync_every: 0``: models made apart), and its "training" is the
collect stage's folder ``results/trainings/<dataset>-c<N>-checkpoints-<digest>`` (:mod:`shardfuse.collect`).

What the headers tell is checked here: every file exists and is safetensors, and every checkpoint (and
the base) holds the same tensors with the same dtypes and shapes; the first that differs is named with
its file and tensor. Whether they fit the model is the collect stage's check (the init_from rules:
:mod:`shardfuse.checkpoints.init_weights`). Torch-free. By hand::

    python -c "from shardfuse.experiment.checkpoint_runs import source_of; print(source_of('run:ties'))"
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from shardfuse.checkpoints.init_weights import read_init_weights
from shardfuse.experiment.keys import is_checkpoint_run, merge_param_keys
from shardfuse.experiment.schema import ConfigError
from shardfuse.fusion.methods.mergekit import read as read_mergekit
from shardfuse.fusion.methods.registry import method_record, names
from shardfuse.io import UserError

RUN_PREFIX = "run:"
SOURCE_FIX = "give a safetensors file, a save_pretrained folder or run:NAME (the merged model of run NAME)"


def source_of(text: str) -> dict[str, Any]:
    """A checkpoint entry as the DAG sees it: ``{"run": NAME}`` (its merged model), ``{"run": NAME,
    "rank": R}`` (rank R of its training), ``{"file": PATH}`` or ``{"folder": PATH}`` (a path that does
    not exist is said by :func:`check_checkpoints`)."""
    if text.startswith(RUN_PREFIX):
        name, _, rank = text[len(RUN_PREFIX) :].partition("/")
        if not rank:
            return {"run": name}
        if not re.fullmatch(r"rank-(0|[1-9][0-9]*)", rank):
            raise ConfigError(
                f"checkpoint {text!r}: after run:NAME/ comes rank-R (rank R of run NAME's training), "
                f"not {rank!r}; {SOURCE_FIX}"
            )
        return {"run": name, "rank": int(rank[len("rank-") :])}
    return {"folder": text} if Path(text).is_dir() else {"file": text}


def _tensors(where: str, key: str, text: str) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """The tensors a file or folder holds (dtype, shape), from its headers; None for run:NAME."""
    source = source_of(text)
    if "run" in source:
        return None
    path = Path(text)
    if not path.exists():
        raise ConfigError(f"{where}.{key}: {text} is not a file or folder; {SOURCE_FIX}")
    try:
        held = read_init_weights(path).tensors
    except UserError as exc:
        raise ConfigError(f"{where}.{key}: {str(exc).replace('init_from ', '', 1)}") from None
    return {name: (tensor.dtype, tensor.shape) for name, tensor in held.items()}


def _same_architecture(where: str, entries: list[tuple[str, str, dict[str, Any]]]) -> None:
    """Every entry's tensors are the first's: the first tensor that is missing, extra or of another
    dtype or shape is named with both files."""
    if len(entries) < 2:
        return
    first_key, first_text, first = entries[0]
    for key, text, tensors in entries[1:]:
        for name, held in first.items():
            found = tensors.get(name)
            if found is None:
                raise ConfigError(
                    f"{where}.{key}: {text} has no tensor {name!r}, which {first_text} ({first_key}) holds; "
                    "give checkpoints of one architecture"
                )
            if found != held:
                raise ConfigError(
                    f"{where}.{key}: tensor {name!r} of {text} is {found[0]} {list(found[1])} but "
                    f"{first_text} ({first_key}) has {held[0]} {list(held[1])}; give checkpoints of one "
                    "architecture and dtype"
                )
        extra = sorted(set(tensors) - set(first))
        if extra:
            raise ConfigError(
                f"{where}.{key}: {text} has tensor {extra[0]!r}, which {first_text} ({first_key}) lacks; "
                "give checkpoints of one architecture"
            )


def apply_mergekit_config(name: str, run: dict[str, Any], given: dict[str, Any]) -> None:
    """A run with ``mergekit_config``: the YAML's models, base, method and parameters become its
    checkpoints, base and merge keys (:mod:`shardfuse.fusion.methods.mergekit`), over run_defaults'.
    ``given`` is the run's own mapping (or runs.tsv row), none of whose keys may say the same again."""
    path = run.get("mergekit_config")
    if path is None:
        return
    where = f"config error at runs[{name}].mergekit_config"
    said = ["checkpoints", "base", "merge_method", *sorted({k for m in names() for k in merge_param_keys(m)})]
    clash = next((key for key in said if given.get(key) is not None), None)
    if clash is not None:
        raise ConfigError(
            f"{where}: the YAML gives the models, base, method and parameters, and the run sets {clash} too; "
            f"remove {clash} from the run (or mergekit_config)"
        )
    try:
        cfg = read_mergekit(path)
    except UserError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    run.update(checkpoints=list(cfg.models), base=cfg.base, merge_method=cfg.method)
    for param, value in cfg.params.items():
        run[f"merge_{param}"] = value


def check_checkpoints(name: str, run: dict[str, Any]) -> None:
    """A run over checkpoints: its sources checked and resolved, its geometry that of one rank per
    checkpoint (set here, so the other checks see it). A base without checkpoints is refused."""
    where = f"config error at runs[{name}]"
    if not is_checkpoint_run(run):
        if run.get("base") is not None:
            raise ConfigError(
                f"{where}.base: base is the weights a run over checkpoints measures task vectors from; set "
                "checkpoints too, or remove base (a training's base is its initial weights)"
            )
        return
    if run.get("init_from") is not None:
        raise ConfigError(
            f"{where}.init_from: a run over checkpoints is not trained, so it starts from nothing; remove "
            "init_from (the checkpoints are the models; base is what task vectors are measured from)"
        )
    method = run.get("merge_method")
    if method_record(method).weighing == "rows" and run.get("merge_weights") is None:
        raise ConfigError(
            f"{where}.merge_weights: {method} weighs each rank by the rows it trained on, which checkpoints "
            "do not record; give merge_weights (one per checkpoint), or use uniform"
        )
    entries = []
    for index, text in enumerate(run["checkpoints"]):
        tensors = _tensors(where, f"checkpoints[{index}]", text)
        if tensors is not None:
            entries.append((f"checkpoints[{index}]", text, tensors))
    if run.get("base") is not None and (tensors := _tensors(where, "base", run["base"])) is not None:
        entries.append(("base", run["base"], tensors))
    _same_architecture(where, entries)
    count = len(run["checkpoints"])
    run.update(
        world_size=count, nodes=1, nproc_per_node=count, strategy="localsgd", sync_every=0, partition="iid"
    )
    run["checkpoint_sources"] = [source_of(text) for text in run["checkpoints"]]
    run["base_source"] = None if run.get("base") is None else source_of(run["base"])


def resolve_checkpoint_runs(runs: dict[str, dict[str, Any]]) -> None:
    """``run:NAME`` entries name runs of this experiment, never the run itself."""
    for name, run in runs.items():
        for source in [*(run.get("checkpoint_sources") or []), run.get("base_source") or {}]:
            other = source.get("run")
            if other is None:
                continue
            if other not in runs or other == name:
                what = "itself" if other == name else f"no run named {other!r}"
                raise ConfigError(
                    f"config error at runs[{name}].checkpoints: run:{other} names {what}; name another run "
                    "of this experiment, or a file or folder"
                )
            rank = source.get("rank")
            if rank is not None and rank >= runs[other]["world_size"]:
                raise ConfigError(
                    f"config error at runs[{name}].checkpoints: run:{other}/rank-{rank} names a rank run "
                    f"{other!r} does not have (world size {runs[other]['world_size']}); name rank-0 .. "
                    f"rank-{runs[other]['world_size'] - 1}"
                )
