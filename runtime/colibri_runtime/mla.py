"""Multi-head Latent Attention (MLA) of DeepSeek-V2/V3 and GLM-5, over the compressed per-token state.

What one token leaves behind in a layer is only its compressed latent (`kv_lora_rank` floats, after
`kv_a_layernorm`) and its shared rotary key (`qk_rope_head_dim` floats, after RoPE): 512 + 64 = 576 floats at
DeepSeek-V3 / GLM-5 dimensions, instead of heads * (k + v) floats for an expanded cache. Keys and values are never
stored; they are functions of the latent through `kv_b_proj`.

Two ways to attend over that state, which agree within float32 rounding:
- expanded (`attend_expanded`, used for prefill): latent @ kv_b_proj.T gives every head's k_nope and v, then plain
  softmax attention, as transformers' DeepseekV3Attention / GlmMoeDsaAttention compute it;
- absorbed (`attend_absorbed`, used for decode): W_uk (the k_nope rows of kv_b_proj) is folded into the query
  (q_lat = q_nope @ W_uk, one kv_lora_rank vector per head) and W_uv into the output (out = (p @ latent) @ W_uv.T),
  so scores and the weighted sum run over the latent directly and nothing per key is expanded.

The scores of head h for key t are (q_nope[h] . k_nope[h, t] + q_pe[h] . k_pe[t]) * scaling, with `scaling` the
softmax scale qk_head_dim ** -0.5 multiplied by mscale(factor, mscale_all_dim) ** 2 when the config's rope is YaRN.

`allowed` masks ([queries, keys] bool) say which keys a query may see: causal by default, further restricted by
DSA's indexer (see dsa.py). Masked scores are -inf; a query always sees at least one key.

Everything here is numpy over one sequence; linear layers are callables x[n, in] -> y[n, out] so the caller decides
how weights are stored (encoded kernels or dense arrays).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numba
import numpy as np

from colibri_format.errors import RuntimeModelError

from .kernels import pick_kernel

F32 = np.float32
Linear = Callable[[np.ndarray], np.ndarray]

# q_a_layernorm and kv_a_layernorm are built with the RMSNorm default epsilon, not config.rms_norm_eps.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLAConfig:
    """Dimensions and constants of one MLA layer, read from a Hugging Face config dict."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    scaling: float

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def state_width(self) -> int:
        """Floats kept per token: the normalized latent, then the roped shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, config: dict, *, force_interleave: bool | None = None) -> MLAConfig:
        qk_head_dim = int(config["qk_nope_head_dim"]) + int(config["qk_rope_head_dim"])
        interleave = (
            bool(config.get("rope_interleave", True)) if force_interleave is None else force_interleave
        )
        return cls(
            hidden_size=int(config["hidden_size"]),
            num_heads=int(config["num_attention_heads"]),
            q_lora_rank=None if config.get("q_lora_rank") is None else int(config["q_lora_rank"]),
            kv_lora_rank=int(config["kv_lora_rank"]),
            qk_nope_head_dim=int(config["qk_nope_head_dim"]),
            qk_rope_head_dim=int(config["qk_rope_head_dim"]),
            v_head_dim=int(config["v_head_dim"]),
            rope_interleave=interleave,
            scaling=softmax_scaling(config, qk_head_dim),
        )


def rope_parameters(config: dict) -> dict:
    """The config's rope parameters in the transformers 5 layout (`rope_parameters`), or the legacy
    `rope_scaling` + `rope_theta` keys folded into one dict."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and params:
        return params
    legacy = dict(config.get("rope_scaling") or {})
    if "type" in legacy and "rope_type" not in legacy:
        legacy["rope_type"] = legacy.pop("type")
    legacy.setdefault("rope_type", "default")
    legacy.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return legacy


def yarn_mscale(scale: float, mscale: float) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def softmax_scaling(config: dict, qk_head_dim: int) -> float:
    """qk_head_dim ** -0.5, times mscale ** 2 for YaRN configs with mscale_all_dim (DeepSeek's long-context fix)."""
    scaling = qk_head_dim ** (-0.5)
    params = rope_parameters(config)
    if params.get("rope_type", "default") != "default":
        mscale_all_dim = params.get("mscale_all_dim", 0)
        if mscale_all_dim:
            m = yarn_mscale(params["factor"], mscale_all_dim)
            scaling = scaling * m * m
    return scaling


