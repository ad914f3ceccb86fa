"""A split in memory, and its batches as a task forms them: the one loop over rows that every scoring
pass (evaluate, greedy soup, merge search) and recalibration's forward passes share, so that two of them
given the same split and batch size see the very same batches.

A library module; no command line. By hand::

    python -c "from shardfuse.scoring.split import load_split; \\
        print(load_split('results/datasets/digits/test.parquet', 'test').rows)"
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardfuse.io import UserError
from shardfuse.models.spec import description_of

if TYPE_CHECKING:
    import torch

    from shardfuse.models.tasks import Task


@dataclass(frozen=True)
class Split:
    """The rows one set is scored on: features and labels as :func:`shardfuse.data.reader.load_table`
    reads them."""

    name: str  # the set's name ("test", "val", ...), for messages and records
    path: Path
    features: torch.Tensor
    labels: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.features.shape[0])

    def require_rows(self, what: str, fix: str) -> Split:
        """Itself, or a one-line UserError when it has no rows (``fix`` says how to get some)."""
        if self.rows == 0:
            raise UserError(f"{what} split {self.path} has no rows; {fix}")
        return self

    def check_fits(self, spec: dict[str, Any]) -> None:
        """The model ``spec`` describes takes rows shaped like this split's (a split of the run's dataset)."""
        description = description_of(spec)
        expected = tuple(description.feature_shape) or (description.num_features,)
        if tuple(self.features.shape[1:]) != expected:
            raise UserError(
                f"the model expects inputs shaped {list(expected)} per row but the data has "
                f"{list(self.features.shape[1:])}; evaluate with a split of the run's dataset"
            )

    def batches(self, task: Task, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, targets) of consecutive ``batch_size`` rows, in file order, as ``task`` forms them."""
        for start in range(0, self.rows, batch_size):
            end = start + batch_size
            yield task.batch(self.features[start:end], self.labels[start:end])


def load_split(path: str | Path, name: str) -> Split:
    """The whole split at ``path`` in memory. The caller has checked it is the file it should be
    (``shardfuse.data.verify.check_split``, an evaluation set's record)."""
    from shardfuse.data.reader import load_table  # deferred: imports torch

    features, labels = load_table(path)
    return Split(name, Path(path), features, labels)
