"""The built-in ``cnn`` and ``transformer`` factories and the cnn's permutation groups (``mlp`` lives in
:mod:`shardfuse.models.mlp`).

A library module; :mod:`shardfuse.models.catalog` names these in ``RECORDS``. By hand::

    python -c "import torch, shardfuse.models.builtin as b, shardfuse.models.spec as s
    d = s.DataDescription('causal_lm', 16, 50, (), (), vocab_size=50, block_size=16, input_kind='tokens')
    print(b.transformer(d, width=32, heads=2)(torch.zeros(2, 16, dtype=torch.long)).shape)"

Built-ins are not wrapped by the framework (no ``Standardized``), so they handle their own inputs: the
cnn normalises with BatchNorm after each convolution (image columns have no recorded moments) and, for
regression, carries the targets' scale as buffers like the mlp does; the transformer reads token ids.

The transformer's tied read-out multiplies by the token embedding's matrix instead of holding a second
``Linear`` that shares it: the state dict then holds that matrix once, so safetensors (which refuses
shared tensors), the optimiser and every merge method see one tensor, and a merge cannot fuse the two
"copies" of a tied matrix differently.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from shardfuse.io import UserError
from shardfuse.models.catalog import Groups
from shardfuse.models.spec import DataDescription
from shardfuse.models.tasks import task_for

INIT_STD = 0.02  # GPT-2's initialisation of linear and embedding weights


def _positive_int(model: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"model {model}: {name} must be a positive integer, got {value!r}; fix model_args")
    return value


def _dropout(model: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise UserError(f"model {model}: dropout must be a number in [0, 1), got {value!r}; fix model_args")
    return float(value)


# ---------------------------------------------------------------- cnn


class CNN(nn.Module):
    """Conv(3x3) -> BatchNorm -> ReLU stages, 2x2 max pooling between them while the image allows,
    then global average pooling and a linear read-out to ``num_outputs``."""

    def __init__(
        self,
        feature_shape: tuple[int, int, int],
        channels: list[int],
        num_outputs: int,
        dropout: float,
        scale_targets: bool,
    ) -> None:
        super().__init__()
        in_channels, height, width = feature_shape
        layers: list[nn.Module] = []
        for index, out_channels in enumerate(channels):
            layers += [
                nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1),
                nn.BatchNorm2d(out_channels),
                nn.ReLU(),
            ]
            # Pool only where both sides can halve: an 8x8 digit survives three stages, a 1x1 input any.
            if index < len(channels) - 1 and height >= 2 and width >= 2:
                layers.append(nn.MaxPool2d(2))
                height, width = height // 2, width // 2
            in_channels = out_channels
        self.features = nn.Sequential(*layers)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.head = nn.Linear(in_channels, num_outputs)
        self.scale_targets = scale_targets
        if scale_targets:
            # As the mlp: the network predicts standardised targets; train fills these from the
            # training split and the regression loss divides by target_scale.
            self.register_buffer("target_mean", torch.zeros(num_outputs))
            self.register_buffer("target_scale", torch.ones(num_outputs))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        pooled = self.features(images).mean(dim=(2, 3))
        outputs = self.head(self.dropout(pooled))
        return outputs * self.target_scale + self.target_mean if self.scale_targets else outputs


def cnn(description: DataDescription, channels: Sequence[int] = (16, 32), dropout: float = 0.0) -> nn.Module:
    """The built-in ``cnn`` for image-like tensor inputs ``[N, C, H, W]`` (classification or regression)."""
    shape = tuple(description.feature_shape)
    if description.input_kind != "tensor" or len(shape) != 3:
        raise UserError(
            f"the built-in cnn takes image tensors [C, H, W] per row, but this dataset's input is "
            f"{description.input_kind} {list(shape)}; use model mlp for numeric columns or transformer "
            "for token blocks"
        )
    if isinstance(channels, (str, bytes)) or not isinstance(channels, Sequence) or not channels:
        raise UserError(f"model cnn: channels must be a non-empty list, got {channels!r}; fix model_args")
    sizes = [_positive_int("cnn", "channels", size) for size in channels]
    return CNN(
        (int(shape[0]), int(shape[1]), int(shape[2])),
        sizes,
        description.num_outputs,
        _dropout("cnn", dropout),
        scale_targets=task_for(description.task).scales_targets,
    )


def cnn_groups(names: list[str]) -> Groups:
    """The built-in cnn: conv stages ``features.<k>`` (+ BatchNorm at ``features.<k+1>``), then ``head``."""
    convs = sorted(
        int(m.group(1))
        for n in names
        if (m := re.fullmatch(r"features\.(\d+)\.weight", n))
        and f"features.{int(m.group(1)) + 1}.running_mean" in names
    )
    groups: Groups = {}
    for i, k in enumerate(convs):
        bn = f"features.{k + 1}"
        members = [(f"features.{k}.weight", 0), (f"features.{k}.bias", 0)]
        members += [(f"{bn}.{p}", 0) for p in ("weight", "bias", "running_mean", "running_var")]
        members.append((f"features.{convs[i + 1]}.weight", 1) if i + 1 < len(convs) else ("head.weight", 1))
        groups[f"channels{i}"] = members
    return groups


# ---------------------------------------------------------------- transformer


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows, length, width = hidden.shape
        query, key, value = (
            part.view(rows, length, self.heads, width // self.heads).transpose(1, 2)
            for part in self.qkv(hidden).split(width, dim=2)
        )
        attended = functional.scaled_dot_product_attention(
            query, key, value, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return self.proj(attended.transpose(1, 2).reshape(rows, length, width))


class Block(nn.Module):
    """Pre-LayerNorm: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, width: int, heads: int, mlp_ratio: int, dropout: float) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads, dropout)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, mlp_ratio * width), nn.GELU(), nn.Linear(mlp_ratio * width, width)
        )
        self.dropout = nn.Dropout(dropout)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.dropout(self.attention(self.attention_norm(hidden)))
        return hidden + self.dropout(self.mlp(self.mlp_norm(hidden)))


