"""The layers every family shares, written once: RMSNorm, RoPE (with its scaling variants), GQA attention over a
KV cache, SwiGLU MLPs, routers (softmax top-k, sigmoid with correction bias and group-limited selection) and the
mixture-of-experts block with optional shared experts.

All arithmetic is float32, as transformers does it on CPU. Everything that reduces (norms, attention, matmuls) does
so in a fixed order per output element, so a row's result never depends on the other rows of a batch, on how a
prompt was split into chunks, or on the thread count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numba
import numpy as np

from colibri_format.errors import RuntimeModelError

from . import timesplit
from .kernels import pick_kernel
from .weights import ExpertProvider, Linear

F32 = np.float32


# --- elementwise helpers ------------------------------------------------------------------------------------------


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x) in float32 (torch computes x / (1 + exp(-x)))."""
    x = np.asarray(x, dtype=F32)
    return x / (F32(1.0) + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=F32)
    return F32(1.0) / (F32(1.0) + np.exp(-x))


ACTIVATIONS = {"silu": silu, "swish": silu}


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise RuntimeModelError(f"activation {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}") from None


# --- RMSNorm ------------------------------------------------------------------------------------------------------


@numba.njit(cache=True)
def _rmsnorm_rows(x, weight, eps, out):  # pragma: no cover - compiled
    n, d = x.shape
    inv_d = F32(1.0) / F32(d)
    for i in range(n):
        acc = np.zeros(8, np.float32)
        full = d - d % 8
        for j0 in range(0, full, 8):
            for k in range(8):
                v = x[i, j0 + k]
                acc[k] += v * v
        tail = F32(0.0)
        for j in range(full, d):
            tail += x[i, j] * x[i, j]
        s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7])) + tail
        r = F32(1.0) / np.sqrt(s * inv_d + eps)
        for j in range(d):
            out[i, j] = weight[j] * (x[i, j] * r)


@dataclass(frozen=True)
class RMSNorm:
    """weight * (x / sqrt(mean(x^2) + eps)) over the last dimension, in float32."""

    weight: np.ndarray
    eps: float

    def __call__(self, x: np.ndarray) -> np.ndarray:
        shape = x.shape
        rows = np.ascontiguousarray(x, dtype=F32).reshape(-1, shape[-1])
        out = np.empty_like(rows)
        _rmsnorm_rows(rows, np.ascontiguousarray(self.weight, dtype=F32), F32(self.eps), out)
        return out.reshape(shape)


# --- RoPE ---------------------------------------------------------------------------------------------------------


