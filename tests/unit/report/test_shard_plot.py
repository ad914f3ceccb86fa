"""The shard-set figure (shards.png): what each rank was dealt, from a real manifest."""

from __future__ import annotations

import matplotlib.image
import numpy as np

from shardfuse import plots
from shardfuse.data.manifest import read_manifest
from shardfuse.partition import partition_parquet
from shardfuse.report.shards import MAX_CLASSES, class_table, plot_shard_set, title_of
from tests.support.data import write_grouped_rows
from tests.support.tracking import make_run_dir


def test_a_dirichlet_shard_set_is_drawn_with_its_partitioner_and_heterogeneity(tmp_path):
    write_grouped_rows(tmp_path / "in.parquet", 800, num_classes=6)
    partition_parquet(
        tmp_path / "in.parquet", tmp_path / "shards", 3, 0, partitioner="dirichlet", params={"alpha": 0.3}
    )
    manifest = read_manifest(tmp_path / "shards")
    title = title_of(manifest, "skewed")
    assert title.startswith(
        "skewed: dirichlet (alpha 0.3, min_rows 10, self_balancing False)\nlabel JSD mean "
    )
    assert f"rows CV {manifest['heterogeneity']['rows_cv']:.2f}" in title
    path = plot_shard_set(manifest, "skewed", tmp_path / "shards.png")
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 300 and image[..., :3].std() > 0.05
    assert plot_shard_set(manifest, "skewed", tmp_path / "again.png").read_bytes() == path.read_bytes()


def test_classes_past_the_legends_room_are_one_part_and_no_labels_plain_bars(tmp_path):
    shards = [
        {"rows": 30, "label_counts": {str(c): 1 for c in range(30)}},
        {"rows": 2, "label_counts": {"0": 2}},
    ]
    classes, table = class_table(shards)
    assert len(classes) == MAX_CLASSES and classes[-1] == "other classes"
    assert table.sum(axis=0).tolist() == [30, 2] and table[-1].tolist() == [30 - MAX_CLASSES + 1, 0]
    unlabelled = {"shards": [{"rows": 10}, {"rows": 30}]}
    assert title_of(unlabelled, "r") == "r: iid\nrows CV 0.50"
    assert plot_shard_set(unlabelled, "r", tmp_path / "plain.png").is_file()


def test_the_run_plots_add_shards_png_when_given_the_manifest(tmp_path):
    run_dir, _ = make_run_dir(tmp_path, "pictured", world_size=2, num_steps=20, training="shared")
    train_dir = tmp_path / "results" / "trainings" / "shared" / "ranks"
    write_grouped_rows(tmp_path / "in.parquet", 200)
    partition_parquet(tmp_path / "in.parquet", tmp_path / "shards", 2, 0)
    written = plots.plot_run(
        run_dir, run_dir / "plots", train_dir, manifest=tmp_path / "shards" / "manifest.json"
    )
    assert [p.name for p in written] == [*plots.RUN_PLOTS, plots.SHARD_PLOT]
    assert np.asarray(matplotlib.image.imread(written[-1])).size
