"""Routing traces round-trip through their file format; the replayer's policies behave as the theory says."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.errors import SidecarError
from colibri_inspect.replay import replay
from colibri_runtime.trace import RoutingTrace, TraceRecorder


def _synthetic_trace(tokens=400, experts=16, k=2, layers=(1, 2), perfect_predictions=False, seed=0):
    rng = np.random.default_rng(seed)
    popularity = rng.dirichlet(np.full(experts, 0.3))
    rec = TraceRecorder(list(layers), k, experts)
    for _ in range(tokens):
        for layer in layers:
            ids = rng.choice(experts, size=k, replace=False, p=popularity)
            if perfect_predictions:
                rec.predicted(layer, ids[None, :])
            rec.routed(layer, ids[None, :])
    return rec.trace()


def test_trace_round_trip(tmp_path):
    trace = _synthetic_trace(perfect_predictions=True)
    trace.save(tmp_path / "t.trace")
    back = RoutingTrace.load(tmp_path / "t.trace")
    assert back.layers == [1, 2] and back.top_k == 2 and back.tokens == 400
    np.testing.assert_array_equal(back.routed, trace.routed)
    np.testing.assert_array_equal(back.predicted, trace.predicted)


def test_corrupt_trace_is_refused(tmp_path):
    trace = _synthetic_trace(tokens=20)
    trace.save(tmp_path / "t.trace")
    data = (tmp_path / "t.trace").read_bytes()
    (tmp_path / "bad.trace").write_bytes(data[: len(data) // 2])
    with pytest.raises(SidecarError):
        RoutingTrace.load(tmp_path / "bad.trace")
    (tmp_path / "bad.trace").write_bytes(b"NOTATRACE" + data)
    with pytest.raises(SidecarError, match="magic"):
        RoutingTrace.load(tmp_path / "bad.trace")


def test_policies_against_belady():
    trace = _synthetic_trace(perfect_predictions=True)
    rates = {r.policy: r.hit_rate for r in replay(trace, capacity_fraction=0.25)}
    assert rates["belady"] >= rates["lru"] and rates["belady"] >= rates["lru+pin"]
    assert rates["lru+pin+prefetch"] == 1.0  # perfect lookahead never stalls
    assert 0 < rates["lru"] < 1


def test_belady_is_optimal_on_a_known_sequence():
    # One layer, capacity 1 (of 4 experts), k=1: the stream a b a b a ... with LRU always misses after warm-up
    # while Belady keeps 'a' (needed sooner) and hits half the time.
    rec = TraceRecorder([0], 1, 4)
    for e in [0, 1] * 50:
        rec.routed(0, np.array([[e]]))
    rates = {r.policy: r.hit_rate for r in replay(rec.trace(), capacity_fraction=0.25, learn_fraction=0.0)}
    assert rates["lru"] == 0.0
    assert rates["belady"] == pytest.approx(0.49, abs=0.02)


def test_replay_command(tmp_path):
    import json

    from typer.testing import CliRunner

    from colibri_inspect.cli import app

    _synthetic_trace(perfect_predictions=True).save(tmp_path / "t.trace")
    result = CliRunner().invoke(app, ["replay", str(tmp_path / "t.trace"), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["capacity"] == 4 and data["policies"]["lru+pin+prefetch"]["hit_rate"] == 1.0
    bad = CliRunner().invoke(app, ["replay", str(tmp_path / "missing.trace")])
    assert bad.exit_code == 1 and "cannot read routing trace" in bad.output
