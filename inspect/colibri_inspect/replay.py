"""Replaying a routing trace through cache policies at a given capacity, against Belady's optimum.

Every policy sees the same demand stream: for each token, for each MoE layer in order, the set of experts routed to.
Capacity is per layer (as the runtime's per-layer LRU). Policies:
- `lru`: per-layer LRU.
- `lru+pin`: the hottest experts of the learning part of the trace are pinned (at most half the capacity, and only
  experts used more than 1.5 times their layer's average, as `--pin auto` does), LRU for the rest.
- `lru+pin+prefetch`: as above, and the trace's lookahead predictions for a layer are loaded before it runs (a
  predicted expert that is then used counts as a hit: it did not stall the token).
- `belady`: evict the expert whose next use is furthest in the future (optimal for demand fetching).
Hit rates are measured on the evaluation part of the trace (the tokens after `learn_fraction`), so pinning is learned
from history and judged on the future, as the runtime does with `.coli_usage`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


PIN_MIN_HEAT = 1.5  # colibri_runtime.placement.AUTO_PIN_MIN_HEAT


@dataclass(frozen=True)
class ReplayResult:
    policy: str
    capacity: int
    accesses: int
    hits: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0


def _demands(routed: np.ndarray, slot: int) -> list[list[int]]:
    return [sorted({int(e) for e in row if e >= 0}) for row in routed[:, slot, :]]


def _lru(demands, capacity, start, pinned=(), predictions=None) -> tuple[int, int]:
    cache: OrderedDict[int, None] = OrderedDict()
    pinned = set(pinned)
    hits = accesses = 0
    for t, wanted in enumerate(demands):
        if predictions is not None and capacity > 0:
            protect = set(predictions[t])
            for e in predictions[t]:
                if e in pinned:
                    continue
                cache[e] = None
                cache.move_to_end(e)
            while len(cache) > capacity:
                victim = next((x for x in cache if x not in protect), next(iter(cache)))
                cache.pop(victim)
        for e in wanted:
            hit = e in pinned or e in cache
            if t >= start:
                accesses += 1
                hits += hit
            if e in pinned:
                continue
            if e in cache:
                cache.move_to_end(e)
            elif capacity > 0:
                cache[e] = None
                while len(cache) > capacity:
                    cache.popitem(last=False)
    return hits, accesses


def _belady(demands, capacity, start) -> tuple[int, int]:
    stream = [(t, e) for t, wanted in enumerate(demands) for e in wanted]
    next_use = [0] * len(stream)
    last: dict[int, int] = {}
    for i in range(len(stream) - 1, -1, -1):
        e = stream[i][1]
        next_use[i] = last.get(e, 1 << 60)
        last[e] = i
    cache: dict[int, int] = {}  # expert -> index of its next use
    hits = accesses = 0
    for i, (t, e) in enumerate(stream):
        hit = e in cache
        if t >= start:
            accesses += 1
            hits += hit
        if capacity <= 0:
            continue
        if not hit and len(cache) >= capacity:
            victim = max(cache, key=lambda x: cache[x])
            if cache[victim] < next_use[i]:
                continue  # bypass: the new expert is needed later than everything cached
            del cache[victim]
        cache[e] = next_use[i]
    return hits, accesses


def replay(trace, capacity_fraction: float = 0.25, learn_fraction: float = 0.5, pin_share: float = 0.5):
    """Hit rates of every policy on `trace` (a runtime.trace.RoutingTrace) at capacity_fraction of each layer."""
    num_experts = trace.num_experts
    capacity = max(1, round(capacity_fraction * num_experts))
    start = int(trace.tokens * learn_fraction)
    pin_count = int(capacity * pin_share)
    totals = {p: [0, 0] for p in ("lru", "lru+pin", "lru+pin+prefetch", "belady")}
    for slot in range(len(trace.layers)):
        demands = _demands(trace.routed, slot)
        preds = [sorted({int(e) for e in row if e >= 0}) for row in trace.predicted[:, slot, :]]
        history = np.bincount(trace.routed[:start, slot, :].reshape(-1).clip(min=0), minlength=num_experts)
        # As colibri-run's --pin auto: only experts clearly hotter than the layer's average are pinned.
        floor = PIN_MIN_HEAT * float(history.mean())
        hot = [int(e) for e in np.argsort(-history, kind="stable")[:pin_count] if history[e] > max(0.0, floor)]
        runs = {
            "lru": _lru(demands, capacity, start),
            "lru+pin": _lru(demands, capacity - len(hot), start, pinned=hot),
            "lru+pin+prefetch": _lru(demands, capacity - len(hot), start, pinned=hot, predictions=preds),
            "belady": _belady(demands, capacity, start),
        }
        for policy, (h, a) in runs.items():
            totals[policy][0] += h
            totals[policy][1] += a
    return [ReplayResult(p, capacity, a, h) for p, (h, a) in totals.items()]
