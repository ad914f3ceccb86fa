"""The domains source: a dataset made of other prepared datasets of this config, its ``parts`` (one task,
one input layout: the same columns, or token blocks of the same tokenizer and block size), each split the
parts' same splits one after the other, every row carrying its part's index (0..P-1, in the order of
``parts``) in an int64 column ``domain``. Nothing is re-split: a part's test rows stay test rows.

``partition: domain`` deals part r to rank r (or as ``partition_groups`` says) and scores each rank's
model and the fusion on each part's test rows (the column partitioner's local rule): the multi-task
set-up of task arithmetic and TIES, one domain per rank, judged per domain. A ddp run on the same
dataset (``partition: iid``) trains on the union, row-weighted, or as ``mix_weights`` say: one weight
per part (torchtitan's ``DatasetMixConfig`` weights), the train split then holding part p's rows in
proportion w_p / sum(w) of the union's train rows (their total unchanged): a part above its share repeats
its rows (every row the same number of times, the remainder a seeded random subset), a part below it
keeps a seeded random subset. Where we differ from torchtitan, which samples the mixture while training:
the mixed train split is written once, so every run of the dataset (ddp on the union, or one part a rank)
sees the same rows; validation and test splits are never reweighted.

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
from shardfuse.data.sources.mix import MIX_WEIGHTS, mix_weights_problem
from shardfuse.data.sources.write import SPLITS
from shardfuse.io import UserError, atomic_path, error_reason
from shardfuse.models.task import Task

# dataset.json keys that must agree between parts (what a model is built from and scored by).
SAME_KEYS = (
    "task",
    "input",
    "feature_names",
    "categories",
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
SPLIT_COUNTS = ("unseen_categories",)  # {split: {column: rows}}: the parts' rows add up too


def part_names(spec: dict[str, Any]) -> list[str]:
    parts = spec.get("parts")
    if not (isinstance(parts, list) and len(parts) >= 2 and all(isinstance(p, str) and p for p in parts)):
        raise UserError(f"spec key 'parts' must list 2 or more dataset names, got {parts!r}; {SPEC_FIX}")
    if len(set(parts)) != len(parts):
        twice = next(part for part in parts if parts.count(part) > 1)
        raise UserError(f"spec key 'parts' names {twice!r} twice; name each part once; {SPEC_FIX}")
    return parts


def mixed_counts(weights: list[float], rows: list[int]) -> list[int]:
    """Each part's train rows in the mix: the union's total cut in proportion to the weights (largest
    remainders get the leftover rows, ties to the earlier part); a part of 0 rows stays at 0."""
    total = sum(rows)
    shares = np.array([w if n else 0.0 for w, n in zip(weights, rows, strict=True)], dtype=np.float64)
    if shares.max() > 0:  # by the largest first: weights near the float maximum sum without overflow
        shares = shares / shares.max()
    if not shares.sum() > 0:
        raise UserError(
            f"{MIX_WEIGHTS} {weights} give weight only to parts without train rows; weigh a part with rows"
        )
    exact = shares / shares.sum() * total
    counts = np.floor(exact).astype(np.int64)
    leftover = total - int(counts.sum())
    order = sorted(range(len(rows)), key=lambda p: (-(exact[p] - counts[p]), p))
    for part in order[:leftover]:
        counts[part] += 1
    return counts.tolist()


def mixed_rows(num_rows: int, wanted: int, seed: int, part: int) -> np.ndarray:
    """The sorted row indices (with repeats) of a part's train rows in the mix: every row
    ``wanted // num_rows`` times, plus a seeded random subset of ``wanted % num_rows`` rows."""
    repeats, extra = divmod(wanted, num_rows)
    chosen = np.random.default_rng([seed, 17, part]).choice(num_rows, size=extra, replace=False)
    counts = np.full(num_rows, repeats, dtype=np.int64)
    counts[chosen] += 1
    return np.repeat(np.arange(num_rows, dtype=np.int64), counts)


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
        if problem := mix_weights_problem(spec):
            raise UserError(f"spec key {problem[0]!r}: {problem[1]}; {SPEC_FIX}")

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
        mix = {}
        if spec.get(MIX_WEIGHTS) is not None:
            own = [info["rows"]["train"] for info in infos]
            wanted = mixed_counts(spec[MIX_WEIGHTS], own)
            mix = {
                part: mixed_rows(n, w, spec["seed"], index)
                for index, (part, n, w) in enumerate(zip(parts, own, wanted, strict=True))
                if n
            }
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
                    count, offset = 0, 0
                    take = mix.get(part) if split == "train" else None
                    for batch in parquet.iter_batches(batch_size=row_group_rows):
                        if take is not None:  # the mix's rows of this batch (sorted, with repeats)
                            lo, hi = np.searchsorted(take, [offset, offset + batch.num_rows])
                            offset += batch.num_rows
                            batch = batch.take(pa.array(take[lo:hi] - (offset - batch.num_rows)))
                        tag = pa.array(np.full(batch.num_rows, index, dtype=np.int64))
                        table = pa.Table.from_batches([batch]).append_column(DOMAIN_COLUMN, tag)
                        writer.write_table(table.cast(schema), row_group_size=row_group_rows)
                        count += batch.num_rows
                    domain_rows[part][split] = count
                    rows[split] += count
        keys = {key: first[key] for key in first if key not in (*OWN_KEYS, *COUNTS, *SPLIT_COUNTS)}
        for key in COUNTS:  # a part's counts add up
            if all(key in info for info in infos):
                keys[key] = sum(info[key] for info in infos)
        for key in SPLIT_COUNTS:
            if all(key in info for info in infos):
                keys[key] = {
                    split: {column: sum(info[key][split][column] for info in infos) for column in columns}
                    for split, columns in first[key].items()
                }
        if all("bytes_per_token" in info for info in infos):  # bits per byte: the union's bytes per token
            weight = "loss_tokens" if "loss_tokens" in keys else "num_tokens"
            total = sum(info["bytes_per_token"] * info[weight] for info in infos)
            keys["bytes_per_token"] = total / max(keys[weight], 1)
        keys = {**keys, "parts": parts, "domain_rows": domain_rows}
        if spec.get(MIX_WEIGHTS) is not None:  # the train rows each part brought before the mix
            keys[MIX_WEIGHTS] = spec[MIX_WEIGHTS]
            unmixed = zip(parts, infos, strict=True)
            keys["unmixed_train_rows"] = {part: info["rows"]["train"] for part, info in unmixed}
        return Written(rows, first["feature_names"], first["label_names"], keys, first["input"])
