"""BatchNorm after fusion: recompute the merged model's running statistics on the validation split.

A library module for the merge stage (``merge_recalibrate: true``); the model and the validation split's
batches are shardfuse.scoring's, as every scoring pass has them. Averaging the ranks' weights does
not average what their BatchNorm layers would measure: the merged network's activations have other
means and variances than any rank's running statistics say, which is a known cause of a merged CNN
scoring below its ranks (Jordan et al. 2023, "REPAIR"; the standard repair after averaging). The
statistics are reset and re-estimated by forward passes over the validation split (never the test
split), in training mode with a cumulative average (``momentum=None``), no gradients, dropout off.
Weights are untouched; only ``running_mean``, ``running_var`` and ``num_batches_tracked`` change. A
model without BatchNorm (the built-in mlp) is left as it is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardfuse.io import UserError


def recalibrate_batchnorm(
    tensors: dict[str, torch.Tensor], spec: dict[str, Any], val_split: Path, batch_size: int
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors with re-estimated BatchNorm statistics, what was done for merge.json)."""
    from shardfuse.scoring.scorer import model_of
    from shardfuse.scoring.split import load_split

    model, task = model_of(tensors, spec, "the merged weights")
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return tensors, {"batchnorm_layers": 0, "rows": 0}
    fix = (
        "merge_recalibrate needs one: set the dataset's val_fraction > 0 (e.g. 0.1) or merge_recalibrate: "
        "false"
    )
    split = load_split(val_split, "val").require_rows("validation", fix)
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # cumulative average over every batch, whatever their number
    model.train()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.eval()
    with torch.no_grad():
        for inputs, _ in split.batches(task, batch_size):  # the batches every scoring pass sees
            model(inputs)
    state = model.state_dict()
    updated = {name: state[name].detach().clone().contiguous() for name in tensors}
    return updated, {"batchnorm_layers": len(norms), "rows": split.rows, "batch_size": batch_size}


def recalibrate_file(
    weights: Path, spec: dict[str, Any], val_split: Path | None, batch_size: int
) -> dict[str, Any]:
    """Re-estimate the BatchNorm statistics of the merged file in place (atomically, its safetensors
    metadata kept); what was done, with the file's new sha256, for merge.json."""
    from safetensors import safe_open

    from shardfuse.checkpoints.weights import write_safetensors
    from shardfuse.io import atomic_path, sha256_file

    if val_split is None:
        raise UserError(
            "merge_recalibrate needs the validation split: pass --val-split (the dataset's val.parquet)"
        )
    with safe_open(str(weights), framework="pt") as handle:
        metadata = handle.metadata()
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    updated, done = recalibrate_batchnorm(tensors, spec, val_split, batch_size)
    if done["batchnorm_layers"]:
        with atomic_path(weights) as tmp:
            write_safetensors(updated, tmp, metadata)
    return {**done, "sha256": sha256_file(weights)}
