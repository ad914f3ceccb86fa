"""A causal bag of tokens: position t sees the running mean of the embeddings of tokens 0..t."""

import torch
from torch import nn


class Bag(nn.Module):
    def __init__(self, vocab_size: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens):
        counts = torch.arange(1, tokens.shape[1] + 1, device=tokens.device).view(1, -1, 1)
        return self.head(self.embed(tokens).cumsum(dim=1) / counts)


def build(description, width=8):
    return Bag(description.vocab_size, width)
