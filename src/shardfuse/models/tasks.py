"""Tasks: what a model is trained to do, and how it is scored.

One object per task owns the training loss, the metrics, the metric that ranks models (and whether lower
is better) and the label handling. Train, evaluate, greedy soup, plots, summary and tracking all ask the
task; none of them names a metric on its own. No command line; a library module::

    python -c "from shardfuse.models.tasks import task_for; print(task_for('regression').score)"   # mse

- ``classification``: cross-entropy on class indices (labels of any type are mapped to 0..C-1 by
  prepare, their names kept in dataset.json); metrics ``loss``, ``accuracy``; ranked by accuracy.
- ``regression``: MSE (or Huber) on one or many float targets, computed on targets divided by their
  training-split standard deviation so that the loss (and the learning rate that suits it) does not
  depend on the targets' units; metrics ``loss`` (that loss), ``mse``, ``mae`` (in the targets' units)
  and ``r2`` (per target, averaged, as scikit-learn's r2_score); ranked by mse, lower is better.
- ``causal_lm``: next-token cross-entropy on blocks of block_size + 1 tokens (inputs are the first
  block_size, targets the last block_size); metrics ``loss`` (nats per token), ``perplexity``,
  ``bits_per_token`` and ``bits_per_byte`` (bits per token / the corpus's bytes per token: equal for
  byte-level tokens, comparable across tokenizers); ranked by loss, lower is better.

Each task also says how the outputs of several models combine into the ensemble's (``combine``, scored by
``accumulate`` like one model's outputs): classification averages the models' softmax probabilities and
returns the log of that mean (so the loss is the NLL of the mean probability and the accuracy the argmax
of it); regression averages the predictions (in the targets' units); causal_lm averages the models'
log-softmax per token and renormalises that mean with logsumexp over the vocabulary (the normalised
geometric mean of the probabilities, a product of experts; not the mean of the probabilities). The
ensemble of one model is that model's outputs, unchanged.

Metrics are accumulated as float64 sums batch by batch, so a split of any size is scored in bounded
memory and the result does not depend on the batch size beyond float rounding. Importing this module
imports no torch (tracking, plots and summary read the task's names and direction only).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shardfuse.io import UserError

if TYPE_CHECKING:
    import torch


def _functional():
    import torch.nn.functional  # deferred: importing this module needs no torch

    return torch.nn.functional


TASKS: tuple[str, ...] = ("classification", "regression", "causal_lm")
REGRESSION_LOSSES = ("mse", "huber")


@dataclass
class Totals:
    """Running float64 sums of one scoring pass; ``rows`` counts samples (tokens for causal_lm)."""

    rows: int = 0
    sums: dict[str, torch.Tensor | float] = field(default_factory=dict)

    def add(self, name: str, value: torch.Tensor | float) -> None:
        self.sums[name] = self.sums[name] + value if name in self.sums else value


class Task:
    """The interface every task implements (see the module docstring for the three built-ins)."""

    name: str
    score: str  # the metric that ranks models (best rank, greedy soup, fusion gain)
    lower_is_better: bool
    metrics: tuple[str, ...]

    def batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(model input, target) of a batch as the reader yields it."""
        return inputs, targets

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def accumulate(self, totals: Totals, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        raise NotImplementedError

    def finish(self, totals: Totals) -> dict[str, float]:
        raise NotImplementedError

    def combine(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        """The output-averaged ensemble of several models' outputs of one batch, in a form
        :meth:`accumulate` scores; one model's outputs are returned as they are."""
        if not outputs:
            raise ValueError("an ensemble needs at least one model's outputs")
        return outputs[0] if len(outputs) == 1 else self._combine(outputs)

    def _combine(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def expected_output_shape(self, rows: int, num_outputs: int, block_size: int | None) -> tuple[int, ...]:
        return (rows, num_outputs)

    def better(self, candidate: float, incumbent: float) -> bool:
        """Whether ``candidate`` is at least as good as ``incumbent`` (ties count as good: greedy soup
        accepts a rank that does not make the soup worse, as in the paper)."""
        return candidate <= incumbent if self.lower_is_better else candidate >= incumbent

    def best(self, values: list[float]) -> float:
        return min(values) if self.lower_is_better else max(values)

    def gain(self, merged: float, reference: float) -> float:
        """How much better the merged model scores than ``reference``: positive means better, whatever
        the direction of the score."""
        return reference - merged if self.lower_is_better else merged - reference

    def sort_key(self, value: float) -> float:
        """Ascending order of this key is best first."""
        return value if self.lower_is_better else -value


class Classification(Task):
    name = "classification"
    score = "accuracy"
    lower_is_better = False
    metrics = ("loss", "accuracy")

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return _functional().cross_entropy(outputs, targets)

    def accumulate(self, totals: Totals, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        totals.rows += int(targets.shape[0])
        totals.add("loss", _functional().cross_entropy(outputs, targets, reduction="sum").item())
        totals.add("correct", int((outputs.argmax(dim=1) == targets).sum()))

    def finish(self, totals: Totals) -> dict[str, float]:
        return {"loss": totals.sums["loss"] / totals.rows, "accuracy": totals.sums["correct"] / totals.rows}

    def _combine(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        """log(mean of the softmax probabilities), in float64: cross-entropy of it is the NLL of the mean
        probability (its log-softmax is itself), its argmax the mean's."""
        import torch

        log_probs = torch.stack([o.double().log_softmax(dim=-1) for o in outputs])
        return torch.logsumexp(log_probs, dim=0) - math.log(len(outputs))


class Regression(Task):
    name = "regression"
    score = "mse"
    lower_is_better = True
    metrics = ("loss", "mse", "mae", "r2")

    def __init__(self, loss: str = "mse", target_scale: torch.Tensor | None = None) -> None:
        if loss not in REGRESSION_LOSSES:
            raise UserError(f"unknown regression loss {loss!r}; use one of {', '.join(REGRESSION_LOSSES)}")
        self.loss_name = loss
        self.target_scale = target_scale

    def _scaled(self, outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.target_scale is None:
            return outputs, targets
        scale = self.target_scale.to(outputs.device, outputs.dtype)
        return outputs / scale, targets / scale

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        outputs, targets = self._scaled(outputs.float(), targets)
        if self.loss_name == "huber":
            return _functional().huber_loss(outputs, targets)
        return _functional().mse_loss(outputs, targets)

    def accumulate(self, totals: Totals, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        outputs, targets = outputs.double(), targets.double()
        error = outputs - targets
        totals.rows += int(targets.shape[0])
        totals.add("loss", self.loss(outputs, targets).item() * targets.shape[0])
        totals.add("squared", (error**2).sum(dim=0))
        totals.add("absolute", error.abs().sum(dim=0))
        totals.add("target", targets.sum(dim=0))
        totals.add("target_squared", (targets**2).sum(dim=0))

    def finish(self, totals: Totals) -> dict[str, float]:
        rows = totals.rows
        squared, absolute = totals.sums["squared"], totals.sums["absolute"]
        mean = totals.sums["target"] / rows
        total_variance = totals.sums["target_squared"] - rows * mean**2
        # A constant target has no variance to explain: scikit-learn scores it 1 if predicted exactly, else 0.
        import torch

        r2 = torch.where(
            total_variance > 0,
            1 - squared / total_variance.clamp_min(1e-300),
            (squared == 0).double(),
        )
        return {
            "loss": float(totals.sums["loss"] / rows),
            "mse": float(squared.sum() / (rows * squared.numel())),
            "mae": float(absolute.sum() / (rows * absolute.numel())),
            "r2": float(r2.mean()),
        }

    def _combine(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        """The mean prediction, in the targets' units (as each model predicts), float64."""
        import torch

        return torch.stack([o.double() for o in outputs]).mean(dim=0)


class CausalLM(Task):
    name = "causal_lm"
    score = "loss"
    lower_is_better = True
    metrics = ("loss", "perplexity", "bits_per_token", "bits_per_byte")

    def __init__(self, bytes_per_token: float = 1.0) -> None:
        # Bits per byte compares models across tokenizers (a byte-level one has 1 byte per token).
        self.bytes_per_token = float(bytes_per_token)

    def batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = inputs.long()
        return tokens[:, :-1], tokens[:, 1:]

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        flat = outputs.reshape(-1, outputs.shape[-1]).float()
        return _functional().cross_entropy(flat, targets.reshape(-1))

    def accumulate(self, totals: Totals, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        totals.rows += int(targets.numel())
        flat = outputs.reshape(-1, outputs.shape[-1]).float()
        totals.add("loss", _functional().cross_entropy(flat, targets.reshape(-1), reduction="sum").item())

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


def task_for(
    name: str, loss: str = "mse", target_scale: torch.Tensor | None = None, bytes_per_token: float = 1.0
) -> Task:
    """The task object for ``name``; ``loss`` and ``target_scale`` concern regression only,
    ``bytes_per_token`` (of the corpus, for bits per byte) causal_lm only."""
    if name == "classification":
        return Classification()
    if name == "regression":
        return Regression(loss, target_scale)
    if name == "causal_lm":
        return CausalLM(bytes_per_token)
    raise UserError(f"unknown task {name!r}; use one of {', '.join(TASKS)}")


def evaluation_task(evaluation: Any, path: str | os.PathLike = "eval.json") -> Task:
    """The task an eval.json was scored for, from its record (shardfuse.experiment.records.EvalRecord,
    which imports this module) or the object as read. Files written before tasks existed are
    classification ranked by accuracy; a score other than the task's would make every "best" and "gain"
    wrong."""
    if not isinstance(evaluation, dict) and hasattr(evaluation, "score"):  # a record: absent reads as None
        recorded = {key: getattr(evaluation, key) for key in ("task", "score")}
        evaluation = {key: value for key, value in recorded.items() if value is not None}
    name = evaluation.get("task", "classification") if isinstance(evaluation, dict) else None
    try:
        task = task_for(str(name))
    except UserError as exc:
        raise UserError(f"{path}: {exc}; re-run the evaluate stage") from None
    score = evaluation.get("score", task.score)
    if score != task.score:
        raise UserError(
            f"{path} ranks {name} by {score!r}, but shardfuse ranks it by {task.score!r}; "
            "re-run the evaluate stage"
        )
    return task


def score_first(task: Task) -> tuple[str, ...]:
    """The task's metrics with its score first (classification: accuracy, loss, as always logged)."""
    return (task.score, *(m for m in task.metrics if m != task.score))
