"""The tensor sources: scikit-learn's digits as 1x8x8 images, a folder of images (one subfolder per class),
a NumPy .npz archive, and a Parquet file whose features are one list column (or are reshaped by
``feature_shape``). Each gives one fixed-shape float32 tensor per row, which prepare writes as a single
tensor column (its shape in the field's metadata).

No command line; a library module: each class is a source's behaviour (:class:`DigitsImages`,
:class:`ImageFolder`, :class:`Npz`, :class:`Parquet`), named by its record in
:mod:`shardfuse.data.sources.registry`; prepare splits and writes their rows as it does the other in-memory
sources' (:mod:`shardfuse.data.sources.write`). By hand::

    python -c "from shardfuse.data.sources.images import DigitsImages
    from shardfuse.models.tasks import task_for
    loaded = DigitsImages().load({'source': 'digits_images'}, task_for('classification'))
    print(loaded.features.shape, loaded.features.max())"   # (1797, 1, 8, 8) 1.0

Images are decoded one at a time with Pillow (a per-file loop: each file is its own decode), converted
to ``mode`` (L: 1 channel, RGB: 3), resized to ``image_size`` [H, W] with bilinear filtering and
scaled to [0, 1] (:func:`decode_images`, which the hf_disk source shares for an Image column); the whole
folder is held in memory (rows x C x H x W float32).
"""

from __future__ import annotations

import io
import math
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shardfuse.data.sources.base import Described, Loaded, SourceBehaviour
from shardfuse.data.sources.checks import SPEC_FIX, require_shape, require_string
from shardfuse.data.sources.files import IMAGE_SUFFIXES
from shardfuse.data.sources.tables import (
    DIGIT_CLASSES,
    Digits,
    UserFile,
    check_finite,
    check_not_continuous,
    numeric_matrix,
    require_file,
    with_decimal_casts,
)
from shardfuse.io import UserError, error_reason
from shardfuse.models.task import CLASSES, Task

IMAGE_MODES = {"L": 1, "RGB": 3}  # mode -> channels
BAD_IMAGE_CHOICES = ("error", "skip")


# ---------------------------------------------------------------- digits as images


class DigitsImages(SourceBehaviour):
    """The digits source's rows (same order, so the same split and writers), as 1x8x8 images scaled to
    [0, 1]."""

    def check(self, spec: dict[str, Any], task: Task) -> None:
        Digits().check(spec, task)

    def describe(self, spec: dict[str, Any], task: Task) -> Described:
        return Described("tensor", [1, 8, 8], [], DIGIT_CLASSES)

    def load(self, spec: dict[str, Any], task: Task) -> Loaded:
        digits = Digits().load(spec, task)
        images = (digits.features / np.float32(16)).reshape(
            -1, 1, 8, 8
        )  # pixel counts 0..16, exact in float32
        return digits._replace(features=images, feature_names=[], kind="tensor")


# ---------------------------------------------------------------- image folder


def _image_files(root: Path) -> tuple[list[Path], np.ndarray, list[str]]:
    """Every image file under root/<class>/ (sorted; hidden files such as macOS's ._x.png left out), its
    class code, and the class names (sorted)."""
    if not root.is_dir():
        problem = "does not exist"
        if root.exists():
            problem = "is a file, not a directory" if root.is_file() else "is not a directory"
        raise UserError(
            f"image folder {root} {problem}; set 'path' to the folder holding one subfolder of images "
            "per class"
        )
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if len(folders) < 2:
        raise UserError(
            f"image folder {root} has {len(folders)} class folder(s); a classifier needs at least 2 "
            "(one subfolder of images per class)"
        )
    files: list[Path] = []
    counts = []
    for folder in folders:
        found = sorted(
            p
            for p in folder.iterdir()
            if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file() and not p.name.startswith(".")
        )
        if not found:
            raise UserError(
                f"class folder {folder} holds no {', '.join(IMAGE_SUFFIXES)} file; add images or remove it"
            )
        files += found
        counts.append(len(found))
    labels = np.repeat(np.arange(len(folders), dtype=np.int64), counts)
    return files, labels, [folder.name for folder in folders]


