"""The training loop's pieces, each against a hand-computed reference: lr schedules, clipping,
gradient accumulation (vs the large-batch step, with and without DDP), the AdamW decay rule,
DiLoCo's outer step on two real gloo ranks, and validation's best/patience tracker."""

from __future__ import annotations

import math
import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from shardfuse.data.epoch_steps import plan_epochs
from shardfuse.experiment.run_config import OptimConfig
from shardfuse.models.tasks import Classification
from shardfuse.rank.loop import accumulate_gradients
from shardfuse.rank.optim import check_schedule, clip_gradients, lr_at, make_optimizer
from shardfuse.rank.setup import check_finite
from shardfuse.rank.validation import BestTracker
from shardfuse.strategies.diloco import DiLoCo
from shardfuse.strategies.localsgd import LocalSGD
from shardfuse.strategies.registry import mode_of

CFG = {"lr": 0.1, "min_lr": 0.01}


@pytest.mark.parametrize(
    ("schedule", "warmup", "step", "expected"),
    [
        ("constant", 0, 0, 0.1),
        ("constant", 0, 99, 0.1),
        ("constant", 10, 0, 0.01),  # 0.1 * 1/10
        ("constant", 10, 4, 0.05),  # 0.1 * 5/10
        ("constant", 10, 9, 0.1),
        ("cosine", 10, 10, 0.1),  # p = 0: the peak
        ("cosine", 10, 99, 0.01),  # p = 1: min_lr at the last step
        ("cosine", 0, 33, 0.01 + 0.09 * 0.5 * (1 + math.cos(math.pi * 1 / 3))),  # p = 33/99
        ("linear", 0, 0, 0.1),
        ("linear", 0, 99, 0.01),
        ("linear", 10, 54, 0.01 + 0.09 * (1 - 44 / 89)),
    ],
)
def test_schedule_values_at_given_steps(schedule, warmup, step, expected):
    cfg = {**CFG, "lr_schedule": schedule, "warmup_steps": warmup}
    assert lr_at(step, 100, OptimConfig(**cfg)) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_constant_schedule_returns_the_configured_lr_bitwise():
    # Runs configured before schedules existed must step with exactly their lr.
    assert lr_at(57, 100, OptimConfig(lr=0.05)) == 0.05


def test_warmup_longer_than_the_run_is_refused():
    check_schedule(OptimConfig(warmup_steps=100), 100)
    with pytest.raises(Exception, match="warmup_steps 101 is longer than the run's 100 optimiser steps"):
        check_schedule(OptimConfig(warmup_steps=101), 100)


def test_clipping_returns_the_pre_clip_norm_and_scales_to_the_limit():
    param = torch.nn.Parameter(torch.zeros(4))
    param.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])  # norm 5
    assert clip_gradients([param], 1.0) == pytest.approx(5.0)
    assert param.grad.norm().item() == pytest.approx(1.0, rel=1e-5)
    param.grad = torch.tensor([0.3, 0.4, 0.0, 0.0])  # below the limit: untouched
    assert clip_gradients([param], 1.0) == pytest.approx(0.5)
    assert torch.equal(param.grad, torch.tensor([0.3, 0.4, 0.0, 0.0]))
    assert math.isnan(clip_gradients([param], None))


def test_adamw_decay_rule_exempts_biases_and_norm_weights():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2))
    cfg = {
        "optimizer": "adamw",
        "lr": 0.01,
        "weight_decay": 0.1,
        "decay_rule": "ndim>=2",
        "betas": [0.8, 0.9],
    }
    optimizer = make_optimizer(model, OptimConfig(**cfg))
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(model[0].weight), id(model[2].weight)}
    assert {id(p) for p in no_decay["params"]} == {
        id(model[0].bias),
        id(model[1].weight),
        id(model[1].bias),
        id(model[2].bias),
    }
    assert decay["betas"] == (0.8, 0.9)
    # Without the rule (sgd, or adamw configured before it), one group decays everything.
    (group,) = make_optimizer(model, OptimConfig(**{**cfg, "decay_rule": None})).param_groups
    assert group["weight_decay"] == 0.1 and len(group["params"]) == 6


