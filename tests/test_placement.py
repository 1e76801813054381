"""Placement never changes a logit: the same prompt through the tier cache under every placement gives the same
bits as reading experts straight from the container. Plus the usage history's failure modes and the RAM budget."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

import tiny_models
from colibri_format.reader import Container
from colibri_format.usage import UsageCounts
from colibri_runtime.expert_io import RecordReader
from colibri_runtime.loader import load_model
from colibri_runtime.placement import PlacementOptions, build_provider, compute_budget, load_usage, save_usage
from colibri_runtime.tiers import CachePlan, TieredExpertProvider
from colibri_runtime.weights import ContainerExpertProvider

FAMILIES = ["qwen3_moe", "glm_moe_dsa"]
PROMPT = np.random.default_rng(5).integers(3, 200, size=20)
DECODE_STEPS = 6


@pytest.fixture(scope="module", params=FAMILIES)
def container_dir(request, tmp_path_factory) -> Path:
    from colibri_convert.convert import convert
    from colibri_convert.sources import open_source

    root = tmp_path_factory.mktemp(f"placement-{request.param}")
    checkpoint = tiny_models.save_tiny_checkpoint(request.param, root / "checkpoint", seed=3, dtype="f32")
    convert(open_source(str(checkpoint), None), root / "container", None, progress=None)
    return root / "container"


def _run(container_dir: Path, make_provider) -> list[np.ndarray]:
    """Prefill the prompt, then decode greedily; every logit row of every step."""
    with Container.open(container_dir) as c:
        provider = make_provider(c)
        model = load_model(container_dir, experts=provider, container=c)
        state = model.new_state()
        out = [model.prefill(PROMPT, state, chunk_size=7, all_logits=True)]
        for _ in range(DECODE_STEPS):
            nxt = int(np.argmax(out[-1][-1]))
            out.append(model.forward([np.array([nxt])], [state], all_logits=True)[0])
        if hasattr(provider, "close"):
            provider.close()
        return out


@pytest.fixture(scope="module")
def baseline(container_dir):
    return _run(container_dir, ContainerExpertProvider)


def _assert_bitwise(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def _tiered(capacity=2, pinned=(), prefetch=True, direct="off", mirrors=(), threads=2):
    def make(c):
        reader = RecordReader(c, mirrors=[Path(m) for m in mirrors], direct=direct)
        return TieredExpertProvider(c, CachePlan(capacity, tuple(pinned)), reader=reader, io_threads=threads,
                                    prefetch=prefetch)

    return make


@pytest.mark.parametrize("capacity", [1, 2, 64])
@pytest.mark.parametrize("prefetch", [False, True])
def test_cache_capacity_and_prefetch_change_no_logit(container_dir, baseline, capacity, prefetch):
    _assert_bitwise(_run(container_dir, _tiered(capacity=capacity, prefetch=prefetch)), baseline)


def test_pinning_changes_no_logit(container_dir, baseline):
    with Container.open(container_dir) as c:
        pinned = [(layer, e) for layer in c.expert_layers for e in range(0, c.num_experts, 2)]
    _assert_bitwise(_run(container_dir, _tiered(capacity=1, pinned=pinned)), baseline)


@pytest.mark.parametrize("direct", ["on", "off"])
def test_direct_io_changes_no_logit(container_dir, baseline, direct):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a file system without O_DIRECT falls back, with a warning
        _assert_bitwise(_run(container_dir, _tiered(capacity=1, direct=direct)), baseline)


def test_mirror_and_a_vanishing_mirror_change_no_logit(container_dir, baseline, tmp_path):
    mirror = tmp_path / "mirror"
    shutil.copytree(container_dir, mirror)
    _assert_bitwise(_run(container_dir, _tiered(capacity=1, mirrors=[mirror])), baseline)

    def vanishing(c):
        provider = _tiered(capacity=1, mirrors=[mirror])(c)
        for f in mirror.glob("*.colx"):  # the mirror drive fails after start-up: every read from it comes back short
            os.truncate(f, 4096)
        return provider

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _assert_bitwise(_run(container_dir, vanishing), baseline)
    assert sum("falling back to the primary" in str(w.message) for w in caught) == 1


def test_ram_budget_smaller_than_the_container_is_honoured(container_dir, baseline):
    with Container.open(container_dir) as c:
        expert_total = sum(c.record_location(layer, e).length for layer in c.expert_layers
                           for e in range(c.num_experts))
        probe = compute_budget(c, PlacementOptions(ram_gb=1.0, context_tokens=64))
        fixed = probe.resident + probe.kv + probe.working
        ram_gb = (fixed + expert_total // 3) / 1024**3  # room for a third of the experts
    seen = {}

    def make(c):
        provider, budget, _, _ = build_provider(c, PlacementOptions(ram_gb=ram_gb, context_tokens=64, direct="off"))
        seen["budget"], seen["provider"] = budget, provider
        return provider

    _assert_bitwise(_run(container_dir, make), baseline)
    budget, provider = seen["budget"], seen["provider"]
    assert budget.experts < expert_total
    assert provider.cached_bytes <= budget.experts
    assert provider.stats.misses + provider.stats.prefetch_hits > 0  # experts were read during the run


# --- .coli_usage ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "other_dims", "other_model", "garbage"])
def test_broken_usage_history_is_ignored_with_a_warning(container_dir, tmp_path, damage):
    with Container.open(container_dir) as c:
        usage, _ = load_usage(c, tmp_path / "none")
        layers, experts = usage.dims
        usage.counts[:] = 1
        path = tmp_path / ".coli_usage"
        data = usage.to_bytes()
        if damage == "corrupt":
            data = data[:80] + bytes([data[80] ^ 1]) + data[81:]
        elif damage == "truncated":
            data = data[: len(data) - 9]
        elif damage == "other_dims":
            data = UsageCounts.empty(c.fingerprint, layers + 1, experts).to_bytes()
        elif damage == "other_model":
            data = UsageCounts.empty("ab" * 32, layers, experts).to_bytes()
        else:
            data = b"\x00" * 7
        path.write_bytes(data)
        with pytest.warns(UserWarning, match="ignoring"):
            loaded, _ = load_usage(c, path)
        assert loaded.turns == 0 and not loaded.counts.any()


def _hammer(path: str, fingerprint: str, dims, seed: int, rounds: int) -> None:
    usage = UsageCounts.empty(fingerprint, *dims)
    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        usage.add_turn(rng.integers(0, 5, size=dims).astype(np.float32))
        usage.save(Path(path))


def test_two_writers_never_leave_a_torn_file(tmp_path):
    path = tmp_path / ".coli_usage"
    fingerprint, dims = "cd" * 32, (6, 16)
    ctx = multiprocessing.get_context("fork")
    writers = [ctx.Process(target=_hammer, args=(str(path), fingerprint, dims, s, 150)) for s in (1, 2)]
    for w in writers:
        w.start()
    reads = 0
    while any(w.is_alive() for w in writers) or reads == 0:
        if path.exists():
            UsageCounts.load(path, expect_fingerprint=fingerprint, expect_dims=dims)  # must never be torn
            reads += 1
    for w in writers:
        w.join()
        assert w.exitcode == 0
    assert not list(tmp_path.glob("*.tmp"))


def test_usage_is_learned_turn_by_turn(container_dir, tmp_path):
    with Container.open(container_dir) as c:
        provider, _, usage, _ = build_provider(c, PlacementOptions(ram_gb=1.0, context_tokens=64, direct="off"))
        model = load_model(container_dir, experts=provider, container=c)
        model.prefill(PROMPT, model.new_state())
        counts = provider.take_turn_counts()
        main_layers = [layer for layer in c.expert_layers if layer < c.config["num_hidden_layers"]]  # not MTP
        assert counts.sum() == len(PROMPT) * len(main_layers) * int(
            c.config.get("num_experts_per_tok", 0) or c.config.get("num_experts_per_token", 0))
        save_usage(usage, tmp_path / ".coli_usage", counts)
        again = UsageCounts.load(tmp_path / ".coli_usage", expect_fingerprint=c.fingerprint)
        assert again.turns == 1 and again.counts.sum() == counts.sum()
        provider.close()
