"""One rank of a training run; started by torchrun, one process per shard.

Not launched by hand with plain python: use the launcher, which wraps torchrun (locally
``--standalone``; under SLURM see ``shardfuse.launch``), as the train rule does::

    python -m shardfuse.launch --nproc-per-node 2 --out-dir results/trainings/<training>/ranks -- \\
        --run-name <training> --shard-dir results/shards/digits/w2-seed0 \\
        --dataset-dir results/datasets/digits --config-json '{"strategy": "ddp", ...}'

Every rank reads only its own shard (streamed by :class:`shardfuse.data.reader.ShardReader`: training starts
after one row group, the sha256 is checked alongside), starts from the same initial weights (rank 0's,
saved once as ``base.safetensors``) and writes ``rank-{rank}.safetensors`` (+ ``.json``),
``metrics/rank-{rank}.parquet`` (one row per optimiser step) and ``metrics/system-rank-{rank}.parquet``
(CPU, memory and GPU use every 5 s: :mod:`shardfuse.metrics.system`). Rank 0 writes ``train.json`` last.

``train_rank`` runs the phases in order: ``set_up`` (model, optimiser, seeds), ``resume_or_start``,
``plan_steps`` (precision, DDP), ``train_loop`` (which calls ``save_checkpoint``), ``publish``.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as torch_dist
from torch.nn.parallel import DistributedDataParallel

from shardfuse.checkpoints.weights import save_weights
from shardfuse.data.manifest import read_manifest
from shardfuse.data.reader import ShardReader, column_stats, feature_stats, read_dataset_info
from shardfuse.experiment.keys import RANK_SEED_STRIDE
from shardfuse.io import StageParser, UserError, parse_json_arg, run_cli
from shardfuse.metrics.steps import MetricsLog
from shardfuse.metrics.system import SystemSampler
from shardfuse.models.registry import build_model, check_output_shape, set_data_stats, task_of
from shardfuse.models.spec import model_spec
from shardfuse.models.tasks import Task
from shardfuse.rank.dist import DistContext, RankGate, autocast, distributed, gate_for, step_dtype
from shardfuse.rank.optim import check_schedule, clip_gradients, lr_at, make_optimizer, set_lr
from shardfuse.rank.resume import (
    Position,
    complete_steps,
    load_rank_extras,
    load_rank_state,
    mark_complete,
    save_rank_state,
)
from shardfuse.rank.sync import Sync, make_sync, mode_of
from shardfuse.rank.validation import BestTracker, Validator, all_out_of_patience, shared_score
from shardfuse.track.client import exit_now
from shardfuse.track.live import LiveLogger


@torch.no_grad()
def broadcast_from_rank0(model: torch.nn.Module) -> None:
    for tensor in model.state_dict().values():
        torch_dist.broadcast(tensor, src=0)


def state_digest(model: torch.nn.Module) -> str:
    """sha256 of the model's tensors: proves every rank started from the same weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def steps_per_epoch(manifest: dict[str, Any], batch_size: int) -> int:
    """Same step count on every rank (DDP would hang otherwise): set by the smallest shard.

    Larger shards spread their extra rows over the same number of batches, so no row is skipped.
    """
    smallest = min(shard["rows"] for shard in manifest["shards"])
    return max(1, math.ceil(smallest / batch_size))


def check_finite(loss_value: float, ctx: DistContext, step: int, policy: str) -> bool:
    """True if the step may proceed. 'error' stops the run; 'skip' skips the batch on every rank."""
    if policy == "skip":
        finite = torch.tensor([int(math.isfinite(loss_value))], dtype=torch.int32, device=ctx.device)
        torch_dist.all_reduce(finite, op=torch_dist.ReduceOp.MIN)
        return bool(finite.item())
    if not math.isfinite(loss_value):
        raise UserError(
            f"rank {ctx.rank}: loss is {loss_value} at step {step}; lower lr, check the data for "
            "extreme values, or set nonfinite_loss: skip to skip such batches"
        )
    return True


