"""The merged model as an MLflow pyfunc model: logged by the track rule, loadable anywhere, never pickled.

The model directory holds ``data/merged.safetensors`` (weights, with the model spec in its header) and
``code/``: this package and, for a user model, the user's modules and packages, each under its own
name. MLflow puts ``code/`` on sys.path, imports this module (``loader_module``) and calls
:func:`_load_pyfunc`, so the model loads in any process with the pinned requirements::

    import mlflow, pandas as pd
    model = mlflow.pyfunc.load_model("runs:/<parent run id>/<run name>")   # or models:/<name>/<version>
    model.predict(pd.DataFrame({"pixel_0_0": [...], ..., "pixel_7_7": [...]}))  # the data's own names

Columns, by task (the logged signature says the same; each task's module says what it returns and how it
predicts):

- classification: input the features; output ``prediction`` (the label as the data spelled it) and
  ``probability_<label>`` per class
- regression: input the features; output one column per target, named after it, in its units
- causal_lm: input ``tokens``, one token id sequence per row (the last block_size count); output
  ``probability_0`` .. ``probability_{V-1}``, the distribution of the next token (no generation)

Features are named as in the dataset (x0..x{F-1} when it names none). A checkpoint from before the
model registry knows no names: it takes x0..x{F-1} and predicts the class index. A categorical feature
column (a csv or parquet dataset's ``categorical_columns``) is one input column of strings, one-hot
encoded here with the training split's vocabulary recorded in the spec: a value outside it (unseen in
training, or missing) gives all zeros, as in prepare's val and test splits. Its cells are compared by
their text, so integer and boolean categories are passed as "3", "True" (the signature says string).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardfuse.data.sources.columns import one_hot_matrix, one_hot_names
from shardfuse.io import UserError
from shardfuse.models.spec import description_of, normalized_spec
from shardfuse.models.task import Outputs, numbered
from shardfuse.models.tasks import Task, task_for

WEIGHTS_FILE = "merged.safetensors"
HF_DIR = "hf"  # model hf: the transformers export inside the logged model's data
FILES_DIR = "files"  # the spec's model_files, at their paths relative to the workflow's directory
TOKENS = "tokens"  # the input column of a model that reads token rows (causal_lm)
TENSOR = "x"  # a tensor-input model's input (images): an array [N, *shape], or a column of arrays
LOADER_MODULE = __name__  # what MLflow imports to load a logged model (its MLmodel names it)


@dataclass(frozen=True)
class Interface:
    """The columns a logged model takes and returns, read from its spec without torch (the track job
    logs models without importing it, so this reads shardfuse.models.spec, not shardfuse.models.registry).
    The task says what the model returns (shardfuse.models.task.Outputs) and how it predicts."""

    task: Task
    inputs: tuple[str, ...]
    outputs: Outputs
    block_size: int | None  # token rows: the tokens a row sees (the last block_size count)
    tensor_shape: tuple[int, ...] | None = None  # tensor inputs (images): one row's shape, e.g. (1, 8, 8)
    categories: dict[str, list[str]] | None = None  # categorical input columns: their vocabularies
    vocab_size: int | None = None  # token rows: the ids a row may hold (0..vocab_size-1)
    # Token rows of a sequence classifier: the id a row is padded with after its first block_size tokens
    # (as prepare made its rows); None: a language model's rows, whose last block_size tokens count.
    pad_id: int | None = None


def interface(spec: dict[str, Any]) -> Interface:
    """The model's columns; names the data lacks are numbered (x0.., target_0.., probability_0..)."""
    description = description_of(spec)
    try:
        task = task_for(description.task)
    except UserError:
        raise UserError(
            f"unknown task {description.task!r} in the checkpoint's model spec; re-train with this shardfuse"
        ) from None
    outputs = task.logged_outputs(description)
    inputs = numbered(description.feature_names, int(description.num_features), "x")
    block_size = vocab_size = None
    if outputs.token_rows:  # num_features holds the same as block_size for a token block
        inputs, block_size = (TOKENS,), int(description.block_size or description.num_features)
        vocab_size = int(description.vocab_size or description.num_outputs)
    tensor_shape = None
    if description.input_kind == "tensor":
        inputs, tensor_shape = (TENSOR,), tuple(int(n) for n in description.feature_shape)
    categories = description.categories or None
    if categories:
        inputs = _original_columns(inputs, categories)
    pad_id = getattr(description, "pad_id", None)
    return Interface(task, inputs, outputs, block_size, tensor_shape, categories, vocab_size, pad_id)


