"""Mirrors: full, partial (hot-only) and corrupted mirrors are told apart; staging is verified and resumable."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from colibri_inspect.facts import ContainerFacts, load_usage
from colibri_inspect.mirror import file_usage_mass, stage_mirror, verify_mirror
from colibri_inspect.verify import verify_container
from inspect_containers import EXPERTS, LAYERS, build_container, write_usage

from colibri_format.errors import ColibriError


@pytest.fixture(scope="module")
def primary(tmp_path_factory):
    c = build_container(tmp_path_factory.mktemp("primary") / "c")
    counts = np.zeros((LAYERS, EXPERTS))
    counts[0] = [40, 30, 20, 10]  # layer 0 is hot: its records live in experts-00001.colx
    counts[2] = [0, 0, 1, 1]  # in experts-00003.colx; experts-00002.colx stays cold
    write_usage(c, counts)
    return c


def hot_mass(primary):
    facts = ContainerFacts.load(primary)
    usage, _ = load_usage(facts)
    return file_usage_mass(facts.records_per_file, usage.layers, usage.counts)


def test_full_mirror_is_identical_and_verifies_as_a_container(primary, tmp_path):
    m = tmp_path / "m"
    report = stage_mirror(primary, m)
    assert "colibri.json" in report.copied and report.bytes_copied == report.bytes_planned
    r = verify_mirror(primary, m)
    assert r.status == "full" and r.ok and r.records_held == r.records_total == 12
    assert verify_container(m, deep=True).ok  # the state file is not mistaken for container data


def test_hot_only_mirror_is_partial_and_self_describing(primary, tmp_path):
    m = tmp_path / "m"
    mass = hot_mass(primary)
    assert mass["experts-00001.colx"] > mass["experts-00003.colx"] > 0 == mass["experts-00002.colx"]
    report = stage_mirror(primary, m, hot_only_bytes=50_000, file_mass=mass)
    held = {p.name for p in m.iterdir() if not p.name.startswith(".")}
    assert held == {"colibri.json", "experts.arrow", "config.json", "experts-00001.colx"}
    assert "experts-00002.colx" not in report.planned
    r = verify_mirror(primary, m)
    assert r.status == "partial" and r.ok
    assert r.records_held == 5 and r.records_total == 12 and r.manifest_matches is True
    statuses = {f.name: f.status for f in r.files}
    assert statuses["experts-00001.colx"] == "identical" and statuses["experts-00002.colx"] == "missing"
    # A larger budget takes the next densest file that has any mass, never a cold one.
    stage_mirror(primary, m, hot_only_bytes=70_000, file_mass=mass)
    assert (m / "experts-00003.colx").is_file() and not (m / "experts-00002.colx").exists()


def test_hot_only_without_usage_is_refused(primary, tmp_path):
    with pytest.raises(ColibriError, match="usage history"):
        stage_mirror(primary, tmp_path / "m", hot_only_bytes=10**9, file_mass=None)


def test_corrupted_mirror_is_reported(primary, tmp_path):
    m = tmp_path / "m"
    shutil.copytree(primary, m)
    p = m / "experts-00002.colx"
    raw = bytearray(p.read_bytes())
    raw[5000] ^= 0xFF
    p.write_bytes(bytes(raw))
    q = m / "experts-00003.colx"
    q.write_bytes(q.read_bytes()[:-10])
    r = verify_mirror(primary, m)
    statuses = {f.name: f.status for f in r.files}
    assert statuses["experts-00002.colx"] == "sha256-mismatch"
    assert statuses["experts-00003.colx"] == "size-mismatch"
    assert statuses["experts-00001.colx"] == "identical"
    assert r.status == "corrupt" and not r.ok


def test_stage_resumes_after_an_interruption(primary, tmp_path):
    m = tmp_path / "m"
    done = []

    def interrupt(name):
        done.append(name)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        stage_mirror(primary, m, on_file_done=interrupt)
    first = done[0]
    assert (m / first).is_file() and not (m / "colibri.json").exists()  # not self-describing until complete
    # A stale partial copy of another file from the interrupted run is replaced, not trusted.
    (m / "experts-00002.colx.partial").write_bytes(b"half a file")
    (m / "experts-00003.colx").write_bytes(b"wrong bytes of some other file")
    report = stage_mirror(primary, m)
    assert first in report.skipped and first not in report.copied
    assert "experts-00003.colx" in report.copied
    assert verify_mirror(primary, m).status == "full"
    assert not list(m.glob("*.partial"))
    again = stage_mirror(primary, m)
    assert again.copied == [] and again.bytes_copied == 0