@dataclass(frozen=True)
class MLAWeights:
    """One layer's MLA weights. Linear callables map x[n, in] -> x @ W.T; `kv_b` is the dense float32
    kv_b_proj weight [heads * (qk_nope + v), kv_lora_rank], needed as a matrix for the absorbed path."""

    kv_a_proj: Linear
    kv_a_norm: np.ndarray
    kv_b: np.ndarray
    o_proj: Linear
    q_proj: Linear | None = None
    q_a_proj: Linear | None = None
    q_a_norm: np.ndarray | None = None
    q_b_proj: Linear | None = None


@dataclass(frozen=True)
class Projected:
    """What the projections of S new tokens give: per-head queries and the tokens' own state."""

    q_nope: np.ndarray  # [S, H, qk_nope]
    q_pe: np.ndarray  # [S, H, qk_rope], roped
    latent: np.ndarray  # [S, kv_lora_rank], normalized
    k_pe: np.ndarray  # [S, qk_rope], roped
    q_resid: np.ndarray | None  # [S, q_lora_rank]: q_a_layernorm(q_a_proj(x)), the DSA indexer's query input


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float32, copy=False)
    variance = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
    return weight * (x * (np.float32(1.0) / np.sqrt(variance + np.float32(eps))))


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleave: bool) -> np.ndarray:
    """RoPE over the last dimension of x [S, ..., d] with cos/sin [S, d] laid out as cat(freqs, freqs) (the
    transformers convention, YaRN attention factor already folded in).

    interleave=True rotates pairs (x0, x1), (x2, x3), ... and returns them de-interleaved as
    cat(even', odd'), exactly like transformers' apply_rotary_pos_emb_interleave; keys and queries get the same
    layout, so their dot products are those of the interleaved rotation."""
    extra = x.ndim - cos.ndim
    shape = (cos.shape[0],) + (1,) * extra + (cos.shape[-1],)
    cos = cos.reshape(shape)
    sin = sin.reshape(shape)
    half = x.shape[-1] // 2
    if interleave:
        c, s = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _latent_norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    return rms_norm(x, weight, LATENT_NORM_EPS)


def project(
    cfg: MLAConfig, w: MLAWeights, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, norm=_latent_norm
) -> Projected:
    """Queries, latent and rotary key of the tokens x [S, hidden] at the positions cos/sin [S, rope] describe.
    `norm(x, weight)` is the RMSNorm of q_a_layernorm / kv_a_layernorm."""
    seq = x.shape[0]
    q_resid = None
    if cfg.q_lora_rank is None:
        q = w.q_proj(x)
    else:
        q_resid = norm(w.q_a_proj(x), w.q_a_norm)
        q = w.q_b_proj(q_resid)
    q = q.reshape(seq, cfg.num_heads, cfg.qk_head_dim)
    q_nope = np.ascontiguousarray(q[..., : cfg.qk_nope_head_dim])
    q_pe = apply_rope(q[..., cfg.qk_nope_head_dim :], cos, sin, cfg.rope_interleave)

    compressed = w.kv_a_proj(x)
    latent = norm(np.ascontiguousarray(compressed[:, : cfg.kv_lora_rank]), w.kv_a_norm)
    k_pe = apply_rope(compressed[:, cfg.kv_lora_rank :], cos, sin, cfg.rope_interleave)
    return Projected(q_nope, q_pe, np.ascontiguousarray(latent), np.ascontiguousarray(k_pe), q_resid)


def causal_allowed(num_queries: int, num_keys: int) -> np.ndarray:
    """[S, T] bool: the S queries are the last S of the T keys' positions and see themselves and everything before."""
    offset = num_keys - num_queries
    return np.arange(num_keys)[None, :] <= (np.arange(num_queries)[:, None] + offset)


def _softmax_rows(scores: np.ndarray) -> np.ndarray:
    peak = np.max(scores, axis=-1, keepdims=True)
    e = np.exp(scores - peak)
    return e / np.sum(e, axis=-1, keepdims=True, dtype=np.float32)


