"""Setting up one rank of a training (its first phase): its model and optimiser, the same initial
weights on every rank, and the helpers the later phases share (steps per epoch, the finite-loss check,
rank 0's buffers). Where it starts is :mod:`shardfuse.rank.start`, the plan of its steps (precision,
DDP, gradient accumulation) :mod:`shardfuse.rank.step_plan`.
"""

from __future__ import annotations

import hashlib
import math
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist

from shardfuse.checkpoints.init_weights import expected_of, load_tensors, match_names, read_init_weights
from shardfuse.cluster.membership import Membership
from shardfuse.data.dataset_info import read_dataset_info
from shardfuse.data.epoch_steps import EpochPlan, alignment_problem, optimizer_steps, plan_epochs
from shardfuse.data.manifest import read_manifest
from shardfuse.data.moments import column_stats, feature_stats
from shardfuse.data.shard_format import target_columns
from shardfuse.data.verify import check_shard_set
from shardfuse.experiment.keys import rank_seed as seed_of_rank
from shardfuse.experiment.run_config import TrainConfig
from shardfuse.io import UserError
from shardfuse.models.adapter import file_ties, load_state, storable_state, tensor_bytes, ties_of
from shardfuse.models.lora import inject as inject_lora
from shardfuse.models.lora import settings as lora_settings
from shardfuse.models.registry import (
    build_model,
    check_output_shape,
    probe_batch,
    set_data_stats,
    task_of,
)
from shardfuse.models.spec import model_spec
from shardfuse.models.tasks import Task, named_task, task_record
from shardfuse.rank.dist import DistContext, RankGate, gate_for
from shardfuse.rank.fsdp import Layout, layout_of, make_mesh, shard_model, wrap_units
from shardfuse.rank.optim import check_schedule, make_optimizer
from shardfuse.strategies.registry import apart_runs, find_strategy


@torch.no_grad()
def broadcast_from_rank0(model: torch.nn.Module) -> None:
    for tensor in storable_state(model)[0].values():  # a tied tensor once
        torch_dist.broadcast(tensor, src=0)


