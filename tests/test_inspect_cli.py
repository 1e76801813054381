"""Every colibri-inspect command through typer's test runner: output, --json and exit codes."""

from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest
from colibri_inspect.cli import app
from inspect_containers import EXPERTS, LAYERS, build_container, manifest, write_manifest, write_usage
from typer.testing import CliRunner

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def c(tmp_path_factory):
    path = build_container(tmp_path_factory.mktemp("cli") / "c")
    counts = np.arange(LAYERS * EXPERTS, dtype=np.float32).reshape(LAYERS, EXPERTS)
    write_usage(path, counts, turns=7)
    return path


def test_info_text_and_json(c):
    r = run("info", c)
    assert r.exit_code == 0, r.output
    for text in ("family qwen3_moe", "format v1", "3 layers, hidden 64", "4 routed per layer, top-2", "KiB",
                 "tokenizer.json", "tiny/qwen3-moe @ abc123", "7 turns"):
        assert text in r.output, text
    data = json.loads(run("info", c, "--json").output)
    assert data["dims"]["num_experts"] == 4 and data["dims"]["experts_per_token"] == 2
    assert data["sizes"]["bytes_per_expert"] == 4352 and data["sizes"]["experts"] == 45056 * 2 + 20480
    assert data["format_version"] == 1 and data["tokenizer"] == "tokenizer.json"


def test_info_on_a_broken_container_exits_1(tmp_path):
    r = run("info", tmp_path)
    assert r.exit_code == 1 and "colibri-inspect verify" in r.output


def test_verify_sound_and_broken(c, tmp_path):
    r = run("verify", c, "--deep")
    assert r.exit_code == 0, r.output
    assert "sound" in r.output and "12 expert records" in r.output and "GB/s" in r.output
    bad = tmp_path / "bad"
    shutil.copytree(c, bad)
    (bad / "experts-00003.colx").unlink()
    m = manifest(bad)
    m["files"]["resident-00001.safetensors"]["sha256"] = "f" * 64
    write_manifest(bad, m)
    r = run("verify", bad)
    assert r.exit_code == 1 and "[file-missing]" in r.output and "NOT sound" in r.output
    assert "[file-sha256]" not in r.output  # fast verify does not hash
    r = run("verify", bad, "--deep", "--json")
    assert r.exit_code == 1
    data = json.loads(r.output)
    assert not data["ok"] and {"file-missing", "expert-missing", "file-sha256"} <= {f["code"] for f in data["findings"]}


def test_mirror_stage_and_verify(c, tmp_path):
    full, hot = tmp_path / "full", tmp_path / "hot"
    r = run("mirror", "stage", c, full)
    assert r.exit_code == 0 and "files copied" in r.output, r.output
    r = run("mirror", "stage", c, full)
    assert "0 files copied" in r.output and "already present and verified" in r.output
    r = run("mirror", "stage", c, hot, "--hot-only", "0.00005")
    assert r.exit_code == 0, r.output
    r = run("mirror", "verify", c, full, hot)
    assert r.exit_code == 0, r.output
    assert "full" in r.output and "partial" in r.output and "missing" in r.output
    p = full / "experts-00001.colx"
    raw = bytearray(p.read_bytes())
    raw[-1] ^= 1
    p.write_bytes(bytes(raw))
    r = run("mirror", "verify", c, full, "--json")
    assert r.exit_code == 1
    data = json.loads(r.output)
    assert data["mirrors"][0]["status"] == "corrupt"


def test_plan_text_and_json(c):
    r = run("plan", c, "--ram", "1.2", "--disk-gbps", "3", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["all_experts_fit"] and data["tokens_per_s"] is None and data["hit_rate"] == 1.0
    assert data["pinned"] == 6  # half of the 12 slots, from .coli_usage
    assert data["pinned_hottest"][0] == [2, 3]  # the hottest count is the last cell
    r = run("plan", c, "--ram", "1.2", "--disk-gbps", "3")
    assert "every expert fits" in r.output and "not disk-bound" in r.output
    # Too little RAM: the dense part does not fit (0.2 GB < 256 MiB of working memory), every expert from disk.
    r = run("plan", c, "--ram", "0.2", "--disk-gbps", "1", "--json")
    data = json.loads(r.output)
    assert not data["dense_fits"] and data["slots"] == 0
    assert data["tokens_per_s"] == pytest.approx(1e9 / (2 * 3 * 4352), rel=1e-3)


def test_doctor(c, tmp_path):
    r = run("doctor", c, "--json", "--probe-mb", "1")
    data = json.loads(r.output)
    names = [ch["name"] for ch in data["checks"]]
    assert names[:3] == ["container", "memory", "drive"]
    assert {"o_direct", "numba", "tokenizer", "family"} <= set(names)
    assert r.exit_code == (0 if data["ready"] else 1)
    assert all(ch["advice"] for ch in data["checks"] if ch["status"] == "fail")
    r = run("doctor", c, "--probe-mb", "1")
    assert "numba" in r.output and ("ready" in r.output)
    notok = tmp_path / "nt"
    shutil.copytree(c, notok)
    m = manifest(notok)
    m["format_version"] = 7
    write_manifest(notok, m)
    r = run("doctor", notok)
    assert r.exit_code == 1 and "FAIL" in r.output and "colibri-inspect verify" in r.output


def test_usage_heatmap_and_table(c, tmp_path):
    png = tmp_path / "heat.png"
    r = run("usage", c, "--png", png, "--top", "3")
    assert r.exit_code == 0, r.output
    assert "7 turns" in r.output and "hottest" in r.output
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width % EXPERTS == 0 and height % LAYERS == 0 and width // EXPERTS == height // LAYERS
    d = json.loads(run("usage", c, "--json", "--top", "2").output)
    assert [(h["layer"], h["expert"]) for h in d["hottest"]] == [(2, 3), (2, 2)]


def test_usage_without_history_exits_1(tmp_path):
    c = build_container(tmp_path / "c")
    r = run("usage", c)
    assert r.exit_code == 1 and "no usage history" in r.output