@dataclass
class RankSetup:
    """What setup builds for one rank, read by every later phase."""

    ctx: DistContext
    run: str
    cfg: dict[str, Any]
    gate: RankGate
    shard_dir: Path
    dataset_dir: Path
    out_dir: Path
    manifest: dict[str, Any]
    spec: dict[str, Any]
    task: Task
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    meta: dict[str, Any]  # recorded in every weights file this rank writes
    rank_seed: int  # dropout and data order: differ per rank

    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / "checkpoints"

    @property
    def identity(self) -> dict[str, Any]:
        """Written into every checkpoint; a resume refuses a checkpoint of another run or world size."""
        return {"world_size": self.ctx.world_size, "run": self.run}


class StepPlan(NamedTuple):
    """How every step runs, fixed after resume-or-start (DDP wraps the model as it was loaded)."""

    net: torch.nn.Module  # the model, or its DDP wrapper (strategy ddp)
    dtype: torch.dtype | None  # autocast dtype; None: fp32
    num_batches: int  # micro-batches per epoch, the same on every rank
    grad_accum_steps: int  # micro-batches per optimiser step (an epoch's last step takes the rest)
    total_steps: int  # optimiser steps of the whole run (the schedule's length)
    sync: Sync  # the strategy's hook after every optimiser step (local SGD, DiLoCo), bytes counted
    checkpoint_every: int  # 0: no checkpoints
    nonfinite_policy: str  # error | skip
    grad_clip_norm: float | None
    eval_every: int  # 0: no validation while training
    validator: Validator | None
    tracker: BestTracker

    @property
    def same_weights(self) -> bool:
        """All ranks hold the same weights at every step (DDP): one validation decision for all."""
        return isinstance(self.net, DistributedDataParallel)


def optimizer_steps(num_batches: int, grad_accum_steps: int) -> int:
    """Optimiser steps per epoch: the last one takes whatever micro-batches are left over."""
    return math.ceil(num_batches / grad_accum_steps)


def _data_stats(manifest: dict[str, Any], info: dict[str, Any], shard_dir: Path) -> tuple[Any, Any]:
    """(mean, std) of the inputs (not for token blocks) and of regression targets over the whole
    training split, from the moments partition recorded: the same on every rank, with no pass over
    the data before the first step."""
    task = info.get("task", "classification")
    if task == "causal_lm":
        return None, None
    numeric = info.get("input", {}).get("kind", "numeric") == "numeric"  # not images: no moments
    input_stats = feature_stats(manifest, info["num_features"]) if numeric else None
    target_stats = None
    if task == "regression":
        target_stats = column_stats(manifest, [f"y{j}" for j in range(len(info["target_names"]))])
    if (numeric and input_stats is None) or (task == "regression" and target_stats is None):
        raise UserError(
            f"shard manifest in {shard_dir} has no finite column moments (made by an older partition, "
            "or a value overflows float64); re-run partition (snakemake -R partition)"
        )
    return input_stats, target_stats


def load_init_weights(model: torch.nn.Module, path: Path) -> None:
    """Load ``init_from`` weights into ``model``; the first key, shape or dtype that differs is a
    one-line error (nothing is loaded by name guessing or partially)."""
    from shardfuse.checkpoints.weights import load_weights

    tensors, _ = load_weights(path)
    expected = model.state_dict()
    for name, tensor in expected.items():
        if name not in tensors:
            raise UserError(
                f"init_from {path} has no tensor {name!r} that the model needs; start from a checkpoint "
                "of the same model (same model, model_args and dataset shape)"
            )
        found = tensors[name]
        if tuple(found.shape) != tuple(tensor.shape) or found.dtype != tensor.dtype:
            raise UserError(
                f"init_from {path}: tensor {name!r} is {found.dtype} {list(found.shape)} but the model "
                f"needs {tensor.dtype} {list(tensor.shape)}; start from a checkpoint of the same model"
            )
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise UserError(
            f"init_from {path} has tensor {extra[0]!r} the model does not have; start from a checkpoint "
            "of the same model"
        )
    model.load_state_dict(tensors)


