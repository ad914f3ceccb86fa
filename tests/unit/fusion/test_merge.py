"""Gather and the merge stage (streaming engine, greedy soup, DCP, CLI) on small hand-made checkpoints."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from shardfuse.checkpoints.weights import load_weights, save_weights
from shardfuse.data import reader as data_module
from shardfuse.fusion.engine import merge_arrays
from shardfuse.fusion.methods.registry import rank_weights, resolve_params
from shardfuse.gather import gather
from shardfuse.io import UserError, file_digests, sha256_file, write_json
from shardfuse.merge import merge
from shardfuse.models.registry import build_model
from shardfuse.models.spec import model_spec
from tests.support.fusion import (
    LOGISTIC,
    MLP_SPEC,
    classifier,
    gather_to,
    make_run,
    random_rank_tensors,
    write_split,
)


@pytest.mark.parametrize("method", ["uniform", "weighted"])
def test_averaging_methods_match_reference(tmp_path, method):
    ranks, rows = random_rank_tensors(3), [10, 30, 60]
    gather_path = gather_to(tmp_path, make_run(tmp_path, ranks, rows), 3)
    record = merge(gather_path, method, tmp_path / "merged.safetensors", tmp_path / "merge.json")
    merged, meta = load_weights(tmp_path / "merged.safetensors")
    weights = [1 / 3] * 3 if method == "uniform" else [r / sum(rows) for r in rows]
    for name in ranks[0]:
        reference = sum(w * ranks[i][name].double() for i, w in enumerate(weights)).float()
        torch.testing.assert_close(merged[name], reference, rtol=0, atol=1e-6)
    assert record.weights == pytest.approx(weights)
    assert meta["merge_method"] == method and meta["model"] == MLP_SPEC
    assert json.loads((tmp_path / "merge.json").read_text())["sha256"] == record.sha256


def test_consolidate_keeps_identical_ranks_and_rejects_drift(tmp_path):
    same = random_rank_tensors(1)[0]
    gather_path = gather_to(tmp_path, make_run(tmp_path, [same, same], [5, 5]), 2)
    record = merge(
        gather_path, "consolidate", tmp_path / "m.safetensors", tmp_path / "m.json", {"tolerance": 0.0}
    )
    merged, _ = load_weights(tmp_path / "m.safetensors")
    assert all(torch.equal(merged[n], same[n]) for n in same)
    assert record.max_abs_diff_between_ranks == 0.0

    drifted = {**same, "b": same["b"] + 1e-3}
    gather_path = gather_to(tmp_path / "x", make_run(tmp_path / "x", [same, drifted], [5, 5]), 2)
    with pytest.raises(UserError, match=r"tensor 'b' differs between ranks by up to 0.001"):
        merge(gather_path, "consolidate", tmp_path / "n.safetensors", tmp_path / "n.json")
    assert not (tmp_path / "n.safetensors").exists()


def test_gather_names_the_missing_rank(tmp_path):
    train_dir = make_run(tmp_path, random_rank_tensors(3), [1, 1, 1])
    (train_dir / "rank-2.safetensors").unlink()
    with pytest.raises(UserError, match=r"^rank 2: checkpoint .*rank-2.safetensors is missing"):
        gather(train_dir, 3)


def test_gather_names_the_rank_with_a_wrong_shape(tmp_path):
    ranks = random_rank_tensors(2)
    ranks[1]["b"] = torch.zeros(3, 6)
    train_dir = make_run(tmp_path, ranks, [1, 1])
    with pytest.raises(
        UserError, match=r"^rank 1: tensor 'b' is F32\[3, 6\] but the base model has F32\[3, 5\]"
    ):
        gather(train_dir, 2)


def test_gather_rejects_a_rank_file_that_is_not_safetensors(tmp_path):
    train_dir = make_run(tmp_path, random_rank_tensors(2), [1, 1])
    (train_dir / "rank-1.safetensors").write_bytes(b"\x80\x04 not a checkpoint")
    with pytest.raises(UserError, match=r"rank-1.safetensors is not a readable safetensors file"):
        gather(train_dir, 2)


def test_gather_detects_a_file_changed_after_training(tmp_path):
    ranks = random_rank_tensors(2)
    train_dir = make_run(tmp_path, ranks, [1, 1])
    sidecar = json.loads((train_dir / "rank-0.json").read_text())
    save_weights(
        train_dir / "rank-0.safetensors",
        ranks[1],
        {k: v for k, v in sidecar.items() if k not in ("sha256", "bytes")},
        sidecar=False,
    )
    with pytest.raises(UserError, match=r"^rank 0: .* does not match the sha256"):
        gather(train_dir, 2)


def test_gather_records_checksums_and_rows(tmp_path):
    record = gather(make_run(tmp_path, random_rank_tensors(2), [3, 4]), 2).to_json()
    assert [r["rows"] for r in record["ranks"]] == [3, 4]
    assert (record["format_version"], record["hash"]) == (2, "blake3")
    for r in record["ranks"]:  # both from one read: the sha256 is training's sidecar's
        assert {"sha256": r["sha256"], "blake3": r["blake3"]} == file_digests(r["path"])
    assert record["tensors"]["a.weight"] == {"shape": [5, 4], "dtype": "F32"}


# ---------------------------------------------------------------- the streaming engine

METHOD_CASES = [
    ("consolidate", {"tolerance": 100.0}, 3),
    ("uniform", {}, 3),
    ("weighted", {"weights": [1.0, 2.0, 5.0]}, 3),
    ("task_arithmetic", {"scale": 0.8}, 3),
    ("ties", {"density": 0.3}, 3),
    ("dare", {"density": 0.6, "seed": 3, "sign_election": True}, 3),
    ("slerp", {"t": 0.3}, 2),
    ("model_stock", {}, 3),
]


def run_with_base(tmp_path, num_ranks):
    ranks, base = random_rank_tensors(num_ranks, seed=1), random_rank_tensors(1, seed=2)[0]
    ranks = [{name: base[name] + 0.5 * tensor for name, tensor in rank.items()} for rank in ranks]
    return (
        ranks,
        base,
        gather_to(tmp_path, make_run(tmp_path, ranks, [10, 20, 30][:num_ranks], base=base), num_ranks),
    )


@pytest.mark.parametrize(("method", "given", "num_ranks"), METHOD_CASES)
def test_streaming_merge_equals_the_in_memory_method_whatever_the_block_size(
    tmp_path, method, given, num_ranks
):
    ranks, base, gather_path = run_with_base(tmp_path, num_ranks)
    merge(gather_path, method, tmp_path / "a.safetensors", tmp_path / "a.json", given, block_bytes=8 * 4 * 3)
    record = merge(gather_path, method, tmp_path / "b.safetensors", tmp_path / "b.json", given)
    tiny, _ = load_weights(tmp_path / "a.safetensors")
    whole, meta = load_weights(tmp_path / "b.safetensors")
    p = resolve_params(method, given, [10, 20, 30][:num_ranks])
    for name in ranks[0]:
        expected, stats = merge_arrays(
            method,
            p,
            [r[name].numpy() for r in ranks],
            base[name].numpy(),
            name,
            rank_weights(method, p, [10, 20, 30][:num_ranks]),
        )
        exact = method not in ("slerp", "model_stock")  # their scans sum dot products block by block
        for merged in (tiny, whole):
            if exact:
                assert np.array_equal(merged[name].numpy(), expected), (method, name)
            else:
                np.testing.assert_allclose(merged[name].numpy(), expected, rtol=1e-6, atol=1e-7)
        assert record.tensor_stats[name].keys() == stats.keys()
    assert meta["merge_method"] == method and meta["merge_params"] == p and meta["rank"] is None


@pytest.mark.parametrize(("method", "given", "num_ranks"), METHOD_CASES)
def test_empty_and_scalar_tensors_pass_through_every_method(tmp_path, method, given, num_ranks):
    ranks = [{"empty": torch.zeros(0, 3), "scalar": torch.tensor(1.5 + r)} for r in range(num_ranks)]
    base = {"empty": torch.zeros(0, 3), "scalar": torch.tensor(1.0)}
    gather_path = gather_to(tmp_path, make_run(tmp_path, ranks, [1] * num_ranks, base=base), num_ranks)
    merge(gather_path, method, tmp_path / "m.safetensors", tmp_path / "m.json", given, block_bytes=8)
    merged, _ = load_weights(tmp_path / "m.safetensors")
    assert merged["empty"].shape == (0, 3) and merged["scalar"].shape == ()


def test_ties_keeps_exactly_k_of_many_equal_magnitudes_across_block_boundaries(tmp_path):
    gen = torch.Generator().manual_seed(3)
    base = {"w": torch.zeros(61)}
    ranks = [{"w": torch.randint(-2, 3, (61,), generator=gen).float()} for _ in range(3)]
    gather_path = gather_to(tmp_path, make_run(tmp_path, ranks, [1, 1, 1], base=base), 3)
    record = merge(gather_path, "ties", tmp_path / "m.safetensors", tmp_path / "m.json", {"density": 0.3},
                   block_bytes=8 * 4 * 5)  # fmt: skip
    expected, stats = merge_arrays("ties", resolve_params("ties", {"density": 0.3}, [1] * 3),
                                   [r["w"].numpy() for r in ranks], np.zeros(61))  # fmt: skip
    assert np.array_equal(load_weights(tmp_path / "m.safetensors")[0]["w"].numpy(), expected)
    assert record.tensor_stats["w"]["kept_fraction"] == stats["kept_fraction"] == 18 / 61


def test_half_precision_checkpoints_merge_like_a_torch_float64_reference(tmp_path):
    gen = torch.Generator().manual_seed(0)
    ranks = [
        {"h": torch.randn(7, 5, generator=gen).half(), "b": torch.randn(33, generator=gen).bfloat16()}
        for _ in range(3)
    ]
    gather_path = gather_to(tmp_path, make_run(tmp_path, ranks, [1, 1, 1]), 3)
    merge(gather_path, "uniform", tmp_path / "m.safetensors", tmp_path / "m.json", block_bytes=64)
    merged, _ = load_weights(tmp_path / "m.safetensors")
    for name, tensor in ranks[0].items():
        reference = (sum(r[name].double() for r in ranks) / 3).to(tensor.dtype)
        assert merged[name].dtype == tensor.dtype and torch.equal(merged[name], reference)


def test_integer_buffers_are_copied_from_rank_0_and_must_agree(tmp_path):
    ranks = random_rank_tensors(2)
    for rank in ranks:
        rank["steps"] = torch.tensor([5, 6], dtype=torch.int64)
    gather_path = gather_to(tmp_path, make_run(tmp_path, ranks, [1, 1]), 2)
    record = merge(gather_path, "uniform", tmp_path / "m.safetensors", tmp_path / "m.json")
    assert torch.equal(load_weights(tmp_path / "m.safetensors")[0]["steps"], ranks[0]["steps"])
    assert record.tensor_stats["steps"] == {"max_abs_diff": 0.0, "copied_from_rank": 0}
    ranks[1]["steps"] = torch.tensor([5, 7], dtype=torch.int64)
    gather_path = gather_to(tmp_path / "x", make_run(tmp_path / "x", ranks, [1, 1]), 2)
    with pytest.raises(UserError, match=r"tensor 'steps' \(I64\) differs between rank 0 and rank 1"):
        merge(gather_path, "uniform", tmp_path / "n.safetensors", tmp_path / "n.json")
    assert not list(tmp_path.glob("*n.*"))


def test_a_rank_file_changed_after_gather_is_refused_and_nothing_is_written(tmp_path):
    gather_path = gather_to(tmp_path, make_run(tmp_path, random_rank_tensors(2), [1, 1]), 2)
    path = tmp_path / "r" / "train" / "rank-1.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # same size, one bit of the last tensor flipped
    path.write_bytes(bytes(data))
    with pytest.raises(
        UserError, match=r"^rank 1: .*rank-1.safetensors is missing or changed since gather; re-run"
    ):
        merge(gather_path, "uniform", tmp_path / "m.safetensors", tmp_path / "m.json")
    assert not list(tmp_path.glob("*m.*"))


def old_format(gather_path):
    """gather.json as gather wrote it before format version 2: sha256 only."""
    info = json.loads(gather_path.read_text())
    del info["format_version"], info["hash"]
    for entry in info["ranks"]:
        del entry["blake3"]
    write_json(gather_path, info)


@pytest.mark.parametrize("changed", [False, True])
def test_an_old_format_gather_json_is_verified_with_sha256(tmp_path, changed):
    ranks = random_rank_tensors(2)
    gather_path = gather_to(tmp_path, make_run(tmp_path, ranks, [1, 1]), 2)
    old_format(gather_path)
    if changed:
        path = tmp_path / "r" / "train" / "rank-0.safetensors"
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
        with pytest.raises(UserError, match=r"^rank 0: .*rank-0.safetensors is missing or changed since"):
            merge(gather_path, "uniform", tmp_path / "m.safetensors", tmp_path / "m.json")
        assert not list(tmp_path.glob("*m.*"))
        return
    record = merge(gather_path, "uniform", tmp_path / "m.safetensors", tmp_path / "m.json")
    info = json.loads(gather_path.read_text())
    assert record.hash == "sha256"
    assert record.ingredients == [
        {"rank": r["rank"], "path": r["path"], "sha256": r["sha256"], "rows": r["rows"]}
        for r in info["ranks"]
    ]
    merged, _ = load_weights(tmp_path / "m.safetensors")
    for name in ranks[0]:
        reference = ((ranks[0][name].double() + ranks[1][name].double()) / 2).float()
        torch.testing.assert_close(merged[name], reference, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (
            {"format_version": 3},
            r"has format version 3, newer than this shardfuse reads \(2\); re-run gather",
        ),
        (
            {"hash": "md5"},
            r": 'hash' is 'md5', not one of sha256, blake3; gather.json was edited or is stale",
        ),
    ],
)
def test_a_gather_json_of_a_newer_format_or_an_unknown_hash_is_refused(tmp_path, change, fragment):
    gather_path = gather_to(tmp_path, make_run(tmp_path, random_rank_tensors(2), [1, 1]), 2)
    write_json(gather_path, {**json.loads(gather_path.read_text()), **change})
    with pytest.raises(UserError, match=fragment):
        merge(gather_path, "uniform", tmp_path / "m.safetensors", tmp_path / "m.json")


def test_a_version_2_gather_json_needs_every_rank_s_blake3(tmp_path):
    gather_path = gather_to(tmp_path, make_run(tmp_path, random_rank_tensors(2), [1, 1]), 2)
    info = json.loads(gather_path.read_text())
    del info["ranks"][1]["blake3"]
    write_json(gather_path, info)
    with pytest.raises(
        UserError, match=r"'ranks\[1\]\.blake3' is missing, not a string; gather.json was edited"
    ):
        merge(gather_path, "uniform", tmp_path / "m.safetensors", tmp_path / "m.json")


def test_merge_json_records_method_params_ingredients_base_and_tensor_stats(tmp_path):
    _, _, gather_path = run_with_base(tmp_path, 3)
    record = merge(
        gather_path, "ties", tmp_path / "m.safetensors", tmp_path / "m.json", {"density": 0.5}, run="sweep"
    )
    assert json.loads((tmp_path / "m.json").read_text()) == record.to_json()
    assert (record.run, record.training, record.method) == ("sweep", "r", "ties")
    assert record.params == {"density": 0.5, "scale": 1.0} and record.weights is None
    info = json.loads(gather_path.read_text())
    assert record.ingredients == [
        {key: r[key] for key in ("rank", "path", "sha256", "blake3", "rows")} for r in info["ranks"]
    ]
    assert record.base == {"path": info["base"], "sha256": sha256_file(info["base"])}
    assert record.tensor_stats["b"]["kept_fraction"] == pytest.approx(8 / 15)  # round(7.5) = 8 of 15
    assert record.sha256 == sha256_file(tmp_path / "m.safetensors") and record.output == "m.safetensors"
    assert (record.num_tensors, record.num_parameters) == (3, 40)
    assert record.peak_rss_mb > 0 and record.seconds > 0 and record.greedy_soup is None


def test_slerp_of_three_ranks_is_refused_before_reading_anything(tmp_path):
    gather_path = gather_to(tmp_path, make_run(tmp_path, random_rank_tensors(3), [1, 1, 1]), 3)
    with pytest.raises(UserError, match="slerp interpolates exactly 2 models but the run has 3 ranks"):
        merge(gather_path, "slerp", tmp_path / "m.safetensors", tmp_path / "m.json")


# ---------------------------------------------------------------- greedy soup


@pytest.fixture()
def greedy_run(tmp_path):
    gen = np.random.default_rng(0)
    features = gen.standard_normal((400, 2)).astype(np.float32)
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    write_split(dataset / "val.parquet", features[:200], (features[:200, 0] > 0).astype(int))
    write_split(dataset / "test.parquet", features[200:], (features[200:, 0] < 0).astype(int))  # opposite!
    splits = ("val", "test")
    (dataset / "dataset.json").write_text(
        json.dumps(
            {
                "rows": dict.fromkeys(splits, 200),
                "sha256": {split: sha256_file(dataset / f"{split}.parquet") for split in splits},
            }
        )
    )
    # rank 0 inverted (accuracy 0), 1 and 3 perfect, 2 decent: order 1, 3, 2, 0
    ranks = [classifier([-10.0, 0.0]), classifier([3.0, 0.0]), classifier([5.0, 3.0]), classifier([5.0, 0.0])]
    gather_path = gather_to(tmp_path, make_run(tmp_path, ranks, [1, 1, 1, 1], spec=LOGISTIC), 4)
    return gather_path, dataset, ranks


def test_greedy_soup_adds_ranks_by_validation_accuracy_while_it_does_not_drop(
    greedy_run, tmp_path, monkeypatch
):
    gather_path, dataset, ranks = greedy_run
    read = []
    original = data_module.load_table
    monkeypatch.setattr(
        data_module, "load_table", lambda path, *a, **k: read.append(Path(path)) or original(path)
    )
    record = merge(
        gather_path,
        "greedy_soup",
        tmp_path / "m.safetensors",
        tmp_path / "m.json",
        val_split=dataset / "val.parquet",
    )
    soup = record.greedy_soup
    assert read == [dataset / "val.parquet"]  # the test split is never read
    assert soup["order"] == [1, 3, 2, 0] and soup["val_accuracy"][0] == 0.0 and soup["val_accuracy"][1] == 1.0
    assert [step["accepted"] for step in soup["steps"]] == [
        True,
        True,
        False,
        False,
    ]  # 3 ties 1.0: >= keeps it
    assert soup["selected"] == [1, 3] and soup["soup_val_accuracy"] == 1.0
    assert record.weights == [0.0, 0.5, 0.0, 0.5]
    merged, _ = load_weights(tmp_path / "m.safetensors")
    for name in ranks[0]:
        assert torch.equal(merged[name], ((ranks[1][name].double() + ranks[3][name].double()) / 2).float())


def test_greedy_soup_refuses_the_test_split_and_needs_a_validation_split(greedy_run, tmp_path):
    gather_path, dataset, _ = greedy_run
    out = (tmp_path / "m.safetensors", tmp_path / "m.json")
    with pytest.raises(
        UserError, match=r"test.parquet is the dataset's test split .* pass the val.parquet split"
    ):
        merge(gather_path, "greedy_soup", *out, val_split=dataset / "test.parquet")
    with pytest.raises(
        UserError, match=r"greedy_soup ranks the ranks by their held-out score and needs --val-split"
    ):
        merge(gather_path, "greedy_soup", *out)
    empty = tmp_path / "empty"  # a dataset prepared with val_fraction 0
    empty.mkdir()
    write_split(empty / "val.parquet", np.zeros((0, 2), np.float32), np.zeros(0, int))
    info = {"rows": {"val": 0}, "sha256": {"val": sha256_file(empty / "val.parquet")}}
    (empty / "dataset.json").write_text(json.dumps(info))
    with pytest.raises(UserError, match=r"val.parquet has no rows; greedy_soup needs one — set the"):
        merge(gather_path, "greedy_soup", *out, val_split=empty / "val.parquet")
    assert not list(tmp_path.glob("*m.*"))


# ---------------------------------------------------------------- BatchNorm statistics and tied weights

# Parameters under which each method moves a weight away from the plain mean of the ranks.
STATISTIC_CASES = [
    ("task_arithmetic", {"scale": 0.5}, 3),
    ("ties", {"density": 0.3}, 3),
    ("dare", {"density": 0.5, "seed": 1}, 3),
    ("slerp", {"t": 0.3}, 2),
    ("model_stock", {}, 3),
]


def batchnorm_tensors(gen, counter):
    return {
        "bn.weight": torch.randn(6, generator=gen),
        "bn.bias": torch.randn(6, generator=gen),
        "bn.running_mean": torch.randn(6, generator=gen),
        "bn.running_var": torch.rand(6, generator=gen) + 0.5,
        "bn.num_batches_tracked": torch.tensor(counter, dtype=torch.int64),
    }


@pytest.mark.parametrize(("method", "given", "num_ranks"), STATISTIC_CASES)
def test_batchnorm_running_statistics_are_the_plain_mean_of_the_ranks_for_every_method(
    tmp_path, method, given, num_ranks
):
    gen = torch.Generator().manual_seed(7)
    base = batchnorm_tensors(gen, counter=0)  # as saved before the first step
    ranks = [batchnorm_tensors(gen, counter=12) for _ in range(num_ranks)]
    gather_path = gather_to(tmp_path, make_run(tmp_path, ranks, [1] * num_ranks, base=base), num_ranks)
    record = merge(
        gather_path, method, tmp_path / "m.safetensors", tmp_path / "m.json", given, block_bytes=64
    )
    merged, _ = load_weights(tmp_path / "m.safetensors")
    for name in ("bn.running_mean", "bn.running_var"):
        reference = (sum(rank[name].double() for rank in ranks) / num_ranks).float()
        assert merged[name].dtype == torch.float32 and torch.equal(merged[name], reference), name
        assert record.tensor_stats[name]["running_statistic"] == "mean"
    plain_mean = sum(rank["bn.weight"] for rank in ranks) / num_ranks
    assert not torch.allclose(merged["bn.weight"], plain_mean)  # the weights did go through the method
    counter = merged["bn.num_batches_tracked"]
    assert counter.dtype == torch.int64 and counter.shape == () and int(counter) == 12
    assert record.tensor_stats["bn.num_batches_tracked"] == {"max_abs_diff": 0.0, "copied_from_rank": 0}


def trained_cnn_states(num_ranks, extra_steps=()):
    """State dicts of a built-in cnn after training-mode forwards on each rank's own batches: the
    running statistics differ between ranks, the counters agree unless a rank takes extra steps."""
    info = {"task": "classification", "num_features": 16, "num_classes": 3}
    info["input"] = {"kind": "tensor", "shape": [2, 4, 4]}
    spec = model_spec("cnn", {"channels": [3, 4]}, [], info)
    torch.manual_seed(0)
    model = build_model(spec)
    base = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    states = []
    for rank in range(num_ranks):
        model.load_state_dict(base)
        for _ in range(2 + (rank in extra_steps)):
            model(torch.randn(8, 2, 4, 4, generator=torch.Generator().manual_seed(rank)) + rank)
        states.append({name: tensor.clone() for name, tensor in model.state_dict().items()})
    return spec, base, states


def test_a_merged_cnn_loads_with_mean_statistics_and_rank_0_counters(tmp_path):
    spec, base, states = trained_cnn_states(3)
    gather_path = gather_to(tmp_path, make_run(tmp_path, states, [1, 1, 1], base=base, spec=spec), 3)
    merge(gather_path, "ties", tmp_path / "m.safetensors", tmp_path / "m.json", {"density": 0.5})
    merged, metadata = load_weights(tmp_path / "m.safetensors")
    model = build_model(metadata["model"])
    model.load_state_dict(merged)
    assert model.eval()(torch.randn(5, 2, 4, 4)).shape == (5, 3)
    counters = [name for name in merged if name.endswith("num_batches_tracked")]
    assert len(counters) == 2
    for name in counters:
        assert merged[name].dtype == torch.int64 and torch.equal(merged[name], states[0][name])
        assert int(merged[name]) == 2
    mean = (sum(state["features.1.running_var"].double() for state in states) / 3).float()
    assert torch.equal(merged["features.1.running_var"], mean)


def test_unequal_batchnorm_counters_stop_the_merge_naming_the_tensor(tmp_path):
    spec, base, states = trained_cnn_states(2, extra_steps={1})
    gather_path = gather_to(tmp_path, make_run(tmp_path, states, [1, 1], base=base, spec=spec), 2)
    with pytest.raises(UserError) as error:
        merge(gather_path, "slerp", tmp_path / "m.safetensors", tmp_path / "m.json")
    message = str(error.value)
    assert message.startswith(
        "tensor 'features.1.num_batches_tracked' (I64) differs between rank 0 and rank 1; integer/bool "
        "tensors (counters such as BatchNorm's num_batches_tracked, masks, indices) have no meaningful "
        "mean, so they are copied from rank 0 and must be identical across ranks"
    )
    assert "\n" not in message
    assert not list(tmp_path.glob("*m.*"))


@pytest.mark.parametrize("method", ["uniform", "ties", "model_stock"])
def test_a_tied_transformer_merges_its_shared_matrix_once_and_loads(tmp_path, method):
    info = {"task": "causal_lm", "num_features": 9, "num_classes": 0, "vocab_size": 20, "block_size": 8}
    spec = model_spec("transformer", {"width": 16, "layers": 1, "heads": 2}, [], info)
    torch.manual_seed(0)
    base = build_model(spec).state_dict()
    gen = torch.Generator().manual_seed(1)
    ranks = [
        {name: t + 0.01 * torch.randn(t.shape, generator=gen) for name, t in base.items()} for _ in range(3)
    ]
    gather_path = gather_to(tmp_path, make_run(tmp_path, ranks, [1, 1, 1], base=base, spec=spec), 3)
    merge(gather_path, method, tmp_path / "m.safetensors", tmp_path / "m.json")
    merged, metadata = load_weights(tmp_path / "m.safetensors")
    assert [name for name, t in merged.items() if t.shape == (20, 16)] == ["token_embedding.weight"]
    model = build_model(metadata["model"])
    model.load_state_dict(merged)  # strict: every tensor once, nothing missing
    assert torch.equal(model.token_embedding.weight, merged["token_embedding.weight"])
    assert model(torch.zeros(2, 8, dtype=torch.long)).shape == (2, 8, 20)


# ---------------------------------------------------------------- torch.distributed.checkpoint


def test_a_dcp_checkpoint_with_a_pickled_index_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    ranks = random_rank_tensors(2)
    gather_path = gather_to(tmp_path, make_run(tmp_path, ranks, [1, 1]), 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(ranks[0], checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    with pytest.raises(UserError, match=r"default format, whose index \(.metadata\) and tensors are pickles"):
        merge(
            gather_path,
            "consolidate",
            tmp_path / "m.safetensors",
            tmp_path / "m.json",
            dcp_dir=tmp_path / "dcp",
        )
    with pytest.raises(
        UserError, match="--dcp-dir consolidates a sharded checkpoint: use it with --method consolidate"
    ):
        merge(
            gather_path, "uniform", tmp_path / "m.safetensors", tmp_path / "m.json", dcp_dir=tmp_path / "dcp"
        )


# ---------------------------------------------------------------- command line
