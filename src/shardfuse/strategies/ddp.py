"""``ddp``: DistributedDataParallel all-reduces every gradient once per optimiser step, inside backward
(gradient accumulation runs the inner micro-steps under ``no_sync``); under fsdp, HSDP over the whole
mesh. The rank set-up wraps the model (its record's ``reduces_gradients``); this hook only counts.
"""

from __future__ import annotations

from typing import Any

import torch

from shardfuse.strategies.sync import Sync


class DDPSync(Sync):
    """DDP all-reduces the gradients inside backward; this only counts them, once per step."""

    @classmethod
    def from_settings(cls, model: torch.nn.Module, world_size: int, settings: Any, group: Any = None) -> Sync:
        return cls(model, world_size, 0, group)  # no cadence: every step

    def resume_at(self, step: int) -> None:
        self.num_syncs = step

    def after_step(self, step: int) -> None:
        self.num_syncs += 1
