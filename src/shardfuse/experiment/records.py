"""What the stages leave about a run, each file as one typed record, written and read here only:
``train.json`` (:class:`TrainRecord`, written by rank 0 when every rank is done), ``merge.json``
(:class:`MergeRecord`, the merge stage) and ``eval.json`` (:class:`EvalRecord`, the evaluate stage), read by
the summary, plots and track stages (and eval.json of a ddp run by the evaluate stage, as a baseline).
gather.json's record (:class:`shardfuse.checkpoints.gather_record.GatherRecord`) lives beside the trust
checks that read it, in checkpoints: the merge paths in fusion read it too, and neither package may
import this one.

Files written by older stages lack the fields added since (train.json: mode, bytes all-reduced,
effective batch size, ...; eval.json: task, score, ensemble, fusion_gain, fusion_gap, ...): those read as
None, never as 0, and :meth:`TrainRecord.training_mode` derives the mode from the strategy as the train
stage now does. Keys this version does not know (a newer stage's) are kept in ``extra`` and written back
unchanged, after the known ones. By hand::

    python -c "from shardfuse.experiment.records import TrainRecord; \\
        print(TrainRecord.read('results/trainings/<training>/ranks/train.json').training_mode())"
    python -c "from shardfuse.experiment.records import EvalRecord; \\
        print(EvalRecord.read('results/runs/<run>/eval.json').best_rank)"
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, ClassVar, TypeVar

from shardfuse.io import UserError, read_json, wrong_type
from shardfuse.models.tasks import evaluation_task
from shardfuse.strategies.registry import mode_of

RecordT = TypeVar("RecordT", bound="_Record")


class _Record:
    """What the records share: their fields in the order their stage writes them, None where the file
    has no such key, and ``extra`` (declared last by each record) for the keys this version does not know."""

    FILE: ClassVar[str]  # the file's name, for the error when it holds no JSON object
    STAGE: ClassVar[str]  # the stage that writes it (the one to re-run)
    WHAT: ClassVar[str]  # how a missing or unreadable file is named (shardfuse.io.read_json)
    # Fields the stage leaves out when it has nothing to say; it writes the others even when null, so that
    # a reader can tell null from absent.
    OPTIONAL: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def written(cls) -> frozenset[str]:
        """The fields written even when null."""
        return frozenset(f.name for f in fields(cls)) - cls.OPTIONAL - {"extra"}

    @classmethod
    def _keys(cls, values: Mapping[str, Any]) -> dict[str, str]:
        """Field name -> its key in the file, in field order; ``values`` (the file's keys, or the record's
        fields) lets a record whose key names depend on its content (:class:`EvalRecord`) choose them."""
        return {f.name: f.name for f in fields(cls) if f.name != "extra"}

    @classmethod
    def from_json(cls: type[RecordT], data: Any, source: str | os.PathLike | None = None) -> RecordT:
        where = cls.FILE if source is None else str(source)
        if not isinstance(data, dict):
            raise UserError(f"{where} is not a JSON object; re-run the {cls.STAGE} stage")
        keys = cls._keys(data)
        known = set(keys.values())
        values = {name: data[key] for name, key in keys.items() if key in data}
        for name, value in values.items():
            if (wrong := wrong_type(value, cls.__dataclass_fields__[name].type)) is not None:
                raise UserError(f"{where}: '{keys[name]}' is {wrong}; re-run the {cls.STAGE} stage")
        record = cls(**values, extra={key: value for key, value in data.items() if key not in known})
        object.__setattr__(record, "_source", where)  # for required()'s error; not a field
        return record

    @classmethod
    def of(cls: type[RecordT], **values: Any) -> RecordT:
        """The record of a stage's ``values``: its fields, and any other key (an extension's entry, such
        as a new selecting merge method's, recorded under its name) in ``extra``."""
        names = {f.name for f in fields(cls)} - {"extra"}
        known = {key: value for key, value in values.items() if key in names}
        return cls(**known, extra={key: value for key, value in values.items() if key not in names})

    @classmethod
    def read(cls: type[RecordT], path: str | os.PathLike, what: str | None = None) -> RecordT:
        return cls.from_json(read_json(path, cls.WHAT if what is None else what), path)

    def to_json(self) -> dict[str, Any]:
        """The object the file holds: the fields in order (those not :data:`OPTIONAL` even when null), then
        ``extra``."""
        data = asdict(self)
        extra = data.pop("extra")
        written = self.written()
        found = {}
        for name, key in self._keys(data).items():
            if data[name] is not None or name in written:
                found[key] = data[name]
        return {**found, **extra}

    def required(self, name: str) -> Any:
        """Field ``name``; :class:`MissingField` (a KeyError naming its key in the file, and a UserError
        naming the file) when the file has none."""
        if (value := getattr(self, name)) is None:
            key = self._keys(vars(self)).get(name, name)
            raise MissingField(key, getattr(self, "_source", self.FILE), self.STAGE)
        return value


