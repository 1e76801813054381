"""DeepSeek Sparse Attention (DSA): GLM-5's lightning indexer, as transformers' GlmMoeDsaIndexer computes it.

A layer whose `indexer_types` entry is "full" owns an indexer: its own small projections pick, for every query,
the `index_topk` past tokens the MLA attention may look at. A "shared" layer has no indexer and reuses the
selection of the nearest full layer below it.

Per token, a full layer's indexer keeps one key of `index_head_dim` floats (after LayerNorm and RoPE): that key is
part of the token's persistent state, stored next to the MLA latent and rope key.

For queries q = wq_b(q_resid) [S, n_heads, D] and cached keys k [T, D] (the first qk_rope_head_dim dims of each
roped with the interleaved rotation, the rest passed through):
    score[s, t] = sum_h  weights_proj(x)[s, h] * n_heads ** -0.5 * relu(q[s, h] . k[t] * D ** -0.5)
and the selection is the index_topk highest scores among the keys the query may see (causal). Ties go to the
earlier position. `select_all=True` selects every visible key: the attention is then exactly the dense one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from .kernels import pick_kernel

from .mla import Linear, apply_rope

INDEXER_NORM_EPS = 1e-6


@dataclass(frozen=True)
class IndexerConfig:
    n_heads: int
    head_dim: int
    rope_dim: int
    topk: int

    @classmethod
    def from_hf(cls, config: dict) -> IndexerConfig:
        return cls(
            n_heads=int(config["index_n_heads"]),
            head_dim=int(config["index_head_dim"]),
            rope_dim=int(config["qk_rope_head_dim"]),
            topk=int(config["index_topk"]),
        )


@dataclass(frozen=True)
class IndexerWeights:
    wq_b: Linear  # [n_heads * head_dim, q_lora_rank]
    wk: Linear  # [head_dim, hidden]
    k_norm_weight: np.ndarray  # LayerNorm(head_dim), with bias
    k_norm_bias: np.ndarray
    weights_proj: Linear  # [n_heads, hidden], kept in float32 by the checkpoint


def indexer_full_layers(config: dict) -> list[bool]:
    """Per layer: True where the layer runs its own indexer ("full"), False where it reuses the previous one's."""
    types = config.get("indexer_types")
    layers = int(config["num_hidden_layers"])
    if types is None:
        pattern = config.get("index_topk_pattern")
        if pattern is not None:
            types = (
                [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else pattern
            )
        else:
            freq = max(int(config.get("index_topk_freq", 1)), 1)
            offset = int(config.get("index_skip_topk_offset", 2))
            types = ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(layers)]
    return [t == "full" for t in list(types)[:layers]]


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = np.mean(x, axis=-1, keepdims=True, dtype=np.float32)
    centered = x - mean
    variance = np.mean(centered * centered, axis=-1, keepdims=True, dtype=np.float32)
    return centered / np.sqrt(variance + np.float32(eps)) * weight + bias


