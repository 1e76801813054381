"""The tier cache hands out exactly the bytes the container holds, whatever the placement: capacity, pinning,
prefetch (right or wrong), O_DIRECT, mirrors, and mirrors whose files vanish mid-run."""

from __future__ import annotations

import os
import shutil
import warnings

import numpy as np
import pytest

from colibri_format.quant import quantize
from colibri_format.reader import Container
from colibri_format.writer import ContainerWriter
from colibri_runtime.expert_io import RecordReader
from colibri_runtime.tiers import CachePlan, TieredExpertProvider, hottest_experts, plan_cache
from colibri_runtime.weights import ContainerExpertProvider

LAYERS, EXPERTS = (1, 2, 3), 6


@pytest.fixture(scope="module")
def container_dir(tmp_path_factory):
    rng = np.random.default_rng(0)
    out = tmp_path_factory.mktemp("tiers") / "c"
    w = ContainerWriter(out, family="olmoe", config={"model_type": "olmoe", "num_hidden_layers": 4},
                        shard_bytes=40_000)
    for layer in LAYERS:
        for e in range(EXPERTS):
            w.add_expert(layer, e,
                         gate=quantize(rng.standard_normal((24, 70)).astype(np.float32), "int4_gs64"),
                         up=quantize(rng.standard_normal((24, 70)).astype(np.float32), "int4_gs64"),
                         down=quantize(rng.standard_normal((70, 24)).astype(np.float32), "int4_gs64"))
    return w.finish()


def _requests():
    rng = np.random.default_rng(1)
    for _ in range(12):
        for layer in LAYERS:
            yield layer, sorted(rng.choice(EXPERTS, size=3, replace=False).tolist())


def _arrays(prepared):
    # Copies: an expert handed out is only guaranteed until the provider's next get() (its read buffer is reused).
    return [np.array(a) for p in prepared for w in (p.gate, p.up, p.down) for a in (w.data, w.scales)]


def _run(provider, hints: str = "none"):
    out = []
    rng = np.random.default_rng(2)
    for layer, ids in _requests():
        if hints == "right":
            provider.hint(layer, ids)
        elif hints == "wrong":
            provider.hint(layer, rng.choice(EXPERTS, size=3, replace=False).tolist())
        out.append(_arrays(provider.get(layer, ids)))
    return out


def _assert_same(a, b):
    assert len(a) == len(b)
    for xs, ys in zip(a, b):
        for x, y in zip(xs, ys):
            np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def baseline(container_dir):
    with Container.open(container_dir) as c:
        return _run(ContainerExpertProvider(c))


@pytest.mark.parametrize("capacity", [0, 1, 2, EXPERTS])
@pytest.mark.parametrize("hints", ["none", "right", "wrong"])
def test_capacity_and_prefetch_never_change_bytes(container_dir, baseline, capacity, hints):
    with Container.open(container_dir) as c:
        provider = TieredExpertProvider(c, CachePlan(capacity), io_threads=2, prefetch=hints != "none")
        _assert_same(_run(provider, hints), baseline)
        s = provider.stats
        assert s.loaded == sum(len(ids) for _, ids in _requests())
        assert s.hits == s.pinned_hits + s.lru_hits + s.prefetch_hits
        if capacity == EXPERTS:
            assert s.misses + s.prefetch_hits <= len(LAYERS) * EXPERTS
        if hints == "right":
            assert s.precision == 1.0 and s.recall == 1.0
        provider.close()


def test_pinning_serves_hot_experts_without_reads(container_dir, baseline):
    with Container.open(container_dir) as c:
        counts = np.zeros((4, EXPERTS), np.float32)
        counts[1, 0], counts[2, 5], counts[3, 3] = 9, 5, 1
        hot = hottest_experts(counts, LAYERS)
        assert hot == [(1, 0), (2, 5), (3, 3)]
        counts[1, 1:] = 1  # layer 1: one hot expert among lukewarm ones; only it stands out
        assert hottest_experts(counts, [1], min_heat=1.5) == [(1, 0)]
        expert_bytes = c.record_location(1, 0).length
        plan = plan_cache(10 * expert_bytes, expert_bytes, LAYERS, pin_bytes=2 * expert_bytes, hot=hot)
        assert plan.pinned == ((1, 0), (2, 5)) and plan.lru_per_layer == 2
        provider = TieredExpertProvider(c, plan, io_threads=1, prefetch=False)
        _assert_same(_run(provider), baseline)
        assert provider.stats.pinned_hits > 0
        provider.close()


@pytest.mark.parametrize("direct", ["on", "off", "auto"])
def test_direct_io_modes_give_the_same_bytes(container_dir, baseline, direct):
    with Container.open(container_dir) as c, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # file systems without O_DIRECT fall back with a warning
        provider = TieredExpertProvider(c, CachePlan(1), reader=RecordReader(c, direct=direct), io_threads=2)
        _assert_same(_run(provider, "right"), baseline)
        provider.close()


def test_mirror_serves_reads_and_a_vanishing_mirror_falls_back(container_dir, baseline, tmp_path):
    mirror = tmp_path / "mirror"
    shutil.copytree(container_dir, mirror)
    with Container.open(container_dir) as c:
        reader = RecordReader(c, mirrors=[mirror], drive_weights=[1.0, 3.0])
        assert reader.drives[1].files == set(c.files_of_role("experts"))
        provider = TieredExpertProvider(c, CachePlan(0), reader=reader, io_threads=2)
        _assert_same(_run(provider), baseline)
        by_drive = provider.stats.bytes_by_drive
        assert by_drive.get("primary", 0) > 0 and by_drive.get(reader.drives[1].name, 0) > by_drive["primary"]
        for f in mirror.glob("*.colx"):  # the mirror's drive fails mid-run: reads come back short
            os.truncate(f, 4096)
        shutil.rmtree(mirror)
        with pytest.warns(UserWarning, match="falling back to the primary"):
            _assert_same(_run(provider), baseline)
        provider.close()


def test_partial_and_corrupt_mirrors_are_admitted_file_by_file(container_dir, tmp_path):
    mirror = tmp_path / "partial"
    mirror.mkdir()
    with Container.open(container_dir) as c:
        files = c.files_of_role("experts")
        assert len(files) >= 3
        shutil.copy(container_dir / files[0], mirror / files[0])
        data = bytearray((container_dir / files[1]).read_bytes())
        data[4096 + 10] ^= 0xFF  # a flipped byte in the first record of the second file
        (mirror / files[1]).write_bytes(bytes(data))
        with pytest.warns(UserWarning, match="unusable"):
            reader = RecordReader(c, mirrors=[mirror])
        assert reader.drives[1].files == {files[0]}


def test_same_expert_always_goes_to_the_same_drive(container_dir, tmp_path):
    mirror = tmp_path / "m"
    shutil.copytree(container_dir, mirror)
    with Container.open(container_dir) as c:
        a = RecordReader(c, mirrors=[mirror], drive_weights=[1, 1])
        b = RecordReader(c, mirrors=[mirror], drive_weights=[1, 1])
        picks = [(a.drive_for(layer, e, "experts-00001.colx").name, b.drive_for(layer, e, "experts-00001.colx").name)
                 for layer in LAYERS for e in range(EXPERTS)]
        assert all(x == y for x, y in picks)
        assert len({x for x, _ in picks}) == 2
