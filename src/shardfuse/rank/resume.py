"""Training checkpoints for exact resume: model, optimiser, RNG states and data position.

Layout (inside the training's staging directory, ``results/trainings/<training>/.ranks.partial/``, so it
survives a failed or killed job)::

    checkpoints/step-{N}/rank-{r}.safetensors   tensors: model.*, optim.<param>.<key>, rng.*
    checkpoints/step-{N}/rank-{r}.json          step, epoch, next batch, optimiser param groups, ...
    checkpoints/step-{N}/COMPLETE               written by rank 0 once every rank's files exist

Only directories with COMPLETE count; the newest ``keep`` complete ones are kept, so that a newest one
left unreadable (a file truncated by a full disk or a crash of the filesystem) has a predecessor to
resume from instead (:func:`resume_step`). Tensors go through safetensors and everything else through
JSON: nothing here is ever unpickled.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from shardfuse.checkpoints.weights import write_safetensors
from shardfuse.io import UserError, atomic_path, error_reason, write_json
from shardfuse.models.adapter import load_state, storable_state
from shardfuse.rank.checkpoint_steps import COMPLETE, STEP_DIR, complete_steps
from shardfuse.strategies.sync import is_dtensor, local


@dataclass
class Position:
    """Where training continues: the next batch of an epoch (the shard reader's batches depend only on
    the seed and the epoch, so this is the whole data position)."""

    step: int = 0
    epoch: int = 0
    next_batch: int = 0


def save_rank_state(
    checkpoint_dir: Path,
    rank: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    position: Position,
    extra: dict[str, Any],
    state_tensors: dict[str, torch.Tensor] | None = None,
    state: dict[str, Any] | None = None,
    sharded: dict[str, torch.Tensor] | None = None,
) -> Path:
    """``state_tensors`` (names outside model./optim./rng.) and the JSON ``state`` hold what a
    strategy or the validation tracker needs to resume; :func:`load_rank_extras` reads them back.
    ``sharded`` (fsdp > 1): the model's tensors, of which this rank saves its own shards, as it does
    of the optimiser state."""
    step_dir = checkpoint_dir / f"step-{position.step}"
    step_dir.mkdir(parents=True, exist_ok=True)
    # A tied tensor once: safetensors refuses shared memory.
    weights = storable_state(model)[0] if sharded is None else sharded
    tensors = {f"model.{name}": local(t).detach().cpu().contiguous() for name, t in weights.items()}
    optim = optimizer.state_dict()
    for index, param_state in optim["state"].items():
        for key, value in param_state.items():
            tensors[f"optim.{index}.{key}"] = local(torch.as_tensor(value)).detach().cpu().contiguous()
    tensors.update({name: t.detach().cpu().contiguous() for name, t in (state_tensors or {}).items()})
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    with atomic_path(step_dir / f"rank-{rank}.safetensors") as tmp:
        write_safetensors(tensors, tmp)
    write_json(
        step_dir / f"rank-{rank}.json",
        {
            **extra,
            "rank": rank,
            "step": position.step,
            "epoch": position.epoch,
            "next_batch": position.next_batch,
            "param_groups": optim["param_groups"],
            "state": state or {},
        },
    )
    return step_dir


# What a rank's checkpoint record must hold to resume from it.
RECORD_KEYS = ("step", "epoch", "next_batch", "param_groups")


def checkpoint_problem(checkpoint_dir: Path, step: int, rank: int) -> str | None:
    """Why this rank cannot resume from the checkpoint of ``step``: its file and what is wrong with it
    (a safetensors file whose header or size is broken, a record that is not JSON or lacks the data
    position); None when both read. Reads headers and the record only, not the tensors."""
    step_dir = checkpoint_dir / f"step-{step}"
    tensors, record_path = step_dir / f"rank-{rank}.safetensors", step_dir / f"rank-{rank}.json"
    try:
        with safe_open(str(tensors), framework="pt"):
            pass
    except (SafetensorError, OSError) as exc:
        return f"{tensors} ({error_reason(exc)})"
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError) as exc:
        return f"{record_path} ({error_reason(exc)})"
    if (
        not isinstance(record, dict)
        or record.get("step") != step
        or any(k not in record for k in RECORD_KEYS)
    ):
        return f"{record_path} (not a checkpoint record of step {step})"
    return None


def resume_step(steps: list[int], problems: list[dict[int, str]]) -> tuple[int | None, list[tuple[int, str]]]:
    """The newest of the complete checkpoints ``steps`` that every rank can read (``problems``: per rank,
    step -> :func:`checkpoint_problem`), or None; and (step, problem) of each newer one passed over,
    newest first."""
    skipped: list[tuple[int, str]] = []
    for step in reversed(steps):
        bad = [problem[step] for problem in problems if step in problem]
        if not bad:
            return step, skipped
        skipped.append((step, bad[0]))
    return None, skipped


def passed_over(step: int, problem: str, resumed: int) -> str:
    """The warning for a complete checkpoint that cannot be read, when an older one is resumed from."""
    return (
        f"shardfuse.train: warning: checkpoint step {step} cannot be read: {problem}; resuming from "
        f"step {resumed} instead"
    )


def none_readable(checkpoint_dir: Path, skipped: list[tuple[int, str]]) -> str:
    """The error when no complete checkpoint can be read by every rank (``skipped``: newest first)."""
    step, problem = skipped[0]
    return (
        f"no checkpoint in {checkpoint_dir} can be read: the newest, step {step}, has {problem}"
        f"{'' if len(skipped) == 1 else f' (and {len(skipped) - 1} older ones cannot be read either)'}; "
        f"delete {checkpoint_dir} to start afresh"
    )


def mark_complete(checkpoint_dir: Path, step: int, keep: int) -> None:
    """Rank 0, after every rank saved: the checkpoint counts; older ones (and incomplete ones) go."""
    step_dir = checkpoint_dir / f"step-{step}"
    with atomic_path(step_dir / COMPLETE) as tmp:
        tmp.write_text(f"{step}\n")
    keep_steps = set(complete_steps(checkpoint_dir)[-keep:])
    for path in checkpoint_dir.iterdir():
        match = STEP_DIR.match(path.name)
        if match and int(match.group(1)) not in keep_steps and int(match.group(1)) < step:
            shutil.rmtree(path, ignore_errors=True)


def load_rank_state(
    checkpoint_dir: Path,
    step: int,
    rank: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    expect: dict[str, Any],
    sharded: dict[str, torch.Tensor] | None = None,
) -> Position:
    """``sharded`` (fsdp > 1): the model's tensors, whose local shards the checkpoint holds."""
    step_dir = checkpoint_dir / f"step-{step}"
    meta = json.loads((step_dir / f"rank-{rank}.json").read_text())
    for key, value in expect.items():
        if meta.get(key) != value:
            raise UserError(
                f"checkpoint {step_dir} was written with {key}={meta.get(key)!r}, this run has "
                f"{value!r}; delete {checkpoint_dir} to start afresh"
            )
    tensors = load_file(str(step_dir / f"rank-{rank}.safetensors"))
    weights = {name[len("model.") :]: t for name, t in tensors.items() if name.startswith("model.")}
    if sharded is None:
        load_state(model, weights, f"checkpoint {step_dir}")
    else:
        load_local_shards(sharded, weights, f"checkpoint {step_dir}")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if name.startswith("optim."):
            _, index, key = name.split(".", 2)
            state.setdefault(int(index), {})[key] = as_shard_of(params[int(index)], tensor)
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    return Position(step=meta["step"], epoch=meta["epoch"], next_batch=meta["next_batch"])