def set_up(
    ctx: DistContext,
    run: str,
    shard_dir: Path,
    dataset_dir: Path,
    cfg: dict[str, Any],
    out_dir: Path,
    init_weights: Path | None = None,
) -> RankSetup:
    """Check the shard set, build the model (the same initial weights on every rank) and optimiser."""
    manifest = read_manifest(shard_dir)
    if manifest["world_size"] != ctx.world_size:
        raise UserError(
            f"shard set {shard_dir} has {manifest['world_size']} shards but torchrun started "
            f"{ctx.world_size} ranks; launch with --nproc-per-node/--nodes giving {manifest['world_size']}"
        )
    info = read_dataset_info(dataset_dir)
    spec = model_spec(
        cfg.get("model", "mlp"), cfg.get("model_args", {}), cfg.get("code_paths", []), info, run_cfg=cfg
    )
    if cfg.get("code_digest") and spec["code"]["digest"] != cfg["code_digest"]:
        raise UserError(
            f"the model code in {', '.join(spec['code']['paths']) or spec['model']} changed after the "
            "workflow started; run snakemake again (the training name follows the code)"
        )
    input_stats, target_stats = _data_stats(manifest, info, shard_dir)
    num_batches = steps_per_epoch(manifest, cfg["batch_size"])
    check_schedule(cfg, cfg["epochs"] * optimizer_steps(num_batches, cfg.get("grad_accum_steps", 1)))
    # Dropout and data order differ per rank; the initial weights do not, unless init: per_rank.
    rank_seed = cfg["seed"] * RANK_SEED_STRIDE + ctx.rank + 1
    per_rank = cfg.get("init", "shared") == "per_rank"
    torch.manual_seed(rank_seed if per_rank else cfg["seed"])
    model = build_model(spec).to(ctx.device)
    set_data_stats(model, input_stats, target_stats)
    if init_weights is not None:
        load_init_weights(model, init_weights)
    check_output_shape(model, spec, ctx.device)
    if not per_rank:
        broadcast_from_rank0(model)
    meta = {
        "run": run,
        "world_size": ctx.world_size,
        "strategy": cfg["strategy"],
        "model": spec,
        "init_from": str(init_weights) if init_weights is not None else None,
        "init_sha256": state_digest(model),
        "host": socket.gethostname(),
    }
    if per_rank:
        meta["init"] = "per_rank"  # headers of shared-init runs stay as they were
    out_dir.mkdir(parents=True, exist_ok=True)
    optimizer = make_optimizer(model, cfg)
    torch.manual_seed(rank_seed)
    return RankSetup(
        ctx=ctx,
        run=run,
        cfg=cfg,
        gate=gate_for(ctx.rank),
        shard_dir=shard_dir,
        dataset_dir=dataset_dir,
        out_dir=out_dir,
        manifest=manifest,
        spec=spec,
        task=task_of(spec, model.state_dict(), loss=cfg.get("loss", "mse")),
        model=model,
        optimizer=optimizer,
        meta=meta,
        rank_seed=rank_seed,
    )


def resume_or_start(setup: RankSetup) -> Position:
    """Continue from the newest complete checkpoint (model, optimiser, RNG, data position), or start
    at step 0 and save the shared initial weights as ``base.safetensors``."""
    model, checkpoint_dir = setup.model, setup.checkpoint_dir
    # Rank 0 picks the checkpoint and every rank takes it: ranks that looked at the directory at
    # different moments (a checkpoint completing in between) would otherwise resume out of step.
    chosen = [complete_steps(checkpoint_dir)[-1:] if setup.ctx.rank == 0 else None]
    torch_dist.broadcast_object_list(chosen, src=0)
    resumable = chosen[0]
    if not resumable:
        base_meta = {**setup.meta, "rank": None}
        setup.gate.call(save_weights, setup.out_dir / "base.safetensors", model.state_dict(), base_meta)
        return Position()
    position = load_rank_state(
        checkpoint_dir, resumable[-1], setup.ctx.rank, model, setup.optimizer, expect=setup.identity
    )
    setup.gate.log(
        f"[{setup.run}] resuming from checkpoint step {position.step} (epoch {position.epoch + 1}, "
        f"batch {position.next_batch})"
    )
    return position


def forward_updates_buffers(model: torch.nn.Module) -> bool:
    """Whether training changes the model's buffers (normalisation running statistics), so DDP must
    broadcast rank 0's before every forward to keep the ranks equal.

    That broadcast is a collective per step, as costly as the gradients' all_reduce on CPU (gloo
    figures: bench/RESULTS.md, bench/scaling.py). Buffers set once before training, such as the MLP's
    input statistics, are already equal on every rank after set-up's broadcast and stay so."""
    return any(getattr(module, "track_running_stats", False) for module in model.modules())


