"""Process-group set-up for ranks started by torchrun, and the one rank gate for side effects.

torchrun exports RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; we only read them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as torch_dist

from shardfuse.console.errors import write_line
from shardfuse.console.stream import console_stream
from shardfuse.io import UserError, write_json
from shardfuse.rank.progress import Progress
from shardfuse.track.live import LiveLogger


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise UserError(
            f"${name} is not set: this entry point runs under torchrun; launch it with "
            "`python -m shardfuse.launch` (or torchrun) instead of plain python"
        )
    return int(value)


def select_device(local_rank: int, cuda_available: bool, gpu_count: int) -> tuple[torch.device, str]:
    """The rank's device and process-group backend: GPU ``local_rank`` with NCCL when CUDA is present
    (one rank per GPU), else the CPU with gloo."""
    if not cuda_available:
        return torch.device("cpu"), "gloo"
    if local_rank >= gpu_count:
        raise UserError(
            f"local rank {local_rank} has no GPU: this node shows {gpu_count} GPU(s); set the run's "
            "nproc_per_node to the GPUs per node and ask for them with gres=gpu:N in the profile"
        )
    return torch.device("cuda", local_rank), "nccl"


def step_dtype(precision: str, device: torch.device, bf16_supported: bool) -> torch.dtype | None:
    """The autocast dtype of the training step for the config's ``precision`` (None: plain fp32).

    ``auto`` takes bf16 on a GPU that supports it and fp32 elsewhere: on CPUs bf16 autocast is slower
    than fp32 for small models, and fp32 keeps CPU runs bitwise reproducible."""
    if precision == "fp32" or (precision == "auto" and not (device.type == "cuda" and bf16_supported)):
        return None
    if precision in ("auto", "bf16"):
        if device.type != "cuda" or not bf16_supported:
            raise UserError(
                f"precision bf16 needs a GPU with bf16 support, this rank runs on {device.type}"
                f"{'' if device.type == 'cpu' else ' without it'}; set precision: auto or fp32"
            )
        return torch.bfloat16
    raise UserError(f"unknown precision {precision!r}; use auto, fp32 or bf16")


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """The step's autocast region (a no-op context for fp32)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


# How long the ranks of one torchrun attempt wait for each other to join the process group. They start
# together (forked by one agent, or after the agents' rendezvous across nodes) and join first thing, so
# a rank missing for minutes hung while starting; without this the others would wait the collectives'
# 10 minutes. The launcher starts such an attempt again, once (shardfuse.launch).
JOIN_TIMEOUT_ENV = "SHARDFUSE_RANK_JOIN_TIMEOUT"
JOIN_TIMEOUT_S = 180.0


class RanksDidNotJoin(RuntimeError):
    """Some rank of this attempt never joined the process group within the join timeout."""


def join_timeout(environ: dict[str, str] | os._Environ = os.environ) -> float:
    value = environ.get(JOIN_TIMEOUT_ENV, "")
    try:
        seconds = float(value) if value else JOIN_TIMEOUT_S
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise UserError(
            f"{JOIN_TIMEOUT_ENV}={value!r} is not a positive number of seconds; unset it or fix it"
        )
    return seconds


@contextlib.contextmanager
def distributed(timeout_s: float = 600.0) -> Iterator[DistContext]:
    """Join the process group for the duration of the block; always tear it down. Every rank must join
    within :func:`join_timeout` (else :class:`RanksDidNotJoin`); collectives then wait ``timeout_s``."""
    rank, world_size, local_rank = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")
    cuda = torch.cuda.is_available()
    device, backend = select_device(local_rank, cuda, torch.cuda.device_count() if cuda else 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout, join = timedelta(seconds=timeout_s), join_timeout()
    base, _, _ = next(
        torch_dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timedelta(seconds=join))
    )
    # torchrun keeps one store across restarts of the ranks: keys of the failed attempt (old gloo
    # addresses) would be read by the new one, so every attempt gets its own key prefix.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = torch_dist.PrefixStore(f"shardfuse/attempt-{attempt}", base)
    # gloo connects every pair of ranks while the group is made, waiting on the group's timeout: the join
    # timeout first, then the collectives' (a private hook of torch; without it, the collectives' alone).
    set_timeout = getattr(torch_dist.distributed_c10d, "_set_pg_timeout", None)
    first = timedelta(seconds=join) if set_timeout is not None else timeout
    try:
        torch_dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=first)
    except torch_dist.DistStoreError as exc:
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise RanksDidNotJoin(
            f"not every rank of {world_size} joined the process group within {join:g} s "
            f"({JOIN_TIMEOUT_ENV}): a rank hung while starting ({detail})"
        ) from None
    base.set_timeout(timeout)  # what the store serves after joining waits as long as a collective
    if set_timeout is not None:
        set_timeout(timeout)
    try:
        yield DistContext(rank, world_size, local_rank, device, backend)
    finally:
        torch_dist.destroy_process_group()


class RankGate:
    """Side effects shared by all ranks (run-level files, console progress) go through here.

    Rank 0 gets this object; other ranks get :class:`NullGate`, so the training loop never asks
    which rank it is before doing something only one rank should do.
    """

    def log(self, message: str) -> None:
        write_line(message)  # one write: the ranks' lines never interleave

    def write_json(self, path: Any, obj: Any) -> None:
        write_json(path, obj)

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    def progress(
        self, total_steps: int, initial_step: int = 0, description: str = "train", score_name: str = "score"
    ) -> Progress:
        return Progress(
            total_steps, enabled=True, initial_step=initial_step, description=description,
            console=console_stream(), score_name=score_name,
        )  # fmt: skip

    def live_logger(self, tracking_uri: str | None, experiment: str, run_name: str) -> LiveLogger:
        return LiveLogger(tracking_uri, experiment, run_name, enabled=tracking_uri is not None)


class NullGate(RankGate):
    def log(self, message: str) -> None:
        pass

    def write_json(self, path: Any, obj: Any) -> None:
        pass

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        return None

    def progress(
        self, total_steps: int, initial_step: int = 0, description: str = "train", score_name: str = "score"
    ) -> Progress:
        return Progress(total_steps, enabled=False, initial_step=initial_step, description=description)

    def live_logger(self, tracking_uri: str | None, experiment: str, run_name: str) -> LiveLogger:
        return LiveLogger(tracking_uri, experiment, run_name, enabled=False)


def gate_for(rank: int) -> RankGate:
    return RankGate() if rank == 0 else NullGate()
