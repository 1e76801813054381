"""Placement plans: what a machine keeps resident, how many experts its caches hold, and how fast it will decode.

The model (all sizes in bytes, L = expert layers a token passes through, E = experts per layer, k = experts
activated per layer per token, B = bytes per expert record):

    RAM budget for experts  = RAM - OS reserve - working buffers - KV cache (context x KV bytes per token) - dense
    VRAM budget for experts = VRAM - VRAM reserve (CUDA context, activations)
    slots                   = floor(RAM budget / B) + floor(VRAM budget / B), at most L x E
    pinned                  = floor(pin_fraction x slots) hottest (layer, expert) pairs by .coli_usage (none
                              without usage history); the hottest of them go to VRAM first
    cache per layer         = floor((slots - pinned) / L) experts of LRU cache in every layer

    predicted hit rate h    = share of routing mass the experts that fit cover: in every layer, the mass of its
                              pinned experts plus the mass of its next `cache per layer` hottest experts (a warm LRU
                              holds about the hottest ones), summed over layers, divided by the total mass. Without
                              usage history every expert is equally likely: h = min(1, (slots / L) / E).
    missed bytes per token  = (1 - h) x k x L x B
    predicted tok/s         = disk bandwidth / missed bytes per token   (unbounded when nothing misses: then decode
                              is compute-bound and this model says nothing about speed)

The hit rate is an optimistic estimate (a perfect cache of the right size); real LRU caches also hold experts that
are about to be evicted. Prefetch hides latency but not bandwidth, so it does not enter the estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

GIB = 1024**3
DEFAULT_CONTEXT = 4096
DEFAULT_WORKING_BYTES = 1 * GIB  # activations, Python, numba, read buffers (when nothing better is known)
RUNTIME_WORKING_BYTES = 256 * 1024**2  # what colibri-run reserves besides read buffers (colibri_runtime.placement)
RUNTIME_IO_THREADS = 4


def runtime_working_bytes(top_k: int, bytes_per_expert: int, io_threads: int = RUNTIME_IO_THREADS) -> int:
    """Working memory as colibri-run budgets it: a fixed reserve plus one read buffer per reader thread and two
    layers' worth of prefetches (colibri_runtime.placement.spare_read_buffers)."""
    return RUNTIME_WORKING_BYTES + (io_threads + 2 * top_k) * bytes_per_expert
DEFAULT_PIN_FRACTION = 0.5
KV_BYTES_PER_VALUE = 4  # the runtime keeps its KV cache in float32