@torch.no_grad()
def load_local_shards(
    expected: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], source: str
) -> None:
    """Copy a checkpoint's local shards into the sharded model's tensors, every name and shape checked."""
    if set(expected) != set(tensors):
        odd = sorted(set(expected) ^ set(tensors))[0]
        raise UserError(
            f"{source} does not hold this model's shards (tensor {odd!r}); delete it to start afresh"
        )
    for name, target in expected.items():
        shard = local(target)
        if shard.shape != tensors[name].shape:
            raise UserError(
                f"{source} holds a shard {list(tensors[name].shape)} of {name!r}, this rank's is "
                f"{list(shard.shape)}; delete it to start afresh"
            )
        shard.copy_(tensors[name])


def as_shard_of(param: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """An optimiser state tensor read back as the optimiser holds it: a shard of a sharded parameter
    (its moments) becomes a DTensor laid out like the parameter; a scalar (the step) stays plain."""
    if not is_dtensor(param) or tensor.dim() == 0:
        return tensor
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        tensor.to(param.device), param.device_mesh, param.placements, run_check=False,
        shape=param.shape, stride=param.stride(),
    )  # fmt: skip


def load_rank_extras(
    checkpoint_dir: Path, step: int, rank: int
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The ``state_tensors`` and ``state`` a rank saved with :func:`save_rank_state` (empty if none)."""
    step_dir = checkpoint_dir / f"step-{step}"
    meta = json.loads((step_dir / f"rank-{rank}.json").read_text())
    tensors = load_file(str(step_dir / f"rank-{rank}.safetensors"))
    own = ("model.", "optim.", "rng.")
    return {name: t for name, t in tensors.items() if not name.startswith(own)}, meta.get("state", {})
