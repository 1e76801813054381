"""verify: a sound container passes; each adversarial container is reported with the right problem named, and a
container with several problems gets all of them reported."""

from __future__ import annotations

import json
import shutil
import struct
from dataclasses import replace

import numpy as np
import pytest
from colibri_inspect.verify import verify_container
from inspect_containers import (
    build_container,
    index_entries,
    manifest,
    rewrite_index,
    set_file_entry,
    write_manifest,
)

from colibri_format.reader import Container


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_container(tmp_path_factory.mktemp("base") / "c")


@pytest.fixture
def c(base, tmp_path):
    dst = tmp_path / "c"
    shutil.copytree(base, dst)
    return dst


def codes(path, deep=True):
    return verify_container(path, deep=deep).codes


def test_sound_container_passes_fast_and_deep(base):
    for deep in (False, True):
        r = verify_container(base, deep=deep)
        assert r.ok and not r.findings, r.findings
        assert r.records_checked == 12 and r.tensors_checked == 15
    r = verify_container(base, deep=True)
    assert r.bytes_read == sum(p.stat().st_size for p in base.iterdir() if p.name != "colibri.json")


def test_truncated_data_file(c):
    p = c / "experts-00002.colx"
    p.write_bytes(p.read_bytes()[:-5000])
    got = codes(c)
    assert {"file-size", "index-bounds", "file-sha256", "expert-missing"} <= got


def test_flipped_byte_in_a_record_fails_its_crc(c):
    loc = Container.open(c).record_location(1, 2)
    raw = bytearray((c / loc.file).read_bytes())
    raw[loc.offset + 100] ^= 0x40
    (c / loc.file).write_bytes(bytes(raw))
    assert verify_container(c, deep=False).ok  # headers and sizes are intact: only the payload is wrong
    r = verify_container(c, deep=True)
    crc = [f for f in r.findings if f.code == "record-crc"]
    assert len(crc) == 1 and "(1, 2)" in crc[0].message and crc[0].file == loc.file
    assert "file-sha256" in r.codes


def test_overlapping_records(c):
    entries = index_entries(c)
    a = next(e for e in entries if (e.layer, e.expert) == (0, 0))
    b = next(e for e in entries if (e.layer, e.expert) == (0, 1))
    assert a.file == b.file
    entries = [replace(e, offset=a.offset) if e is b else e for e in entries]
    rewrite_index(c, entries)
    r = verify_container(c, deep=True)
    assert "index-overlap" in r.codes
    assert any("(0, 0)" in f.message and "(0, 1)" in f.message for f in r.findings if f.code == "index-overlap")


def test_index_entry_past_the_end_of_its_file(c):
    entries = index_entries(c)
    last = max((e for e in entries if e.file == "experts-00003.colx"), key=lambda e: e.offset)
    size = (c / last.file).stat().st_size
    entries = [replace(e, offset=size) if e is last else e for e in entries]
    rewrite_index(c, entries)
    r = verify_container(c, deep=False)
    bounds = [f for f in r.findings if f.code == "index-bounds"]
    assert len(bounds) == 1 and "past the end" in bounds[0].message


def test_manifest_from_a_future_version(c):
    m = manifest(c)
    m["format_version"] = 99
    write_manifest(c, m)
    r = verify_container(c, deep=True)
    assert [f.code for f in r.findings] == ["manifest-version"]
    assert "upgrade Colibri" in r.findings[0].message


def test_path_traversal_file_name_in_the_manifest(c):
    m = manifest(c)
    m["files"]["../../etc/passwd"] = {"role": "verbatim", "size": 10, "sha256": "0" * 64}
    m["files"]["sub/dir.json"] = {"role": "verbatim", "size": 10, "sha256": "0" * 64}
    write_manifest(c, m, refingerprint=False)
    r = verify_container(c, deep=True)
    unsafe = [f for f in r.findings if f.code == "unsafe-name"]
    assert len(unsafe) == 2 and "path traversal" in unsafe[0].message
    assert "file-missing" not in r.codes  # never looked outside the container


def test_absurdly_large_safetensors_header(c):
    p = c / "resident-00001.safetensors"
    raw = bytearray(p.read_bytes())
    raw[:8] = struct.pack("<Q", 1 << 40)
    p.write_bytes(bytes(raw))
    set_file_entry(c, p.name)  # the manifest agrees with the bytes: only the header is hostile
    r = verify_container(c, deep=True)
    assert [f.code for f in r.findings] == ["safetensors-header"]
    assert "exceeds" in r.findings[0].message


