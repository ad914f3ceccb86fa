"""What a run's MLflow push carries, read from its files and computed without talking to MLflow.

:func:`load_inputs` reads and checks every file the track stage needs (manifest, train.json, gather.json,
merge.json, the merged weights, eval.json, each rank's ``metrics/rank-{r}.parquet`` and any plots) before
MLflow is touched, so a missing or malformed file is one error that names it and the stage to re-run;
it returns them as a :class:`RunInputs` (the :class:`RunFiles`, one :class:`RankInputs` per rank).
gather.json is only uploaded, but the checkpoints it lists must still be the training's
(shardfuse.checkpoints.trust.read_gather), and the merged weights' model spec must fit their tensors (the
torch-free shardfuse.checkpoints.trust.check_spec_bounds): MLflow would otherwise record another model, or log
one whose spec builds a network larger than the file.
From them come what :mod:`shardfuse.track.sync` pushes: the config as params (:func:`flatten_params`) and
the training's own (:data:`TRAIN_PARAMS`), the headline metrics, each rank's sparse step series
(:mod:`shardfuse.track.series`); the provenance tags (git commit, tool versions, hosts, SLURM job id,
config hash) and the fingerprint that tells an unchanged run from one to sync again are in
:mod:`shardfuse.track.provenance`.

train.json and the metrics files of older trainings lack what later train stages added (mode, bytes
all-reduced, the grad_norm and val_score columns, ...): what is absent is not pushed, never an error.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from shardfuse.checkpoints.trust import RERUN_MERGE, check_merged_record, header_spec, read_gather
from shardfuse.checkpoints.weights import read_metadata
from shardfuse.data.heterogeneity import shard_metrics
from shardfuse.experiment.records import COLLECTED_MODE, EvalRecord, MergeRecord, TrainRecord
from shardfuse.io import UserError, read_json
from shardfuse.metrics.system import system_metrics_path
from shardfuse.models.bounds import check_spec_bounds
from shardfuse.models.tasks import evaluation_task, score_first
from shardfuse.track.series import (
    no_step_metrics,
    node_peaks,
    read_rank_system,
    read_step_metrics,
    step_series,
    system_series,
    validation_metric,
)

# train.json fields that become parent params, when the train stage wrote them.
TRAIN_PARAMS = ("mode", "grad_accum_steps", "effective_batch_size", "init", "keep")
MAX_PARAM_VALUE_CHARS = 6000  # MLflow's limit (mlflow.utils.validation); a longer value is rejected


def flatten_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Flatten a nested config into MLflow params: dotted keys, lists as JSON, None as "None"."""
    params: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            params.update(flatten_params(value, prefix=f"{name}."))
            continue
        text = json.dumps(value, sort_keys=True) if isinstance(value, (list, tuple, dict)) else str(value)
        # MLflow rejects longer values; a truncated param beats a failed push.
        if len(text) > MAX_PARAM_VALUE_CHARS:
            text = text[: MAX_PARAM_VALUE_CHARS - 3] + "..."
        params[name] = text
    return params


def _require_file(path: Path, stage: str) -> Path:
    if not path.is_file():
        raise UserError(f"{path} does not exist; re-run the {stage} stage for this run first")
    return path


def _field(obj: dict, key: str, path: Path) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise UserError(f"{path} has no '{key}' field; re-run the stage that produces it")
    return obj[key]


def _recorded(record: TrainRecord | MergeRecord | EvalRecord, name: str, path: Path) -> Any:
    """A field the record's file must have (every stage that writes the file wrote it)."""
    try:
        return record.required(name)
    except KeyError as missing:
        key = missing.args[0]
        raise UserError(f"{path} has no '{key}' field; re-run the stage that produces it") from None