@pytest.fixture
def single_process_group(tmp_path):
    torch_dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    torch_dist.destroy_process_group()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


@pytest.mark.parametrize("wrap", ["plain", "ddp"])
def test_accumulation_equals_the_large_batch_step(single_process_group, wrap):
    generator = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(32, 6, generator=generator), torch.randint(0, 3, (32,), generator=generator)
    task = Classification()

    reference = _model()
    task.loss(reference(inputs), targets).backward()

    model = _model()
    net = DistributedDataParallel(model) if wrap == "ddp" else model
    ctx = SimpleNamespace(device=torch.device("cpu"), rank=0)
    setup = SimpleNamespace(ctx=ctx, task=task, epochs=plan_epochs([32], 8, "min"))
    plan = SimpleNamespace(net=net, dtype=None, nonfinite_policy="error", mesh=None)
    batches = iter([(inputs[i : i + 8], targets[i : i + 8]) for i in range(0, 32, 8)])
    result = accumulate_gradients(setup, plan, batches, 4, step=1)

    assert result.applied and result.rows == 32
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-7)


def test_mode_names_independent_training():
    assert [mode_of(s, h) for s, h in [("ddp", 0), ("localsgd", 0), ("localsgd", 8), ("diloco", 16)]] == [
        "ddp",
        "independent",
        "localsgd",
        "diloco",
    ]


# -------------------------------------------------------------- DiLoCo on two real ranks


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Per rank: the parameter values after each round's inner steps (set by hand, not trained).
THETA0 = [1.0, -2.0, 0.5]
INNER = {0: [[0.8, -1.5, 0.7], [0.1, 0.2, 0.3]], 1: [[1.4, -2.1, 0.1], [-0.2, 0.0, 0.9]]}


SHARES = {"mean": None, "row-weighted": (0.25, 0.75)}


def _diloco_case(rank: int, shares: tuple[float, float] | None) -> dict:
    model = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([THETA0]))
    diloco = DiLoCo(model, world_size=2, sync_every=5, outer_lr=0.7, outer_momentum=0.9)
    diloco.share = None if shares is None else shares[rank]
    results = []
    for round_index, step in enumerate((5, 10)):
        with torch.no_grad():
            model.weight.copy_(torch.tensor([INNER[rank][round_index]]))
        diloco.after_step(step - 1)  # not a sync step: nothing happens
        assert model.weight.tolist()[0] == pytest.approx(INNER[rank][round_index])
        diloco.after_step(step)
        results.append(model.weight.detach().clone().tolist()[0])
    saved = diloco.state_tensors()
    return {"results": results, "bytes": diloco.bytes_all_reduced, "saved": sorted(saved)}


def _localsgd_case(rank: int, shares: tuple[float, float] | None) -> list[float]:
    model = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([INNER[rank][0]]))
    sync = LocalSGD(model, world_size=2, sync_every=4)
    sync.share = None if shares is None else shares[rank]
    sync.after_step(4)
    return model.weight.detach().tolist()[0]


def _two_rank_cases(rank: int, port: int, out: dict) -> None:
    """Every two-rank case in one process group (spawning the two ranks is most of the cost)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch_dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        cases = {("diloco", name): _diloco_case(rank, shares) for name, shares in SHARES.items()}
        cases |= {("localsgd", name): _localsgd_case(rank, shares) for name, shares in SHARES.items()}
        out[rank] = cases
    finally:
        torch_dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    """{case: (rank 0's result, rank 1's)} of two real gloo ranks."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_two_rank_cases, args=(_free_port(), out), nprocs=2, start_method="spawn")
        out = dict(out)
    return {case: (out[0][case], out[1][case]) for case in out[0]}


