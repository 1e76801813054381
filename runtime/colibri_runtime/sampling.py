"""Choosing the next token from logits: greedy, temperature, top-k, top-p, repetition penalty, seeded.

The order is transformers': repetition penalty, then temperature, then top-k, then top-p. Temperature 0 (or below)
means greedy, the first index of the largest logit. Sampling draws from a numpy Generator seeded once, so a seed
reproduces a whole generation.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from colibri_format.errors import RuntimeModelError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.top_p <= 1.0:
            raise RuntimeModelError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RuntimeModelError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise RuntimeModelError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def apply_repetition_penalty(logits: np.ndarray, previous: Iterable[int], penalty: float) -> np.ndarray:
    """transformers' rule: a seen token's logit is divided by the penalty if positive, multiplied if negative."""
    if penalty == 1.0:
        return logits
    seen = np.unique(np.fromiter(previous, dtype=np.int64))
    if seen.size == 0:
        return logits
    out = logits.copy()
    vals = out[seen]
    out[seen] = np.where(vals < 0, vals * np.float32(penalty), vals / np.float32(penalty))
    return out


def filter_top_k(logits: np.ndarray, k: int) -> np.ndarray:
    if k <= 0 or k >= logits.size:
        return logits
    kth = np.sort(logits)[-k]
    return np.where(logits < kth, -np.inf, logits)


def filter_top_p(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose probability reaches p (at least one token)."""
    if p >= 1.0:
        return logits
    order = np.argsort(-logits, kind="stable")
    probs = _softmax64(logits[order])
    cum = np.cumsum(probs)
    keep_n = int(np.searchsorted(cum, p) + 1)
    out = np.full_like(logits, -np.inf)
    kept = order[:keep_n]
    out[kept] = logits[kept]
    return out


def _softmax64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    finite = np.isfinite(x)
    m = x[finite].max()
    e = np.where(finite, np.exp(x - m), 0.0)
    return e / e.sum()


class Sampler:
    """Stateful sampler: one per generation (holds the seeded random stream)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, previous: Iterable[int] = ()) -> int:
        p = self.params
        x = np.asarray(logits, dtype=np.float32).reshape(-1)
        x = apply_repetition_penalty(x, previous, p.repetition_penalty)
        if p.greedy:
            return int(np.argmax(x))
        x = x / np.float32(p.temperature)
        x = filter_top_k(x, p.top_k)
        x = filter_top_p(x, p.top_p)
        probs = _softmax64(x)
        u = self._rng.random()
        idx = int(np.searchsorted(np.cumsum(probs), u, side="right"))
        return min(idx, probs.size - 1) if probs[min(idx, probs.size - 1)] > 0 else int(np.argmax(probs))
