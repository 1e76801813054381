"""Golden bytes: a tiny v1 container built from fixed inputs must equal the committed one, byte for byte.

A failure here means the on-disk format changed: change specs/, colibri_format/constants.py and the golden files
(`python tests/golden/make_golden.py`) together, and bump the format version if the change is structural.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from colibri_format.quant import dequantize, quantize_reference
from colibri_format.reader import Container

sys.path.insert(0, str(Path(__file__).parent / "golden"))
import make_golden


def _manifest_without_writer(path: Path) -> dict:
    manifest = json.loads(path.read_text())
    manifest.pop("writer")  # the writing tool's version may change without a format change
    return manifest


def test_tiny_container_bytes_match_golden(tmp_path):
    built = make_golden.build(tmp_path / "tiny")
    golden = make_golden.GOLDEN_DIR
    assert sorted(p.name for p in built.iterdir()) == sorted(p.name for p in golden.iterdir())
    for path in sorted(golden.iterdir()):
        if path.name == "colibri.json":
            assert _manifest_without_writer(built / path.name) == _manifest_without_writer(path)
        else:
            assert (built / path.name).read_bytes() == path.read_bytes(), f"{path.name} differs from the golden copy"


def test_golden_container_reads_back_the_fixed_inputs():
    h, i = make_golden.CONFIG["hidden_size"], make_golden.CONFIG["moe_intermediate_size"]
    with Container.open(make_golden.GOLDEN_DIR) as c:
        assert c.family == "qwen3_moe"
        assert c.expert_layers == [0, 1] and c.num_experts == 2
        emb = c.tensor("model.embed_tokens.weight")
        expected = quantize_reference(make_golden._values(1, (16, h)), "int8_gs64")
        np.testing.assert_array_equal(np.asarray(emb.data), expected.data)
        np.testing.assert_array_equal(dequantize(emb), dequantize(expected))
        rec = c.expert(1, 1)
        gate = quantize_reference(make_golden._values(111, (i, h)), "int4_gs64")
        np.testing.assert_array_equal(np.asarray(rec.gate.data), gate.data)
        np.testing.assert_array_equal(np.asarray(rec.gate.scales), gate.scales)
        assert rec.down.shape == (h, i)
        mtp = c.tensor("model.layers.2.eh_proj.weight")
        assert mtp.encoding == "bf16" and c.tensor_names("mtp") == ["model.layers.2.eh_proj.weight"]
        for layer, expert, _ in c.iter_records():
            c.verify_record(layer, expert)


def test_expert_file_header_bytes():
    head = (make_golden.GOLDEN_DIR / "experts-00001.colx").read_bytes()[:4096]
    assert head[:8] == b"COLIBRIX"
    assert head[8:24] == (1).to_bytes(4, "little") + (4096).to_bytes(4, "little") + (4096).to_bytes(4, "little") + (
        64
    ).to_bytes(4, "little")
    assert head[24:] == b"\0" * (4096 - 24)
