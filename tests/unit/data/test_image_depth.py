"""Image bit depth converted faithfully (issue 54): a 16-bit grayscale PNG is scaled by 65535, not clipped
at 255 (which turned 97 % of such pixels into 1.0); 32-bit pixels are refused in one line."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from shardfuse.data.sources.images import decode_images
from shardfuse.io import UserError

SPEC = {"source": "image_folder", "image_size": [8, 8], "mode": "L", "on_bad_image": "error"}


def png(array: np.ndarray, mode: str | None = None) -> bytes:
    buffer = io.BytesIO()
    (Image.fromarray(array, mode) if mode else Image.fromarray(array)).save(buffer, "PNG")
    return buffer.getvalue()


def decoded(source: bytes, mode: str = "L") -> np.ndarray:
    channels = 1 if mode == "L" else 3
    out = np.empty((1, channels, 8, 8), dtype=np.float32)
    assert decode_images([source], {**SPEC, "mode": mode}, out, lambda index: "x.png").all()
    return out[0]


def test_a_16_bit_gray_png_keeps_its_range_in_l_and_rgb():
    ramp = np.linspace(0, 65535, 64).astype(np.uint16).reshape(8, 8)
    source = png(ramp)
    assert Image.open(io.BytesIO(source)).mode == "I;16"
    gray = decoded(source)
    np.testing.assert_allclose(gray[0], ramp / 65535, atol=1e-6)  # same size: no resampling
    assert np.count_nonzero(gray == 1.0) == 1  # only the brightest pixel, not 97 % of them
    rgb = decoded(source, "RGB")
    assert rgb.shape == (3, 8, 8) and all(np.array_equal(rgb[c], gray[0]) for c in range(3))


def test_an_8_bit_png_is_read_as_before():
    ramp = np.arange(64, dtype=np.uint8).reshape(8, 8) * 4
    np.testing.assert_array_equal(decoded(png(ramp))[0], ramp.astype(np.float32) / np.float32(255))


def test_32_bit_pixels_are_refused_in_one_line():
    source = io.BytesIO()
    Image.fromarray(np.zeros((8, 8), dtype=np.int32), "I").save(source, "TIFF")
    with pytest.raises(
        UserError, match=r"^image x\.png has 32-bit integer pixels, which shardfuse does not scale"
    ):
        decoded(source.getvalue())