def _original_columns(feature_names: tuple[str, ...], categories: dict[str, list[str]]) -> tuple[str, ...]:
    """The data's columns: each one-hot block (column=category...) read back as its column."""
    column_of = {
        name: column for column, values in categories.items() for name in one_hot_names(column, values)
    }
    return tuple(dict.fromkeys(column_of.get(name, name) for name in feature_names))


def _category_text(cell: Any) -> str | None:
    """A cell as its category's name (an integral float, as pandas holds integers beside a gap, as the
    integer); None for a missing value."""
    if cell is None or (isinstance(cell, float) and np.isnan(cell)):
        return None
    if isinstance(cell, (float, np.floating)) and float(cell).is_integer():
        return str(int(cell))
    return str(cell)


def _one_hot_rows(cells: Any, vocabulary: list[str]) -> np.ndarray:
    """rows x categories float32: a 1 at each cell's category, all zeros for a value outside the
    vocabulary (unseen in training, or missing)."""
    index = {value: j for j, value in enumerate(vocabulary)}
    return one_hot_matrix([index.get(_category_text(cell), -1) for cell in cells], len(vocabulary))


def _feature_rows(frame, shape: Interface) -> np.ndarray:
    """float32 [N, F]: the numeric columns as they are, each categorical one as its one-hot block."""
    columns = _columns(frame, shape.inputs)
    if not shape.categories:
        return columns.to_numpy(dtype=np.float32, copy=True)
    blocks = [
        _one_hot_rows(columns[name].tolist(), shape.categories[name])
        if name in shape.categories
        else columns[name].to_numpy(dtype=np.float32).reshape(-1, 1)
        for name in shape.inputs
    ]
    return np.ascontiguousarray(np.concatenate(blocks, axis=1))


def feature_names(spec: dict[str, Any]) -> list[str]:
    """The input columns ``predict`` reads."""
    return list(interface(spec).inputs)


def _columns(frame, names: tuple[str, ...]):
    missing = [name for name in names if name not in frame.columns]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        expected = ", ".join(names) if len(names) <= 8 else f"{', '.join(names[:4])}, …, {names[-1]}"
        raise UserError(
            f"input lacks column(s) {', '.join(missing[:5])}{more}; the model takes {len(names)} "
            f"column(s): {expected}"
        )
    return frame[list(names)]


def _tensor_rows(model_input: Any, shape: tuple[int, ...]) -> np.ndarray:
    """float32 [N, *shape] from an array, or from a DataFrame column ``x`` holding one array per row."""
    if isinstance(model_input, np.ndarray):
        values = model_input
    else:
        cells = _columns(model_input, (TENSOR,))[TENSOR]
        values = np.stack([np.asarray(cell, dtype=np.float32) for cell in cells]) if len(cells) else None
    if values is None or values.size % int(np.prod(shape)) or values.shape[0] == 0:
        raise UserError(
            f"the model takes inputs shaped [N, {', '.join(map(str, shape))}]; pass such an array"
        )
    values = np.asarray(values, dtype=np.float32).reshape(-1, *shape)
    return np.ascontiguousarray(values)


def _token_ids(cell: Any, row: int, vocab_size: int) -> np.ndarray:
    ids = np.asarray(cell)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise UserError(f"row {row} of column {TOKENS!r} is not a non-empty sequence of int token ids")
    outside = ids[(ids < 0) | (ids >= vocab_size)]
    if outside.size:
        raise UserError(f"row {row} holds token id {outside[0]}, outside the vocabulary 0..{vocab_size - 1}")
    return ids.astype(np.int64)


def _padded(ids: list[np.ndarray], block_size: int, pad_id: int | None) -> Any:
    """A language model's rows: each one's last block_size tokens. A sequence classifier's: an int64
    array [N, block_size] of each row's first block_size tokens, padded with ``pad_id`` after them."""
    if pad_id is None:
        return [row[-block_size:] for row in ids]
    rows = np.full((len(ids), block_size), pad_id, dtype=np.int64)
    for index, row in enumerate(ids):
        rows[index, : min(len(row), block_size)] = row[:block_size]
    return rows


@contextlib.contextmanager
def _working_directory(path: Path | None) -> Iterator[None]:
    """Build the model with relative model_files resolving into the logged copy (code paths are made
    absolute first: they resolve against the directory the model was loaded from)."""
    if path is None:
        yield
        return
    previous = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