class MissingField(UserError, KeyError):
    """A field a record's file must have is absent (or null). A KeyError whose argument is the key, for
    readers that say more; uncaught, a one-line UserError naming the file and the stage to re-run."""

    def __init__(self, key: str, source: str, stage: str) -> None:
        super().__init__(key)
        self.message = f"{source} has no '{key}' field; re-run the {stage} stage"

    def __str__(self) -> str:
        return self.message


# train.json's mode for a run over checkpoints (shardfuse.collect): models collected, not trained.
COLLECTED_MODE = "checkpoints"


@dataclass(frozen=True)
class TrainRecord(_Record):
    """train.json, field by field in the order the train stage writes them."""

    FILE, STAGE, WHAT = "train.json", "train", "training"
    OPTIONAL = frozenset({"git_commit", "git_dirty", "adapter", "fsdp", "framework_seconds"})

    run: str | None = None
    world_size: int | None = None
    strategy: str | None = None
    mode: str | None = None
    sync_every: int | None = None
    num_steps: int | None = None  # on the ranks' shared clock (each rank's own: ``ranks``)
    epochs: int | None = None
    steps_per_epoch: int | None = None  # on the ranks' shared clock (epoch_steps own: the longest rank's)
    # how ranks with unequal shards lined up an epoch (shardfuse.data.epoch_steps); None: an older train
    # stage, whose ranks all took the smallest shard's steps, spreading their own shards over them
    epoch_steps: str | None = None
    grad_accum_steps: int | None = None
    # rows of an optimiser step over all ranks: batch_size x grad_accum_steps per rank, capped at the rank's
    # rows per epoch (older train stages: uncapped, and a larger shard's steps took more rows)
    effective_batch_size: int | None = None
    # the true effective batch: the mean rows an optimiser step took over all ranks, each rank's rows seen
    # over its steps summed (an epoch's rows are spread evenly over its steps, so at most the one above)
    rows_per_step: float | None = None
    lr_schedule: str | None = None
    warmup_steps: int | None = None
    grad_clip_norm: float | None = None
    bytes_all_reduced_per_rank: int | None = None
    num_syncs: int | None = None
    init: str | None = None
    keep: str | None = None
    validation: dict[str, Any] | None = None  # {"score", "every"} when the run validated while training
    stopped_early: bool | None = None
    train_seconds: float | None = None  # the slowest rank's loop
    # of which the most any rank spent outside the step's own work (forward, backward, the optimiser's
    # step, the strategy's sync): reading batches, metrics, schedule, stop checks, validation, checkpoints
    # (host clock: on a GPU, kernels still running when the host moves on are counted where it waits)
    framework_seconds: float | None = None
    backend: str | None = None
    device: str | None = None
    precision: str | None = None
    peak_gpu_memory_bytes: int | None = None
    step_metrics: bool | None = None
    hosts: list[str] | None = None
    slurm_job_id: str | None = None
    torch_version: str | None = None
    shard_dir: str | None = None
    dataset_dir: str | None = None
    task: str | None = None
    model: dict[str, Any] | None = None
    init_from: str | None = None
    # rank, rows (its shard's), num_steps and rows_seen (its optimiser steps and the rows they took;
    # absent from older train stages), host, checkpoint, published_step, best_val_score; after a rank
    # lost for good with orphans: reshard, rows_dealt (the lost rank's rows it took on, in rows_seen)
    ranks: list[dict[str, Any]] | None = None
    # LoRA runs: the adapter config, its targets and the base's sha256 (shardfuse.models.lora)
    adapter: dict[str, Any] | None = None
    # fsdp > 1: {shards_per_replica, replicas, precision, hsdp, bytes_within_replica_per_rank}; then
    # ``ranks`` lists the replicas (shardfuse.rank.fsdp)
    fsdp: dict[str, Any] | None = None
    # which rank read which data shard in which replica, the lost ranks and the shards the alive replicas
    # cover (shardfuse.cluster.membership); None in train.json of older train stages
    membership: dict[str, Any] | None = None
    git_commit: str | None = None  # older train stages only
    git_dirty: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def training_mode(self, strategy: str | None = None, sync_every: Any = None) -> str:
        """The recorded mode, else what the recorded (or the given run config's) strategy and sync_every
        amount to; "" when neither says."""
        if self.mode:
            return str(self.mode)
        strategy = self.strategy if self.strategy is not None else strategy
        sync_every = self.sync_every if self.sync_every is not None else sync_every
        return "" if strategy is None else mode_of(str(strategy), sync_every)


# Written even when null (the train stage always writes them; a reader tells null from absent).
WRITTEN = TrainRecord.written()