def state_digest(model: torch.nn.Module) -> str:
    """sha256 of the model's tensors (any dtype): proves every rank started from the same weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor_bytes(tensor))
    return digest.hexdigest()


def epoch_plan(manifest: dict[str, Any], cfg: TrainConfig) -> EpochPlan:
    """Every shard's epoch (its rows, its micro-batches) under the run's ``epoch_steps``: the same step
    count on every rank unless the ranks never meet (:mod:`shardfuse.data.epoch_steps`)."""
    rows = [shard["rows"] for shard in manifest["shards"]]
    return plan_epochs(rows, cfg.loop.batch_size, cfg.loop.epoch_steps)


def check_finite(loss_value: float, ctx: DistContext, step: int, policy: str, agree: bool = True) -> bool:
    """True if the step may proceed. 'error' stops the run; 'skip' skips the batch on every rank (on
    this rank alone unless ``agree``: ranks that take their own steps never meet mid-step)."""
    if policy == "skip" and not agree:
        return math.isfinite(loss_value)
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
    cfg: TrainConfig
    membership: Membership  # who trains which shard in which replica, who is alive
    gate: RankGate
    shard_dir: Path
    dataset_dir: Path
    out_dir: Path
    manifest: dict[str, Any]
    epochs: EpochPlan  # every shard's epoch: its rows and micro-batches (epoch_steps)
    spec: dict[str, Any]
    task: Task
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    meta: dict[str, Any]  # recorded in every weights file this rank writes
    rank_seed: int  # dropout and data order: differ per rank
    updates_buffers: bool = False  # a training forward changes buffers: DDP broadcasts rank 0's
    layout: Layout | None = None  # replicas and shards (fsdp); None: every rank its own replica
    mesh: Any = None  # fsdp > 1: the (replicate, shard) device mesh
    ties: dict[str, str] | None = None  # fsdp > 1: the model's ties, found before sharding

    @property
    def sharded(self) -> bool:
        return self.layout is not None and self.layout.sharded

    @property
    def member_rank(self) -> int:
        """This process's rank in the training's first world: its seed, shard, checkpoint and metrics
        files (torch's rank while no rank was lost; shardfuse.cluster.membership)."""
        return self.membership.member_of_process(self.ctx.rank).rank

    @property
    def data_shard(self) -> int:
        """The shard this rank reads: the membership's, not torch's rank."""
        return self.membership.shard_of(self.member_rank)

    def model_state(self) -> dict[str, torch.Tensor]:
        """The tensors a weights file holds (a tied tensor once); sharded tensors as DTensors."""
        if self.sharded:
            ties = self.ties or {}
            return {name: t for name, t in self.model.state_dict().items() if name not in ties}
        return storable_state(self.model)[0]

    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / "checkpoints"

    @property
    def identity(self) -> dict[str, Any]:
        """Written into every checkpoint; a resume refuses a checkpoint of another run or world size
        (or, sharded, another fsdp: its files hold other slices)."""
        identity = {"world_size": self.membership.world_size, "run": self.run}
        if self.sharded:
            identity["fsdp"] = self.layout.shards
        return identity


def data_stats(manifest: dict[str, Any], info: dict[str, Any], shard_dir: Path) -> tuple[Any, Any]:
    """(mean, std) of the inputs (not for token blocks) and of regression targets over the whole
    training split, from the moments partition recorded: the same on every rank, with no pass over
    the data before the first step."""
    task = task_record(named_task(info))
    # Not images, not token ids: only numeric columns have moments.
    numeric = info.get("input", {}).get("kind", task.default_input) == "numeric"
    input_stats = feature_stats(manifest, info["num_features"]) if numeric else None
    target_stats = None
    if task.scales_targets:
        target_stats = column_stats(manifest, target_columns(len(info["target_names"])))
    if (numeric and input_stats is None) or (task.scales_targets and target_stats is None):
        raise UserError(
            f"shard manifest in {shard_dir} has no finite column moments (made by an older partition, "
            "or a value overflows float64); re-run partition (snakemake -R partition)"
        )
    return input_stats, target_stats


def spec_of(cfg: TrainConfig, info: dict[str, Any]) -> dict[str, Any]:
    """The model spec of a train config's model keys on a prepared dataset (its dataset.json)."""
    return model_spec(
        cfg.model.model,
        cfg.model.model_args,
        cfg.model.code_paths,
        info,
        run_cfg=cfg.model.mlp_keys(),
        output=cfg.model.model_output,
        model_files=cfg.model.model_files,
    )


def load_init_weights(
    model: torch.nn.Module, path: Path, prefix_map: dict[str, str | None] | None = None
) -> None:
    """Load ``init_from`` (a shardfuse checkpoint, another safetensors file or a save_pretrained
    folder) into ``model``, its names renamed by ``prefix_map`` (init_from_prefix); the first tensor
    that does not fit is a one-line error, the config check's (nothing is loaded by name guessing or
    partially; shardfuse.checkpoints.init_weights)."""
    weights = read_init_weights(path)
    expected, ties = storable_state(model)
    plan = match_names(weights, expected_of(expected), ties, prefix_map)
    dtypes = {name: tensor.dtype for name, tensor in model.state_dict().items()}
    tensors = load_tensors(weights, plan, dtypes)
    for name, tensor in tensors.items():  # a NaN start would surface as "loss is nan" at step 1
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            count = int((~torch.isfinite(tensor)).sum())
            raise UserError(
                f"{weights.source} holds {count} inf or NaN value(s) in tensor {name!r}; "
                "training cannot start from it: fix or replace the file"
            )
    load_state(model, tensors, weights.source, file_ties(weights.metadata or {}))


def set_up(
    ctx: DistContext,
    run: str,
    shard_dir: Path,
    dataset_dir: Path,
    cfg: TrainConfig,
    out_dir: Path,
    init_weights: Path | None = None,
    membership: Membership | None = None,
) -> RankSetup:
    """Check the shard set, build the model (the same initial weights on every rank) and optimiser.
    ``membership``: who is alive, when ranks were lost (the launcher's; default: every rank)."""
    strategy = find_strategy(cfg.sync.strategy)  # an unknown one fails before anything is built
    sync = cfg.sync
    problem = alignment_problem(cfg.loop.epoch_steps, strategy, sync.sync_every, sync.fsdp, apart_runs())
    if problem is not None:
        raise UserError(problem)
    manifest = read_manifest(shard_dir)
    world_size = ctx.world_size if membership is None else membership.world_size
    if manifest["world_size"] != world_size:
        raise UserError(
            f"shard set {shard_dir} has {manifest['world_size']} shards but torchrun started "
            f"{world_size} ranks; launch with --nproc-per-node/--nodes giving {manifest['world_size']}"
        )
    if membership is None:
        layout_of(ctx.rank, ctx.world_size, cfg.sync.fsdp)  # fsdp that does not divide: its own line
        membership = Membership.full(ctx.world_size, cfg.sync.fsdp)
    elif len(membership.alive_members) != ctx.world_size:
        raise UserError(
            f"torchrun started {ctx.world_size} ranks but {len(membership.alive_members)} of the training's "
            f"{world_size} are alive; start one process per alive rank (shardfuse.launch does)"
        )
    member = membership.member_of_process(ctx.rank)
    layout = layout_of(member.rank, membership.world_size, cfg.sync.fsdp)
    info = read_dataset_info(dataset_dir)
    check_shard_set(shard_dir, manifest, dataset_dir, info, member.data_shard)
    spec = spec_of(cfg, info)
    if cfg.model.code_digest and spec["code"]["digest"] != cfg.model.code_digest:
        raise UserError(
            f"the model code in {', '.join(spec['code']['paths']) or spec['model']} changed after the "
            "workflow started; run snakemake again (the training name follows the code)"
        )
    input_stats, target_stats = data_stats(manifest, info, shard_dir)
    epochs = epoch_plan(manifest, cfg)
    # The shortest schedule: every rank's, but with epoch_steps own each rank has its own.
    shortest = min(optimizer_steps(shard.num_batches, cfg.loop.grad_accum_steps) for shard in epochs.shards)
    check_schedule(cfg.optim, cfg.loop.epochs * shortest)
    if (warning := epochs.warning()) is not None:
        gate_for(ctx.rank).log(warning)  # rank 0's stderr: one line
    # Dropout and data order differ per rank; the initial weights do not, unless init: per_rank.
    rank_seed = seed_of_rank(cfg.loop.seed, member.rank)
    per_rank = cfg.model.init == "per_rank"
    torch.manual_seed(rank_seed if per_rank else cfg.loop.seed)
    model = build_model(spec).to(ctx.device)
    set_data_stats(model, input_stats, target_stats)
    if init_weights is not None:
        load_init_weights(model, init_weights, cfg.model.init_from_prefix)
    check_output_shape(model, spec, ctx.device)
    updates_buffers = forward_updates_buffers(model, probe_batch(spec, ctx.device))
    if not per_rank:
        broadcast_from_rank0(model)
    init_sha256 = state_digest(model)
    adapter = None
    if cfg.model.adapter is not None:  # LoRA over the frozen weights, drawn alike or per rank
        adapter = lora_settings(cfg.model.adapter)
        shared = adapter["init"] == "shared"
        targets = inject_lora(model, adapter, cfg.loop.seed if shared else rank_seed)
        adapter = {**adapter, "targets": targets, "base": "base.safetensors"}
    task = task_of(spec, model.state_dict(), loss=cfg.model.loss)
    mesh = None
    ties = ties_of(model) if adapter is None else None  # found before sharding hides them
    if layout.sharded:  # FSDP2 inside each replica: every unit, then the root
        if adapter is not None or updates_buffers:
            what = "a LoRA adapter" if adapter is not None else "a model whose forward updates buffers"
            raise UserError(f"fsdp > 1 does not train {what} yet; set fsdp: 1")
        units = wrap_units(model, cfg.model.model)
        mesh = make_mesh(ctx.device, layout)
        shard_model(model, mesh, units, strategy.reduces_gradients, cfg.sync.fsdp_precision, ctx.device)
    meta = {
        "run": run,
        "world_size": membership.world_size,
        "strategy": cfg.sync.strategy,
        "model": spec,
        "init_from": str(init_weights) if init_weights is not None else None,
        "init_sha256": init_sha256,
        "host": socket.gethostname(),
    }
    if per_rank:
        meta["init"] = "per_rank"  # headers of shared-init runs stay as they were
    if adapter is not None:
        meta["adapter"] = adapter  # base_sha256 joins it when the rank publishes (the base is written then)
    elif ties:
        meta["ties"] = ties  # {alias: source}: the alias is not in the file (shardfuse.models.adapter)
    if layout.sharded:
        meta["fsdp"] = {"shards": layout.shards, "replicas": layout.replicas}
    out_dir.mkdir(parents=True, exist_ok=True)
    optimizer = make_optimizer(model, cfg.optim)
    torch.manual_seed(rank_seed)
    return RankSetup(
        ctx=ctx,
        run=run,
        cfg=cfg,
        membership=membership,
        gate=gate_for(ctx.rank),
        shard_dir=shard_dir,
        dataset_dir=dataset_dir,
        out_dir=out_dir,
        manifest=manifest,
        epochs=epochs,
        spec=spec,
        task=task,
        model=model,
        optimizer=optimizer,
        meta=meta,
        rank_seed=rank_seed,
        updates_buffers=updates_buffers,
        layout=layout,
        mesh=mesh,
        ties=ties,
    )


def forward_updates_buffers(model: torch.nn.Module, probe: torch.Tensor | None = None) -> bool:
    """Whether training changes the model's buffers (normalisation running statistics, an EMA a
    forward keeps), so DDP must broadcast rank 0's before every forward to keep the ranks equal:
    normalisation layers that track statistics, or else any buffer one training-mode forward on
    ``probe`` changes (run without gradients, its buffers and the RNG restored afterwards).

    That broadcast is a collective per step, as costly as the gradients' all_reduce on CPU (gloo
    figures: bench/RESULTS.md, bench/scaling.py). Buffers set once before training, such as the MLP's
    input statistics, are already equal on every rank after set-up's broadcast and stay so."""
    if any(getattr(module, "track_running_stats", False) for module in model.modules()):
        return True
    buffers = [b for b in model.buffers() if b.numel()]
    if probe is None or not buffers:
        return False
    saved = [b.detach().clone() for b in buffers]
    was_training = model.training
    try:
        cuda = [probe.device.index or 0] if probe.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            model.train()
            model(probe)
        return any(not torch.equal(b, s) for b, s in zip(buffers, saved, strict=True))
    finally:
        model.train(was_training)
        with torch.no_grad():
            for b, s in zip(buffers, saved, strict=True):
                b.copy_(s)


@torch.no_grad()
def publish_rank0_buffers(model: torch.nn.Module) -> None:
    """Rank 0's buffers (normalisation running statistics) on every rank, as DDP's next forward would
    make them: DDP broadcasts them before each forward, and each rank's last forward then updated its
    own, so without this the published (or best) ranks would differ in their running statistics."""
    for buffer in model.buffers():
        torch_dist.broadcast(buffer, src=0)
