"""The README's image and text examples (CNN on digit images, byte-level transformer on the standard
library), run exactly as it shows them, one after the other in a copy of the checkout. A module of its
own so that the test workers run it beside the tabular examples (tests/slow/test_examples.py)."""

from __future__ import annotations

import pytest

from tests.support.helpers import checkout_copy, run_readme_examples

# Two whole experiments in one fixture: about 5.5 min on a 2-core machine shared with the other worker.
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def examples(tmp_path_factory) -> dict:
    checkout = checkout_copy(tmp_path_factory.mktemp("checkout"))
    return run_readme_examples(checkout, "examples-kinds")


def test_the_image_and_text_examples_of_the_readme_run_and_learn(examples):
    assert {"digits_cnn", "stdlib_lm"} <= set(examples)
    cnn = examples["digits_cnn"]
    assert float(cnn["cnn_ddp"]["test_accuracy_merged"]) > 0.9
    assert float(cnn["cnn_soup"]["test_accuracy_merged"]) > 0.7
    language = examples["stdlib_lm"]
    for run in ("lm_ddp", "lm_localsgd", "lm_soup"):
        # Bytes are 8 bits; an untrained model is near log2(256) = 8 bits, a trained one well below.
        assert float(language[run]["test_bits_per_byte_merged"]) < 4.5
        # Synchronised training halves the initial loss; a soup of independently trained transformers
        # loses part of that (README figures).
        bound = 0.6 if run == "lm_soup" else 0.5
        assert float(language[run]["test_loss_merged"]) < float(language[run]["test_loss_base"]) * bound