@pytest.mark.parametrize("case", list(SHARES))
def test_diloco_outer_step_matches_a_hand_computed_reference_on_two_ranks(case, two_ranks):
    """The outer gradient is the ranks' mean, or after a lost rank each survivor's share of the rows
    the survivors hold (Sync.share, from Membership.row_shares)."""
    shares, out = SHARES[case], two_ranks["diloco", case]
    # Hand reference: outer gradient g = sum over ranks of w_r (theta - theta_r), w_r = 1/2 or the
    # shares; Nesterov momentum (torch's form, Sutskever et al.): b = mu*b + g; theta -= lr * (g + mu*b).
    lr, mu = 0.7, 0.9
    w = shares or (0.5, 0.5)
    theta, buffer, expected = list(THETA0), [0.0] * 3, []
    for round_index in range(2):
        grad = [
            theta[j] - (w[0] * INNER[0][round_index][j] + w[1] * INNER[1][round_index][j]) for j in range(3)
        ]
        buffer = [grad[j] if round_index == 0 else mu * buffer[j] + grad[j] for j in range(3)]
        theta = [theta[j] - lr * (grad[j] + mu * buffer[j]) for j in range(3)]
        expected.append(theta)
    for rank in (0, 1):
        for got, want in zip(out[rank]["results"], expected, strict=True):
            assert got == pytest.approx(want, rel=1e-6)
        assert out[rank]["bytes"] == 2 * 3 * 4  # two syncs of three float32 parameters
        assert out[rank]["saved"] == ["outer.momentum.weight", "outer.param.weight"]


@pytest.mark.parametrize("case", list(SHARES))
def test_localsgd_averages_the_ranks_by_their_share_of_the_rows_after_a_loss(case, two_ranks):
    shares, out = SHARES[case], two_ranks["localsgd", case]
    w = shares or (0.5, 0.5)
    expected = [w[0] * a + w[1] * b for a, b in zip(INNER[0][0], INNER[1][0], strict=True)]
    assert out[0] == out[1] == pytest.approx(expected, rel=1e-6)


def test_localsgd_counts_one_parameter_payload_per_sync():
    model = torch.nn.Linear(3, 2)  # 8 float32 parameters
    sync = LocalSGD(model, world_size=2, sync_every=4)
    sync.resume_at(13)  # an uninterrupted run had synced at steps 4, 8 and 12
    assert sync.num_syncs == 3 and sync.bytes_all_reduced == 3 * 8 * 4


# -------------------------------------------------------------- validation tracker


def test_best_tracker_keeps_the_best_weights_and_counts_patience():
    model = torch.nn.Linear(2, 1)
    tracker = BestTracker(Classification(), keep_best=True, patience=2)
    for step, score in [(10, 0.5), (20, 0.7), (30, 0.7), (40, 0.6)]:
        with torch.no_grad():
            model.weight.fill_(step)
        tracker.update(score, step, model)
    # A tie is not an improvement: the step-20 weights stay, and patience is used up.
    assert (tracker.best_step, tracker.best_score, tracker.since_best) == (20, 0.7, 2)
    assert tracker.out_of_patience()
    assert torch.all(tracker.best_weights["weight"] == 20)

    restored = BestTracker(Classification(), keep_best=True, patience=2)
    restored.load(tracker.state(), tracker.state_tensors())
    assert restored.state() == tracker.state()
    assert torch.equal(restored.best_weights["weight"], tracker.best_weights["weight"])


def test_a_rank_taking_its_own_steps_skips_a_nonfinite_batch_alone_without_a_collective():
    # epoch_steps own: the ranks never meet mid-step, so skip asks no other rank (no process group here).
    ctx = SimpleNamespace(device=torch.device("cpu"), rank=1)
    assert check_finite(math.nan, ctx, 3, "skip", agree=False) is False
    assert check_finite(0.5, ctx, 3, "skip", agree=False) is True