class ImageFolder(SourceBehaviour):
    """path/<class>/*.png|*.jpg|*.jpeg, resized to image_size, in mode L or RGB."""

    def check(self, spec: dict[str, Any], task: Task) -> None:
        require_string(spec, "path")
        check_image_keys(spec)

    def load(self, spec: dict[str, Any], task: Task) -> Loaded:
        return _load_image_folder(spec)


def check_image_keys(spec: dict[str, Any]) -> None:
    """The image keys the spec holds (image_folder's, and hf_disk's for an Image column): image_size a
    [height, width], mode and on_bad_image among their choices."""
    if "image_size" in spec:
        require_shape(spec, "image_size", 2)
    for key, choices in (("mode", tuple(IMAGE_MODES)), ("on_bad_image", BAD_IMAGE_CHOICES)):
        if key in spec and spec[key] not in choices:
            raise UserError(
                f"spec key {key!r} must be one of {', '.join(choices)}, got {spec[key]!r}; {SPEC_FIX}"
            )


def decode_images(
    sources: Sequence[Path | bytes], spec: dict[str, Any], out: np.ndarray, where: Callable[[int], str]
) -> np.ndarray:
    """Decode image files (or their encoded bytes) into ``out`` (one C x H x W row each, a view of the
    caller's preallocated array): converted to the spec's mode, resized to image_size with bilinear
    filtering, scaled to [0, 1]. Returns which were readable; one Pillow cannot read is an error naming
    ``where(index)``, or with on_bad_image: skip is left unwritten."""
    try:
        from PIL import Image  # deferred: only the image sources decode images
    except ImportError:
        name = spec["source"]
        raise UserError(f"the {name} source needs Pillow; install it (pip install pillow)") from None
    height, width = spec["image_size"]
    channels = IMAGE_MODES[spec["mode"]]
    readable = np.ones(len(sources), dtype=bool)
    unreadable = (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)
    for index, source in enumerate(sources):
        stream = io.BytesIO(source) if isinstance(source, bytes) else source
        try:
            with Image.open(stream) as image:
                wide = image.mode.startswith("I;16")  # 16-bit grayscale: scaled, not clipped at 255
                if image.mode in ("I", "F"):
                    raise UserError(
                        f"image {where(index)} has 32-bit {'integer' if image.mode == 'I' else 'float'} "
                        "pixels, which shardfuse does not scale; save it with 8 or 16 bits per channel"
                    )
                if wide:
                    gray = Image.fromarray(np.asarray(image, dtype=np.float32), "F")
                    pixels = gray.resize((width, height), Image.Resampling.BILINEAR)
                else:
                    pixels = image.convert(spec["mode"]).resize((width, height), Image.Resampling.BILINEAR)
        except unreadable as exc:
            if spec["on_bad_image"] == "skip":
                readable[index] = False
                continue
            reason = error_reason(exc).replace(f" {stream!r}", "")  # Pillow names bytes by their repr
            raise UserError(
                f"cannot read image {where(index)} ({reason}); fix or remove it, or set on_bad_image: skip"
            ) from None
        if wide:  # one gray channel in 0 ... 65535, repeated for RGB
            gray = np.asarray(pixels, dtype=np.float32).reshape(height, width, 1) / np.float32(65535)
            out[index] = np.repeat(gray, channels, axis=2).transpose(2, 0, 1)
            continue
        values = np.asarray(pixels, dtype=np.float32).reshape(height, width, channels)
        out[index] = values.transpose(2, 0, 1) / np.float32(255)
    return readable


def _load_image_folder(spec: dict) -> Loaded:
    files, labels, class_names = _image_files(Path(spec["path"]))
    height, width = spec["image_size"]
    images = np.empty((len(files), IMAGE_MODES[spec["mode"]], height, width), dtype=np.float32)
    readable = decode_images(files, spec, images, lambda index: str(files[index]))
    if not readable.all():  # (a copy, so only when needed)
        images, labels = images[readable], labels[readable]
    empty = [class_names[c] for c in np.flatnonzero(np.bincount(labels, minlength=len(class_names)) == 0)]
    if empty:
        raise UserError(
            f"class folder(s) {', '.join(map(repr, empty))} in {spec['path']} have no readable image left; "
            "add images or remove the folder(s)"
        )
    skipped = {"skipped_images": int(np.count_nonzero(~readable))}
    return Loaded(images, labels, [], class_names, "tensor", skipped)


