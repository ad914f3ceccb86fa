"""BatchNorm after fusion: the merged model's running statistics re-estimated on the validation split."""

from __future__ import annotations

import pytest
import torch

from shardfuse.data.dataset_info import read_dataset_info
from shardfuse.data.reader import load_table
from shardfuse.fusion.recalibrate import recalibrate_batchnorm
from shardfuse.models.registry import build_model
from shardfuse.models.spec import model_spec


@pytest.fixture(scope="module")
def cnn_spec_and_data(digits_images_data):
    dataset, _ = digits_images_data
    spec = model_spec("cnn", {"channels": [6, 5]}, [], read_dataset_info(dataset))
    return spec, dataset


def test_recalibration_sets_the_statistics_the_validation_split_measures(cnn_spec_and_data):
    spec, dataset = cnn_spec_and_data
    torch.manual_seed(0)
    tensors = {k: v.clone() for k, v in build_model(spec).state_dict().items()}
    tensors["features.1.running_mean"].fill_(5.0)  # stale statistics, as after averaging
    val = dataset / "val.parquet"
    updated, done = recalibrate_batchnorm(tensors, spec, val, batch_size=100_000)  # one batch
    assert done == {"batchnorm_layers": 2, "rows": 179, "batch_size": 100_000}
    # By hand: the first conv's outputs over the whole split, per channel.
    images, _ = load_table(val)
    conv = torch.nn.functional.conv2d(
        images, tensors["features.0.weight"], tensors["features.0.bias"], padding=1
    )
    torch.testing.assert_close(
        updated["features.1.running_mean"], conv.mean(dim=(0, 2, 3)), rtol=1e-4, atol=1e-5
    )
    torch.testing.assert_close(
        updated["features.1.running_var"], conv.var(dim=(0, 2, 3), unbiased=True), rtol=1e-4, atol=1e-5
    )
    # Only the statistics change; the weights are untouched.
    for name, tensor in tensors.items():
        if not name.endswith(("running_mean", "running_var", "num_batches_tracked")):
            assert torch.equal(updated[name], tensor), name


def test_recalibration_leaves_a_model_without_batchnorm_as_it_is(digits_dataset):
    spec = model_spec("mlp", {"hidden_sizes": [8]}, [], read_dataset_info(digits_dataset))
    tensors = build_model(spec).state_dict()
    updated, done = recalibrate_batchnorm(tensors, spec, digits_dataset / "val.parquet", 64)
    assert done["batchnorm_layers"] == 0 and updated is tensors