def plan_steps(setup: RankSetup, position: Position) -> StepPlan:
    """Precision, the DDP wrapper, the strategy, validation and the step counts; a resumed run's
    strategy and validation state come back from its checkpoint. Peak GPU memory counts from here."""
    device, cfg, model = setup.ctx.device, setup.cfg, setup.model
    cuda = device.type == "cuda"
    dtype = step_dtype(cfg.get("precision", "auto"), device, cuda and torch.cuda.is_bf16_supported())
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    device_ids = [device.index] if cuda else None
    net = (
        DistributedDataParallel(
            model, device_ids=device_ids, broadcast_buffers=forward_updates_buffers(model)
        )
        if cfg["strategy"] == "ddp"
        else model
    )
    num_batches = steps_per_epoch(setup.manifest, cfg["batch_size"])
    grad_accum_steps = cfg.get("grad_accum_steps", 1)
    eval_every = cfg.get("eval_every", 0)
    sync = make_sync(model, setup.ctx.world_size, cfg)
    tracker = BestTracker(setup.task, cfg.get("keep", "last") == "best", cfg.get("patience"))
    if position.step:
        tensors, state = load_rank_extras(setup.checkpoint_dir, position.step, setup.ctx.rank)
        sync.resume_at(position.step)
        sync.load_state_tensors(tensors)
        tracker.load(state.get("validation", {}), tensors)
    validator = (
        Validator(setup.dataset_dir, setup.task, 4 * cfg["batch_size"], device) if eval_every else None
    )
    return StepPlan(
        net=net,
        dtype=dtype,
        num_batches=num_batches,
        grad_accum_steps=grad_accum_steps,
        total_steps=cfg["epochs"] * optimizer_steps(num_batches, grad_accum_steps),
        sync=sync,
        checkpoint_every=cfg.get("checkpoint_every", 0),
        nonfinite_policy=cfg.get("nonfinite_loss", "error"),
        grad_clip_norm=cfg.get("grad_clip_norm"),
        eval_every=eval_every,
        validator=validator,
        tracker=tracker,
    )


@torch.no_grad()
def publish_rank0_buffers(model: torch.nn.Module) -> None:
    """Rank 0's buffers (normalisation running statistics) on every rank, as DDP's next forward would
    make them: DDP broadcasts them before each forward, and each rank's last forward then updated its
    own, so without this the published (or best) ranks would differ in their running statistics."""
    for buffer in model.buffers():
        torch_dist.broadcast(buffer, src=0)


class StepResult(NamedTuple):
    loss: float  # mean of the micro-batches' losses
    rows: int
    applied: bool  # whether the optimiser may step (a finite loss reached the gradients)


def accumulate_gradients(
    setup: RankSetup,
    plan: StepPlan,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    group_size: int,
    step: int,
) -> StepResult:
    """Forward and backward over ``group_size`` micro-batches, each loss scaled by 1/group_size, so the
    gradient is the mean over the group (the large batch's, for equal micro-batches). DDP all-reduces
    once, in the last backward: the others run under ``no_sync``."""
    ctx, task = setup.ctx, setup.task
    ddp = isinstance(plan.net, DistributedDataParallel)
    total_loss, rows, applied = 0.0, 0, False
    for micro in range(group_size):
        inputs, targets = next(batches)
        inputs = inputs.to(ctx.device, non_blocking=True)
        targets = targets.to(ctx.device, non_blocking=True)
        inputs, targets = task.batch(inputs, targets)
        last = micro == group_size - 1
        with plan.net.no_sync() if ddp and not last else contextlib.nullcontext():
            with autocast(ctx.device, plan.dtype):
                loss = task.loss(plan.net(inputs), targets)
            loss_value = loss.item()  # one host sync a micro-step: the finite check and metrics share it
            if check_finite(loss_value, ctx, step, plan.nonfinite_policy):
                (loss / group_size if group_size > 1 else loss).backward()
                # Under DDP only the last backward syncs the accumulated gradients: without it the
                # ranks' gradients differ, so the whole step is skipped.
                applied = last or (applied and not ddp)
        total_loss += loss_value
        rows += len(targets)
    return StepResult(total_loss / group_size, rows, applied)


