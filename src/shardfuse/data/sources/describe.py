"""What a dataset's spec alone says about its data, before prepare has read a byte: the dataset.json
keys a model is built from (the task, the input's kind and shape, the classes or targets, the
vocabulary), for the sources whose spec determines them. The config check of a foreign ``init_from``
(``python -m shardfuse.check_init``) builds the run's model from it before any job.

Each source says what it can (``describe`` of its class: digits, digits_images, diabetes, synthetic,
text, a csv's regression targets); the others learn their shapes from their files (the classes of a csv
or parquet label column, an image folder's classes and channels, an npz's arrays): :func:`info_from_spec`
returns None for them, and the train stage checks the weights once the dataset is prepared. The task's
layout of targets turns the source's target names into dataset.json's keys, as prepare does.
tests/unit/data/test_describe.py holds what it returns to what prepare writes. By hand::

    python -c "import shardfuse.data.sources.describe as d; print(d.info_from_spec({'source': 'digits'}))"
"""

from __future__ import annotations

import math
from typing import Any

from shardfuse.data.labels import layout_of
from shardfuse.data.sources.registry import find_source
from shardfuse.models.tasks import task_for


def info_from_spec(spec: dict[str, Any]) -> dict[str, Any] | None:
    """The dataset.json keys a model is built from, as prepare will write them for ``spec`` (a dataset
    spec as the config resolves it), or None where only the data can tell. A tokenizer's bytes per token
    is measured on the corpus: left at 1 here (it scales a metric, not a tensor)."""
    source = find_source(spec["source"])
    task = task_for(spec.get("task") or source.default_task())
    described = source.behaviour_of().describe(spec, task)
    if described is None:
        return None
    label_names, keys = layout_of(task.name).names(described.target_names)
    return {
        "task": task.name,
        "input": {"kind": described.kind, "shape": described.shape},
        "num_features": math.prod(described.shape),
        "num_classes": len(label_names),
        "feature_names": described.feature_names,
        "label_names": label_names,
        **keys,
        **(described.dataset_keys or {}),
    }
