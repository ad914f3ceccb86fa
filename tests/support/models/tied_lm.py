"""A user model with what real language models bring: input and output embeddings tied (one
Parameter under two names, as GPT-2's), a dict output (as a Hugging Face ModelOutput), a buffer its
forward updates (an EMA of the hidden state, not named running_*), a parameter dtype of choice and, on
request, a parameter no forward uses."""

from __future__ import annotations

import torch
from torch import nn


class TiedLM(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, width: int, unused: bool = False) -> None:
        super().__init__()
        if unused:  # a parameter no forward reaches: DDP needs find_unused_parameters
            self.spare = nn.Linear(width, width)
        self.embed = nn.Embedding(vocab_size, width)
        self.position = nn.Parameter(torch.randn(block_size, width) * 0.02)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied, as tie_word_embeddings does
        self.register_buffer("hidden_ema", torch.zeros(width))

    def forward(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.embed(tokens) + self.position[: tokens.shape[1]]
        # Causal: each position sees the running mean of the ones before it.
        steps = torch.arange(1, tokens.shape[1] + 1, device=tokens.device, dtype=hidden.dtype)
        hidden = hidden + torch.tanh(self.mix(hidden.cumsum(dim=1) / steps[:, None]))
        if self.training:
            with torch.no_grad():
                self.hidden_ema.mul_(0.9).add_(0.1 * hidden.mean(dim=(0, 1)))
        return {"logits": self.head(hidden), "hidden": hidden}


def build(description, width: int = 16, dtype: str = "float32", unused: bool = False) -> nn.Module:
    model = TiedLM(description.vocab_size, description.block_size, width, unused)
    return model.to(getattr(torch, dtype))
