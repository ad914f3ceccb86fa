"""The strategy records are the one place a strategy is named: its config rules (with the words the error
catalogue shows), its mode and colour, its identity keys, and the hook a training builds from it."""

from __future__ import annotations

import pytest
import torch

from shardfuse.experiment.load import load_experiment
from shardfuse.experiment.run_config import SyncConfig
from shardfuse.experiment.schema import ConfigError
from shardfuse.io import UserError
from shardfuse.strategies import registry
from shardfuse.strategies.ddp import DDPSync
from shardfuse.strategies.diloco import DiLoCo
from shardfuse.strategies.localsgd import LocalSGD
from shardfuse.strategies.registry import find_strategy, identity_keys, make_sync, mode_colors, mode_of
from tests.support.helpers import base_config


def test_modes_name_the_strategy_and_localsgd_that_never_syncs_is_independent():
    cases = [("ddp", 0), ("localsgd", 0), ("localsgd", "0"), ("localsgd", ""), ("localsgd", None)]
    cases += [("localsgd", 5), ("diloco", 5), ("a_newer_strategy", 3)]
    assert [mode_of(strategy, sync_every) for strategy, sync_every in cases] == [
        "ddp", "independent", "independent", "independent", "independent", "localsgd", "diloco",
        "a_newer_strategy",
    ]  # fmt: skip


def test_the_figures_colour_every_mode_as_before_the_records():
    assert mode_colors() == {
        "ddp": "#1f77b4", "localsgd": "#ff7f0e", "diloco": "#9467bd", "independent": "#2ca02c",
    }  # fmt: skip


def test_a_ddp_baseline_may_differ_in_the_keys_a_strategy_choice_sets():
    assert set(identity_keys()) == {
        "strategy", "sync_every", "outer_lr", "outer_momentum", "init", "find_unused_parameters",
        "static_graph",
    }  # fmt: skip
    assert find_strategy("diloco").identity_keys == (
        "strategy",
        "sync_every",
        "init",
        "outer_lr",
        "outer_momentum",
    )


def test_only_ddp_reduces_gradients_is_the_baseline_and_publishes_identical_ranks_always():
    flags = {
        r.name: (r.reduces_gradients, r.baseline, r.publishes_identical("best")) for r in registry.RECORDS
    }
    assert flags == {
        "ddp": (True, True, True),
        "localsgd": (False, False, False),
        "diloco": (False, False, False),
    }
    assert find_strategy("diloco").publishes_identical("last")  # it ends with an outer step


@pytest.mark.parametrize(
    ("run", "message"),
    [
        (
            {"sync_every": 3},
            "runs[r].sync_every: only localsgd and diloco sync every N steps (ddp syncs gradients every "
            "step); remove sync_every or set strategy localsgd or diloco",
        ),
        (
            {"strategy": "diloco"},
            "runs[r].sync_every: strategy diloco needs sync_every >= 1 (the inner steps between outer steps, "
            "e.g. 16); set sync_every",
        ),
        (
            {"strategy": "localsgd", "outer_lr": 0.5},
            "runs[r].outer_lr: only strategy diloco has an outer optimiser but strategy is localsgd; remove "
            "outer_lr or set strategy diloco",
        ),
        (
            {"strategy": "diloco", "sync_every": 4, "static_graph": True},
            "runs[r].static_graph: a DistributedDataParallel setting but strategy is diloco, which keeps no "
            "DDP wrapper; remove static_graph or set strategy ddp",
        ),
        (
            {"init": "per_rank"},
            "runs[r].init: per_rank gives each rank its own initial weights but ddp starts every rank from "
            "rank 0's weights; use init shared or strategy localsgd",
        ),
        (
            {"strategy": "diloco", "sync_every": 4, "keep": "best", "eval_every": 5,
             "merge_method": "consolidate"},
            "runs[r].merge_method: consolidate needs identical ranks (strategy ddp, or diloco keeping its "
            "last weights) but strategy is diloco with keep best; use merge_method uniform or weighted",
        ),
        (
            {"strategy": "localsgd", "merge_method": "consolidate"},
            "runs[r].merge_method: consolidate needs identical ranks (strategy ddp, or diloco keeping its "
            "last weights) but strategy is localsgd; use merge_method uniform or weighted",
        ),
    ],
)  # fmt: skip
def test_the_config_rules_come_from_the_records_in_the_catalogues_words(run, message):
    with pytest.raises(ConfigError) as info:
        load_experiment(base_config({"r": run}), environ={})
    assert str(info.value) == f"config error at {message}"


def test_each_record_builds_its_hook_from_the_run_settings():
    model = torch.nn.Linear(3, 2)
    assert isinstance(make_sync(model, 2, SyncConfig(strategy="ddp", sync_every=7)), DDPSync)
    assert make_sync(model, 2, SyncConfig(strategy="ddp", sync_every=7)).sync_every == 0  # ddp has no cadence
    localsgd = make_sync(model, 2, SyncConfig(strategy="localsgd", sync_every=4))
    assert type(localsgd) is LocalSGD and localsgd.sync_every == 4
    assert localsgd.payload_bytes == (3 * 2 + 2) * 4  # its trainable parameters, float32
    diloco = make_sync(
        model, 2, SyncConfig(strategy="diloco", sync_every=5, outer_lr=0.5, outer_momentum=0.0)
    )
    assert isinstance(diloco, DiLoCo) and diloco.outer_optimizer.defaults["lr"] == 0.5
    assert not diloco.outer_optimizer.defaults["nesterov"]


def test_an_unknown_strategy_is_refused_by_name_before_any_training():
    with pytest.raises(UserError, match=r"^unknown strategy 'fsdp'; use one of ddp, localsgd, diloco$"):
        make_sync(torch.nn.Linear(1, 1), 2, SyncConfig(strategy="fsdp"))