def _masked(scores: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """scores [H, S, T] with -inf where allowed [S, T] is False."""
    return np.where(allowed[None, :, :], scores, np.float32(-np.inf))


def _split_kv_b(cfg: MLAConfig, kv_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """W_uk [H, qk_nope, r] and W_uv [H, v, r] views of kv_b_proj."""
    per_head = kv_b.reshape(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    return per_head[:, : cfg.qk_nope_head_dim, :], per_head[:, cfg.qk_nope_head_dim :, :]


def attend_expanded(
    cfg: MLAConfig,
    kv_b: np.ndarray,
    q_nope: np.ndarray,
    q_pe: np.ndarray,
    latent: np.ndarray,
    k_pe: np.ndarray,
    allowed: np.ndarray,
) -> np.ndarray:
    """Attention of S queries over T cached tokens with keys/values expanded from the latent. Returns [S, H * v]."""
    seq, num_keys = allowed.shape
    kv = (latent @ kv_b.T).reshape(num_keys, cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim)
    k_nope = kv[..., : cfg.qk_nope_head_dim].transpose(1, 0, 2)  # [H, T, dn]
    values = kv[..., cfg.qk_nope_head_dim :].transpose(1, 0, 2)  # [H, T, v]
    keys = np.concatenate(
        [k_nope, np.broadcast_to(k_pe[None], (cfg.num_heads, num_keys, cfg.qk_rope_head_dim))], axis=-1
    )
    query = np.concatenate([q_nope, q_pe], axis=-1).transpose(1, 0, 2)  # [H, S, dqk]
    scores = (query @ keys.transpose(0, 2, 1)) * np.float32(cfg.scaling)
    probs = _softmax_rows(_masked(scores, allowed))
    out = probs @ values  # [H, S, v]
    return np.ascontiguousarray(out.transpose(1, 0, 2)).reshape(seq, cfg.num_heads * cfg.v_head_dim)


def attend_absorbed(
    cfg: MLAConfig,
    kv_b: np.ndarray,
    q_nope: np.ndarray,
    q_pe: np.ndarray,
    latent: np.ndarray,
    k_pe: np.ndarray,
    allowed: np.ndarray,
) -> np.ndarray:
    """The same attention computed over the latent: kv_b_proj folded into the query and the output.

    A single query attends over the keys it is allowed to see only (gathered in position order), so a sparse DSA
    selection costs topk keys, not all of them."""
    seq = allowed.shape[0]
    w_uk, w_uv = _split_kv_b(cfg, kv_b)
    q_lat = np.matmul(q_nope.transpose(1, 0, 2), w_uk)  # [H, S, r]
    if seq == 1:
        keep = np.flatnonzero(allowed[0])
        latent, k_pe, allowed = latent[keep], k_pe[keep], allowed[:, keep]
    scores = (q_lat @ latent.T + q_pe.transpose(1, 0, 2) @ k_pe.T) * np.float32(cfg.scaling)  # [H, S, T]
    probs = _softmax_rows(_masked(scores, allowed))
    o_lat = probs @ latent  # [H, S, r]
    out = np.matmul(o_lat, w_uv.transpose(0, 2, 1))  # [H, S, v]
    return np.ascontiguousarray(out.transpose(1, 0, 2)).reshape(seq, cfg.num_heads * cfg.v_head_dim)


def attend(
    cfg: MLAConfig,
    kv_b: np.ndarray,
    proj: Projected,
    latent: np.ndarray,
    k_pe: np.ndarray,
    allowed: np.ndarray | None = None,
    *,
    absorb: bool | None = None,
) -> np.ndarray:
    """Attention of the projected queries over all T cached tokens (latent [T, r], k_pe [T, rope], the new tokens
    included as the last S). absorb=None picks the absorbed form for a single query (decode), expanded otherwise."""
    seq = proj.q_nope.shape[0]
    if allowed is None:
        allowed = causal_allowed(seq, latent.shape[0])
    if absorb is None:
        absorb = seq == 1
    fn = attend_absorbed if absorb else attend_expanded
    return fn(cfg, kv_b, proj.q_nope, proj.q_pe, latent, k_pe, allowed)


# --- the runtime layer: deterministic kernels over a growing compressed cache -------------------------------------
#
# The runtime always attends in the absorbed form, for prefill chunks and decode steps alike, with one sequential
# reduction per (query, head) in a fixed order: a row's result depends only on that row and the cached state, never
# on how a prompt was chunked (the DecoderModel contract), so a session restored from `.coli_kv` continues with the
# very bits an uninterrupted one produces. `attend_expanded` above remains the reference form of the same function.


@numba.njit(cache=True, inline="always")
def _dot(a, b, n):  # pragma: no cover - compiled
    """sum(a[:n] * b[:n]) in 8 fixed lanes, then a fixed tree: vectorizable and order-stable."""
    acc = np.zeros(8, np.float32)
    full = n - n % 8
    for j0 in range(0, full, 8):
        for k in range(8):
            acc[k] += a[j0 + k] * b[j0 + k]
    tail = np.float32(0.0)
    for j in range(full, n):
        tail += a[j] * b[j]
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7])) + tail