@dataclass(frozen=True)
class MergeRecord(_Record):
    """merge.json, field by field in the order the merge stage writes them (shardfuse.merge: what went in,
    then what came out)."""

    FILE, STAGE, WHAT = "merge.json", "merge", "merge record"
    # Written by one merge path only: alignment (merge_align), hash and ingredients (the rank files), dcp
    # (a sharded checkpoint), recalibration (merge_recalibrate), adapter (LoRA updates fused).
    OPTIONAL = frozenset({"alignment", "hash", "ingredients", "dcp", "recalibration", "adapter", "search"})

    run: str | None = None
    training: str | None = None
    method: str | None = None
    params: dict[str, Any] | None = None  # the method's parameters, defaults filled in
    num_ranks: int | None = None
    base: dict[str, Any] | None = None  # {"path", "sha256"} of the shared initial weights (task vectors)
    weights: list[float] | None = None  # per rank, for the methods that weight them
    greedy_soup: dict[str, Any] | None = None  # the ranks it selected and their held-out scores
    search: dict[str, Any] | None = None  # merge_search: the study, its trials, best and default scores
    alignment: dict[str, Any] | None = None  # shardfuse.fusion.align
    hash: str | None = None  # the checksum algorithm checked against the merged bytes
    ingredients: list[dict[str, Any]] | None = None  # rank, path, each digest gather.json records, rows
    dcp: dict[str, Any] | None = None  # {"dir", "files", "skipped_tensors"}
    recalibration: dict[str, Any] | None = None  # shardfuse.fusion.recalibrate, with the output's new sha256
    adapter: dict[str, Any] | None = None  # {"type", "r", "alpha", "init"} of the adapters fused
    tensor_stats: dict[str, dict[str, Any]] | None = None
    max_abs_diff_between_ranks: float | None = None  # null for a sharded checkpoint
    seconds: float | None = None
    peak_rss_mb: float | None = None
    output: str | None = None  # the merged weights' file name
    sha256: str | None = None  # of the merged weights as written (after recalibration)
    num_tensors: int | None = None
    num_parameters: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# EvalRecord fields written under a key named after the run's score: field -> the key's prefix
# (best_rank -> best_rank_accuracy, best_rank_mse, best_rank_loss, ...).
SCORE_KEYS = {"best_rank": "best_rank", "mean_rank": "mean_rank", "ensemble_score": "ensemble"}


def keyed_score(task: Any, score: Any) -> str | None:
    """The score eval.json's ``best_rank_<score>``, ... keys are named after: its ``score``, else its task's
    (files from before tasks existed: classification's accuracy); None for a task shardfuse does not know,
    whose keys then stay in ``extra`` (the readers' evaluation_task refuses it)."""
    if isinstance(score, str):
        return score
    with contextlib.suppress(UserError):
        return evaluation_task({} if task is None else {"task": task}).score
    return None


