"""``localsgd`` (Lin et al. 2020): every ``sync_every`` steps the ranks average their parameters;
``sync_every: 0`` never does (independent training, the "train on each shard, fuse" mode).
"""

from __future__ import annotations

import torch

from shardfuse.strategies.sync import Sync, local


class LocalSGD(Sync):
    @torch.no_grad()
    def sync(self) -> None:
        for param in self.model.parameters():
            if not param.requires_grad:  # frozen (an adapter's base): the same on every rank
                continue
            self.average(local(param))
        self.num_syncs += 1
