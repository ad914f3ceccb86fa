"""Score these weights on this split: the task's metrics of one or several models, and of their ensemble,
in one pass over the split's batches.

Every scoring in shardfuse goes through :func:`score_models`: evaluate (each named set: the merged model,
every rank and their ensemble, the initial model), greedy soup's candidates on the validation split
(:class:`Scorer`), and merge search's trials next. Same split, same batch size, same weights: the same
figures, whoever asks. No command line; by hand::

    python -c "from shardfuse.scoring.scorer import model_from_file, score_models; \\
        from shardfuse.scoring.split import load_split; \\
        split = load_split('results/datasets/digits/test.parquet', 'test'); \\
        print(score_models([model_from_file('results/runs/ddp/merged.safetensors')], split, 4096))"
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from shardfuse.models.adapter import file_ties, load_state
from shardfuse.models.lora import load_model_weights
from shardfuse.models.registry import build_model, task_of
from shardfuse.models.spec import normalized_spec
from shardfuse.models.tasks import Task, Totals, task_for
from shardfuse.scoring.split import Split

Metrics = dict[str, float]


class Model(NamedTuple):
    """A model ready to score: the network in eval mode and the task that scores its outputs (for
    regression with the target scale of its own weights)."""

    module: nn.Module
    task: Task


def model_of(
    tensors: Mapping[str, torch.Tensor], spec: dict[str, Any], source: str, ties: Mapping[str, str] = ()
) -> Model:
    """The model ``spec`` describes with weights ``tensors`` (``source`` names them in errors)."""
    module = build_model(spec)
    load_state(module, tensors, source, ties)
    module.eval()
    return Model(module, task_of(spec, dict(tensors)))


def model_from_file(path: str | Path) -> Model:
    """The model a checkpoint holds, built from the spec in its header (a LoRA rank's factors added to
    its base: shardfuse.models.lora.load_model_weights)."""
    tensors, metadata = load_model_weights(path)
    return model_of(tensors, metadata["model"], str(path), file_ties(metadata))


@torch.no_grad()
def score_models(
    models: Sequence[Model], split: Split, batch_size: int, *, ensemble: bool = False
) -> tuple[list[Metrics], Metrics | None]:
    """(each model's metrics, their ensemble's or None) in one pass: every batch goes through every
    model, each model's outputs are scored by its task, and (``ensemble``) their combination by the
    first model's task (the models of one training share the task and the target scale). Memory holds
    every model, but one batch of outputs. Each model's figures are those it gets scored alone."""
    scored = score_in_cells(models, split, batch_size, ensemble=ensemble)
    return scored.metrics, scored.ensemble


class CellScores(NamedTuple):
    """One pass's figures: each model's metrics on the whole split and its ensemble's (or None), and
    (with cells) each model's running sums per cell and its ensemble's (the cells' mixtures:
    shardfuse.scoring.mixture)."""

    metrics: list[Metrics]
    ensemble: Metrics | None
    cells: list[list[Totals]]
    ensemble_cells: list[Totals] | None


@torch.no_grad()
def score_in_cells(
    models: Sequence[Model],
    split: Split,
    batch_size: int,
    *,
    ensemble: bool = False,
    of_row: torch.Tensor | None = None,
    num_cells: int = 0,
) -> CellScores:
    """:func:`score_models`'s pass, also summing each model's (and the ensemble's) scores per cell of
    rows (``of_row``: each row's cell, -1 for none) from the same outputs: the whole split's figures are
    those of a pass without cells, bit for bit."""
    if not models:
        raise ValueError("no models to score")
    task = models[0].task
    # A model whose weights equal an earlier one's (ddp's and DiLoCo's ranks, a consolidated merge)
    # gives that model's outputs bit for bit: it is run once, and its figures are the earlier one's.
    first = same_as_earlier(models)
    totals = [Totals() for _ in models]
    combined = Totals()
    cells = [[Totals() for _ in range(num_cells)] for _ in models]
    combined_cells = [Totals() for _ in range(num_cells)]
    for index, (inputs, targets) in enumerate(split.batches(task, batch_size)):
        groups = []
        if of_row is not None:
            batch_cells = of_row[index * batch_size : index * batch_size + targets.shape[0]]
            groups = [
                (int(k), torch.nonzero(batch_cells == k).squeeze(1)) for k in batch_cells.unique() if k >= 0
            ]
        outputs: list[torch.Tensor] = []
        for position, model in enumerate(models):
            model_totals, model_cells = totals[position], cells[position]
            if first[position] != position:  # the earlier model's outputs, scored once
                outputs.append(outputs[first[position]])
                continue
            outputs.append(model.module(inputs))
            model.task.accumulate(model_totals, outputs[-1], targets)
            for cell, rows in groups:
                model.task.accumulate(model_cells[cell], outputs[-1][rows], targets[rows])
        if ensemble:
            together = task.combine(outputs)
            task.accumulate(combined, together, targets)
            for cell, rows in groups:
                task.accumulate(combined_cells[cell], together[rows], targets[rows])
        del outputs
    totals = [totals[first[position]] for position in range(len(models))]
    cells = [cells[first[position]] for position in range(len(models))]
    metrics = [model.task.finish(model_totals) for model, model_totals in zip(models, totals, strict=True)]
    return CellScores(
        metrics,
        task.finish(combined) if ensemble else None,
        cells,
        combined_cells if ensemble else None,
    )


def same_as_earlier(models: Sequence[Model]) -> list[int]:
    """For each model, the position of the first model with the same class and bitwise the same weights
    and buffers (its own position when none before it has)."""
    states = [(type(model.module), model.module.state_dict()) for model in models]
    first: list[int] = []
    for position, state in enumerate(states):
        earlier = (i for i in range(position) if first[i] == i and same_state(states[i], state))
        first.append(next(earlier, position))
    return first


def same_state(a: tuple[type, dict[str, torch.Tensor]], b: tuple[type, dict[str, torch.Tensor]]) -> bool:
    """Whether two models (class, state dict) compute the same function: one class, the same state bit
    for bit."""
    (kind_a, left), (kind_b, right) = a, b
    if kind_a is not kind_b:
        return False
    return left.keys() == right.keys() and all(
        left[name].dtype == right[name].dtype
        and left[name].shape == right[name].shape
        and torch.equal(left[name], right[name])
        for name in left
    )


class Scorer:
    """Weights of one model spec scored on one split, as many times as asked: greedy soup's candidate
    soups, merge search's trials. The split is checked against the spec once."""

    def __init__(self, split: Split, spec: dict[str, Any], batch_size: int) -> None:
        split.check_fits(spec)
        self.split, self.spec, self.batch_size = split, spec, batch_size
        self.task = task_for(normalized_spec(spec)["task"])  # the score and its direction

    def score(self, tensors: Mapping[str, torch.Tensor]) -> Metrics:
        """The task's metrics of the model with weights ``tensors`` on the split."""
        model = model_of(tensors, self.spec, "the weights to score")
        return score_models([model], self.split, self.batch_size)[0][0]
