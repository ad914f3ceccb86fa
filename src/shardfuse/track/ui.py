"""What the MLflow UI shows of a run besides its metrics, computed from the run's files without MLflow.

The track stage (:mod:`shardfuse.tracking`) writes these; everything here is a pure function of files
already read by :mod:`shardfuse.track.inputs`, so a push of unchanged files writes nothing:

- **datasets as run inputs** (:func:`run_datasets`): the parent gets the prepared dataset's training
  split (what the shards were cut from; context ``training``) and, where dataset.json is beside it, the
  test split (context ``evaluation``: the merged model's metrics name it); each rank's child gets its
  own shard. The digest is the file's sha256, cut to the 36 characters MLflow stores (the full hash is in
  the dataset's profile). Schema in MLflow's column-spec form, row counts in the profile. The runs table's
  Dataset column and filter read these.
- **times that describe the training** (:func:`run_times`): a parent's start/end are its training's
  (end: the last logged step of any rank; start: end minus train.json's ``train_seconds``, the slowest
  rank's loop), a child's are its rank's first and last logged step; so the runs table's Created and
  Duration columns compare trainings, not track jobs.
- **source and user** (:func:`source_tags`): ``mlflow.source.name`` is the workflow's Snakefile (its
  absolute path), ``mlflow.source.git.repoURL`` the checkout's ``origin`` remote where there is one, and
  ``mlflow.user`` the user who runs the workflow.
- **the merge settings that were used** (:func:`merge_params`): the config's ``merge_<param>`` keys the
  run's method does not take are left out, and the ones it takes show the values merge.json records,
  defaults filled in (``merge_density`` 0.2 for ``ties``, not ``None``); greedy soup's chosen ranks as
  ``merge_greedy_soup_selected``.
- **the partition settings that were used** (:func:`partition_params`): only the ``partition_<param>``
  keys of the partitioner that made the shards, with the values its manifest records (defaults filled
  in, nulls left out); none for iid.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import subprocess
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from shardfuse.experiment.records import MergeRecord
from shardfuse.io import read_json

DIGEST_CHARS = 36  # MLflow's datasets.digest column (VARCHAR(36))
# Arrow type names (manifest.json's schema) -> MLflow column-spec types; anything else shows as its text.
MLFLOW_TYPES = {
    "double": "double",
    "float": "float",
    "int64": "long",
    "int32": "integer",
    "int16": "integer",
    "int8": "integer",
    "bool": "boolean",
    "string": "string",
    "large_string": "string",
    "binary": "binary",
    "large_binary": "binary",
}


class DatasetRef(NamedTuple):
    """One MLflow dataset input: what the UI's Dataset column and drawer show."""

    name: str
    sha256: str
    source: str  # absolute path of the file
    schema: tuple[tuple[str, str], ...]  # (column, arrow type)
    profile: dict[str, Any]  # rows and the like (JSON)
    context: str  # "training" | "evaluation" (the mlflow.data.context input tag)

    @property
    def digest(self) -> str:
        return self.sha256[:DIGEST_CHARS]

    def entity(self):
        """The mlflow.entities.DatasetInput that logs this dataset to a run."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        columns = [{"name": name, "type": MLFLOW_TYPES.get(kind, kind)} for name, kind in self.schema]
        dataset = Dataset(
            name=self.name,
            digest=self.digest,
            source_type="local",
            source=json.dumps({"uri": self.source}),
            schema=json.dumps({"mlflow_colspec": columns}) if columns else None,
            profile=json.dumps({**self.profile, "sha256": self.sha256}, sort_keys=True),
        )
        return DatasetInput(dataset, tags=[InputTag("mlflow.data.context", self.context)])


class RunDatasets(NamedTuple):
    parent: tuple[DatasetRef, ...]  # the training split, then the test split where known
    ranks: dict[int, DatasetRef]  # rank -> its shard
    evaluation: DatasetRef | None  # the test split: the merged model's metrics name it


def _schema(manifest: dict) -> tuple[tuple[str, str], ...]:
    fields = manifest.get("schema") if isinstance(manifest.get("schema"), list) else []
    return tuple(
        (str(f["name"]), str(f.get("type", ""))) for f in fields if isinstance(f, dict) and "name" in f
    )


def run_datasets(manifest_path: Path, manifest: dict, dataset_name: str) -> RunDatasets:
    """The datasets a run's parent and children record (see the module docstring).

    ``dataset_name`` is the config's dataset name; dataset.json is looked for beside the split the
    manifest was cut from (results/datasets/NAME/), and only adds the test split when it is there.
    """
    source = manifest.get("source") if isinstance(manifest.get("source"), dict) else {}
    schema = _schema(manifest)
    world_size = int(manifest.get("world_size", len(manifest.get("shards", []))))
    parent: list[DatasetRef] = []
    source_path = Path(str(source.get("path", ""))) if source.get("path") else None
    if source_path is not None and isinstance(source.get("sha256"), str):
        profile = {"num_rows": source.get("rows"), "split": "train", "num_shards": world_size}
        path = str(source_path.resolve())
        parent.append(DatasetRef(dataset_name, source["sha256"], path, schema, profile, "training"))
    evaluation = None
    info_path = source_path.parent / "dataset.json" if source_path is not None else None
    if info_path is not None and info_path.is_file():
        with contextlib.suppress(Exception):  # an older or hand-made dataset.json: no test split shown
            info = read_json(info_path, "dataset")
            test_sha = info["sha256"]["test"]
            rows = info.get("rows")
            profile = {"num_rows": rows.get("test") if isinstance(rows, dict) else None, "split": "test"}
            path = str((info_path.parent / "test.parquet").resolve())
            name = f"{dataset_name}-test"
            evaluation = DatasetRef(name, str(test_sha), path, schema, profile, "evaluation")
            parent.append(evaluation)
    ranks = {}
    for shard in manifest.get("shards", []):
        with contextlib.suppress(KeyError, TypeError, ValueError):
            rank = int(shard["rank"])
            path = str((manifest_path.parent / str(shard["path"])).resolve())
            profile = {"num_rows": int(shard["rows"]), "rank": rank, "world_size": world_size}
            if "label_counts" in shard:
                profile["label_counts"] = shard["label_counts"]
            name = f"{dataset_name}-shard-{rank}-of-{world_size}"
            ranks[rank] = DatasetRef(name, str(shard["sha256"]), path, schema, profile, "training")
    return RunDatasets(tuple(parent), ranks, evaluation)


class RunTimes(NamedTuple):
    parent: tuple[int, int] | None  # (start_ms, end_ms) of the training
    ranks: dict[int, tuple[int, int]]  # rank -> (first, last) logged step time in ms


def run_times(histories: dict[int, dict[str, np.ndarray]], train_seconds: float | None) -> RunTimes:
    """Start and end times (ms) that describe the training (see the module docstring)."""
    ranks = {}
    for rank, history in histories.items():
        stamps = history.get("timestamp_ms")
        if stamps is not None and len(stamps):
            ranks[rank] = (int(np.min(stamps)), int(np.max(stamps)))
    if not ranks:
        return RunTimes(None, {})
    end = max(last for _, last in ranks.values())
    start = min(first for first, _ in ranks.values())
    if train_seconds is not None and np.isfinite(train_seconds) and train_seconds >= 0:
        start = min(start, end - round(train_seconds * 1000))
    return RunTimes((start, end), ranks)


def _git(directory: Path, *args: str) -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        proc = subprocess.run(
            ["git", "-C", str(directory), *args], capture_output=True, text=True, timeout=10
        )
        if proc.returncode == 0 and proc.stdout.strip():
            return proc.stdout.strip()
    return None


def source_tags(snakefile: Path | None) -> dict[str, str]:
    """mlflow.source.* and mlflow.user: the workflow that produced the run and who ran it."""
    if snakefile is None:
        snakefile = Path.cwd() / "Snakefile"
    path = snakefile.resolve()
    tags = {"mlflow.source.type": "LOCAL", "mlflow.source.name": str(path)}
    if url := _git(path.parent, "config", "--get", "remote.origin.url"):
        tags["mlflow.source.git.repoURL"] = url
    with contextlib.suppress(Exception):  # no passwd entry (containers): fall back to the environment
        tags["mlflow.user"] = getpass.getuser()
    if "mlflow.user" not in tags and os.environ.get("USER"):
        tags["mlflow.user"] = os.environ["USER"]
    return tags


def param_text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return json.dumps(list(value))
    return str(value)


def merge_params(config_params: dict[str, str], merge: MergeRecord) -> dict[str, str]:
    """The run's params with the merge settings merge.json says were used (see the module docstring).

    A config key that sets a merge method's parameter (``merge_<param>`` for a param
    of a shardfuse.fusion.methods.registry record) stays only when the run's method takes it, with the
    value the merge stage resolved."""
    from shardfuse.fusion.methods import registry  # numpy only; the config's key for param p is merge_<p>

    method = str(config_params.get("merge_method", "") if merge.method is None else merge.method)
    used = merge.params if isinstance(merge.params, dict) else {}
    params_of = {record.name: record.params for record in registry.RECORDS}
    method_keys = {f"merge_{name}" for spec in params_of.values() for name in spec}
    taken = {f"merge_{name}": name for name in params_of.get(method, {})}
    params = {k: v for k, v in config_params.items() if k not in method_keys or k in taken}
    for key, name in taken.items():
        if used.get(name) is not None:
            params[key] = param_text(used[name])
    search = merge.search
    if isinstance(search, dict):  # the best trial's parameters are the merge_<param> above
        for key in ("study", "sampler", "seed", "objective", "trials_done"):
            params[f"merge_search_{key}"] = str(search.get(key))
    soup = merge.greedy_soup
    if isinstance(soup, dict) and isinstance(soup.get("selected"), list):
        params["merge_greedy_soup_selected"] = ",".join(str(rank) for rank in soup["selected"])
    return params


def partition_params(config_params: dict[str, str], manifest: dict[str, Any]) -> dict[str, str]:
    """The run's params with the partition settings its shards' manifest says were used (see the module
    docstring): every config has a ``partition_<param>`` key for each param of every partitioner, mostly
    null; the run's own partitioner's resolved ones replace them all."""
    from shardfuse.data.partitioners import registry  # standard library only

    config_keys = {f"partition_{name}" for record in registry.RECORDS for name in record.params}
    params = {key: value for key, value in config_params.items() if key not in config_keys}
    used = manifest.get("partition") if isinstance(manifest, dict) else None  # absent: iid
    if isinstance(used, dict) and isinstance(used.get("params"), dict):
        for name, value in used["params"].items():
            if value is not None:
                params[f"partition_{name}"] = param_text(value)
    return params
