"""Plan arithmetic against hand-computed cases (see the model in colibri_inspect/plan.py)."""

from __future__ import annotations

import numpy as np
import pytest
from colibri_inspect.heatmap import concentration, hottest, png_bytes
from colibri_inspect.plan import PlanInputs, covered_mass, make_plan

# bytes per expert 100, 2 layers x 10 experts, top-2; KV 10 B/token x 100 tokens = 1000 B; dense 4000 B;
# reserves 500 (OS) + 500 (buffers). RAM 7000 leaves 7000 - 500 - 500 - 1000 - 4000 = 1000 B = 10 expert slots.
BASE = PlanInputs(
    dense_bytes=4000, bytes_per_expert=100, layers=(1, 2), num_experts=10, top_k=2, kv_bytes_per_token=10,
    ram_bytes=7000, context=100, disk_bytes_per_s=1000.0, os_reserve_bytes=500, working_bytes=500,
)
USAGE = np.array(
    [
        [50, 20, 10, 5, 5, 4, 3, 2, 1, 0],  # layer 1, mass 100
        [30, 30, 10, 10, 10, 5, 2, 1, 1, 1],  # layer 2, mass 100
    ],
    dtype=np.float64,
)


def test_uniform_routing_without_usage():
    p = make_plan(BASE)
    assert (p.kv_bytes, p.ram_expert_budget, p.ram_slots, p.slots) == (1000, 1000, 10, 10)
    assert p.pinned == () and p.cache_per_layer == 5
    assert p.hit_rate == pytest.approx(0.5)  # 5 of 10 experts per layer
    assert p.experts_per_token == 4
    assert p.missed_bytes_per_token == pytest.approx(0.5 * 4 * 100)  # 200 B
    assert p.tokens_per_s == pytest.approx(1000 / 200)  # 5 tok/s
    assert p.hit_rate_source == "uniform"


def test_usage_pins_the_hottest_and_covers_their_mass():
    p = make_plan(BASE, USAGE)
    # 10 slots, half pinned: the 5 hottest overall are L1/E0 (50), L2/E0 (30), L2/E1 (30), L1/E1 (20), then the
    # first 10 in index order, L1/E2. The LRU gets (10 - 5) // 2 = 2 per layer: the next hottest of each layer,
    # L1: 5 + 5, L2: 10 + 10. Covered: layer 1 50+20+10+5+5 = 90, layer 2 30+30+10+10 = 80 -> 170 / 200.
    assert p.pinned == ((1, 0), (2, 0), (2, 1), (1, 1), (1, 2))
    assert p.cache_per_layer == 2
    assert p.hit_rate == pytest.approx(0.85)
    assert p.missed_bytes_per_token == pytest.approx(0.15 * 4 * 100)  # 60 B
    assert p.tokens_per_s == pytest.approx(1000 / 60)
    assert p.hit_rate_source == "usage"


def test_vram_tier_adds_slots_and_takes_the_hottest_pins():
    inputs = PlanInputs(**{**BASE.__dict__, "vram_bytes": 600, "vram_reserve_bytes": 100})
    p = make_plan(inputs)
    assert (p.vram_slots, p.ram_slots, p.slots) == (5, 10, 15)
    assert p.hit_rate == pytest.approx(0.75)  # 7.5 of 10 per layer
    assert p.tokens_per_s == pytest.approx(1000 / (0.25 * 400))  # 10 tok/s
    q = make_plan(inputs, USAGE)
    assert len(q.pinned) == 7 and q.vram_pinned == 5 and q.cache_per_layer == 4


def test_everything_fits_so_the_disk_does_not_bound_decode():
    p = make_plan(PlanInputs(**{**BASE.__dict__, "ram_bytes": 100_000}), USAGE)
    assert p.all_experts_fit and p.slots == 20
    assert p.hit_rate == pytest.approx(1.0) and p.missed_bytes_per_token == 0 and p.tokens_per_s is None


def test_dense_weights_that_do_not_fit():
    p = make_plan(PlanInputs(**{**BASE.__dict__, "ram_bytes": 5000}))
    assert not p.dense_fits and p.slots == 0 and p.hit_rate == 0.0
    assert p.missed_bytes_per_token == pytest.approx(400)
    assert any("dense weights" in w for w in p.warnings)
    assert any("fewer than the 2" in w for w in p.warnings)


def test_glm5_scale_numbers():
    # GLM-5.2-like: 75 MoE layers x 256 experts of 19 MB, top-8, 9.9 GB dense, 128 GB box, 9 GB/s NVMe, no usage.
    gb = 1e9
    p = make_plan(PlanInputs(
        dense_bytes=int(9.9 * gb), bytes_per_expert=19_000_000, layers=tuple(range(3, 78)), num_experts=256, top_k=8,
        kv_bytes_per_token=576 * 78 * 4, ram_bytes=128 * 10**9, context=4096, disk_bytes_per_s=9 * gb,
    ))
    ram_left = 128 * gb - 2 * 1024**3 - 1024**3 - 576 * 78 * 4 * 4096 - 9.9 * gb
    assert p.ram_slots == int(ram_left // 19_000_000)
    hit = (p.slots / 75) / 256
    assert p.hit_rate == pytest.approx(hit)
    assert p.tokens_per_s == pytest.approx(9 * gb / ((1 - hit) * 8 * 75 * 19_000_000))
    assert 1.0 < p.tokens_per_s < 3.0  # the C engine reports ~1.8 tok/s warm on a 128 GB box


def test_covered_mass_and_hot_table():
    pinned = np.zeros_like(USAGE, dtype=bool)
    assert covered_mass(USAGE, pinned, 1) == pytest.approx((50 + 30) / 200)
    hot = hottest(USAGE, (1, 2), 3)
    assert [(h.layer, h.expert, h.count) for h in hot] == [(1, 0, 50), (2, 0, 30), (2, 1, 30)]
    assert hot[0].layer_share == pytest.approx(0.5) and hot[0].total_share == pytest.approx(0.25)
    assert concentration(USAGE, (0.05,))[0.05] == pytest.approx(50 / 200)


def test_png_writer_produces_a_valid_png():
    import struct
    import zlib

    img = np.zeros((3, 5, 3), dtype=np.uint8)
    img[1, 2] = (255, 128, 7)
    data = png_bytes(img)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (5, 3)
    idat_len = struct.unpack(">I", data[33:37])[0]
    raw = zlib.decompress(data[41 : 41 + idat_len])
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(3, 1 + 15)
    assert (rows[:, 0] == 0).all() and tuple(rows[1, 1 + 6 : 1 + 9]) == (255, 128, 7)