def validate(setup: RankSetup, plan: StepPlan, step: int) -> tuple[float, bool]:
    """Score the validation split; (score, whether every rank now stops early)."""
    if plan.same_weights and forward_updates_buffers(setup.model):
        publish_rank0_buffers(setup.model)
    score = shared_score(plan.validator.score(setup.model), plan.same_weights, setup.ctx.device)
    plan.tracker.update(score, step, setup.model)
    stop = plan.tracker.patience is not None and all_out_of_patience(plan.tracker, setup.ctx.device)
    return score, stop


def train_loop(
    setup: RankSetup, plan: StepPlan, position: Position, metrics: MetricsLog | None, live: LiveLogger | None
) -> tuple[int, float, bool]:
    """Run the remaining optimiser steps; the last step's number, this rank's seconds in the loop and
    whether validation stopped the run early."""
    ctx, cfg, run, gate = setup.ctx, setup.cfg, setup.run, setup.gate
    model, optimizer, num_batches = setup.model, setup.optimizer, plan.num_batches
    accum = plan.grad_accum_steps
    gate.log(
        f"[{run}] {mode_of(cfg['strategy'], cfg.get('sync_every', 0))} on {ctx.world_size} ranks "
        f"({ctx.backend}, {'fp32' if plan.dtype is None else 'bf16 autocast'}): {cfg['epochs']} epochs x "
        f"{optimizer_steps(num_batches, accum)} steps" + (f" of {accum} micro-batches" if accum > 1 else "")
    )
    model.train()
    # The ranks start the timed loop together. Without this, the start-up that one rank finishes
    # later than another (imports, rank 0's base.safetensors) lands in the other's loop time at their
    # first collective (a checkpoint's barrier, a sync), and train_seconds (the slowest rank's loop)
    # charges the loop with it: bench/scaling.py, figures in bench/RESULTS.md.
    torch_dist.barrier()
    started = time.perf_counter()
    step = position.step
    loss_value = float("nan")  # a resume at an epoch's end runs no batch in that epoch
    stop = False
    # The reader streams the shard (first batch after one row group; sha256 checked alongside, a
    # mismatch stops the run when the first epoch ends) and keeps it in memory for later epochs.
    with (
        ShardReader(setup.shard_dir, ctx.rank, seed=setup.rank_seed, cache=True, verify=True) as reader,
        gate.progress(plan.total_steps, initial_step=step, description=run) as progress,
    ):
        for epoch in range(position.epoch, cfg["epochs"]):
            first = position.next_batch if epoch == position.epoch else 0
            batches = reader.epoch(epoch, num_batches, first)
            tick = time.perf_counter()  # samples/s covers the whole step: waiting for data included
            for group_start in range(first, num_batches, accum):
                group_size = min(accum, num_batches - group_start)
                optimizer.zero_grad(set_to_none=True)
                result = accumulate_gradients(setup, plan, batches, group_size, step + 1)
                lr = lr_at(step, plan.total_steps, cfg)  # the schedule is a function of the step
                step += 1
                loss_value, grad_norm = result.loss, math.nan
                if result.applied:
                    set_lr(optimizer, lr)
                    grad_norm = clip_gradients(model.parameters(), plan.grad_clip_norm)
                    optimizer.step()
                plan.sync.after_step(step)
                end_of_epoch = group_start + group_size == num_batches
                val_score = math.nan
                if plan.validator is not None and (step % plan.eval_every == 0 or end_of_epoch):
                    val_score, stop = validate(setup, plan, step)
                if metrics is not None:
                    now = time.perf_counter()
                    throughput = result.rows / max(now - tick, 1e-9)
                    tick = now
                    metrics.append(step, epoch, loss_value, throughput, lr, now, grad_norm, val_score)
                    progress.update(step, loss=loss_value, samples_per_second=throughput)
                    if live is not None:
                        live.log(step, {"loss": loss_value, "samples_per_second": throughput})
                # No checkpoint at the stopping step: a run resumed from an earlier one stops here again.
                if plan.checkpoint_every and step % plan.checkpoint_every == 0 and not stop:
                    save_checkpoint(setup, plan, Position(step, epoch, group_start + group_size), metrics)
                if stop:
                    break
            gate.log(f"[{run}] epoch {epoch + 1}/{cfg['epochs']} step {step} rank-0 loss {loss_value:.4f}")
            if stop:
                gate.log(
                    f"[{run}] early stop at step {step}: no rank improved for "
                    f"{plan.tracker.patience} validations"
                )
                break
    plan.sync.finish(step)
    return step, time.perf_counter() - started, stop