def _number(value: Any) -> float | None:
    """A JSON number as float; None for null, booleans and anything else."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def train_params(train: TrainRecord) -> dict[str, str]:
    """The :data:`TRAIN_PARAMS` that train.json has (not null), as MLflow params; ``mode`` derived from
    strategy and sync_every for a train.json from before the train stage wrote it."""
    params = {key: str(getattr(train, key)) for key in TRAIN_PARAMS if getattr(train, key) is not None}
    if "mode" not in params and isinstance(train.strategy, str):
        params["mode"] = train.training_mode()
    return params


def rank_train_metrics(entry: dict[str, Any]) -> dict[str, float]:
    """published_step and best_val_score of a train.json ``ranks`` entry, where they are numbers."""
    values = {key: _number(entry.get(key)) for key in ("published_step", "best_val_score")}
    return {key: value for key, value in values.items() if value is not None}


@dataclass(frozen=True)
class RunFiles:
    """Every file a push reads, checked to exist; their names and hashes make up the fingerprint."""

    manifest: Path
    train: Path
    gather: Path
    merge: Path
    weights: Path
    eval: Path
    metrics: dict[int, Path]  # rank -> metrics/rank-{r}.parquet
    plots: tuple[Path, ...]  # sorted *.png of the plots dir, if any
    system: dict[int, Path] | None = None  # rank -> metrics/system-rank-{r}.parquet, where the rank wrote one
    adapter: tuple[Path, ...] = ()  # the run's PEFT adapter folder (merge_adapter), its files sorted
    mergekit: Path | None = None  # the run's mergekit_config YAML, uploaded under mergekit/

    def results(self) -> tuple[Path, ...]:
        """The JSON results uploaded under ``results/``, in upload order."""
        return (self.manifest, self.train, self.gather, self.merge, self.eval)

    def by_name(self) -> dict[str, Path]:
        """Name -> path as the fingerprint hashes them (the names are part of the hashed text)."""
        named = {"manifest": self.manifest, "train": self.train, "gather": self.gather}
        named.update(merge=self.merge, weights=self.weights, eval=self.eval)
        named.update({f"metrics-{rank}": path for rank, path in self.metrics.items()})
        named.update({f"plot-{path.name}": path for path in self.plots})
        named.update({f"system-{rank}": path for rank, path in (self.system or {}).items()})
        named.update({f"adapter-{path.name}": path for path in self.adapter})
        if self.mergekit is not None:
            named["mergekit"] = self.mergekit
        return named


class RankInputs(NamedTuple):
    """What one rank's child run carries."""

    rank: int
    shard_rows: int
    history: dict[str, np.ndarray]  # columns of metrics/rank-{r}.parquet (:func:`read_step_metrics`)
    # test_<metric> of the rank's own model, for every task metric; local_<score>(_merged) on its local
    # test distribution (non-iid shard sets)
    test_metrics: dict[str, float]
    host: str | None  # None when neither train.json nor the rank's sidecar names it
    train_metrics: dict[str, float]  # published_step, best_val_score (:func:`rank_train_metrics`)
    series: dict[str, np.ndarray]  # grad_norm, val_<score>: finite points only (:func:`step_series`)
    # lost for good while training (shardfuse.rank.loss): its curves up to then, no model, no test metrics
    lost: bool = False


@dataclass(frozen=True)
class RunInputs:
    """Everything a push needs, read and checked before MLflow is touched."""

    files: RunFiles
    train: TrainRecord  # train.json as the train stage wrote it (num_steps, provenance)
    ranks: tuple[RankInputs, ...]  # ranks[r].rank == r
    model_spec: dict[str, Any]  # the merged weights' model reference and args
    headline: dict[str, float]  # the parent run's metrics
    params: dict[str, str]  # the parent's params from train.json (:func:`train_params`), besides the config
    manifest: dict[str, Any]  # the shards' manifest.json
    merge: MergeRecord  # merge.json (the resolved merge settings)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def hosts(self) -> dict[int, str]:
        return {r.rank: r.host for r in self.ranks if r.host is not None}


