"""The shard manifest (``manifest.json`` beside the shards): its format tag, its keys, and the checked read.

JSON only (no torch, no pyarrow), so the launcher can check a shard set's world size before it starts
any rank. A library module: the partition stage writes manifests, ``shardfuse.data`` and the launcher
read them.
"""

from __future__ import annotations

from pathlib import Path

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
    return manifest
