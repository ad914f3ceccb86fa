"""The interface every task implements: what a model is trained to do, how it is scored, and what the
rest of shardfuse asks of it. A task is a class; :data:`shardfuse.models.tasks.RECORDS` lists them (one
module each: :mod:`~shardfuse.models.classification`, :mod:`~shardfuse.models.regression`,
:mod:`~shardfuse.models.causal_lm`). Nothing outside those modules compares a task's name: callers ask
the task (a contract test holds it).

A task owns the training loss, the metrics, the metric that ranks models (and whether lower is better),
how an ensemble combines outputs, the output shape it expects, the model outputs it describes
(``outputs_of``: from dataset.json), the columns and predictions of the logged MLflow model, the Hugging
Face head it needs, and which labels it trains on (``labels``): the layout of the targets in a prepared
dataset (:mod:`shardfuse.data.labels` writes and splits them; a source gives some of the layouts).

Metrics are accumulated as float64 sums batch by batch, so a split of any size is scored in bounded
memory and the result does not depend on the batch size beyond float rounding. ``finish`` is a function
of the sums per row (scaling every sum and ``rows`` by one factor leaves the metrics as they were): a
weighted mixture of cells' sums is then the exact score of the mixture (each rank's local test
distribution, :mod:`shardfuse.scoring.mixture`), so a task must keep it so. Importing this module
imports no torch (tracking, plots, summary and the config checks read names and directions only).
A library module, no command line.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas
    import torch


# A shardfuse.models.spec.DataDescription (that module reads the tasks: not imported, not even for types).
Description = Any
# The layouts of a prepared dataset's targets (Task.labels; shardfuse.data.labels has one record each).
CLASSES = "classes"  # an int64 ``label`` column of class codes 0..C-1 (names in dataset.json)
VALUES = "values"  # float32 target columns y0..y{K-1} (names in dataset.json's target_names)
TOKENS = "tokens"  # no target column: the targets are the token block shifted by one


def functional():
    import torch.nn.functional  # deferred: importing a task module needs no torch

    return torch.nn.functional


@dataclass
class Totals:
    """Running float64 sums of one scoring pass; ``rows`` counts samples (tokens for causal_lm), a float
    in a mixture of cells' sums (shardfuse.scoring.mixture)."""

    rows: int = 0
    sums: dict[str, torch.Tensor | float] = field(default_factory=dict)

    def add(self, name: str, value: torch.Tensor | float) -> None:
        self.sums[name] = self.sums[name] + value if name in self.sums else value


@dataclass(frozen=True)
class Outputs:
    """The columns a logged model returns (shardfuse.track.model's signature and ``predict``)."""

    names: tuple[str, ...]
    types: tuple[str, ...]  # MLflow column types, one per name
    labels: tuple[str, ...] | None = None  # what a ``prediction`` says per class (None: the class index)
    token_rows: bool = False  # the input is one token id sequence per row, not features


def numbered(given: tuple[str, ...], count: int, prefix: str) -> tuple[str, ...]:
    """The data's names, or prefix0.. when it has not exactly ``count`` of them."""
    names = tuple(str(name) for name in given)
    return names if len(names) == count else tuple(f"{prefix}{i}" for i in range(count))


class Task:
    """What every task has (see the module docstring); subclasses set the attributes and the scoring."""

    name: str
    score: str  # the metric that ranks models (best rank, greedy soup, fusion gain)
    lower_is_better: bool
    metrics: tuple[str, ...]
    labels: str  # CLASSES, VALUES or TOKENS: the targets' layout in a prepared dataset
    losses: tuple[str, ...] = ()  # the run's `loss` choices (the default, mse, is ignored by the others)
    scales_targets: bool = False  # float targets standardised inside the model (built-ins and wrapper)
    next_token: bool = False  # outputs are a distribution over the vocabulary per position (a causal LM)
    default_input: str = "numeric"  # the input kind of a dataset.json that records none (older files)
    hf_auto_classes: Mapping[str, str] = MappingProxyType({})  # input kind -> transformers Auto class
    # metric -> (lowest, highest) a model can score: eval.json's numbers are checked against them
    metric_ranges: Mapping[str, tuple[float, float]] = MappingProxyType({})
    peft_task_type: str | None = None  # PEFT's adapter_config task_type for a model: hf adapter

    @classmethod
    def configured(
        cls, loss: str = "mse", target_scale: torch.Tensor | None = None, bytes_per_token: float = 1.0
    ) -> Task:
        """The task object for a run: each task takes what concerns it of the run's loss, the targets'
        scale (from the model) and the corpus's bytes per token."""
        return cls()

    # ------------------------------------------------------------ training and scoring

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

    @classmethod
    def metric_problem(cls, metrics: Mapping[str, Any]) -> str | None:
        """What is impossible in ``metrics`` ({metric: value}, as eval.json holds a model's): a finite
        value outside the metric's range (an accuracy of 1.7); None if nothing. Values that are not
        finite numbers are left to the record's type check (a diverged model's loss may be inf)."""
        for name, value in metrics.items():
            bounds = cls.metric_ranges.get(name)
            if bounds is None or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value) and not bounds[0] <= value <= bounds[1]:
                return f"{name} {value:g} is outside [{bounds[0]:g}, {bounds[1]:g}]"
        return None

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

    def ratio(self, value: float, reference: float) -> float | None:
        """How good ``value`` is relative to ``reference``: value / reference for a higher-is-better score,
        reference / value for a lower-is-better one (1.0: as good, above: better); None where that
        divides by 0."""
        numerator, denominator = (reference, value) if self.lower_is_better else (value, reference)
        return None if denominator == 0 else numerator / denominator

    def sort_key(self, value: float) -> float:
        """Ascending order of this key is best first."""
        return value if self.lower_is_better else -value

    # ------------------------------------------------------------ the data a model is built for

    def outputs_of(self, info: dict[str, Any]) -> dict[str, Any]:
        """The model-facing fields of a dataset.json (shardfuse.models.spec.DataDescription): how many
        values a model outputs per row, and their names."""
        raise NotImplementedError

    def hf_labels(self, description: Description) -> dict[str, Any]:
        """The config keys a transformers head needs for this task (a classifier's num_labels)."""
        return {}

    # ------------------------------------------------------------ the logged model (shardfuse.track.model)

    def logged_outputs(self, description: Description) -> Outputs:
        raise NotImplementedError

    def predict(self, model: Any, rows: Any, outputs: Outputs) -> pandas.DataFrame:
        """The logged model's answer for ``rows``: float32 features [N, ...], or (``token_rows``) a list
        of int64 token id sequences. The default runs the model once and frames its outputs."""
        import torch

        with torch.no_grad():
            values = model(torch.from_numpy(rows)).float()
        return self.frame(values, outputs)

    def frame(self, values: torch.Tensor, outputs: Outputs) -> pandas.DataFrame:
        import pandas as pd

        return pd.DataFrame(values.numpy(), columns=list(outputs.names))