def load_inputs(
    run_dir: Path,
    manifest_path: Path,
    plots_dir: Path | None = None,
    train_dir: Path | None = None,
    gather_path: Path | None = None,
    ddp_baseline: Path | None = None,
    adapter_dir: Path | None = None,
    mergekit: Path | None = None,
) -> RunInputs:
    """Read and check every file the push needs before MLflow is touched (``ddp_baseline``: the ddp
    run's eval.json, whose merged metrics are this run's baseline).

    ``train_dir`` (train.json, metrics/rank-{r}.parquet; default RUN_DIR/train) and ``gather_path``
    (default RUN_DIR/gather.json) may be shared by runs that differ only in how they merge.
    """
    train_dir = train_dir if train_dir is not None else run_dir / "train"
    manifest = _require_file(manifest_path, "partition")
    train_path = _require_file(train_dir / "train.json", "train")
    gather = _require_file(gather_path if gather_path is not None else run_dir / "gather.json", "gather")
    merge_path = _require_file(run_dir / "merge.json", "merge")
    weights = _require_file(run_dir / "merged.safetensors", "merge")
    eval_path = _require_file(run_dir / "eval.json", "evaluate")
    train = TrainRecord.read(train_path, "train")
    merge, evaluation = (
        MergeRecord.read(merge_path, "merge"),
        EvalRecord.read_with_baseline(eval_path, ddp_baseline, "eval"),
    )
    read_gather(gather)  # only uploaded, but it must list this training's checkpoints
    # The model logged as this run's is the one its merge.json describes (not one copied over it since).
    check_merged_record(weights, merge_path, merge.method, merge.sha256)
    try:
        world_size = int(_recorded(train, "world_size", train_path))
        if isinstance(train.fsdp, dict):  # a checkpoint, a child run, per replica
            world_size //= int(train.fsdp["shards_per_replica"])
        train_ranks = {int(r["rank"]): r for r in _recorded(train, "ranks", train_path)}
        shard_rows = {rank: int(entry["rows"]) for rank, entry in train_ranks.items()}
        eval_ranks = {int(r["rank"]): r for r in _recorded(evaluation, "ranks", eval_path)}
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(
            f"malformed 'ranks' entry in {train_path} or {eval_path} ({exc!r}); "
            "re-run the train and evaluate stages"
        ) from None
    lost = {rank for rank, entry in train_ranks.items() if entry.get("lost")}  # no model, no scores
    metrics = {}
    for rank in range(world_size):
        if rank not in shard_rows or (rank not in eval_ranks and rank not in lost):
            raise UserError(
                f"rank {rank} of world size {world_size} is missing from {train_path} "
                f"or {eval_path}; re-run the train and evaluate stages"
            )
        step_file = train_dir / "metrics" / f"rank-{rank}.parquet"
        if rank in lost and not step_file.is_file():
            continue  # lost before its first checkpoint: no curve to keep
        if train.mode != COLLECTED_MODE:  # a run over checkpoints took no steps: no step metrics
            metrics[rank] = _require_file(step_file, "train")
    plots = sorted(plots_dir.glob("*.png")) if plots_dir is not None and plots_dir.is_dir() else []
    system = {
        rank: path
        for rank in range(world_size)
        if (path := system_metrics_path(train_dir / "metrics", rank)).is_file()
    }
    adapter = ()
    if adapter_dir is not None:
        fusion = _require_file(adapter_dir / "fusion.json", "export_adapter")
        adapter = tuple(
            sorted(p for p in adapter_dir.iterdir() if p.is_file() and not p.name.startswith("."))
        )
    if mergekit is not None and not mergekit.is_file():
        raise UserError(f"the run's mergekit_config {mergekit} does not exist; restore it or fix the run")
    files = RunFiles(
        manifest, train_path, gather, merge_path, weights, eval_path, metrics, tuple(plots), system, adapter,
        mergekit,
    )  # fmt: skip
    task = evaluation_task(evaluation, eval_path)
    # Under fsdp a child run is a replica, and the local sets are ranks': those stay the parent's.
    local = {} if isinstance(train.fsdp, dict) else evaluation.local or {}
    test_metrics = {
        rank: {
            f"test_{k}": float(_field(eval_ranks[rank], k, eval_path))
            for k in score_first(task)
            if k == task.score or k in eval_ranks[rank]
        }
        | local_rank_metrics(local, task.score, rank)
        for rank in range(world_size)
        if rank not in lost
    }
    histories = {
        rank: read_step_metrics(metrics[rank]) if rank in metrics else no_step_metrics()
        for rank in range(world_size)
    }
    model_spec = _field(read_metadata(weights), "model", weights)
    check_spec_bounds(f"the header of {weights}", *header_spec(weights, RERUN_MERGE), RERUN_MERGE)
    hosts = _rank_hosts(train_dir, train, world_size)
    val_metric = validation_metric(train, task.score)
    samples = {rank: read_rank_system(path) for rank, path in system.items()}
    ranks = tuple(
        RankInputs(
            rank,
            shard_rows[rank],
            histories[rank],
            test_metrics.get(rank, {}),
            hosts.get(rank),
            rank_train_metrics(train_ranks[rank]),
            {**step_series(histories[rank], val_metric), **system_series(samples.get(rank, {}))},
            rank in lost,
        )
        for rank in range(world_size)
    )
    headline = headline_metrics(files, train, merge, evaluation, ranks)
    headline.update(node_peaks(samples, hosts))
    if adapter_dir is not None:
        headline.update(adapter_metrics(read_json(fusion, "adapter fusion record"), fusion))
    manifest_json = read_json(manifest, "manifest")
    headline.update(shard_metrics(manifest_json))  # how heterogeneous the shards are (iid's computed)
    return RunInputs(files, train, ranks, model_spec, headline, train_params(train), manifest_json, merge)


def local_rank_metrics(local: dict[str, float], score: str, rank: int) -> dict[str, float]:
    """A rank's child run's scores on its local test distribution (eval.json's ``local``; non-iid shard
    sets only): ``local_<score>`` of its own model, ``local_<score>_merged`` of the merged model."""
    keys = {
        f"local_{score}": f"local_{score}_rank_{rank}",
        f"local_{score}_merged": f"local_{score}_merged_rank_{rank}",
    }
    return {name: float(local[key]) for name, key in keys.items() if key in local}


def adapter_metrics(record: Any, path: Path) -> dict[str, float]:
    """The exported adapter's rank, size and how much of the fused update it keeps (fusion.json)."""
    keys = ("r", "num_parameters", "max_truncation_error", "mean_truncation_error")
    if not isinstance(record, dict) or any(_number(record.get(key)) is None for key in keys):
        raise UserError(f"{path} is not an adapter fusion record; re-run export_adapter (snakemake -R merge)")
    return {f"adapter_{key}": float(record[key]) for key in keys}