@dataclass(frozen=True)
class EvalRecord(_Record):
    """eval.json, field by field in the order the evaluate stage writes them; the fields of
    :data:`SCORE_KEYS` go by keys named after the score (:func:`keyed_score`). Metrics are
    {metric: value} of the task's metrics."""

    FILE, STAGE, WHAT = "eval.json", "evaluate", "evaluation"
    # sets: absent from files of evaluate stages before named sets; local: from runs of iid shard sets
    OPTIONAL = frozenset({"sets", "local", "ranks_lost", "coverage", "steps_discarded"})
    # The keys of ``local``: flat in the file (shardfuse.scoring.local names them), one mapping here.
    LOCAL_PREFIXES = ("local_", "normalized_", "domain_")

    run: str | None = None
    training: str | None = None
    test_rows: int | None = None
    task: str | None = None  # absent from files written before tasks: classification
    score: str | None = None
    lower_is_better: bool | None = None
    metrics: list[str] | None = None
    merged: dict[str, float] | None = None  # the merged model's metrics
    base: dict[str, float] | None = None  # the initial model's (before training)
    ranks: list[dict[str, Any]] | None = None  # {"rank", **metrics} of each rank's own model
    best_rank: float | None = None
    mean_rank: float | None = None
    # For causal_lm (scored by loss) this and mean_rank share the key mean_rank_loss, as the stage writes it.
    mean_rank_loss: float | None = None
    fusion_gain: float | None = None  # how much better the merged model scores than the best rank
    ensemble: dict[str, float] | None = None  # the ranks' output-averaged ensemble's metrics
    ensemble_score: float | None = None
    fusion_gap: float | None = None  # how much better the ensemble scores than the merged model
    ddp_baseline: dict[str, Any] | None = None  # {"run", **metrics} of the ddp run trained alike, if any
    # The scores on each rank's local test distribution by their keys (local_<score>_merged_rank_<r>,
    # local_<score>_rank_<r>, local_<score>_merged_mean, _worst, normalized_<score>; shardfuse.scoring.local),
    # each a key of its own in the file; None for runs of iid shard sets, which have none.
    local: dict[str, float] | None = None
    # Every evaluation set's scores by its name: {"kind", "path", "rows", "merged", "ranks", "ensemble",
    # "base"} (the models its kind scores; shardfuse.scoring.sets). The fields above are the "test" set's,
    # as evaluate always wrote them; files from before named sets have none (see scores_on).
    sets: dict[str, dict[str, Any]] | None = None
    # After a rank lost for good (shardfuse.rank.loss): how many, the share of the training rows the
    # fused models hold (rows-weighted, over every epoch) and the lost ranks' steps no model holds.
    ranks_lost: int | None = None
    coverage: float | None = None
    steps_discarded: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def _keys(cls, values: Mapping[str, Any]) -> dict[str, str]:
        keys = super()._keys(values)
        score = keyed_score(values.get("task"), values.get("score"))
        for name, prefix in SCORE_KEYS.items():
            if score is None:
                del keys[name]
            else:
                keys[name] = f"{prefix}_{score}"
        return keys

    @classmethod
    def from_json(cls, data: Any, source: str | os.PathLike | None = None) -> EvalRecord:
        if isinstance(data, dict) and (flat := [key for key in data if key.startswith(cls.LOCAL_PREFIXES)]):
            data = {key: value for key, value in data.items() if key not in flat} | {
                "local": {key: data[key] for key in flat}
            }
        record = super().from_json(data, source)
        record.check_ranges()
        return record

    def check_ranges(self) -> None:
        """Every model's metrics within what the task can score (shardfuse.models.task.Task.metric_ranges):
        an eval.json edited to an accuracy of 1.7 is one line, never a row of summary.csv or MLflow."""
        from shardfuse.models.tasks import IMPLICIT_TASK, task_record  # torch-free

        try:
            task = task_record(self.task or IMPLICIT_TASK)
        except UserError:
            return  # a task this version does not know: the stages that score say so
        models = {"merged": self.merged, "base": self.base, "ensemble": self.ensemble}
        models |= {f"ranks[{i}]": entry for i, entry in enumerate(self.ranks or [])}
        models["ddp_baseline"] = self.ddp_baseline
        for where, metrics in models.items():
            if isinstance(metrics, Mapping) and (problem := task.metric_problem(metrics)) is not None:
                source = getattr(self, "_source", self.FILE)
                raise UserError(
                    f"{source}: {where} {problem} for task {task.name} (an edited or damaged file); re-run "
                    f"the {self.STAGE} stage"
                )

    def to_json(self) -> dict[str, Any]:
        """As every record writes itself, ``local``'s keys flat where the field stands."""
        return {
            name: value
            for key, entry in super().to_json().items()
            for name, value in (entry.items() if key == "local" else [(key, entry)])
        }

    @classmethod
    def read_with_baseline(
        cls, path: str | os.PathLike, baseline: str | os.PathLike | None, what: str = "evaluation"
    ) -> EvalRecord:
        """eval.json with ``ddp_baseline`` filled from the ddp run's eval.json ``baseline`` (the plots,
        track and summary stages): evaluate no longer waits for that run, so a failed ddp baseline
        leaves its sibling runs evaluated. A ddp run's own file already names itself; eval.json files
        of older evaluate stages already hold the baseline."""
        record = cls.read(path, what)
        if baseline is None or record.ddp_baseline is not None:
            return record
        ddp = cls.read(baseline, "ddp baseline evaluation")
        return replace(record, ddp_baseline={"run": ddp.required("run"), **ddp.required("merged")})

    def set_names(self) -> list[str]:
        """The evaluation sets the file holds scores for, in the order evaluate scored them."""
        return list(self.sets) if self.sets is not None else ["test"]

    def scores_on(self, name: str) -> dict[str, Any]:
        """Set ``name``'s scores ({"kind", "rows", "merged", "ranks", "ensemble", "base"} where scored); for
        "test" in a file from before named sets, its top-level fields."""
        if self.sets is not None and name in self.sets:
            return self.sets[name]
        if self.sets is None and name == "test":
            found = {"kind": "test", "rows": self.test_rows, "merged": self.merged, "ranks": self.ranks}
            found |= {"ensemble": self.ensemble, "base": self.base}
            return {key: value for key, value in found.items() if value is not None}
        raise UserError(
            f"{getattr(self, '_source', self.FILE)} has no scores on evaluation set {name!r} (it has "
            f"{', '.join(self.set_names())}); re-run the evaluate stage with that set"
        )

    def initial_model(self) -> dict[str, Any] | None:
        """The initial model's metrics: ``base``, unless the file has an ``initial`` (no evaluate stage
        wrote one; the plots have always read it first)."""
        initial = self.extra.get("initial")
        return self.base if initial is None else initial
