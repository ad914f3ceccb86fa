"""The floor of a train job: a bare torchrun rank that imports torch, joins the process group, builds a
small model under DDP and takes one optimiser step, then exits (bench/pipeline.py times it whole, two
ranks, as the train job's fixed cost is timed)."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
torch.manual_seed(0)
layers = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
model = DistributedDataParallel(layers)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
loss = torch.nn.functional.cross_entropy(model(torch.randn(32, 64)), torch.randint(0, 10, (32,)))
loss.backward()
optimizer.step()
dist.destroy_process_group()