def _rank_hosts(train_dir: Path, train: TrainRecord, world_size: int) -> dict[int, str]:
    """Host per rank from train.json's "hosts", else the rank sidecars' "host" (both optional)."""
    hosts = train.hosts
    if isinstance(hosts, list) and len(hosts) == world_size:
        return {rank: str(host) for rank, host in enumerate(hosts)}
    found = {}
    for rank in range(world_size):
        sidecar = train_dir / f"rank-{rank}.json"
        with contextlib.suppress(OSError, ValueError, AttributeError):
            if host := json.loads(sidecar.read_text()).get("host"):
                found[rank] = str(host)
    return found


def headline_metrics(
    files: RunFiles,
    train: TrainRecord,
    merge: MergeRecord,
    evaluation: EvalRecord,
    ranks: tuple[RankInputs, ...],
) -> dict[str, float]:
    """The parent run's metrics, named after the task's metrics and score (classification: the
    test_accuracy_* names runs have always carried)."""
    eval_path = files.eval
    task = evaluation_task(evaluation, eval_path)
    score = task.score
    merged = _recorded(evaluation, "merged", eval_path)
    # An eval.json from before a task gained a metric lacks it: the score is required, the rest optional.
    names = [m for m in score_first(task) if m == score or m in merged]
    metrics = {f"test_{m}_merged": float(_field(merged, m, eval_path)) for m in names}
    best_rank = float(_recorded(evaluation, "best_rank", eval_path))
    metrics.update(
        {
            f"test_{score}_best_rank": best_rank,
            f"test_{score}_mean_rank": float(_recorded(evaluation, "mean_rank", eval_path)),
            "test_loss_mean_rank": float(_recorded(evaluation, "mean_rank_loss", eval_path)),
            "train_seconds": float(_recorded(train, "train_seconds", files.train)),
            "merge_seconds": float(_recorded(merge, "seconds", files.merge)),
        }
    )
    # eval.json's gain is already signed by the task; files without one get the same formula here.
    gain = evaluation.fusion_gain
    if not isinstance(gain, (int, float)):
        gain = task.gain(metrics[f"test_{score}_merged"], best_rank)
    metrics["fusion_gain"] = float(gain)
    # Written by newer evaluate stages only. eval.json's "base" is the initial model (before training):
    # named so in MLflow, where "base" read like the ddp baseline.
    for scored, name in ((evaluation.base, "initial"), (evaluation.ddp_baseline, "ddp_baseline")):
        with contextlib.suppress(KeyError, TypeError, ValueError):
            metrics[f"test_{score}_{name}"] = float(scored[score])
    if f"test_{score}_ddp_baseline" in metrics:  # how much better the ddp baseline scores (task's sign)
        ddp = metrics[f"test_{score}_ddp_baseline"]
        metrics["ddp_gap"] = float(task.gain(ddp, metrics[f"test_{score}_merged"]))
    # The ensemble of the ranks (newer evaluate stages only): every metric it has, and how much better
    # than the merged model it scores (the task's sign, as fusion_gain's).
    ensemble = evaluation.ensemble
    if isinstance(ensemble, dict) and isinstance(ensemble.get(score), (int, float)):
        for m in score_first(task):
            if (value := _number(ensemble.get(m))) is not None:
                metrics[f"test_{m}_ensemble"] = value
        gap = _number(evaluation.fusion_gap)
        gap = (
            task.gain(metrics[f"test_{score}_ensemble"], metrics[f"test_{score}_merged"])
            if gap is None
            else gap
        )
        metrics["fusion_gap"] = float(gap)
    for rank in ranks:
        if not rank.lost:
            metrics[f"test_{score}_rank_{rank.rank}"] = rank.test_metrics[f"test_{score}"]
    # A rank lost for good (shardfuse.rank.loss): how many, the share of the rows the models hold.
    for name in ("ranks_lost", "coverage", "steps_discarded"):
        if (value := _number(getattr(evaluation, name))) is not None:
            metrics[name] = value
    # Each rank's local test distribution (runs of non-iid shard sets): eval.json's keys as they are.
    metrics.update({key: float(value) for key, value in (evaluation.local or {}).items()})
    # Unknown (absent) in train.json of older train stages; 0 for independent training.
    if (communicated := _number(train.bytes_all_reduced_per_rank)) is not None:
        metrics["bytes_all_reduced_per_rank"] = communicated
    throughputs = [float(np.mean(r.history["samples_per_second"])) for r in ranks if len(r.history["step"])]
    if throughputs:
        metrics["samples_per_second"] = sum(throughputs)  # all ranks together
    return metrics
