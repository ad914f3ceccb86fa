"""What a dataset spec alone says about its data (the config check of a foreign init_from builds the
model from it before any job) is what prepare then writes; the sources whose files decide say nothing."""

from __future__ import annotations

import numpy as np
import pytest

from shardfuse.data.sources.describe import info_from_spec
from shardfuse.experiment.load import _dataset_with_defaults
from shardfuse.experiment.schema import SCHEMA_PATH, load_schema
from shardfuse.models.spec import DataDescription
from shardfuse.prepare import prepare

SPECS = {
    "digits": {"source": "digits", "classes": [0, 1, 2]},
    "digits_images": {"source": "digits_images"},
    "diabetes": {"source": "diabetes"},
    "synthetic": {"source": "synthetic", "num_rows": 60, "num_features": 3, "num_classes": 4},
    "synthetic_regression": {
        "source": "synthetic",
        "num_rows": 60,
        "num_features": 3,
        "num_outputs": 2,
        "task": "regression",
    },
    "text": {"source": "text", "paths": ["{stdlib}/json/*.py"], "block_size": 16, "max_tokens": 2000},
    "csv_regression": {
        "source": "csv",
        "path": "data.csv",
        "feature_columns": ["a", "b"],
        "label_columns": ["y", "z"],
        "task": "regression",
    },
}


def resolved(spec: dict) -> dict:
    """The spec as the config loader hands it on (defaults filled, the task where not classification)."""
    return _dataset_with_defaults("d", spec, load_schema(SCHEMA_PATH)["$defs"]["dataset"])


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_spec_describes_the_data_as_prepare_writes_it(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    rows = ["a,b,y,z", *(",".join(f"{v:.3f}" for v in rng.normal(size=4)) for _ in range(30))]
    (tmp_path / "data.csv").write_text("\n".join(rows) + "\n")
    spec = resolved(SPECS[name])
    written = prepare("d", spec, tmp_path / "out")
    assert DataDescription.from_info(info_from_spec(spec)) == DataDescription.from_info(written)


@pytest.mark.parametrize(
    "spec",
    [
        {"source": "csv", "path": "x.csv", "feature_columns": ["a"], "label_column": "y"},
        {"source": "npz", "path": "x.npz"},
        {"source": "image_folder", "path": "images", "image_size": [8, 8]},
    ],
)
def test_sources_whose_files_decide_the_shapes_say_nothing(spec):
    assert info_from_spec(resolved(spec)) is None