def save_checkpoint(setup: RankSetup, plan: StepPlan, position: Position, metrics: MetricsLog | None) -> None:
    """Every rank saves its state; the checkpoint counts (rank 0 marks it complete) once all have."""
    if metrics is not None:
        metrics.flush()  # every row up to the checkpoint survives a restart from it
    save_rank_state(
        setup.checkpoint_dir,
        setup.ctx.rank,
        setup.model,
        setup.optimizer,
        position,
        setup.identity,
        state_tensors={**plan.sync.state_tensors(), **plan.tracker.state_tensors()},
        state={"validation": plan.tracker.state()},
    )
    torch_dist.barrier()  # every rank saved before the checkpoint counts
    setup.gate.call(mark_complete, setup.checkpoint_dir, position.step, setup.cfg.get("keep_checkpoints", 2))


def publish(
    setup: RankSetup,
    plan: StepPlan,
    num_steps: int,
    loop_seconds: float,
    stopped_early: bool,
    metrics: MetricsLog | None,
    system: SystemSampler,
) -> None:
    """Write this rank's weights (the last, or with keep: best the best validated) and metrics (step
    and system); rank 0 writes train.json once every rank's files exist."""
    ctx, cfg, manifest, tracker = setup.ctx, setup.cfg, setup.manifest, plan.tracker
    seconds = torch.tensor([loop_seconds], dtype=torch.float64)
    torch_dist.all_reduce(seconds, op=torch_dist.ReduceOp.MAX)  # the slowest rank's time

    if plan.same_weights and forward_updates_buffers(setup.model):
        publish_rank0_buffers(setup.model)  # consolidate checks that the ddp ranks are identical
    weights, published_step = setup.model.state_dict(), num_steps
    if tracker.keep_best and tracker.best_weights is not None:
        weights, published_step = tracker.best_weights, tracker.best_step
    num_rows = manifest["shards"][ctx.rank]["rows"]
    rank_meta = {**setup.meta, "rank": ctx.rank, "rows": num_rows, "num_steps": num_steps}
    if published_step != num_steps:
        rank_meta["published_step"] = published_step
    save_weights(setup.out_dir / f"rank-{ctx.rank}.safetensors", weights, rank_meta)
    if metrics is not None:
        metrics.consolidate()
    system.consolidate()  # does nothing when sampling is off
    cuda = ctx.device.type == "cuda"
    peak_memory = int(torch.cuda.max_memory_allocated(ctx.device)) if cuda else None
    best = None if math.isnan(tracker.best_score) else tracker.best_score
    facts: list[Any] = [None] * ctx.world_size
    # Also the barrier: every rank's files exist once this returns.
    torch_dist.all_gather_object(facts, (setup.meta["host"], published_step, best))
    hosts = [fact[0] for fact in facts]
    world_size, accum = ctx.world_size, plan.grad_accum_steps
    setup.gate.write_json(
        setup.out_dir / "train.json",
        {
            "run": setup.run,
            "world_size": world_size,
            "strategy": cfg["strategy"],
            "mode": mode_of(cfg["strategy"], cfg.get("sync_every", 0)),
            "sync_every": plan.sync.sync_every,
            "num_steps": num_steps,
            "epochs": cfg["epochs"],
            "steps_per_epoch": optimizer_steps(plan.num_batches, accum),
            "grad_accum_steps": accum,
            "effective_batch_size": cfg["batch_size"] * accum * world_size,
            "lr_schedule": cfg.get("lr_schedule", "constant"),
            "warmup_steps": cfg.get("warmup_steps", 0),
            "grad_clip_norm": plan.grad_clip_norm,
            "bytes_all_reduced_per_rank": plan.sync.bytes_all_reduced,
            "num_syncs": plan.sync.num_syncs,
            "init": setup.meta.get("init", "shared"),
            "keep": cfg.get("keep", "last"),
            "validation": (
                {"score": setup.task.score, "every": plan.eval_every} if plan.validator is not None else None
            ),
            "stopped_early": stopped_early,
            "train_seconds": float(seconds.item()),
            "backend": ctx.backend,
            "device": str(ctx.device),
            "precision": "fp32" if plan.dtype is None else "bf16",
            "peak_gpu_memory_bytes": peak_memory,
            "step_metrics": metrics is not None,
            "hosts": hosts,
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "torch_version": torch.__version__,
            "shard_dir": str(setup.shard_dir),
            "dataset_dir": str(setup.dataset_dir),
            "task": setup.task.name,
            "model": setup.spec,
            "init_from": setup.meta["init_from"],
            "ranks": [
                {
                    "rank": s["rank"],
                    "rows": s["rows"],
                    "host": hosts[s["rank"]],
                    "checkpoint": f"rank-{s['rank']}.safetensors",
                    "published_step": facts[s["rank"]][1],
                    "best_val_score": facts[s["rank"]][2],
                }
                for s in manifest["shards"]
            ],
        },
    )