@numba.njit(cache=True, parallel=True, nogil=True)
def _mla_absorbed_kernel(q_nope, q_pe, w_uk, w_uv, latent, k_pe, q_pos, sel, sel_count, scaling, out):
    """out[i, h] = W_uv[h] @ sum_t softmax_t((q_nope W_uk . latent_t + q_pe . k_pe_t) * scaling) latent_t.

    Query i sees keys sel[i, :sel_count[i]] (ascending), or every key 0..q_pos[i] when sel_count[i] < 0."""
    n, n_heads, dn = q_nope.shape
    r = latent.shape[1]
    dr = k_pe.shape[1]
    dv = w_uv.shape[1]
    for job in numba.prange(n * n_heads):
        i = job // n_heads
        h = job % n_heads
        q_lat = np.zeros(r, np.float32)
        for j in range(dn):
            qv = q_nope[i, h, j]
            for c in range(r):
                q_lat[c] += qv * w_uk[h, j, c]
        count = sel_count[i]
        dense = count < 0
        if dense:
            count = q_pos[i] + 1
        scores = np.empty(count, np.float32)
        m = np.float32(-np.inf)
        for t in range(count):
            key = t if dense else sel[i, t]
            s = _dot(q_lat, latent[key], r) + _dot(q_pe[i, h], k_pe[key], dr)
            s = s * scaling
            scores[t] = s
            m = max(m, s)
        total = np.float32(0.0)
        for t in range(count):
            e = np.exp(scores[t] - m)
            scores[t] = e
            total += e
        o_lat = np.zeros(r, np.float32)
        for t in range(count):
            key = t if dense else sel[i, t]
            p = scores[t] / total
            for c in range(r):
                o_lat[c] += p * latent[key, c]
        for j in range(dv):
            out[i, h, j] = _dot(w_uv[h, j], o_lat, r)


