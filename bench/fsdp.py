"""Benchmark FSDP2 inside a replica (``fsdp: S``) against DDP: per-rank memory and step time.

    python bench/fsdp.py                  # the built-in transformer, width 512, 8 blocks; S = 1, 2, 4
    python bench/fsdp.py --quick          # CI smoke: width 64, 2 blocks, S = 1, 2; 3 steps
    python bench/fsdp.py --gpu            # one GPU (when there is one): fp32 vs bf16 at S = 1

Each configuration runs as real ranks under torchrun (gloo on CPU, NCCL on GPUs) through the train
stage's own code (shardfuse.rank.fsdp: the wrap units, ``fully_shard``, the (replicate, shard) mesh),
on the built-in transformer (its blocks the wrap units), AdamW, random byte tokens. S = 1 is DDP over
the same number of ranks as the FSDP run it is compared with (DDP keeps the whole model on each).

Reported per rank, after the first optimiser step (the state is then all allocated):
- the bytes of the persistent training state it holds: parameters + gradients + AdamW's two moments
  (each tensor's local shard, counted from the tensors: exact, unlike RSS on a CPU);
- the largest wrap unit's parameters + gradients, which FSDP gathers whole for its forward and backward
  (one unit at a time, so the transient on top of the shards);
- the peak RSS growth of the rank from just before the model is built (informative: glibc and
  torch's CPU allocator keep freed memory, so it overstates);
- the median step time (forward, backward, clip, AdamW) after two warm-up steps, and its ratio to DDP's
  over the same ranks.
Target (exit status): each FSDP rank's state <= DDP's / S x 1.05 + the largest unit's (parameters +
gradients), i.e. about 1/S of DDP's plus one unit. The step time has no target on CPU: gloo's
reduce_scatter and all_gather are slow, and ranks share two cores (see RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

FULL = {"width": 512, "layers": 8, "heads": 8, "vocab": 256, "block": 128, "batch": 8, "steps": 12}
QUICK = {"width": 64, "layers": 2, "heads": 2, "vocab": 256, "block": 32, "batch": 4, "steps": 3}


def worker(args: argparse.Namespace) -> None:
    """One rank: build, shard (S > 1) or wrap in DDP, step, measure; rank 0 writes the JSON."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from shardfuse.models.builtin import Transformer
    from shardfuse.rank.fsdp import layout_of, local, make_mesh, shard_model, wrap_units

    cfg = json.loads(args.config)
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch.manual_seed(0)
    model = Transformer(
        cfg["vocab"], cfg["block"], cfg["width"], cfg["layers"], cfg["heads"], 4, 0.0, True
    ).to(device)
    units = wrap_units(model, "transformer")
    unit_bytes = max(sum(p.numel() * p.element_size() for p in unit.parameters()) for unit in units)
    if args.shards > 1 or args.precision == "bf16":  # FSDP (on one GPU too, for its mixed precision)
        layout = layout_of(rank, world, args.shards)
        shard_model(model, make_mesh(device, layout), units, True, args.precision, device)
        net = model
    else:
        net = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(cfg["steps"]):
        tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["block"] + 1), generator=generator)
        tokens = tokens.to(device)
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        logits = net(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg["vocab"]), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        if len(times) == 1:  # state as the rest of the run holds it: gradients kept until zero_grad
            params = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
            grads = sum(local(p.grad).numel() * local(p.grad).element_size() for p in model.parameters())
            moments = sum(
                local(value).numel() * local(value).element_size()
                for state in optimizer.state.values()
                for key, value in state.items()
                if key != "step"
            )
        optimizer.zero_grad(set_to_none=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    record = {
        "rank": rank,
        "state_bytes": params + grads + moments,
        "param_bytes": params,
        "unit_bytes": 2 * unit_bytes,  # the largest unit's parameters and gradients, gathered whole
        "rss_growth_mb": (peak - before) / 1024,
        "gpu_peak_mb": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None,
        "step_s": statistics.median(times[2:] if len(times) > 3 else times),
        "tokens_per_s": cfg["batch"] * cfg["block"] * world / statistics.median(times[2:] or times),
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, record)
    if rank == 0:
        Path(args.out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def launch(world: int, shards: int, cfg: dict, device: str, precision: str, out: Path) -> list[dict]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
        __file__, "--worker", "--shards", str(shards), "--config", json.dumps(cfg), "--device", device,
        "--precision", precision, "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=common.child_env(OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def run(quick: bool = False, shard_counts: list[int] | None = None, reps: int = 1) -> tuple[str, bool]:
    """(the Markdown table, whether every target holds)."""
    cfg = QUICK if quick else FULL
    counts = shard_counts or ([1, 2] if quick else [1, 2, 4])
    rows, ok = [], True
    with tempfile.TemporaryDirectory(prefix="shardfuse-bench-fsdp-") as tmp:
        out = Path(tmp) / "ranks.json"
        for shards in counts:
            world = max(shards, 2)  # DDP and FSDP over the same ranks (DDP needs two to communicate)
            ddp_times, fsdp_times, ddp, fsdp = [], [], None, None
            for _ in range(reps):  # interleaved: a busy machine slows both alike
                ddp = launch(world, 1, cfg, "cpu", "fp32", out)
                ddp_times.append(max(r["step_s"] for r in ddp))
                if shards > 1:
                    fsdp = launch(world, shards, cfg, "cpu", "fp32", out)
                    fsdp_times.append(max(r["step_s"] for r in fsdp))
            ddp_state = max(r["state_bytes"] for r in ddp)
            if shards == 1:
                rows.append(["1 (DDP)", world, f"{ddp_state / 2**20:.1f}", "-", "-",
                             f"{max(r['rss_growth_mb'] for r in ddp):.0f}",
                             f"{1000 * statistics.median(ddp_times):.1f}", "1.00", "-"])  # fmt: skip
                continue
            state = max(r["state_bytes"] for r in fsdp)
            bound = ddp_state / shards * 1.05 + fsdp[0]["unit_bytes"]
            holds = state <= bound
            ok &= holds
            ratio = statistics.median(f / d for f, d in zip(fsdp_times, ddp_times, strict=True))
            rows.append([
                shards, world, f"{state / 2**20:.1f}", f"{state / ddp_state:.3f}",
                f"{bound / 2**20:.1f}", f"{max(r['rss_growth_mb'] for r in fsdp):.0f}",
                f"{1000 * statistics.median(fsdp_times):.1f}", f"{ratio:.2f}", common.verdict(holds),
            ])  # fmt: skip
    header = [
        "S (fsdp)", "ranks", "state MiB per rank", "of DDP's", "target MiB (DDP/S x 1.05 + unit)",
        "peak RSS growth MiB", "step ms", "step / DDP's", "target",
    ]  # fmt: skip
    return common.table(header, rows), ok


def run_gpu(cfg: dict, out: Path) -> str:
    """One GPU: FSDP at S = 1 in fp32 (plain DDP) and with bf16 parameters (MixedPrecisionPolicy)."""
    rows = []
    for precision in ("fp32", "bf16"):
        (record,) = launch(1, 1, cfg, "cuda", precision, out)
        rows.append([precision, f"{record['tokens_per_s']:.0f}", f"{record['gpu_peak_mb']:.0f}"])
    return common.table(["precision", "tokens/s", "peak GPU MiB"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CI smoke)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--gpu", action="store_true", help="one GPU: fp32 vs bf16 at S = 1")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shards", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            print("no GPU on this machine: bench/fsdp.py --gpu measures nothing here")
            raise SystemExit(0)
        with tempfile.TemporaryDirectory() as tmp:
            print(run_gpu(FULL, Path(tmp) / "ranks.json"))
        return
    cfg = QUICK if args.quick else FULL
    print(f"model: built-in transformer, width {cfg['width']}, {cfg['layers']} blocks; {cfg['steps']} steps")
    table, ok = run(args.quick, reps=1 if args.quick else args.reps)
    print(table)
    print(f"target (state per rank <= DDP's / S x 1.05 + the largest unit): {common.verdict(ok)}")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