def train_rank(
    ctx: DistContext,
    run: str,
    shard_dir: Path,
    dataset_dir: Path,
    cfg: dict[str, Any],
    out_dir: Path,
    live: LiveLogger | None = None,
    step_metrics: bool = True,
    init_weights: Path | None = None,
) -> None:
    """Train this rank. ``step_metrics=False`` records no per-step metrics, progress or live points
    (the logging-overhead benchmark's baseline; the track stage then has no curves to log)."""
    setup = set_up(ctx, run, shard_dir, dataset_dir, cfg, out_dir, init_weights)
    position = resume_or_start(setup)
    # Rows logged after the checkpoint we resume from (or by an attempt that saved none) are dropped.
    metrics = MetricsLog(out_dir / "metrics", ctx.rank, resume_step=position.step) if step_metrics else None
    # CPU, memory and GPU use every few seconds, from a thread that only reads /proc and NVML (no torch,
    # so training stays bitwise the same); off with the step metrics. A resumed run appends its samples.
    gpu = ctx.device.index if ctx.device.type == "cuda" else None
    with SystemSampler(out_dir / "metrics", ctx.rank, gpu, interval_s=None if step_metrics else 0) as system:
        plan = plan_steps(setup, position)
        num_steps, loop_seconds, stopped_early = train_loop(setup, plan, position, metrics, live)
        publish(setup, plan, num_steps, loop_seconds, stopped_early, metrics, system)


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="python -m shardfuse.train", description="One torchrun rank.")
    parser.add_argument("--run-name", required=True, help="run name (recorded in every output)")
    parser.add_argument("--shard-dir", required=True, type=Path, help="shard set with manifest.json")
    parser.add_argument("--dataset-dir", required=True, type=Path, help="prepared dataset (dataset.json)")
    parser.add_argument("--config-json", required=True, help="the run's resolved config as JSON")
    parser.add_argument("--out-dir", required=True, type=Path, help="where this run's rank files go")
    parser.add_argument(
        "--init-from", type=Path, help="start every rank from these weights (the run's init_from, resolved)"
    )
    parser.add_argument("--live-tracking-uri", help="rank 0 also logs to MLflow while training (optional)")
    parser.add_argument("--live-experiment", default="shardfuse", help="MLflow experiment for live logging")
    parser.add_argument(
        "--no-step-metrics",
        dest="step_metrics",
        action="store_false",
        help="record no per-step metrics, progress or live points (for measuring their overhead: "
        "bench/logging_overhead.py; the track stage then has no curves to log)",
    )
    args = parser.parse_args(argv)
    cfg = parse_json_arg(args.config_json, "--config-json")
    with (
        distributed() as ctx,
        gate_for(ctx.rank).live_logger(args.live_tracking_uri, args.live_experiment, args.run_name) as live,
    ):
        train_rank(
            ctx,
            args.run_name,
            args.shard_dir,
            args.dataset_dir,
            cfg,
            args.out_dir,
            live,
            args.step_metrics,
            args.init_from,
        )


if __name__ == "__main__":
    run_cli(main)
    # Every file is written and closed, the process group destroyed and the sampler and live threads
    # joined: skip the interpreter's teardown, where torch's C++ destructors once aborted a finished rank
    # ("terminate called without an active exception", SIGABRT) under heavy load in CI.
    exit_now()
