"""Prepare one dataset, the library behind the prepare stage (:mod:`shardfuse.prepare`): validate the spec
against its source's record, let the source write the three split files, then write dataset.json (last,
so its presence means the split is complete) and the checksums partition reuses. A library module::

    python -c "from shardfuse.data.sources.dataset import prepare
    print(prepare('digits', {'source': 'digits'}, '/tmp/digits')['rows'])"
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from shardfuse.data.dataset_info import INFO_DIGEST, info_digest
from shardfuse.data.labels import layout_of
from shardfuse.data.sources.registry import find_source
from shardfuse.data.sources.spec import validate_spec
from shardfuse.data.sources.write import SPLITS
from shardfuse.io import UserError, sha256_file, write_json, write_stamps
from shardfuse.models.tasks import task_for

ROW_GROUP_ROWS = 1 << 16


def prepare(name: str, spec: Any, out_dir: str | Path, row_group_rows: int = ROW_GROUP_ROWS) -> dict:
    """Write OUT_DIR/{train,val,test}.parquet and dataset.json for ``spec``; return the dataset.json content.

    ``row_group_rows`` only changes the Parquet layout, never the rows (tests rely on that)."""
    if not isinstance(name, str) or not name:
        raise UserError("--name must be a non-empty dataset name, e.g. --name digits")
    spec = validate_spec(spec)
    out_dir = Path(out_dir)
    source = find_source(spec["source"])
    written = source.behaviour_of().prepare(spec, task_for(spec["task"]), out_dir, row_group_rows)
    info = {
        "name": name,
        "source": spec["source"],
        "task": spec["task"],
        "input": written.input,
        "num_features": math.prod(written.input["shape"]),
        "num_classes": len(written.label_names),
        "feature_names": written.feature_names,
        "label_names": written.label_names,
        **written.task_keys,
        "rows": written.rows,
        "test_fraction": spec["test_fraction"],
        "val_fraction": spec["val_fraction"],
        "seed": spec["seed"],
        "sha256": {split: sha256_file(out_dir / f"{split}.parquet") for split in SPLITS},
    }
    info[INFO_DIGEST] = info_digest(info)  # the file's own fields: an edit by hand is refused on reading
    write_json(out_dir / "dataset.json", info)
    # Partition reuses these checksums (one pass less over train.parquet) while the files are unchanged.
    write_stamps(out_dir, {f"{split}.parquet": info["sha256"][split] for split in SPLITS})
    return info


def describe(info: dict) -> str:
    """One line on what was prepared, after the row counts: its inputs and its targets."""
    shape = info["input"]["shape"]
    inputs = f"{info['num_features']} features" if info["input"]["kind"] == "numeric" else f"shape {shape}"
    return layout_of(info["task"]).summary(info, inputs)
