"""Writer state machine, round trips, and the adversarial folder: every hostile container is refused with a clear
error; none crashes the reader or hangs it."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from colibri_format.errors import ColibriError, FormatError, IntegrityError, VersionError, WriterStateError
from colibri_format.quant import dequantize, quantize
from colibri_format.reader import Container
from colibri_format.writer import ContainerWriter, IndexEntry, write_index

sys.path.insert(0, str(Path(__file__).parent / "golden"))
import make_golden

GOLDEN = make_golden.GOLDEN_DIR


@pytest.fixture
def container(tmp_path) -> Path:
    dst = tmp_path / "c"
    shutil.copytree(GOLDEN, dst)
    return dst


def _manifest(path: Path) -> dict:
    return json.loads((path / "colibri.json").read_text())


def _write_manifest(path: Path, manifest: dict) -> None:
    (path / "colibri.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))


def _rewrite_index(path: Path, mutate) -> None:
    with Container.open(path) as c:
        entries = [
            IndexEntry(layer, expert, loc.file, loc.offset, loc.length, loc.crc32, ("int4_gs64",) * 3)
            for layer, expert, loc in c.iter_records()
        ]
    entries = mutate(entries)
    info = write_index(path / "experts.arrow", entries)
    manifest = _manifest(path)
    manifest["files"]["experts.arrow"].update(size=info.size, sha256=info.sha256)
    manifest["experts"]["records"] = len(entries)
    _write_manifest(path, manifest)


# --- round trips and the writer -------------------------------------------------------------------------------


def test_round_trip_every_encoding(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {f"t.{enc}": (rng.standard_normal((5, 70)).astype(np.float32), enc)
               for enc in ("int4_gs64", "int8_gs64", "f32", "f16", "bf16")}
    w = ContainerWriter(tmp_path / "rt", family="olmoe", config={"model_type": "olmoe"})
    for name, (x, enc) in tensors.items():
        w.add_tensor(name, quantize(x, enc))
    experts = {}
    for layer in (0, 3):
        for e in range(3):
            parts = {p: quantize(rng.standard_normal(s).astype(np.float32), enc) for p, s, enc in
                     (("gate", (40, 70), "int4_gs64"), ("up", (40, 70), "int8_gs64"), ("down", (70, 40), "f16"))}
            experts[(layer, e)] = parts
            w.add_expert(layer, e, **parts)
    path = w.finish()
    assert not any(p.name.startswith(".rt.tmp") for p in tmp_path.iterdir())
    with Container.open(path) as c:
        for name, (x, enc) in tensors.items():
            np.testing.assert_array_equal(c.tensor(name).dequantize(), quantize(x, enc).dequantize())
        assert c.expert_layers == [0, 3]
        for (layer, e), parts in experts.items():
            rec = c.expert(layer, e)
            for p in ("gate", "up", "down"):
                np.testing.assert_array_equal(dequantize(getattr(rec, p)), dequantize(parts[p]))
            loc = c.record_location(layer, e)
            assert loc.offset % 4096 == 0
            buf = bytearray(loc.padded_length)
            with open(loc.path, "rb") as f:
                f.seek(loc.offset)
                f.readinto(buf)
            np.testing.assert_array_equal(dequantize(c.decode_record(buf, layer, e).down), dequantize(parts["down"]))


def test_writer_refuses_out_of_order_and_duplicate_calls(tmp_path):
    g = quantize(np.ones((8, 64), np.float32), "int4_gs64")
    d = quantize(np.ones((64, 8), np.float32), "int4_gs64")
    w = ContainerWriter(tmp_path / "w", family="olmoe", config={})
    w.add_tensor("a", g)
    with pytest.raises(WriterStateError, match="added twice"):
        w.add_tensor("a", g)
    w.add_expert(0, 0, gate=g, up=g, down=d)
    with pytest.raises(WriterStateError, match="added twice"):
        w.add_expert(0, 0, gate=g, up=g, down=d)
    with pytest.raises(WriterStateError, match="shapes"):
        w.add_expert(0, 1, gate=d, up=d, down=g)
    with pytest.raises(WriterStateError, match="unknown tensor group"):
        w.add_tensor("b", g, group="elsewhere")
    w.finish()
    for call in (lambda: w.add_tensor("c", g), lambda: w.add_expert(1, 0, gate=g, up=g, down=d), w.finish):
        with pytest.raises(WriterStateError, match="finished"):
            call()


def test_a_crash_mid_write_leaves_nothing_that_looks_like_a_container(tmp_path):
    g = quantize(np.ones((8, 64), np.float32), "int4_gs64")
    with pytest.raises(RuntimeError), ContainerWriter(tmp_path / "crash", family="olmoe", config={}) as w:
        w.add_tensor("a", g)
        raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []


def test_writer_refuses_a_non_empty_target(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(WriterStateError, match="not empty"):
        ContainerWriter(tmp_path / "full", family="olmoe", config={})


# --- the adversarial folder -----------------------------------------------------------------------------------


def test_truncated_data_file(container):
    p = container / "experts-00001.colx"
    p.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(FormatError, match="truncated"):
        Container.open(container)


def test_flipped_byte_in_a_record_fails_its_checksum(container):
    with Container.open(container) as c:
        loc = c.record_location(1, 0)
    data = bytearray((container / loc.file).read_bytes())
    data[loc.offset + 100] ^= 0x01
    (container / loc.file).write_bytes(bytes(data))
    with Container.open(container) as c:  # sizes are intact: the cheap checks pass
        c.verify_record(0, 0)
        with pytest.raises(IntegrityError, match=r"\(1, 0\)"):
            c.verify_record(1, 0)


def test_overlapping_records(container):
    def overlap(entries):
        e = entries[1]
        entries[1] = IndexEntry(e.layer, e.expert, e.file, entries[0].offset, e.length, e.crc32, e.encodings)
        return entries

    _rewrite_index(container, overlap)
    with pytest.raises(FormatError, match="overlap"):
        Container.open(container)


def test_index_entry_past_the_end_of_its_file(container):
    def past_end(entries):
        e = entries[-1]
        entries[-1] = IndexEntry(e.layer, e.expert, e.file, e.offset + 8192, e.length, e.crc32, e.encodings)
        return entries

    _rewrite_index(container, past_end)
    with pytest.raises(FormatError, match="past the end"):
        Container.open(container)


def test_misaligned_and_duplicate_index_rows(container, tmp_path):
    other = tmp_path / "dup"
    shutil.copytree(container, other)

    def misalign(entries):
        e = entries[0]
        entries[0] = IndexEntry(e.layer, e.expert, e.file, e.offset + 64, e.length, e.crc32, e.encodings)
        return entries

    _rewrite_index(container, misalign)
    with pytest.raises(FormatError, match="aligned"):
        Container.open(container)
    _rewrite_index(other, lambda entries: entries + [entries[0]])
    with pytest.raises(FormatError, match="duplicate"):
        Container.open(other)


def test_manifest_from_a_future_version(container):
    manifest = _manifest(container)
    manifest["format_version"] = 2
    _write_manifest(container, manifest)
    with pytest.raises(VersionError, match="upgrade"):
        Container.open(container)


@pytest.mark.parametrize("name", ["../escape.colx", "/etc/passwd", "sub/dir.colx", "..", ".hidden", "a\0b"])
def test_path_traversal_in_a_file_name(container, name):
    manifest = _manifest(container)
    manifest["files"][name] = manifest["files"].pop("experts-00001.colx")
    _write_manifest(container, manifest)
    with pytest.raises(FormatError, match="not a plain file name"):
        Container.open(container)


def test_absurdly_large_safetensors_header(container):
    p = container / "resident-00001.safetensors"
    data = bytearray(p.read_bytes())
    data[:8] = struct.pack("<Q", 2**62)
    p.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="exceeds"):
        Container.open(container)


def test_safetensors_with_a_hole(container):
    p = container / "mtp-00001.safetensors"
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin + 2, end + 2]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    new = struct.pack("<Q", len(text)) + text + raw[8 + n :] + b"\0\0"
    p.write_bytes(new)
    manifest = _manifest(container)
    manifest["files"][p.name]["size"] = len(new)
    _write_manifest(container, manifest)
    with pytest.raises(FormatError, match="hole"):
        Container.open(container)


def test_index_corrupted_on_disk(container):
    p = container / "experts.arrow"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="index is corrupt"):
        Container.open(container)


def test_duplicate_keys_and_garbage_manifests(container):
    (container / "colibri.json").write_text('{"format": "colibri", "format": "colibri"}')
    with pytest.raises(FormatError, match="duplicate key"):
        Container.open(container)
    (container / "colibri.json").write_bytes(b"\xff\xfe garbage")
    with pytest.raises(FormatError, match="not valid JSON"):
        Container.open(container)
    (container / "colibri.json").unlink()
    with pytest.raises(FormatError, match="no colibri.json"):
        Container.open(container)


def test_random_mutations_never_crash_the_reader(container, tmp_path):
    """Flip random bytes of every metadata-bearing file (re-signing the index so its parser is exercised too):
    opening must either succeed or raise a ColibriError, never anything else."""
    rng = np.random.default_rng(7)
    targets = ["colibri.json", "experts.arrow", "resident-00001.safetensors", "mtp-00001.safetensors", "config.json"]
    for trial in range(120):
        case = tmp_path / f"m{trial}"
        shutil.copytree(container, case)
        target = case / targets[trial % len(targets)]
        data = bytearray(target.read_bytes())
        limit = min(len(data), 600)
        for _ in range(int(rng.integers(1, 4))):
            data[int(rng.integers(0, limit))] = int(rng.integers(0, 256))
        target.write_bytes(bytes(data))
        if target.name == "experts.arrow":
            manifest = _manifest(case)
            manifest["files"]["experts.arrow"]["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
            _write_manifest(case, manifest)
        try:
            with Container.open(case) as c:
                for layer, expert, _ in c.iter_records():
                    c.expert(layer, expert)
        except ColibriError:
            pass
        shutil.rmtree(case)
