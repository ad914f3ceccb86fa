"""What a dataset's spec alone says about its data, before prepare has read a byte: the dataset.json
keys a model is built from (the task, the input's kind and shape, the classes or targets, the
vocabulary), for the sources whose spec determines them. The config check of a foreign ``init_from``
(``python -m shardfuse.check_init``) builds the run's model from it before any job.

The other sources learn their shapes from their files (the classes of a csv or parquet label column, an
image folder's classes and channels, an npz's arrays): :func:`info_from_spec` returns None for them, and
the train stage checks the weights once the dataset is prepared. tests/unit/data/test_describe.py holds
what it returns to what prepare writes. By hand::

    python -c "import shardfuse.data.sources.describe as d; print(d.info_from_spec({'source': 'digits'}))"
"""

from __future__ import annotations

import math
from typing import Any

from shardfuse.data.sources.hf_tokenizer import is_hf, load_hf_tokenizer

BYTE_VOCAB_SIZE = 256  # the byte tokenizer's (shardfuse.data.sources.tables.VOCAB_SIZE)
DIGIT_CLASSES = [str(digit) for digit in range(10)]
DIGIT_PIXELS = [f"pixel_{row}_{col}" for row in range(8) for col in range(8)]  # scikit-learn's names
DIABETES_FEATURES = ["age", "sex", "bmi", "bp", "s1", "s2", "s3", "s4", "s5", "s6"]


def _info(task: str, kind: str, shape: list[int], features: list[str], labels: list[str], **keys) -> dict:
    return {
        "task": task,
        "input": {"kind": kind, "shape": shape},
        "num_features": math.prod(shape),
        "num_classes": len(labels),
        "feature_names": features,
        "label_names": labels,
        **keys,
    }


def _synthetic(spec: dict[str, Any], task: str) -> dict:
    width = int(spec["num_features"])
    features = [f"x{j}" for j in range(width)]
    if task == "regression":
        targets = [f"y{k}" for k in range(int(spec["num_outputs"]))]
        return _info(task, "numeric", [width], features, [], target_names=targets)
    return _info(task, "numeric", [width], features, [str(c) for c in range(int(spec["num_classes"]))])


def _text(spec: dict[str, Any]) -> dict:
    block_size, tokenizer = int(spec["block_size"]), spec.get("tokenizer")
    if tokenizer is None:
        vocab_size = BYTE_VOCAB_SIZE
    elif is_hf(tokenizer):
        vocab_size = max(load_hf_tokenizer(tokenizer)[1], int(spec.get("vocab_size", 0)))
    else:
        vocab_size = int(spec["vocab_size"])
    width = block_size + 1  # block_size inputs and, shifted by one, the targets
    return _info(
        "causal_lm",
        "tokens",
        [width],
        [f"t{j}" for j in range(width)],
        [],
        vocab_size=vocab_size,
        block_size=block_size,
        tokenizer=tokenizer,
    )


def info_from_spec(spec: dict[str, Any]) -> dict[str, Any] | None:
    """The dataset.json keys a model is built from, as prepare will write them for ``spec`` (a dataset
    spec as the config resolves it), or None where only the data can tell. A tokenizer's bytes per token
    is measured on the corpus: left at 1 here (it scales a metric, not a tensor)."""
    source = spec["source"]
    task = spec.get("task", "classification")
    if source == "digits":
        return _info("classification", "numeric", [64], DIGIT_PIXELS, DIGIT_CLASSES)
    if source == "digits_images":
        return _info("classification", "tensor", [1, 8, 8], [], DIGIT_CLASSES)
    if source == "diabetes":
        return _info("regression", "numeric", [10], DIABETES_FEATURES, [], target_names=["target"])
    if source == "synthetic":
        return _synthetic(spec, task)
    if source == "text":
        return _text(spec)
    if source == "csv" and task == "regression":
        columns = list(spec["feature_columns"])
        return _info(task, "numeric", [len(columns)], columns, [], target_names=list(spec["label_columns"]))
    return None
