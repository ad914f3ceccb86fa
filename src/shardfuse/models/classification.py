"""The classification task: cross-entropy on class indices (labels of any type are mapped to 0..C-1 by
prepare, their names kept in dataset.json); metrics ``loss`` and ``accuracy``; ranked by accuracy. An
ensemble averages the models' softmax probabilities and returns the log of that mean (so its loss is the
NLL of the mean probability and its accuracy the argmax of it). The logged model returns ``prediction``
(the label as the data spelled it) and ``probability_<label>`` per class. Over token rows (text
classification: :mod:`shardfuse.data.sources.text_labels`) the logged model takes ``tokens``, one token
id sequence per row (its first block_size count, padded as prepare padded them), and a transformers
model is told the pad id and the class names (``pad_token_id``, ``id2label``).

A library module (its record is the class, in :data:`shardfuse.models.tasks.RECORDS`)::

    python -c "from shardfuse.models.classification import Classification as C; print(C.score)"  # accuracy
"""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from shardfuse.models.task import CLASSES, Description, Outputs, Task, Totals, functional

if TYPE_CHECKING:
    import pandas
    import torch


class Classification(Task):
    name = "classification"
    score = "accuracy"
    lower_is_better = False
    metrics = ("loss", "accuracy")
    metric_ranges = MappingProxyType({"loss": (0.0, math.inf), "accuracy": (0.0, 1.0)})
    labels = CLASSES
    hf_auto_classes = MappingProxyType(
        {"tokens": "AutoModelForSequenceClassification", "tensor": "AutoModelForImageClassification"}
    )

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return functional().cross_entropy(outputs, targets)

    def accumulate(self, totals: Totals, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        totals.rows += int(targets.shape[0])
        totals.add("loss", functional().cross_entropy(outputs, targets, reduction="sum").item())
        totals.add("correct", int((outputs.argmax(dim=1) == targets).sum()))

    def finish(self, totals: Totals) -> dict[str, float]:
        return {"loss": totals.sums["loss"] / totals.rows, "accuracy": totals.sums["correct"] / totals.rows}

    def _combine(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        """log(mean of the softmax probabilities), in float64: cross-entropy of it is the NLL of the mean
        probability (its log-softmax is itself), its argmax the mean's."""
        import torch

        log_probs = torch.stack([o.double().log_softmax(dim=-1) for o in outputs])
        return torch.logsumexp(log_probs, dim=0) - math.log(len(outputs))

    def outputs_of(self, info: dict[str, Any]) -> dict[str, Any]:
        num_classes = int(info["num_classes"])
        labels = tuple(str(name) for name in info.get("label_names", []))
        outputs = {"num_outputs": num_classes, "label_names": labels, "num_classes": num_classes}
        if "vocab_size" in info:  # token rows (sequence classification): what an embedding is built for
            outputs |= {"vocab_size": int(info["vocab_size"]), "block_size": int(info["block_size"])}
        return outputs

    def hf_labels(self, description: Description) -> dict[str, Any]:
        """A new head for the labels; token rows padded after their last token name the pad id, which
        a transformers sequence classifier needs to find each row's last token."""
        labels: dict[str, Any] = {"num_labels": description.num_outputs}
        names = [str(name) for name in description.label_names]
        if len(names) == description.num_outputs:  # the export's config names its classes
            labels |= {"id2label": dict(enumerate(names)), "label2id": {n: i for i, n in enumerate(names)}}
        if getattr(description, "pad_id", None) is not None:
            labels["pad_token_id"] = description.pad_id
        return labels

    def logged_outputs(self, description: Description) -> Outputs:
        count = int(description.num_outputs)
        names = description.label_names
        labels = tuple(str(name) for name in names) if len(names) == count else None
        columns = ("prediction", *(f"probability_{name}" for name in labels or range(count)))
        token_rows = description.input_kind == "tokens"  # a sequence classifier takes token id rows
        return Outputs(columns, ("string" if labels else "long", *("float",) * count), labels, token_rows)

    def frame(self, values: torch.Tensor, outputs: Outputs) -> pandas.DataFrame:
        import numpy as np
        import pandas as pd
        import torch

        probabilities = torch.softmax(values, dim=1).numpy()
        frame = pd.DataFrame(probabilities, columns=list(outputs.names[1:]))
        classes = probabilities.argmax(axis=1).astype(np.int64)
        labels = outputs.labels
        frame.insert(0, outputs.names[0], np.asarray(labels, dtype=object)[classes] if labels else classes)
        return frame
