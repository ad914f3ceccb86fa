"""The built-in cnn and transformer, built through the registry as every stage builds them (fast tier)."""

from __future__ import annotations

import pytest
import torch

from shardfuse.checkpoints.weights import load_weights, save_weights
from shardfuse.io import UserError
from shardfuse.models.registry import build_model, check_output_shape, set_data_stats
from shardfuse.models.spec import model_spec

IMAGE_INFO = {
    "task": "classification",
    "num_features": 64,
    "num_classes": 10,
    "label_names": [str(digit) for digit in range(10)],
    "input": {"kind": "tensor", "shape": [1, 8, 8]},
}
IMAGE_REGRESSION_INFO = {
    **IMAGE_INFO,
    "task": "regression",
    "num_classes": 0,
    "target_names": ["brightness", "size"],
}
LM_INFO = {"task": "causal_lm", "num_features": 17, "num_classes": 0, "vocab_size": 50, "block_size": 16}
SMALL_LM = {"width": 32, "layers": 2, "heads": 4}


def built(info, ref, **model_args):
    spec = model_spec(ref, model_args, [], info)
    torch.manual_seed(0)
    return build_model(spec), spec


def tokens(rows=3, length=16, seed=1):
    return torch.randint(0, 50, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("info", "num_outputs"), [(IMAGE_INFO, 10), (IMAGE_REGRESSION_INFO, 2)])
def test_cnn_maps_images_to_one_row_of_outputs_for_classification_and_regression(info, num_outputs):
    model, spec = built(info, "cnn", channels=[4, 8, 8], dropout=0.1)
    check_output_shape(model, spec, torch.device("cpu"))
    model.eval()
    assert model(torch.randn(5, 1, 8, 8)).shape == (5, num_outputs)


def test_cnn_regression_predicts_in_the_targets_units():
    model, _ = built(IMAGE_REGRESSION_INFO, "cnn", channels=[4])
    model.eval()
    images = torch.randn(4, 1, 8, 8)
    standardised = model(images)
    set_data_stats(model, None, (torch.tensor([100.0, -3.0]), torch.tensor([10.0, 0.5])))
    expected = standardised * torch.tensor([10.0, 0.5]) + torch.tensor([100.0, -3.0])
    torch.testing.assert_close(model(images), expected)


def test_cnn_pools_only_while_the_image_can_halve():
    model, _ = built(
        {**IMAGE_INFO, "input": {"kind": "tensor", "shape": [3, 2, 2]}}, "cnn", channels=[4, 4, 4]
    )
    pools = [layer for layer in model.features if isinstance(layer, torch.nn.MaxPool2d)]
    assert len(pools) == 1
    model.eval()
    assert model(torch.randn(2, 3, 2, 2)).shape == (2, 10)


def test_cnn_state_dict_has_batchnorm_running_stats_and_an_int64_counter():
    model, _ = built(IMAGE_INFO, "cnn")
    state = model.state_dict()
    for stage in (1, 5):  # conv, bn, relu, pool | conv, bn, relu
        assert state[f"features.{stage}.running_mean"].dtype == torch.float32
        assert state[f"features.{stage}.running_var"].dtype == torch.float32
        assert state[f"features.{stage}.num_batches_tracked"].dtype == torch.int64


def test_cnn_refuses_token_inputs_in_one_line():
    with pytest.raises(UserError, match=r"^the built-in cnn takes image tensors .*tokens \[17\]") as error:
        built({**LM_INFO, "input": {"kind": "tokens", "shape": [17]}}, "cnn")
    assert "\n" not in str(error.value)
    with pytest.raises(UserError, match=r"the built-in cnn takes image tensors .* numeric"):
        built({**IMAGE_INFO, "input": {"kind": "numeric", "shape": [64]}}, "cnn")


def test_transformer_maps_tokens_to_logits_per_position():
    model, spec = built(LM_INFO, "transformer", **SMALL_LM)
    check_output_shape(model, spec, torch.device("cpu"))
    assert model(tokens()).shape == (3, 16, 50)
    assert model(tokens(length=5)).shape == (3, 5, 50)  # shorter blocks use the first positions


