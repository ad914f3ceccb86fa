"""The shard manifest (``manifest.json`` beside the shards): its format tag, its keys, and the checked read.

JSON only (no torch, no pyarrow), so the launcher can check a shard set's world size before it starts
any rank. ``columns`` (each column's kind, dtype and row shape, e.g. ``{"name": "x", "kind": "tensor",
"dtype": "float32", "shape": [1, 8, 8]}``) is optional: manifests written before it stay readable.
A library module: the partition stage writes manifests, ``shardfuse.data.reader`` and the launcher read them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from shardfuse.io import UserError, read_json

MANIFEST_FORMAT = "shardfuse.shards/1"
MANIFEST_NAME = "manifest.json"
RERUN_PARTITION = "re-run the partition stage (snakemake -R partition)"
MANIFEST_KEYS = (
    "format",
    "world_size",
    "seed",
    "drop_remainder",
    "source",
    "total_rows",
    "dropped_rows",
    "schema",
    "shards",
)
SHARD_KEYS = ("rank", "path", "rows", "sha256", "bytes")
# What a column holds (shardfuse.data.shard_format decides): one input value per column (numeric x0..), a
# fixed-shape tensor per row (x), a token block per row (tokens), the class label, a regression target
# (y0..), or "other": carried through partition, read by nobody (ids, notes).
ColumnKind = Literal["numeric", "tensor", "tokens", "label", "target", "mask", "other"]
COLUMN_KINDS: tuple[str, ...] = ("numeric", "tensor", "tokens", "label", "target", "mask", "other")


@dataclass(frozen=True)
class ColumnSpec:
    """One column of a shard as the manifest records it: ``dtype`` is the stored value type (the
    element type of a list column; NumPy's name where it has one, else Arrow's), ``shape`` one row's
    shape (() for a scalar)."""

    name: str
    kind: ColumnKind
    dtype: str
    shape: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "dtype": self.dtype, "shape": list(self.shape)}


def manifest_columns(manifest: dict) -> tuple[ColumnSpec, ...] | None:
    """The shard columns a (checked) manifest records; None for a manifest written before partition
    recorded them."""
    entries = manifest.get("columns")
    if entries is None:
        return None
    return tuple(ColumnSpec(e["name"], e["kind"], e["dtype"], tuple(e["shape"])) for e in entries)


def _bad_column_entry(entry: object) -> bool:
    return not (
        isinstance(entry, dict)
        and isinstance(entry.get("name"), str)
        and entry.get("kind") in COLUMN_KINDS
        and isinstance(entry.get("dtype"), str)
        and isinstance(entry.get("shape"), list)
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in entry["shape"])
    )


def read_manifest(shard_dir: str | Path) -> dict:
    """Read and check shard_dir/manifest.json (format tag, keys, one entry per rank in rank order)."""
    path = Path(shard_dir) / MANIFEST_NAME
    manifest = read_json(path, "shard manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise UserError(
            f"shard manifest {path} has format {found!r}, expected {MANIFEST_FORMAT!r}; {RERUN_PARTITION}"
        )
    missing = [key for key in MANIFEST_KEYS if key not in manifest]
    shards = manifest.get("shards")
    if not missing and isinstance(shards, list):
        missing = [
            f"shards[{i}].{key}"
            for i, shard in enumerate(shards)
            for key in SHARD_KEYS
            if not isinstance(shard, dict) or key not in shard
        ]
    if missing:
        raise UserError(f"shard manifest {path} lacks {', '.join(missing[:5])}; {RERUN_PARTITION}")
    world_size = manifest["world_size"]
    if not isinstance(world_size, int) or world_size < 1:
        raise UserError(f"shard manifest {path} has world_size {world_size!r}; {RERUN_PARTITION}")
    if not isinstance(shards, list) or [shard["rank"] for shard in shards] != list(range(world_size)):
        raise UserError(
            f"shard manifest {path} does not list ranks 0..{world_size - 1} in order; {RERUN_PARTITION}"
        )
    _check_rows_add_up(path, manifest)
    _check_shard_entries(path, shards)
    columns = manifest.get("columns")  # optional: older manifests do not have it
    if columns is not None and (not isinstance(columns, list) or any(map(_bad_column_entry, columns))):
        raise UserError(
            f"shard manifest {path} has a malformed 'columns' list (each entry needs name, kind, dtype "
            f"and shape); {RERUN_PARTITION}"
        )
    return manifest


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value: object) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _bad_shard_field(shard: dict) -> str | None:
    """The first field of a shard entry a rank could not use as it is (a path that is not a file name in
    the shard directory, a size, label count or column moment that is not a number), or None."""
    checks = {
        "path": lambda v: isinstance(v, str) and v not in ("", ".", "..") and "/" not in v,
        "sha256": lambda v: isinstance(v, str),
        "bytes": _is_count,
        "label_counts": lambda v: v is None or (isinstance(v, dict) and all(map(_is_count, v.values()))),
        # A partitioner's group values and their rows per column (column, say): {column: {value: rows}}.
        "value_counts": lambda v: (
            v is None
            or (
                isinstance(v, dict)
                and all(isinstance(c, dict) and all(map(_is_count, c.values())) for c in v.values())
            )
        ),
        "column_moments": lambda v: (
            v is None
            or (
                isinstance(v, dict)
                and all(
                    isinstance(m, dict)
                    and _is_count(m.get("count"))
                    and all(_is_number(m.get(k)) for k in ("sum", "sum_squares"))
                    for m in v.values()
                )
            )
        ),
    }
    return next((key for key, fits in checks.items() if not fits(shard.get(key))), None)


def _check_shard_entries(path: Path, shards: list[dict]) -> None:
    for shard in shards:
        if (key := _bad_shard_field(shard)) is not None:
            raise UserError(
                f"shard manifest {path} has a malformed shards[{shard['rank']}].{key} "
                f"({json.dumps(shard.get(key))[:40]}); {RERUN_PARTITION}"
            )


def _check_rows_add_up(path: Path, manifest: dict) -> None:
    """The row counts agree with each other (shard rows, total_rows, dropped_rows, the source's rows) and
    no shard is listed twice (the same sha256: a shard copied over another, the manifest edited to match)."""
    shards = manifest["shards"]
    counts = [shard["rows"] for shard in shards]
    source = manifest["source"]
    source_rows = source.get("rows") if isinstance(source, dict) else None
    total, dropped = manifest["total_rows"], manifest["dropped_rows"]
    numbers = [*counts, total, dropped, source_rows]
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers):
        raise UserError(f"shard manifest {path} has a row count that is not an integer; {RERUN_PARTITION}")
    if sum(counts) != total or dropped < 0 or total + dropped != source_rows:
        raise UserError(
            f"shard manifest {path} lists shards of {'+'.join(map(str, counts))} = {sum(counts)} rows but "
            f"records total_rows {total} and dropped_rows {dropped} of its source's {source_rows}; "
            f"{RERUN_PARTITION}"
        )
    first_rank: dict[str, int] = {}
    for shard in shards:
        other = first_rank.setdefault(str(shard["sha256"]), shard["rank"])
        if other != shard["rank"]:
            raise UserError(
                f"shard manifest {path} lists the same sha256 for the shards of ranks {other} and "
                f"{shard['rank']} (one shard copied over another); {RERUN_PARTITION}"
            )
