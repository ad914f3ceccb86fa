"""The checkpoint checksum helpers: BLAKE3 and sha256 against published test vectors, and streamed
hashing (file_digests, the safetensors reader) equal to one-shot hashing."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from shardfuse.checkpoints.stream import SafetensorsReader, SafetensorsWriter
from shardfuse.io import HASH_ALGORITHMS, file_digests, new_hash

# BLAKE3 of b"" and b"abc" (the BLAKE3 specification's reference implementation); sha256 from FIPS 180-2.
VECTORS = {
    ("blake3", b""): "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262",
    ("blake3", b"abc"): "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85",
    ("sha256", b""): "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    ("sha256", b"abc"): "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
}


@pytest.mark.parametrize(("algorithm", "data"), list(VECTORS))
def test_hashers_match_the_published_test_vectors(algorithm, data, tmp_path):
    hasher = new_hash(algorithm)
    hasher.update(data)
    assert hasher.hexdigest() == VECTORS[algorithm, data]
    path = tmp_path / "f"
    path.write_bytes(data)
    assert file_digests(path, (algorithm,)) == {algorithm: VECTORS[algorithm, data]}


def test_an_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match="unknown hash algorithm 'md5'"):
        new_hash("md5")


def test_file_digests_over_many_chunks_equal_one_shot_hashes(tmp_path):
    data = np.random.default_rng(0).bytes(3 * 1024 * 1024 + 17)  # several BLAKE3 chunks and reads
    path = tmp_path / "f"
    path.write_bytes(data)
    expected = {}
    for algorithm in HASH_ALGORITHMS:
        hasher = new_hash(algorithm)
        hasher.update(data)
        expected[algorithm] = hasher.hexdigest()
    assert expected["sha256"] == hashlib.sha256(data).hexdigest()
    assert file_digests(path, chunk_size=1 << 16) == expected == file_digests(path)


@pytest.mark.parametrize("algorithm", HASH_ALGORITHMS)
def test_the_reader_hashes_what_it_streams_with_either_algorithm(algorithm, tmp_path):
    path = tmp_path / "m.safetensors"
    values = np.arange(10_000, dtype=np.float32)
    writer = SafetensorsWriter(path, {"a": ("F32", [10_000]), "b": ("F32", [3])})
    writer.write("a", values.view(np.uint8))
    writer.write("b", values[:3].view(np.uint8))
    writer.close()
    with SafetensorsReader(path, hash_algorithm=algorithm) as reader:
        buffer = np.empty(40_000, dtype=np.uint8)
        info = reader.tensors["a"]
        for start in range(0, 10_000, 999):  # streamed in file order, the way the engine reads
            reader.read_into(info, start, min(999, 10_000 - start), buffer)
        assert reader.hexdigest() == file_digests(path, (algorithm,))[algorithm]