def attend_latent(
    cfg: MLAConfig,
    w_uk: np.ndarray,
    w_uv: np.ndarray,
    q_nope: np.ndarray,
    q_pe: np.ndarray,
    latent: np.ndarray,
    k_pe: np.ndarray,
    q_positions: np.ndarray,
    selection: tuple[np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
    """Deterministic absorbed attention; q_positions are cache indices (query i sees keys 0..q_positions[i]).
    selection = (sel [n, k] ascending key indices, counts [n]) restricts each query to its DSA keys; a count of -1
    means every causal key. Returns [n, H * v]."""
    n = q_nope.shape[0]
    if selection is None:
        sel = np.zeros((n, 1), np.int64)
        counts = np.full(n, -1, np.int64)
    else:
        sel, counts = selection
    out = np.empty((n, cfg.num_heads, cfg.v_head_dim), F32)
    macs = n * cfg.num_heads * (latent.shape[0] * (latent.shape[1] + k_pe.shape[1]) + w_uk.shape[1] * w_uk.shape[2])
    pick_kernel(_mla_absorbed_kernel, macs)(
        np.ascontiguousarray(q_nope, F32),
        np.ascontiguousarray(q_pe, F32),
        w_uk,
        w_uv,
        np.ascontiguousarray(latent, F32),
        np.ascontiguousarray(k_pe, F32),
        np.ascontiguousarray(q_positions, np.int64),
        np.ascontiguousarray(sel, np.int64),
        np.ascontiguousarray(counts, np.int64),
        F32(cfg.scaling),
        out,
    )
    return out.reshape(n, cfg.num_heads * cfg.v_head_dim)


@dataclass
class MLACache:
    """One layer's compressed state for one sequence: latent [T, r], rope key [T, dr] and, on DSA layers with an
    indexer, the indexer key [T, di]; grown on demand up to `limit` positions.

    `selection` holds the DSA choice of the last forward's rows ((sel, counts), see attend_latent) so that a
    "shared" layer can reuse it; `source` is, on such a layer, the cache of the full layer it borrows from."""

    limit: int
    widths: tuple[int, ...]  # (kv_lora_rank, qk_rope_head_dim[, index_head_dim])
    length: int = 0
    parts: list[np.ndarray] = None
    selection: tuple[np.ndarray, np.ndarray] | None = None
    source: MLACache | None = None

    def __post_init__(self) -> None:
        cap = min(self.limit, 256)
        self.parts = [np.zeros((cap, w), F32) for w in self.widths]

    @property
    def state_width(self) -> int:
        return sum(self.widths)

    def view(self, part: int) -> np.ndarray:
        return self.parts[part][: self.length]

    def append(self, *new: np.ndarray) -> None:
        end = self.length + new[0].shape[0]
        if end > self.limit:
            raise RuntimeModelError(
                f"context limit reached: {end} positions > {self.limit} (max_position_embeddings); "
                "start a new conversation or shorten the prompt"
            )
        if end > self.parts[0].shape[0]:
            cap = min(self.limit, max(end, 2 * self.parts[0].shape[0]))
            grown = []
            for old in self.parts:
                arr = np.zeros((cap, old.shape[1]), F32)
                arr[: self.length] = old[: self.length]
                grown.append(arr)
            self.parts = grown
        for arr, rows in zip(self.parts, new, strict=True):
            arr[self.length : end] = rows
        self.length = end

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def export_rows(self, start: int, stop: int) -> np.ndarray:
        """[stop - start, state_width]: the persistent state of those tokens (latent, rope key[, indexer key])."""
        return np.concatenate([p[start:stop] for p in self.parts], axis=1)

    def import_rows(self, rows: np.ndarray) -> None:
        """Append tokens' persistent state as export_rows gives it."""
        offs = np.cumsum((0,) + self.widths)
        self.append(*(rows[:, offs[k] : offs[k + 1]] for k in range(len(self.widths))))


@dataclass(frozen=True)
class MLAAttention:
    """The runtime MLA layer (DecoderModel attention protocol): `new_cache()`, `__call__(x, positions, cache)`.

    `indexer` (dsa.Indexer) is set on DSA layers that run their own indexer; `shares_selection` marks DSA layers
    that reuse the selection of the full layer their cache's `source` points to."""

    cfg: MLAConfig
    weights: MLAWeights
    rope: object  # layers.RotaryEmbedding (cos_sin(positions) -> cos, sin of [n, qk_rope_head_dim])
    limit: int
    norm: Callable[[np.ndarray, np.ndarray], np.ndarray]  # (x, weight) -> RMSNorm(x) with LATENT_NORM_EPS
    w_uk: np.ndarray  # [H, qk_nope, r], contiguous
    w_uv: np.ndarray  # [H, v, r], contiguous
    indexer: object | None = None
    shares_selection: bool = False

    @classmethod
    def create(
        cls,
        cfg: MLAConfig,
        weights: MLAWeights,
        rope,
        limit: int,
        norm,
        indexer=None,
        shares_selection: bool = False,
    ) -> MLAAttention:
        w_uk, w_uv = _split_kv_b(cfg, np.asarray(weights.kv_b, F32))
        return cls(
            cfg,
            weights,
            rope,
            limit,
            norm,
            np.ascontiguousarray(w_uk),
            np.ascontiguousarray(w_uv),
            indexer,
            shares_selection,
        )

    def new_cache(self) -> MLACache:
        widths = (self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim)
        if self.indexer is not None:
            widths += (self.indexer.cfg.head_dim,)
        return MLACache(self.limit, widths)

    def __call__(self, x: np.ndarray, positions: np.ndarray, cache: MLACache) -> np.ndarray:
        n = x.shape[0]
        cos, sin = self.rope.cos_sin(positions)
        p = project(self.cfg, self.weights, x, cos, sin, norm=self.norm)
        start = cache.length
        q_idx = np.arange(start, start + n, dtype=np.int64)
        selection = None
        if self.indexer is not None:
            cache.append(p.latent, p.k_pe, self.indexer.keys(x, cos, sin))
            selection = self.indexer.select(x, p.q_resid, cos, sin, cache.view(2), q_idx)
        else:
            cache.append(p.latent, p.k_pe)
            if self.shares_selection:
                selection = cache.source.selection
        cache.selection = selection
        o = attend_latent(
            self.cfg, self.w_uk, self.w_uv, p.q_nope, p.q_pe, cache.view(0), cache.view(1), q_idx, selection
        )
        return self.weights.o_proj(o)
