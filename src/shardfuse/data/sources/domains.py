"""The domains source: a dataset made of other prepared datasets of this config, its ``parts`` (one task,
one input layout: the same columns, or token blocks of the same tokenizer and block size), each split the
parts' same splits one after the other, every row carrying its part's index (0..P-1, in the order of
``parts``) in an int64 column ``domain``. Nothing is re-split: a part's test rows stay test rows.

``partition: domain`` deals part r to rank r (or as ``partition_groups`` says) and scores each rank's
model and the fusion on each part's test rows (the column partitioner's local rule): the multi-task
set-up of task arithmetic and TIES, one domain per rank, judged per domain. A ddp run on the same
dataset (``partition: iid``) trains on the union, row-weighted.

The parts are prepared by their own prepare jobs (the workflow makes their split files this dataset's
inputs: editing one part's data re-prepares that part and the union, nothing else); the prepare stage
reads them beside its own output directory (``results/datasets/<part>``). No command line; a library
module: :class:`Domains` is the source's behaviour.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardfuse.data.sources.base import SourceBehaviour, Written
from shardfuse.data.sources.carried import DOMAIN_COLUMN
from shardfuse.data.sources.checks import SPEC_FIX
from shardfuse.data.sources.write import SPLITS
from shardfuse.io import UserError, atomic_path, error_reason
from shardfuse.models.task import Task

# dataset.json keys that must agree between parts (what a model is built from and scored by).
SAME_KEYS = (
    "task",
    "input",
    "feature_names",
    "label_names",
    "target_names",
    "vocab_size",
    "block_size",
    "tokenizer",
)


# dataset.json keys the prepare stage writes itself, and the parts' counts, summed for the union.
OWN_KEYS = (
    "name", "source", "task", "input", "num_features", "num_classes", "feature_names", "label_names", "rows",
    "test_fraction", "val_fraction", "seed", "sha256", "bytes_per_token",
)  # fmt: skip
COUNTS = ("num_tokens", "loss_tokens", "records", "blocks_without_loss", "skipped_images")


def part_names(spec: dict[str, Any]) -> list[str]:
    parts = spec.get("parts")
    if not (isinstance(parts, list) and len(parts) >= 2 and all(isinstance(p, str) and p for p in parts)):
        raise UserError(f"spec key 'parts' must list 2 or more dataset names, got {parts!r}; {SPEC_FIX}")
    if len(set(parts)) != len(parts):
        twice = next(part for part in parts if parts.count(part) > 1)
        raise UserError(f"spec key 'parts' names {twice!r} twice; name each part once; {SPEC_FIX}")
    return parts


def _read_info(folder: Path, part: str) -> dict[str, Any]:
    path = folder / "dataset.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(
            f"part {part!r}: cannot read {path} ({error_reason(exc)}); prepare the part first (the workflow "
            "does: snakemake --until prepare_dataset)"
        ) from None


class Domains(SourceBehaviour):
    """The union of the parts' prepared splits, each row tagged with its part."""

    def check(self, spec: dict[str, Any], task: Task) -> None:
        part_names(spec)

    def prepare(self, spec: dict[str, Any], task: Task, out_dir: Path, row_group_rows: int) -> Written:
        parts = part_names(spec)
        folders = [out_dir.parent / part for part in parts]
        infos = [_read_info(folder, part) for folder, part in zip(folders, parts, strict=True)]
        first = infos[0]
        for part, info in zip(parts[1:], infos[1:], strict=True):
            for key in SAME_KEYS:
                if info.get(key) != first.get(key):
                    raise UserError(
                        f"parts {parts[0]!r} and {part!r} differ in {key} ({first.get(key)!r} against "
                        f"{info.get(key)!r}); the parts of a domains dataset share one task and input layout "
                        "(same columns and labels, or the same tokenizer and block_size)"
                    )
        if first["task"] != task.name:
            raise UserError(
                f"the parts are {first['task']} datasets but this dataset's task is {task.name}; set task: "
                f"{first['task']} (or leave task out)"
            )
        out_dir.mkdir(parents=True, exist_ok=True)
        rows = {split: 0 for split in SPLITS}
        domain_rows: dict[str, dict[str, int]] = {part: {} for part in parts}
        schema = None
        for split in SPLITS:
            with contextlib.ExitStack() as stack:
                writer = None
                for index, (part, folder) in enumerate(zip(parts, folders, strict=True)):
                    path = folder / f"{split}.parquet"
                    try:
                        parquet = stack.enter_context(pq.ParquetFile(path))
                    except (OSError, pa.ArrowException) as exc:
                        raise UserError(
                            f"part {part!r}: cannot read {path} ({error_reason(exc)}); re-run its prepare job"
                        ) from None
                    part_schema = parquet.schema_arrow
                    if DOMAIN_COLUMN in part_schema.names:
                        raise UserError(
                            f"part {part!r} already has a column {DOMAIN_COLUMN!r}; a part cannot be a "
                            "domains dataset itself (name its own parts instead)"
                        )
                    if schema is None:
                        schema = part_schema.append(pa.field(DOMAIN_COLUMN, pa.int64()))
                    elif not part_schema.equals(schema.remove(schema.get_field_index(DOMAIN_COLUMN))):
                        raise UserError(
                            f"part {part!r}'s {split} split has columns {part_schema.names} and types unlike "
                            f"part {parts[0]!r}'s; give the parts the same columns (carried columns too)"
                        )
                    if writer is None:
                        tmp = stack.enter_context(atomic_path(out_dir / f"{split}.parquet"))
                        writer = stack.enter_context(pq.ParquetWriter(tmp, schema))
                    count = 0
                    for batch in parquet.iter_batches(batch_size=row_group_rows):
                        tag = pa.array(np.full(batch.num_rows, index, dtype=np.int64))
                        table = pa.Table.from_batches([batch]).append_column(DOMAIN_COLUMN, tag)
                        writer.write_table(table.cast(schema), row_group_size=row_group_rows)
                        count += batch.num_rows
                    domain_rows[part][split] = count
                    rows[split] += count
        keys = {key: first[key] for key in first if key not in OWN_KEYS and key not in COUNTS}
        for key in COUNTS:  # a part's counts add up
            if all(key in info for info in infos):
                keys[key] = sum(info[key] for info in infos)
        if all("bytes_per_token" in info for info in infos):  # bits per byte: the union's bytes per token
            weight = "loss_tokens" if "loss_tokens" in keys else "num_tokens"
            total = sum(info["bytes_per_token"] * info[weight] for info in infos)
            keys["bytes_per_token"] = total / max(keys[weight], 1)
        keys = {**keys, "parts": parts, "domain_rows": domain_rows}
        return Written(rows, first["feature_names"], first["label_names"], keys, first["input"])