class Transformer(nn.Module):
    """A decoder-only causal language model: tokens ``[N, T]`` (int64) to logits ``[N, T, vocab]``."""

    def __init__(
        self,
        vocab_size: int,
        max_positions: int,
        width: int,
        layers: int,
        heads: int,
        mlp_ratio: int,
        dropout: float,
        tie_embeddings: bool,
    ) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.position_embedding = nn.Embedding(max_positions, width)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, mlp_ratio, dropout) for _ in range(layers))
        self.final_norm = nn.LayerNorm(width)
        # Tied: no module here at all, forward multiplies by the embedding (see the module docstring).
        self.head = None if tie_embeddings else nn.Linear(width, vocab_size, bias=False)
        self._initialise(layers)

    @torch.no_grad()
    def _initialise(self, layers: int) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=INIT_STD)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        # GPT-2: residual projections scaled by 1/sqrt(2 * layers) keep the residual stream's variance
        # from growing with depth.
        for block in self.blocks:
            for projection in (block.attention.proj, block.mlp[2]):
                nn.init.normal_(projection.weight, std=INIT_STD / math.sqrt(2 * layers))

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """The final normalised hidden states ``[N, T, width]``."""
        length = tokens.shape[1]
        if length > self.max_positions:
            raise ValueError(f"{length} tokens per row exceed the model's max_positions {self.max_positions}")
        positions = torch.arange(length, device=tokens.device)
        hidden = self.dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        for block in self.blocks:
            hidden = block(hidden)
        return self.final_norm(hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.hidden_states(tokens)
        if self.head is None:
            return hidden @ self.token_embedding.weight.T
        return self.head(hidden)


class SequenceClassifier(Transformer):
    """The same decoder over token rows padded after their last token with ``pad_id``, classifying each
    row from the hidden state at its last token before the padding (as transformers'
    GPT2ForSequenceClassification does; causal attention: that state has seen the whole row): tokens
    ``[N, T]`` to class logits ``[N, classes]``. No language-model head."""

    def __init__(self, num_classes: int, pad_id: int, **sizes: Any) -> None:
        super().__init__(**sizes, tie_embeddings=True)
        self.pad_id = pad_id
        self.classifier = nn.Linear(sizes["width"], num_classes)
        nn.init.normal_(self.classifier.weight, std=INIT_STD)
        nn.init.zeros_(self.classifier.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.hidden_states(tokens)
        # Each row's last token before the padding (a row of padding only: its first position).
        content = (tokens != self.pad_id).long()
        last = (content * torch.arange(1, tokens.shape[1] + 1, device=tokens.device)).argmax(dim=1)
        return self.classifier(hidden[torch.arange(tokens.shape[0], device=tokens.device), last])


def transformer(
    description: DataDescription,
    width: int = 128,
    layers: int = 2,
    heads: int = 4,
    mlp_ratio: int = 4,
    dropout: float = 0.0,
    tie_embeddings: bool = True,
    max_positions: int | None = None,
) -> nn.Module:
    """The built-in ``transformer``: a pre-LayerNorm decoder-only causal LM with learned positions, or
    over token rows with class labels (sequence classification) the same decoder with a class head on
    each row's last token (:class:`SequenceClassifier`)."""
    classifies = description.input_kind == "tokens" and getattr(description, "pad_id", None) is not None
    if not (task_for(description.task).next_token or classifies) or not description.vocab_size:
        raise UserError(
            f"the built-in transformer reads token rows but the dataset's task is {description.task} on "
            f"{description.input_kind} inputs; use it with task causal_lm or a text classification dataset "
            "(jsonl with label_field), or cnn / mlp for this data"
        )
    block_size = int(description.block_size or 0)
    if max_positions is None:
        max_positions = block_size
    positions = _positive_int("transformer", "max_positions", max_positions)
    if block_size > positions:
        raise UserError(
            f"block_size {block_size} exceeds the model's max_positions {positions}; raise max_positions "
            "in model_args or lower block_size"
        )
    sizes = {
        name: _positive_int("transformer", name, value)
        for name, value in {"width": width, "layers": layers, "heads": heads, "mlp_ratio": mlp_ratio}.items()
    }
    if sizes["width"] % sizes["heads"]:
        raise UserError(f"model transformer: width {width} is not divisible by heads {heads}; fix model_args")
    if not isinstance(tie_embeddings, bool):
        raise UserError(f"model transformer: tie_embeddings must be true or false, got {tie_embeddings!r}")
    if classifies:
        return SequenceClassifier(
            int(description.num_outputs),
            int(description.pad_id),
            vocab_size=int(description.vocab_size),
            max_positions=positions,
            dropout=_dropout("transformer", dropout),
            **sizes,
        )
    return Transformer(
        int(description.vocab_size),
        positions,
        dropout=_dropout("transformer", dropout),
        tie_embeddings=tie_embeddings,
        **sizes,
    )