def default_os_reserve(ram_bytes: int) -> int:
    """RAM left to the operating system and other programs: 10% of RAM, at most 2 GiB."""
    return min(2 * GIB, ram_bytes // 10)


def default_vram_reserve(vram_bytes: int) -> int:
    """VRAM left to the CUDA context and activations: 10% of VRAM, at most 1 GiB."""
    return min(GIB, vram_bytes // 10)


@dataclass(frozen=True)
class PlanInputs:
    """Everything the plan depends on, in plain numbers (so the arithmetic can be checked by hand)."""

    dense_bytes: int  # resident (+ MTP when speculative decoding is on)
    bytes_per_expert: int
    layers: tuple[int, ...]  # expert layers a token passes through
    num_experts: int
    top_k: int
    kv_bytes_per_token: int
    ram_bytes: int
    vram_bytes: int = 0
    context: int = DEFAULT_CONTEXT
    disk_bytes_per_s: float = 0.0
    pin_fraction: float = DEFAULT_PIN_FRACTION
    os_reserve_bytes: int | None = None
    working_bytes: int = DEFAULT_WORKING_BYTES
    vram_reserve_bytes: int | None = None


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    os_reserve_bytes: int
    kv_bytes: int
    ram_expert_budget: int
    vram_expert_budget: int
    dense_fits: bool
    ram_slots: int
    vram_slots: int
    slots: int
    pinned: tuple[tuple[int, int], ...]  # (layer, expert), hottest first
    vram_pinned: int  # how many of `pinned` live in VRAM
    cache_per_layer: int
    hit_rate: float
    hit_rate_source: str  # "usage" or "uniform"
    experts_per_token: int
    missed_bytes_per_token: float
    tokens_per_s: float | None  # None: nothing misses, the disk does not bound decode speed
    warnings: tuple[str, ...] = field(default=())

    @property
    def all_experts_fit(self) -> bool:
        return self.slots >= len(self.inputs.layers) * self.inputs.num_experts

    def to_json(self) -> dict:
        i = self.inputs
        return {
            "ram_bytes": i.ram_bytes,
            "vram_bytes": i.vram_bytes,
            "dense_bytes": i.dense_bytes,
            "os_reserve_bytes": self.os_reserve_bytes,
            "working_bytes": i.working_bytes,
            "context": i.context,
            "kv_bytes": self.kv_bytes,
            "dense_fits": self.dense_fits,
            "bytes_per_expert": i.bytes_per_expert,
            "expert_layers": len(i.layers),
            "num_experts": i.num_experts,
            "ram_expert_budget": self.ram_expert_budget,
            "vram_expert_budget": self.vram_expert_budget,
            "ram_slots": self.ram_slots,
            "vram_slots": self.vram_slots,
            "slots": self.slots,
            "all_experts_fit": self.all_experts_fit,
            "pinned": len(self.pinned),
            "vram_pinned": self.vram_pinned,
            "pinned_hottest": [list(p) for p in self.pinned[:32]],
            "cache_per_layer": self.cache_per_layer,
            "hit_rate": round(self.hit_rate, 6),
            "hit_rate_source": self.hit_rate_source,
            "experts_per_token": self.experts_per_token,
            "missed_bytes_per_token": round(self.missed_bytes_per_token),
            "disk_bytes_per_s": i.disk_bytes_per_s,
            "tokens_per_s": None if self.tokens_per_s is None else round(self.tokens_per_s, 4),
            "warnings": list(self.warnings),
        }


def make_plan(inputs: PlanInputs, usage: np.ndarray | None = None) -> Plan:
    """Plan placement. `usage` is routing mass per (expert layer, expert), rows in the order of `inputs.layers`."""
    i = inputs
    n_layers, n_experts, bpe = len(i.layers), i.num_experts, max(1, i.bytes_per_expert)
    warnings: list[str] = []
    os_reserve = default_os_reserve(i.ram_bytes) if i.os_reserve_bytes is None else i.os_reserve_bytes
    vram_reserve = default_vram_reserve(i.vram_bytes) if i.vram_reserve_bytes is None else i.vram_reserve_bytes
    kv = i.kv_bytes_per_token * i.context
    ram_left = i.ram_bytes - os_reserve - i.working_bytes - kv - i.dense_bytes
    dense_fits = ram_left >= 0
    if not dense_fits:
        warnings.append(
            f"dense weights, KV cache and buffers need {_gib(i.dense_bytes + kv + i.working_bytes + os_reserve)} "
            f"but RAM is {_gib(i.ram_bytes)}: dense layers would page from disk; lower --context or add RAM"
        )
    ram_budget = max(0, ram_left)
    vram_budget = max(0, i.vram_bytes - vram_reserve)
    total_experts = n_layers * n_experts
    vram_slots = min(vram_budget // bpe, total_experts)
    ram_slots = min(ram_budget // bpe, total_experts - vram_slots)
    slots = vram_slots + ram_slots

    have_usage = usage is not None and usage.shape == (n_layers, n_experts) and float(usage.sum()) > 0
    pinned: list[tuple[int, int]] = []
    if have_usage:
        n_pinned = math.floor(i.pin_fraction * slots)
        if n_pinned:
            order = np.argsort(-usage, axis=None, kind="stable")[:n_pinned]
            pinned = [(i.layers[int(f) // n_experts], int(f) % n_experts) for f in order]
    cache_per_layer = (slots - len(pinned)) // n_layers if n_layers else 0
    if n_layers and slots // n_layers < i.top_k and not all_fit(slots, total_experts):
        warnings.append(
            f"the cache holds {slots // n_layers} experts per layer, fewer than the {i.top_k} a token activates: "
            "every token reads most of its experts from disk"
        )

    if all_fit(slots, total_experts):
        cache_per_layer = n_experts  # every expert stays in memory once read: nothing is ever evicted
        hit = 1.0
        source = "usage" if have_usage else "uniform"
    elif have_usage:
        hit = covered_mass(usage, pinned_mask(usage.shape, pinned, i.layers), cache_per_layer)
        source = "usage"
    else:
        hit = min(1.0, (slots / n_layers) / n_experts) if n_layers and n_experts else 1.0
        source = "uniform"
    per_token = i.top_k * n_layers
    missed = (1.0 - hit) * per_token * i.bytes_per_expert
    if missed <= 0:
        tps = None
    elif i.disk_bytes_per_s > 0:
        tps = i.disk_bytes_per_s / missed
    else:
        tps = 0.0
        warnings.append("no disk bandwidth measured or given: speed not predicted (use --disk-gbps)")
    return Plan(
        inputs=i,
        os_reserve_bytes=os_reserve,
        kv_bytes=kv,
        ram_expert_budget=ram_budget,
        vram_expert_budget=vram_budget,
        dense_fits=dense_fits,
        ram_slots=int(ram_slots),
        vram_slots=int(vram_slots),
        slots=int(slots),
        pinned=tuple(pinned),
        vram_pinned=min(len(pinned), int(vram_slots)),
        cache_per_layer=int(cache_per_layer),
        hit_rate=float(hit),
        hit_rate_source=source,
        experts_per_token=per_token,
        missed_bytes_per_token=float(missed),
        tokens_per_s=tps,
        warnings=tuple(warnings),
    )


def all_fit(slots: int, total: int) -> bool:
    return slots >= total


def pinned_mask(shape: tuple[int, int], pinned: list[tuple[int, int]], layers: tuple[int, ...]) -> np.ndarray:
    mask = np.zeros(shape, dtype=bool)
    row = {layer: r for r, layer in enumerate(layers)}
    for layer, expert in pinned:
        mask[row[layer], expert] = True
    return mask


def covered_mass(usage: np.ndarray, pinned: np.ndarray, cache_per_layer: int) -> float:
    """Share of routing mass held by the pinned experts plus, in each layer, the `cache_per_layer` hottest others."""
    total = float(usage.sum())
    if total <= 0:
        return 0.0
    covered = float(usage[pinned].sum())
    if cache_per_layer > 0:
        rest = np.where(pinned, -np.inf, usage)
        top = -np.sort(-rest, axis=1)[:, :cache_per_layer]
        covered += float(np.where(np.isfinite(top), top, 0.0).sum())
    return min(1.0, covered / total)


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"
