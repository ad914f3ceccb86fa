"""The causal_lm task: next-token cross-entropy on blocks of block_size + 1 tokens (inputs are the first
block_size, targets the last block_size; with a loss mask, as supervised fine-tuning's blocks carry, only
the targets the mask marks count: the loss is their mean, the metrics their sums, and the others are
context, such as a prompt); metrics ``loss`` (nats per token), ``perplexity``,
``bits_per_token`` and ``bits_per_byte`` (bits per token / the corpus's bytes per token: equal for
byte-level tokens, comparable across tokenizers); ranked by loss, lower is better.

An ensemble averages the models' log-softmax per token and renormalises that mean with logsumexp over
the vocabulary (the normalised geometric mean of the probabilities, a product of experts; not the mean of
the probabilities). The logged model takes ``tokens`` (one token id sequence per row, the last
block_size count) and returns ``probability_0`` .. ``probability_{V-1}``, the next token's distribution.

A library module (its record is the class, in :data:`shardfuse.models.tasks.RECORDS`)::

    python -c "from shardfuse.models.causal_lm import CausalLM; print(CausalLM.score)"   # loss
"""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from shardfuse.models.task import TOKENS, Description, Outputs, Task, Totals, functional

if TYPE_CHECKING:
    import pandas
    import torch


BATCH_ROWS = 1024  # rows per forward pass of the logged model: logits are [rows, T, vocab]
IGNORED = -100  # a target that does not count (torch's cross_entropy ignores it by default)


class CausalLM(Task):
    name = "causal_lm"
    score = "loss"
    lower_is_better = True
    metrics = ("loss", "perplexity", "bits_per_token", "bits_per_byte")
    metric_ranges = MappingProxyType(
        {
            "loss": (0.0, math.inf),
            "perplexity": (1.0, math.inf),
            "bits_per_token": (0.0, math.inf),
            "bits_per_byte": (0.0, math.inf),
        }
    )
    labels = TOKENS
    next_token = True
    default_input = "tokens"
    hf_auto_classes = MappingProxyType({"tokens": "AutoModelForCausalLM"})
    peft_task_type = "CAUSAL_LM"

    def __init__(self, bytes_per_token: float = 1.0) -> None:
        # Bits per byte compares models across tokenizers (a byte-level one has 1 byte per token).
        self.bytes_per_token = float(bytes_per_token)

    @classmethod
    def configured(
        cls, loss: str = "mse", target_scale: torch.Tensor | None = None, bytes_per_token: float = 1.0
    ) -> Task:
        return cls(bytes_per_token)

    def batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the first block_size tokens, the next token of each); ``targets`` is empty, or the blocks'
        loss mask (1 where the next token counts), whose 0s become IGNORED."""
        tokens = inputs.long()
        following = tokens[:, 1:]
        if targets.numel():
            following = following.masked_fill(targets == 0, IGNORED)
        return tokens[:, :-1], following

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        flat = outputs.reshape(-1, outputs.shape[-1]).float()
        return functional().cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORED)

    def accumulate(self, totals: Totals, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        totals.rows += int((targets != IGNORED).sum())  # the counted tokens
        flat = outputs.reshape(-1, outputs.shape[-1]).float()
        totals.add(
            "loss",
            functional()
            .cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORED, reduction="sum")
            .item(),
        )

    def finish(self, totals: Totals) -> dict[str, float]:
        loss = totals.sums["loss"] / totals.rows
        bits = loss / math.log(2)
        return {
            "loss": loss,
            "perplexity": math.exp(min(loss, 700.0)),
            "bits_per_token": bits,
            "bits_per_byte": bits / self.bytes_per_token,
        }

    def _combine(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        """The mean of the models' log-softmax over the vocabulary, renormalised (minus its logsumexp)
        so that every token's row is a log-distribution: the normalised geometric mean of the models'
        probabilities. Float32 (a vocabulary times a block is large), summed one model at a time."""
        total = outputs[0].float().log_softmax(dim=-1)
        for other in outputs[1:]:
            total = total + other.float().log_softmax(dim=-1)
        mean = total / len(outputs)
        return mean - mean.logsumexp(dim=-1, keepdim=True)

    def expected_output_shape(self, rows: int, num_outputs: int, block_size: int | None) -> tuple[int, ...]:
        return (rows, int(block_size or 0), num_outputs)

    def outputs_of(self, info: dict[str, Any]) -> dict[str, Any]:
        return {
            "num_outputs": int(info["vocab_size"]),
            "label_names": tuple(str(name) for name in info.get("label_names", [])),
            "vocab_size": int(info["vocab_size"]),
            "block_size": int(info["block_size"]),
        }

    def logged_outputs(self, description: Description) -> Outputs:
        count = int(description.num_outputs)
        return Outputs(
            tuple(f"probability_{token}" for token in range(count)), ("float",) * count, None, True
        )

    def predict(self, model: Any, rows: Any, outputs: Outputs) -> pandas.DataFrame:
        """The next token's distribution after each sequence of ``rows`` (int64 token id arrays)."""
        import numpy as np
        import pandas as pd
        import torch

        probabilities = np.empty((len(rows), len(outputs.names)), dtype=np.float32)
        by_length: dict[int, list[int]] = {}
        for row, ids in enumerate(rows):
            by_length.setdefault(len(ids), []).append(row)
        # Rows of one length form a batch: no padding, which a model with positions would misread.
        with torch.no_grad():
            for members in by_length.values():
                for start in range(0, len(members), BATCH_ROWS):
                    chunk = members[start : start + BATCH_ROWS]
                    tokens = torch.from_numpy(np.stack([rows[row] for row in chunk]))
                    logits = model(tokens)[:, -1].float()
                    probabilities[chunk] = torch.softmax(logits, dim=-1).numpy()
        return pd.DataFrame(probabilities, columns=list(outputs.names))