def test_transformer_is_causal_a_later_token_leaves_earlier_logits_unchanged():
    model, _ = built(LM_INFO, "transformer", **SMALL_LM)
    model.eval()
    first = tokens()
    changed = first.clone()
    changed[:, 10] = (changed[:, 10] + 7) % 50
    with torch.no_grad():
        before, after = model(first), model(changed)
    assert torch.equal(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_transformer_is_deterministic_on_cpu():
    first, _ = built(LM_INFO, "transformer", **SMALL_LM, dropout=0.1)
    second, _ = built(LM_INFO, "transformer", **SMALL_LM, dropout=0.1)
    outputs = []
    for model in (first, second):
        model.train()  # dropout on: the same seed must draw the same masks
        torch.manual_seed(5)
        outputs.append(model(tokens()))
    assert torch.equal(*outputs)


def test_tied_transformer_stores_the_matrix_once_and_round_trips_through_a_checkpoint(tmp_path):
    model, spec = built(LM_INFO, "transformer", **SMALL_LM)
    model.eval()
    state = model.state_dict()
    assert [name for name, t in state.items() if t.shape == (50, 32)] == ["token_embedding.weight"]
    assert not any(name.startswith("head") for name in state)
    assert len({tensor.data_ptr() for tensor in state.values()}) == len(state)  # no shared storage
    # The optimiser sees the matrix once too.
    assert sum(p.shape == (50, 32) for p in model.parameters()) == 1
    save_weights(tmp_path / "lm.safetensors", state, {"model": spec})
    tensors, metadata = load_weights(tmp_path / "lm.safetensors")
    torch.manual_seed(99)  # another initialisation: the loaded weights must replace all of it
    reloaded = build_model(metadata["model"])
    reloaded.load_state_dict(tensors)
    reloaded.eval()
    with torch.no_grad():
        assert torch.equal(model(tokens()), reloaded(tokens()))


def test_untied_transformer_has_a_separate_bias_free_head():
    model, _ = built(LM_INFO, "transformer", **SMALL_LM, tie_embeddings=False)
    state = model.state_dict()
    assert state["head.weight"].shape == (50, 32) and "head.bias" not in state
    assert not torch.equal(state["head.weight"], state["token_embedding.weight"])
    assert model(tokens()).shape == (3, 16, 50)


def test_block_size_beyond_max_positions_is_a_one_line_error():
    message = (
        "block_size 16 exceeds the model's max_positions 8; raise max_positions in model_args or "
        "lower block_size"
    )
    with pytest.raises(UserError) as error:
        built(LM_INFO, "transformer", **SMALL_LM, max_positions=8)
    assert str(error.value) == message
    model, _ = built(LM_INFO, "transformer", **SMALL_LM, max_positions=32)
    assert model.state_dict()["position_embedding.weight"].shape == (32, 32)


@pytest.mark.parametrize(
    ("info", "args", "fragment"),
    [
        (
            IMAGE_INFO,
            {},
            "the built-in transformer reads token rows but the dataset's task is classification on tensor",
        ),
        (LM_INFO, {"width": 30, "heads": 4}, "width 30 is not divisible by heads 4"),
        (LM_INFO, {"layers": 0}, "layers must be a positive integer, got 0"),
        (LM_INFO, {"dropout": 1.5}, "dropout must be a number in [0, 1)"),
    ],
)
def test_transformer_refuses_other_tasks_and_bad_args_in_one_line(info, args, fragment):
    with pytest.raises(UserError) as error:
        built(info, "transformer", **args)
    assert fragment in str(error.value) and "\n" not in str(error.value)


TEXT_CLASSES_INFO = {
    "task": "classification", "num_features": 16, "num_classes": 3, "label_names": ["a", "b", "c"],
    "vocab_size": 51, "block_size": 16, "pad_id": 50, "input": {"kind": "tokens", "shape": [16]},
}  # fmt: skip


def test_the_transformer_classifies_token_rows_from_each_rows_last_token_before_the_padding():
    model, spec = built(TEXT_CLASSES_INFO, "transformer", **SMALL_LM)
    assert (
        spec["description"]["pad_id"] == 50
        and "pad_id" not in built(LM_INFO, "transformer", **SMALL_LM)[1]["description"]
    )  # other data's specs read as before
    assert "classifier.weight" in model.state_dict() and "head.weight" not in model.state_dict()
    model.eval()
    content = tokens(rows=3, length=9)
    rows = torch.full((3, 16), 50, dtype=torch.long)
    rows[:, :9] = content
    rows[1, 5:] = 50  # row 1: 5 tokens, then padding
    with torch.no_grad():
        logits = model(rows)
        assert logits.shape == (3, 3)
        # Causal attention: the state at a row's last token never sees the padding after it, so the row
        # alone, unpadded, gives the same logits (to rounding: another length, another kernel order).
        torch.testing.assert_close(logits[1], model(rows[1:2, :5])[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(logits[0], model(rows[:1, :9])[0], rtol=1e-5, atol=1e-6)
        longer = rows[1:2, :6].clone()
        longer[0, 5] = 7  # a sixth token instead of padding: its state is read instead
        assert (logits[1] - model(longer)[0]).abs().max() > 1e-3