# ---------------------------------------------------------------- a Parquet list column


def _is_list(data_type: pa.DataType) -> bool:
    types = pa.types
    return types.is_list(data_type) or types.is_large_list(data_type) or types.is_fixed_size_list(data_type)


def _list_column(table: pa.Table, name: str, path: str) -> np.ndarray:
    """A list column whose rows all hold the same number of values, as a float32 (rows, length) matrix."""
    column = table.column(name)
    value_type = column.type.value_type
    if not (pa.types.is_integer(value_type) or pa.types.is_floating(value_type)):
        raise UserError(
            f"feature column {name!r} in {path} holds lists of {value_type}, not numbers; a tensor column "
            "must hold lists of integers or floats"
        )
    if column.null_count:
        raise UserError(
            f"feature column {name!r} in {path} has {column.null_count} missing row(s); fill or drop "
            "those rows first"
        )
    if pa.types.is_fixed_size_list(column.type):
        length = column.type.list_size
    else:
        lengths = pc.list_value_length(column).to_numpy()
        length = int(lengths[0])
        if np.any(lengths != length):
            other = int(lengths[lengths != length][0])
            raise UserError(
                f"column {name!r} of {path} has rows of different lengths (e.g. {length} and {other}); "
                "every row must hold the same shape"
            )
    values = pc.list_flatten(column)
    if length == 0 or values.null_count:
        fault = "empty lists" if length == 0 else f"{values.null_count} missing value(s) inside its lists"
        raise UserError(f"feature column {name!r} in {path} has {fault}; fill or drop those rows first")
    matrix = pc.cast(values, pa.float32(), safe=False).to_numpy().reshape(table.num_rows, length)
    check_finite(matrix, f"feature column {name!r} in {path}")
    return matrix


class Parquet(UserFile):
    """The user's Parquet file: numeric feature columns, or a tensor when its only feature column is a
    list column or it has ``feature_shape`` (which reshapes the list, or the numeric columns in order)."""

    def open(self, path: Path) -> tuple[list[str], Callable[[list[str]], pa.Table]]:
        return pq.read_schema(path).names, lambda columns: pq.read_table(path, columns=columns)

    def load(self, spec: dict[str, Any], task: Task) -> Loaded:
        table, path, names = self.read_table(spec, task), spec["path"], spec["feature_columns"]
        single_list = len(names) == 1 and _is_list(table.column(names[0]).type)
        if not single_list and "feature_shape" not in spec:
            return self.rows(spec, task, table)
        features = _list_column(table, names[0], path) if single_list else numeric_matrix(table, names, path)
        shape = spec.get("feature_shape") or [features.shape[1]]
        if math.prod(shape) != features.shape[1]:
            what = f"column {names[0]!r} of {path} has rows" if single_list else "feature_columns give rows"
            raise UserError(
                f"feature_shape {shape} holds {math.prod(shape)} values but {what} of {features.shape[1]}; "
                f"fix feature_shape ({SPEC_FIX})"
            )
        loaded = self.rows(spec, task, table, features.reshape(-1, *shape))
        return loaded if single_list else with_decimal_casts(loaded, table, names)


# ---------------------------------------------------------------- npz archive


def _read_npz(spec: dict) -> tuple[np.ndarray, np.ndarray]:
    path = Path(spec["path"])
    require_file(path)
    keys = (spec["features_key"], spec["labels_key"])
    try:
        archive = np.load(path, allow_pickle=False)
        if not isinstance(archive, np.lib.npyio.NpzFile):
            raise UserError(
                f"{path} holds a single array, not an .npz archive; save it with "
                f"np.savez(path, {keys[0]}=features, {keys[1]}=labels)"
            )
        with archive:
            missing = [key for key in keys if key not in archive.files]
            if missing:
                raise UserError(
                    f"array(s) {', '.join(map(repr, missing))} not found in {path}; available arrays: "
                    f"{', '.join(archive.files) or 'none'} (set features_key / labels_key)"
                )
            for key in keys:
                _check_npz_member(path, key)
            return archive[keys[0]], archive[keys[1]]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise UserError(f"cannot read {path} as npz ({error_reason(exc)}); check the file") from None