class MergedModel:
    """A shardfuse model on CPU; ``predict`` takes and returns the columns of :class:`Interface`.

    ``code_dir`` replaces the user code paths recorded in the spec (relative to the workflow's
    directory): there the logged model keeps its copy of that code, the code that now counts."""

    def __init__(
        self, weights_path: str | Path, code_dir: str | Path | None = None, hf_dir: str | Path | None = None
    ) -> None:
        from shardfuse.checkpoints.weights import load_weights
        from shardfuse.models.adapter import file_ties, load_state
        from shardfuse.models.registry import build_model

        tensors, metadata = load_weights(weights_path)
        self.spec = metadata["model"]
        self.interface = interface(self.spec)
        spec = normalized_spec(self.spec)
        if spec.get("code") and code_dir is not None:
            spec = {**spec, "code": {**spec["code"], "paths": [str(code_dir)]}}
        if hf_dir is not None:  # build from the shipped export, not the training's pretrained folder
            spec = {**spec, "args": {**spec["args"], "pretrained": str(hf_dir)}}
        files_dir = Path(weights_path).parent / FILES_DIR
        with _working_directory(files_dir if files_dir.is_dir() else None):
            self.model = build_model(spec)
        load_state(self.model, tensors, str(weights_path), file_ties(metadata))
        self.model.eval()
        self.columns = list(self.interface.inputs)

    def predict(self, model_input: Any, params: dict[str, Any] | None = None):
        import pandas as pd

        frame = model_input
        if not isinstance(model_input, (pd.DataFrame, np.ndarray)):
            frame = pd.DataFrame(model_input)
        outputs = self.interface.outputs
        if outputs.token_rows:
            cells = _columns(frame, (TOKENS,))[TOKENS]
            shape = self.interface
            ids = [_token_ids(cell, row, int(shape.vocab_size)) for row, cell in enumerate(cells)]
            rows = _padded(ids, int(shape.block_size), shape.pad_id)
        elif self.interface.tensor_shape is not None:
            rows = _tensor_rows(model_input, self.interface.tensor_shape)
        else:
            rows = _feature_rows(frame, self.interface)
        return self.interface.task.predict(self.model, rows, outputs)


def _load_pyfunc(data_path: str) -> MergedModel:
    """MLflow's entry point: ``data_path`` is the logged data directory (or the weights file itself)."""
    path = Path(data_path).resolve()
    # The model's code/ (MLflow has put it on sys.path) is beside MLmodel, data_path is <model>/data/data.
    code_dir = next((p / "code" for p in path.parents if (p / "MLmodel").is_file()), None)
    weights = path / WEIGHTS_FILE if path.is_dir() else path
    hf_dir = weights.parent / HF_DIR
    return MergedModel(
        weights,
        code_dir if code_dir is not None and code_dir.is_dir() else None,
        hf_dir if hf_dir.is_dir() else None,
    )


def model_signature(spec: dict[str, Any]):
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema, TensorSpec
    from mlflow.types.schema import Array

    shape = interface(spec)
    if shape.tensor_shape is not None:
        inputs = Schema([TensorSpec(np.dtype(np.float32), (-1, *shape.tensor_shape))])
    elif shape.outputs.token_rows:
        inputs = Schema([ColSpec(Array("long"), TOKENS)])
    else:
        # "double" inputs: MLflow rejects float64 columns for a float32 schema; predict casts to float32.
        categorical = shape.categories or {}
        inputs = Schema(
            [ColSpec("string" if name in categorical else "double", name) for name in shape.inputs]
        )
    columns = zip(shape.outputs.types, shape.outputs.names, strict=True)
    outputs = [ColSpec(kind, name) for kind, name in columns]
    return ModelSignature(inputs=inputs, outputs=Schema(outputs))


def input_example(spec: dict[str, Any]):
    """One row of zeros (for token rows, one block of token 0): shown in the UI and as the serving example."""
    import pandas as pd

    shape = interface(spec)
    if shape.tensor_shape is not None:
        return np.zeros((1, *shape.tensor_shape), dtype=np.float32)
    if shape.outputs.token_rows:
        return pd.DataFrame({TOKENS: [[0] * int(shape.block_size or 1)]})
    categorical = shape.categories or {}
    row = {name: [categorical[name][0]] if name in categorical else [0.0] for name in shape.inputs}
    return pd.DataFrame(row, columns=list(shape.inputs))