def test_wrong_sha256_in_the_manifest(c):
    m = manifest(c)
    m["files"]["experts-00001.colx"]["sha256"] = "0" * 64
    write_manifest(c, m)
    assert verify_container(c, deep=False).ok
    r = verify_container(c, deep=True)
    assert [(f.code, f.file) for f in r.findings] == [("file-sha256", "experts-00001.colx")]


def test_missing_file(c):
    (c / "experts-00003.colx").unlink()
    r = verify_container(c, deep=True)
    assert {"file-missing", "expert-missing"} <= r.codes
    assert any(f.file == "experts-00003.colx" for f in r.findings if f.code == "file-missing")


def test_nan_scales_in_a_tensor_and_an_expert(tmp_path):
    c = build_container(tmp_path / "nan", nan_tensor="model.layers.0.self_attn.k_proj.weight", nan_expert=(2, 3))
    assert verify_container(c, deep=False).ok
    r = verify_container(c, deep=True)
    bad = [f for f in r.findings if f.code == "non-finite"]
    assert len(bad) == 2
    assert any("k_proj.weight.scales" in f.message for f in bad)
    assert any("expert (2, 3) up scales" in f.message for f in bad)


def test_hole_after_the_last_record_and_duplicate_rows(c):
    p = c / "experts-00001.colx"
    p.write_bytes(p.read_bytes() + b"\0" * 8192)
    set_file_entry(c, p.name)
    entries = index_entries(c)
    entries.append(replace(entries[0]))
    rewrite_index(c, entries)
    r = verify_container(c, deep=True)
    assert {"index-hole", "index-duplicate"} <= r.codes
    assert not r.ok


def test_hole_between_records(c):
    entries = index_entries(c)
    e = next(x for x in entries if (x.layer, x.expert) == (0, 0))
    entries = [x for x in entries if x is not e]
    rewrite_index(c, entries)
    r = verify_container(c, deep=False)
    assert "index-hole" in r.codes and "expert-missing" in r.codes


def test_every_problem_is_reported_not_only_the_first(c):
    loc = Container.open(c).record_location(0, 1)
    (c / "experts-00003.colx").unlink()
    raw = bytearray((c / loc.file).read_bytes())
    raw[loc.offset + 7] ^= 1
    (c / loc.file).write_bytes(bytes(raw))
    p = c / "resident-00001.safetensors"
    p.write_bytes(p.read_bytes()[:-100])
    r = verify_container(c, deep=True)
    assert {"file-missing", "record-crc", "file-size", "safetensors-header", "file-sha256"} <= r.codes


def test_shapes_against_the_config(c):
    cfg = json.loads((c / "config.json").read_text())
    cfg["hidden_size"] = 128
    cfg["num_experts"] = 5
    data = (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()
    (c / "config.json").write_bytes(data)
    set_file_entry(c, "config.json")
    r = verify_container(c, deep=False)
    assert {"tensor-shape", "expert-shape", "expert-layers"} <= r.codes
    assert any("embed_tokens" in f.message for f in r.findings if f.code == "tensor-shape")


def test_unlisted_files_are_warnings_only(c):
    (c / "experts-00009.colx.partial").write_bytes(b"x")
    (c / ".coli_usage").write_bytes(b"ignored")
    r = verify_container(c, deep=False)
    assert r.ok and [f.code for f in r.findings] == ["unlisted-file"]


def test_deep_verify_reads_large_records_across_chunks(tmp_path):
    c = build_container(tmp_path / "c", nan_expert=(1, 1))
    # Records, scales and tensors straddle chunk boundaries at odd offsets.
    r = verify_container(c, deep=True, chunk_bytes=4096 + 37)
    assert [f.code for f in r.findings] == ["non-finite"]
    assert np.isfinite(r.read_seconds)


def test_crc_only_deep_verify_still_names_corrupt_records(c):
    loc = Container.open(c).record_location(2, 0)
    raw = bytearray((c / loc.file).read_bytes())
    raw[loc.offset + 3] ^= 0x10
    (c / loc.file).write_bytes(bytes(raw))
    r = verify_container(c, deep=True, crc_only=True)
    assert [f.code for f in r.findings] == ["record-crc"]  # no sha256 of expert data files in this mode
    m = manifest(c)
    m["files"]["resident-00001.safetensors"]["sha256"] = "0" * 64
    write_manifest(c, m)
    assert {"record-crc", "file-sha256"} <= verify_container(c, deep=True, crc_only=True).codes
