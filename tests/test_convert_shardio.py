"""The shard reader hands out every tensor of a shard exactly as stored and hashes the whole file, with O_DIRECT reads
and with plain ones, through recycled batch buffers and buffers of their own for large tensors."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from colibri_convert import shardio
from colibri_format.safetensors_io import SafetensorsFile, read_header, write_arrays


@pytest.mark.parametrize("direct", [True, False])
def test_reader_yields_every_tensor_and_hashes_the_file(tmp_path, monkeypatch, direct):
    rng = np.random.default_rng(0)
    arrays = [(f"t{i:03d}", "BF16", rng.integers(0, 2**16, size=(int(rng.integers(1, 40)), 33), dtype=np.uint16))
              for i in range(120)]
    arrays.append(("big", "F32", rng.standard_normal((300, 70)).astype(np.float32)))
    arrays.append(("empty", "F32", np.zeros((0, 4), dtype=np.float32)))
    path = tmp_path / "shard.safetensors"
    write_arrays(path, arrays)
    if not direct:
        monkeypatch.setattr(shardio.ShardReader, "_open_direct", lambda self: None)
    monkeypatch.setattr(shardio, "RING_BUFFERS", 3)
    reader = shardio.ShardReader(path, read_header(path), batch_bytes=20_000, depth=1)
    seen = {}
    try:
        for entry, array in reader:
            seen[entry.name] = np.array(array)
        sha = reader.sha256()
    finally:
        reader.close()
    assert sha == hashlib.sha256(path.read_bytes()).hexdigest()
    sf = SafetensorsFile(path)
    try:
        assert sorted(seen) == sf.names
        for name in sf.names:
            np.testing.assert_array_equal(seen[name], sf.array(name))
    finally:
        sf.close()
