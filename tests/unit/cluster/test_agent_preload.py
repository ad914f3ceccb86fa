"""The libraries the agent imports before forking the ranks (shardfuse.train.FORK_PRELOAD) cover what a
rank imports lazily as it trains: after them, making and stepping an optimiser, writing step metrics and
reading a checkpoint's tensors import nothing heavy. Checked in a fresh interpreter (pytest's own has
imported everything already)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = r"""
import importlib, json, sys
import shardfuse.train as train
for name in train.FORK_PRELOAD:
    importlib.import_module(name)
before = set(sys.modules)
import torch
model = torch.nn.Linear(3, 2)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
model(torch.ones(1, 3)).sum().backward()
optimizer.step()
import pandas
pandas.DataFrame({"step": [1]})
print(json.dumps(sorted(set(sys.modules) - before)))
"""
HEAVY = ("torch._dynamo", "sympy", "pandas", "torch.distributed.fsdp", "torch.distributed.tensor")


def test_after_the_preload_an_optimiser_step_and_the_step_metrics_import_nothing_heavy():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    late = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [name for name in late if name.startswith(HEAVY)] == []


def test_without_the_preload_the_optimiser_imports_dynamo_so_the_probe_can_fail():
    probe = PROBE.replace("for name in train.FORK_PRELOAD:", "for name in ():")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    late = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "torch._dynamo" in late and "pandas" in late