def rope_parameters(config: dict) -> dict:
    """The RoPE parameters of a config in transformers' v5 form (`rope_parameters`), accepting the older
    `rope_theta` / `rope_scaling` / `partial_rotary_factor` spelling too."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("rope_type", params.get("type", "default"))
    if "rope_theta" not in params:
        params["rope_theta"] = config.get("rope_theta", 10000.0)
    if "partial_rotary_factor" not in params and config.get("partial_rotary_factor") is not None:
        params["partial_rotary_factor"] = config["partial_rotary_factor"]
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        params.setdefault("original_max_position_embeddings",
                          config.get("original_max_position_embeddings", config.get("max_position_embeddings")))
    return params


def _arange_inv_freq(base: float, dim: int) -> np.ndarray:
    # torch: 1.0 / (base ** (arange(0, dim, 2).float() / dim)), all in float32
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(F32) / F32(dim)
    return (F32(1.0) / np.power(F32(base), exponents, dtype=F32)).astype(F32)


def compute_inv_freq(params: dict, head_dim: int, max_positions: int) -> tuple[np.ndarray, float, int]:
    """(inv_freq float32, attention scaling, rotary dim) for the rope types transformers knows.

    `dynamic` NTK scaling only changes frequencies beyond max_position_embeddings, which the KV cache never reaches,
    so inside the context limit it equals the default."""
    rope_type = params.get("rope_type", "default")
    base = float(params["rope_theta"])
    dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
    if rope_type in ("default", "dynamic"):
        return _arange_inv_freq(base, dim), 1.0, dim
    if rope_type == "linear":
        return (_arange_inv_freq(base, dim) / F32(params["factor"])).astype(F32), 1.0, dim
    if rope_type == "llama3":
        inv = _arange_inv_freq(base, dim)
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old = float(params["original_max_position_embeddings"])
        low_wl, high_wl = old / low, old / high
        wavelen = (F32(2 * math.pi) / inv).astype(F32)
        inv_l = np.where(wavelen > low_wl, inv / F32(factor), inv).astype(F32)
        smooth = ((F32(old) / wavelen - F32(low)) / F32(high - low)).astype(F32)
        smoothed = ((F32(1) - smooth) * inv_l / F32(factor) + smooth * inv_l).astype(F32)
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return np.where(medium, smoothed, inv_l).astype(F32), 1.0, dim
    if rope_type == "yarn":
        return _yarn(params, base, dim, max_positions)
    raise RuntimeModelError(f"rope type {rope_type!r} is not supported; supported: default, dynamic, linear, "
                            "llama3, yarn")


def _yarn(params: dict, base: float, dim: int, max_positions: int) -> tuple[np.ndarray, float, int]:
    factor = params.get("factor")
    original = params["original_max_position_embeddings"]
    if factor is None:
        factor = max_positions / original
    factor = float(factor)

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rot):
        return (dim * math.log(original / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = np.power(F32(base), np.arange(0, dim, 2).astype(F32) / F32(dim), dtype=F32)
    extrapolation = (F32(1.0) / pos_freqs).astype(F32)
    interpolation = (F32(1.0) / (F32(factor) * pos_freqs)).astype(F32)
    ramp = np.clip((np.arange(dim // 2, dtype=F32) - F32(low)) / F32(high - low), 0, 1).astype(F32)
    extra_factor = (F32(1) - ramp).astype(F32)
    inv = (interpolation * (F32(1) - extra_factor) + extrapolation * extra_factor).astype(F32)
    return inv, float(attention_factor), dim


@dataclass(frozen=True)
class RotaryEmbedding:
    """Rotary position embedding over the first `rotary_dim` features of each head.

    layout "half": transformers' rotate_half (pairs i and i + dim/2). layout "interleaved": transformers'
    apply_rotary_pos_emb_interleave (pairs 2i and 2i+1), whose output is returned de-interleaved, i.e. in the half
    layout, exactly as transformers returns it."""

    inv_freq: np.ndarray
    attention_scaling: float
    rotary_dim: int
    layout: str = "half"

    @classmethod
    def from_config(cls, config: dict, head_dim: int, layout: str = "half") -> RotaryEmbedding:
        inv, scaling, dim = compute_inv_freq(rope_parameters(config), head_dim,
                                             int(config.get("max_position_embeddings", 0) or 0))
        return cls(inv, scaling, dim, layout)

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin of shape (n, rotary_dim), float32, each row a function of its position only."""
        freqs = np.asarray(positions).astype(F32)[:, None] * self.inv_freq[None, :]
        emb = np.concatenate([freqs, freqs], axis=-1)
        scale = F32(self.attention_scaling)
        return (np.cos(emb) * scale).astype(F32), (np.sin(emb) * scale).astype(F32)

    def apply(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rotate x (n, heads, head_dim) for the given absolute positions (n,)."""
        cos, sin = self.cos_sin(positions)
        d = self.rotary_dim
        rot = x[..., :d]
        half = d // 2
        if self.layout == "interleaved":
            c, s = cos[:, None, :half], sin[:, None, :half]
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out_rot = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
        else:
            c, s = cos[:, None, :], sin[:, None, :]
            rotated = np.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
            out_rot = rot * c + rotated * s
        if d == x.shape[-1]:
            return out_rot.astype(F32)
        return np.concatenate([out_rot, x[..., d:]], axis=-1).astype(F32)


# --- attention ----------------------------------------------------------------------------------------------------


@numba.njit(cache=True, parallel=True)
def _causal_attention(q, k, v, q_pos, scaling, window, out):  # pragma: no cover - compiled
    """q (n, H, d), k (T, Hkv, d), v (T, Hkv, dv); query i sees keys 0..q_pos[i] (and > q_pos[i]-window if set)."""
    n, n_heads, d = q.shape
    n_kv = k.shape[1]
    dv = v.shape[2]
    group = n_heads // n_kv
    for job in numba.prange(n * n_heads):
        i = job // n_heads
        h = job % n_heads
        kh = h // group
        last = q_pos[i]
        first = 0
        if window > 0 and last - window + 1 > 0:
            first = last - window + 1
        count = last - first + 1
        scores = np.empty(count, np.float32)
        m = np.float32(-np.inf)
        for t in range(count):
            s = np.float32(0.0)
            for j in range(d):
                s += q[i, h, j] * k[first + t, kh, j]
            s = s * scaling
            scores[t] = s
            m = max(m, s)
        total = np.float32(0.0)
        for t in range(count):
            e = np.exp(scores[t] - m)
            scores[t] = e
            total += e
        for j in range(dv):
            out[i, h, j] = 0.0
        for t in range(count):
            p = scores[t] / total
            for j in range(dv):
                out[i, h, j] += p * v[first + t, kh, j]


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_positions: np.ndarray, scaling: float,
                     window: int | None = None) -> np.ndarray:
    """Softmax attention of queries over cached keys/values with a causal (optionally sliding-window) mask.
    Queries at cache index p see keys 0..p. Deterministic: one sequential reduction per (query, head)."""
    out = np.empty((q.shape[0], q.shape[1], v.shape[2]), dtype=F32)
    macs = q.shape[0] * q.shape[1] * k.shape[0] * (q.shape[2] + v.shape[2])
    pick_kernel(_causal_attention, macs)(np.ascontiguousarray(q, F32), np.ascontiguousarray(k, F32), np.ascontiguousarray(v, F32),
                      np.ascontiguousarray(q_positions, np.int64), F32(scaling), int(window or 0), out)
    return out


class ContextLimitError(RuntimeModelError):
    """A sequence would grow past the model's context limit (max_position_embeddings)."""


@dataclass
class KVCache:
    """Keys and values of one layer of one sequence, grown on demand up to `limit` positions."""

    limit: int
    n_kv_heads: int
    k_dim: int
    v_dim: int
    length: int = 0
    k: np.ndarray = field(default=None, repr=False)
    v: np.ndarray = field(default=None, repr=False)

    def __post_init__(self) -> None:
        cap = min(self.limit, 256)
        self.k = np.zeros((cap, self.n_kv_heads, self.k_dim), F32)
        self.v = np.zeros((cap, self.n_kv_heads, self.v_dim), F32)

    def append(self, k_new: np.ndarray, v_new: np.ndarray) -> None:
        end = self.length + k_new.shape[0]
        if end > self.limit:
            raise ContextLimitError(f"context limit reached: {end} positions > {self.limit} "
                                    "(max_position_embeddings); start a new conversation or shorten the prompt")
        if end > self.k.shape[0]:
            cap = min(self.limit, max(end, 2 * self.k.shape[0]))
            for name in ("k", "v"):
                old = getattr(self, name)
                new = np.zeros((cap,) + old.shape[1:], F32)
                new[: self.length] = old[: self.length]
                setattr(self, name, new)
        self.k[self.length:end] = k_new
        self.v[self.length:end] = v_new
        self.length = end

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


@dataclass(frozen=True)
class GQAAttention:
    """Grouped-query attention with RoPE, optional q/k RMSNorm (per head, or over the whole projection as OLMoE
    does), optional QKV clipping and sliding window. Called once per sequence with that sequence's rows."""

    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RotaryEmbedding | None
    scaling: float
    limit: int
    q_norm: RMSNorm | None = None
    k_norm: RMSNorm | None = None
    qk_norm_per_head: bool = True
    clip_qkv: float | None = None
    sliding_window: int | None = None

    def new_cache(self) -> KVCache:
        return KVCache(self.limit, self.num_kv_heads, self.head_dim, self.head_dim)

    def __call__(self, x: np.ndarray, positions: np.ndarray, cache: KVCache) -> np.ndarray:
        n = x.shape[0]
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        if not self.qk_norm_per_head:
            if self.q_norm is not None:
                q = self.q_norm(q)
            if self.k_norm is not None:
                k = self.k_norm(k)
        if self.clip_qkv is not None:
            c = F32(self.clip_qkv)
            q, k, v = np.clip(q, -c, c), np.clip(k, -c, c), np.clip(v, -c, c)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm_per_head:
            if self.q_norm is not None:
                q = self.q_norm(q)
            if self.k_norm is not None:
                k = self.k_norm(k)
        if self.rope is not None:
            q = self.rope.apply(q, positions)
            k = self.rope.apply(k, positions)
        start = cache.length
        cache.append(k, v)
        q_idx = np.arange(start, start + n, dtype=np.int64)
        o = causal_attention(q, cache.k[: cache.length], cache.v[: cache.length], q_idx, self.scaling,
                             self.sliding_window)
        return self.o_proj(o.reshape(n, self.num_heads * self.head_dim))


# --- feed-forward -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SwiGLU:
    """down(act(gate(x)) * up(x))."""

    gate: Linear
    up: Linear
    down: Linear
    act: str = "silu"

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.down(activation(self.act)(self.gate(x)) * self.up(x))


@dataclass(frozen=True)
class SoftmaxRouter:
    """softmax over expert logits (float32), top-k, optionally renormalised to sum to one (norm_topk_prob)."""

    weight: Linear
    top_k: int
    norm_topk_prob: bool

    def route(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        logits = self.weight(x)
        probs = _softmax_rows(logits)
        idx = _topk(probs, self.top_k)
        w = np.take_along_axis(probs, idx, axis=1)
        if self.norm_topk_prob:
            w = w / _sum_rows(w)[:, None]
        return w.astype(F32), idx


@dataclass(frozen=True)
class SigmoidRouter:
    """DeepSeek-V3 / GLM-4.5 routing: sigmoid scores; selection on scores + e_score_correction_bias restricted to
    the topk_group best of n_group groups (a group scores the sum of its two best); weights are the plain scores of
    the chosen experts, optionally renormalised (+1e-20), times routed_scaling_factor."""

    weight: Linear
    top_k: int
    norm_topk_prob: bool
    correction_bias: np.ndarray | None
    n_group: int
    topk_group: int
    routed_scaling_factor: float

    def route(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        logits = self.weight(x)
        scores = sigmoid(logits)
        choice = scores + self.correction_bias if self.correction_bias is not None else scores.copy()
        n, e = choice.shape
        if self.n_group > 1:
            per_group = e // self.n_group
            grouped = choice.reshape(n, self.n_group, per_group)
            top2 = -np.sort(-grouped, axis=-1)[..., :2]
            group_scores = top2[..., 0] + top2[..., 1] if per_group > 1 else top2[..., 0]
            keep = _topk(group_scores.astype(F32), self.topk_group)
            mask = np.zeros((n, self.n_group), dtype=bool)
            np.put_along_axis(mask, keep, True, axis=1)
            choice = np.where(np.repeat(mask, per_group, axis=1), choice, F32(-np.inf))
        idx = _topk(choice.astype(F32), self.top_k)
        w = np.take_along_axis(scores, idx, axis=1)
        if self.norm_topk_prob:
            w = w / (_sum_rows(w)[:, None] + F32(1e-20))
        return (w * F32(self.routed_scaling_factor)).astype(F32), idx


def _softmax_rows(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=1, keepdims=True)
    e = np.exp(x - m)
    return (e / _sum_rows(e)[:, None]).astype(F32)


def _sum_rows(x: np.ndarray) -> np.ndarray:
    """Row sums accumulated left to right (fixed order, independent of the other rows)."""
    acc = np.zeros(x.shape[0], dtype=F32)
    for j in range(x.shape[1]):
        acc = acc + x[:, j]
    return acc


def _topk(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values per row (ties: the lower index first, as a stable sort gives)."""
    order = np.argsort(-x, axis=1, kind="stable")
    return order[:, :k]


@dataclass(frozen=True)
class MoE:
    """Routed experts (through an ExpertProvider) plus optional shared experts.

    Rows choosing the same expert run through it together (batch-union; the kernels are row-independent so this
    changes no bits). Each row's expert outputs are weighted and summed in ascending expert order starting from
    zero, as transformers' index_add_ loop does. Shared experts add after the routed sum; qwen2_moe scales them by
    sigmoid(shared_expert_gate(x))."""

    layer: int
    router: SoftmaxRouter | SigmoidRouter
    experts: ExpertProvider
    shared: SwiGLU | None = None
    shared_gate: Linear | None = None
    act: str = "silu"

    def __call__(self, x: np.ndarray) -> np.ndarray:
        t0 = timesplit.clock()
        weights, ids = self.router.route(x)
        observe = getattr(self.experts, "observe_routing", None)
        if observe is not None:
            observe(self.layer, ids)
        union = [int(e) for e in np.unique(ids)]
        request = getattr(self.experts, "request", None)
        # A provider that streams starts its reads now; the shared expert computes while they are in flight.
        arrivals = request(self.layer, union) if request is not None else None
        shared = None
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = sigmoid(self.shared_gate(x)) * shared
        if arrivals is None:
            arrivals = zip(union, self.experts.get(self.layer, union))
        out = self.routed(x, weights, ids, arrivals)
        if shared is not None:
            out = out + shared
        timesplit.SPLIT.moe += timesplit.clock() - t0
        return out

    def routed(self, x: np.ndarray, weights: np.ndarray, ids: np.ndarray, arrivals) -> np.ndarray:
        """Each expert's contribution is computed as the expert arrives (in any order); the contributions are then
        added in ascending expert order, so the bits never depend on which expert came first."""
        act = activation(self.act)
        contributions = {}
        for e, rec in arrivals:
            rows, slot = np.nonzero(ids == e)
            xs = x[rows]
            h = act(_lin(xs, rec.gate)) * _lin(xs, rec.up)
            contributions[e] = (rows, _lin(h, rec.down) * weights[rows, slot][:, None])
        out = np.zeros_like(x, dtype=F32)
        for e in sorted(contributions):
            rows, y = contributions[e]
            out[rows] = out[rows] + y
        return out


def _lin(x, w):
    from .kernels import linear

    return linear(x, w)