def _rope_first(x: np.ndarray, rope_dim: int, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Interleaved RoPE on the first rope_dim dims of the last axis, the rest unchanged (the indexer's layout)."""
    rotated = apply_rope(x[..., :rope_dim], cos, sin, interleave=True)
    return np.concatenate([rotated, x[..., rope_dim:]], axis=-1)


def indexer_keys(
    cfg: IndexerConfig, w: IndexerWeights, x: np.ndarray, cos: np.ndarray, sin: np.ndarray
) -> np.ndarray:
    """The keys [S, head_dim] the indexer caches for the tokens x [S, hidden]."""
    k = layer_norm(w.wk(x), w.k_norm_weight, w.k_norm_bias, INDEXER_NORM_EPS)
    return np.ascontiguousarray(_rope_first(k, cfg.rope_dim, cos, sin), dtype=np.float32)


def index_scores(
    cfg: IndexerConfig,
    w: IndexerWeights,
    x: np.ndarray,
    q_resid: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    keys: np.ndarray,
) -> np.ndarray:
    """[S, T] relevance of every cached token (keys [T, head_dim], the S new ones last) for every query."""
    seq = x.shape[0]
    q = w.wq_b(q_resid).reshape(seq, cfg.n_heads, cfg.head_dim)
    q = _rope_first(q, cfg.rope_dim, cos, sin)
    scores = (q @ keys.T) * np.float32(cfg.head_dim**-0.5)  # [S, H, T]
    np.maximum(scores, np.float32(0), out=scores)
    weights = w.weights_proj(x) * np.float32(cfg.n_heads**-0.5)  # [S, H]
    return (weights[:, None, :] @ scores)[:, 0, :]


def select(scores: np.ndarray, allowed: np.ndarray, topk: int, *, select_all: bool = False) -> np.ndarray:
    """[S, T] bool: the topk best-scoring keys each query may see (all of them when it sees fewer, or when
    select_all). Equal scores go to the earlier position."""
    if select_all:
        return allowed.copy()
    num_keys = scores.shape[-1]
    if topk >= num_keys:
        return allowed.copy()
    masked = np.where(allowed, scores, np.float32(-np.inf))
    order = np.argsort(-masked, axis=-1, kind="stable")[:, :topk]
    chosen = np.zeros_like(allowed)
    np.put_along_axis(chosen, order, True, axis=-1)
    return chosen & allowed


# --- the runtime indexer: deterministic scores, one row at a time ------------------------------------------------


@numba.njit(cache=True, parallel=True, nogil=True)
def _index_scores_kernel(q, weights, keys, q_idx, scale, out):  # pragma: no cover - compiled
    """out[i, t] = sum_h weights[i, h] * relu(q[i, h] . keys[t] * scale) for t <= q_idx[i]; heads in order."""
    n, n_heads, d = q.shape
    for job in numba.prange(n):
        i = job
        for t in range(q_idx[i] + 1):
            total = np.float32(0.0)
            for h in range(n_heads):
                acc = np.zeros(8, np.float32)
                full = d - d % 8
                for j0 in range(0, full, 8):
                    for k in range(8):
                        acc[k] += q[i, h, j0 + k] * keys[t, j0 + k]
                tail = np.float32(0.0)
                for j in range(full, d):
                    tail += q[i, h, j] * keys[t, j]
                s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7])) + tail
                s = s * scale
                if s > 0:
                    total += weights[i, h] * s
            out[i, t] = total


@dataclass(frozen=True)
class Indexer:
    """A full DSA layer's indexer as the runtime runs it: `keys` for the new tokens (cached), `select` for the
    queries. select_all=True makes every causal key selected (the dense attention, exactly)."""

    cfg: IndexerConfig
    weights: IndexerWeights
    select_all: bool = False

    def keys(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        return indexer_keys(self.cfg, self.weights, x, cos, sin)

    def scores(self, x, q_resid, cos, sin, keys, q_idx) -> np.ndarray:
        """[n, T] index scores; -inf past each query's own position."""
        n = x.shape[0]
        q = self.weights.wq_b(q_resid).reshape(n, self.cfg.n_heads, self.cfg.head_dim)
        q = np.ascontiguousarray(_rope_first(q, self.cfg.rope_dim, cos, sin), dtype=np.float32)
        w = np.ascontiguousarray(
            self.weights.weights_proj(x) * np.float32(self.cfg.n_heads**-0.5), np.float32
        )
        out = np.full((n, keys.shape[0]), -np.inf, np.float32)
        macs = q.shape[0] * q.shape[1] * q.shape[2] * keys.shape[0]
        pick_kernel(_index_scores_kernel, macs)(
            q,
            w,
            np.ascontiguousarray(keys, np.float32),
            np.asarray(q_idx, np.int64),
            np.float32(self.cfg.head_dim**-0.5),
            out,
        )
        return out

    def select(self, x, q_resid, cos, sin, keys, q_idx) -> tuple[np.ndarray, np.ndarray]:
        """(sel [n, k] ascending key indices, counts [n]) for mla.attend_latent."""
        q_idx = np.asarray(q_idx, np.int64)
        n = len(q_idx)
        visible = q_idx + 1
        width = int(visible.max()) if self.select_all else int(min(self.cfg.topk, visible.max()))
        sel = np.zeros((n, width), np.int64)
        counts = np.zeros(n, np.int64)
        scores = None
        for i in range(n):
            v = int(visible[i])
            if self.select_all or v <= self.cfg.topk:
                chosen = np.arange(v)
            else:
                if scores is None:
                    scores = self.scores(x, q_resid, cos, sin, keys, q_idx)
                order = np.argsort(-scores[i, :v], kind="stable")[: self.cfg.topk]
                chosen = np.sort(order)
            sel[i, : len(chosen)] = chosen
            counts[i] = len(chosen)
        return sel, counts
