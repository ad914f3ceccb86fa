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


def test_an_npz_whose_header_claims_more_than_the_archive_holds_is_one_line(tmp_path):
    """A crafted or damaged .npy header in an npz (a 954 GiB shape in a 200-byte member): refused from the
    header, before numpy allocates it."""
    import zipfile

    from shardfuse.data.sources.images import _read_npz

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": (256000000, 1000)}
    )
    labels = io.BytesIO()
    np.save(labels, np.arange(10) % 2)
    path = tmp_path / "bad.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("features.npy", header.getvalue() + bytes(64))
        archive.writestr("labels.npy", labels.getvalue())
    with pytest.raises(UserError) as refused:
        _read_npz({"path": str(path), "features_key": "features", "labels_key": "labels"})
    assert str(refused.value) == (
        f"array 'features' in {path} claims shape [256000000, 1000] of float32 (954 GiB) but the archive "
        "holds 192 bytes for it: the file is damaged; re-save it with np.savez"
    )