def _check_npz_member(path: Path, key: str) -> None:
    """The array ``key``'s header claims no more bytes than the archive holds for it: a damaged or crafted
    header (a shape of hundreds of GiB in a small file) is one line, not an allocation that fails."""
    with zipfile.ZipFile(path) as archive, archive.open(f"{key}.npy") as member:
        size = archive.getinfo(f"{key}.npy").file_size
        version = np.lib.format.read_magic(member)
        header = (
            np.lib.format.read_array_header_1_0(member)
            if version == (1, 0)
            else np.lib.format.read_array_header_2_0(member)
        )
        shape, _, dtype = header
        claimed = math.prod(shape) * dtype.itemsize
        if claimed > size:
            raise UserError(
                f"array {key!r} in {path} claims shape {list(shape)} of {dtype} ({claimed / 2**30:.3g} GiB) "
                f"but the archive holds {size:,} bytes for it: the file is damaged; re-save it with np.savez"
            )


def _npz_labels(labels: np.ndarray, where: str) -> tuple[np.ndarray, list[str]]:
    """Class labels (integers, integral floats or strings) coded 0..C-1 in sorted order."""
    if labels.ndim != 1 or labels.dtype.kind not in "iufbUS":
        raise UserError(
            f"labels {where} have shape {labels.shape} and dtype {labels.dtype}; classification needs one "
            "integer or string label per row"
        )
    if labels.dtype.kind == "f":
        fractional = labels[labels != np.floor(labels)]  # NaN too: NaN != NaN
        if fractional.size:
            raise UserError(
                f"labels {where} hold non-integer floats (e.g. {fractional[0]:g}); a classification label "
                "must be a class — use task: regression"
            )
        check_not_continuous(labels, f"label array {where}")
    distinct, codes = np.unique(labels, return_inverse=True)
    if len(distinct) < 2:
        raise UserError(f"labels {where} have a single value {distinct[0]!r}; a classifier needs at least 2")
    return codes.astype(np.int64), [str(value) for value in distinct.tolist()]


def _finite_float32(array: np.ndarray, what: str) -> np.ndarray:
    values = array.astype(np.float32)
    check_finite(values, what)
    return values


class Npz(SourceBehaviour):
    """A NumPy .npz archive: features (rows, ...) and labels (rows,) or targets (rows, K)."""

    def check(self, spec: dict[str, Any], task: Task) -> None:
        require_string(spec, "path")
        for key in ("features_key", "labels_key"):
            require_string(spec, key)
        if spec["features_key"] == spec["labels_key"]:
            raise UserError(f"spec keys 'features_key' and 'labels_key' name the same array; {SPEC_FIX}")

    def load(self, spec: dict[str, Any], task: Task) -> Loaded:
        return _load_npz(spec, task)


def _load_npz(spec: dict, task: Task) -> Loaded:
    features, labels = _read_npz(spec)
    path, (features_key, labels_key) = spec["path"], (spec["features_key"], spec["labels_key"])
    if features.ndim < 2 or math.prod(features.shape[1:]) == 0 or features.dtype.kind not in "iufb":
        raise UserError(
            f"array {features_key!r} in {path} has shape {features.shape} and dtype {features.dtype}; "
            "features need one row of numbers per sample, e.g. (N, F) or (N, C, H, W)"
        )
    if len(labels) != len(features) or len(features) < 2:
        raise UserError(
            f"array {features_key!r} in {path} has {len(features)} rows and {labels_key!r} "
            f"{len(labels)}; they need the same number of rows, at least 2"
        )
    features = _finite_float32(features, f"array {features_key!r} in {path}")
    if task.labels == CLASSES:
        codes, label_names = _npz_labels(labels, f"{labels_key!r} in {path}")
        return Loaded(features, codes, [], label_names, "tensor")
    if labels.ndim not in (1, 2) or labels.dtype.kind not in "iuf":
        raise UserError(
            f"array {labels_key!r} in {path} has shape {labels.shape} and dtype {labels.dtype}; regression "
            "needs numeric targets of shape (N,) or (N, K)"
        )
    targets = _finite_float32(labels.reshape(len(labels), -1), f"array {labels_key!r} in {path}")
    return Loaded(features, targets, [], [f"y{k}" for k in range(targets.shape[1])], "tensor")
