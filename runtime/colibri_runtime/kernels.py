"""Matrix kernels of the runtime: float32 activations times an encoded weight, deterministic by construction.

`linear(x, w)` computes y[n, out] = x[n, in] @ W[out, in].T for a weight prepared by `prepare_weight` from a
QuantizedTensor (int4_gs64, int8_gs64, f32, f16, bf16).

Determinism (the reason these kernels exist instead of BLAS): every output element y[i, o] is computed by one
thread in one fixed order that depends on neither the other rows of x nor the thread count.
- The input dimension is walked in blocks of 64 (one quantization group; the activations are zero-padded to a
  whole number of groups, matching the zero codes stored in the padding).
- Inside a block, 32 float32 lanes each form x[j] * c[j] + x[j+32] * c[j+32] (c: the integer code as float32, or the
  float weight), multiply by the group's float16 scale (1 for float weights) and add to their running sum. Lanes
  are independent, so the compiler may vectorize them without reordering any addition.
- After the last group the 32 lanes are summed pairwise in a fixed tree, then the bias (if any) is added.
Work is split across threads by output feature only, so the thread count cannot change a sum. The one-row path
(decode) and the many-row path (prefill) evaluate the same expression for each element, hence the same bits: the
many-row path merely decodes a weight row once and reuses it for every activation row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np

from colibri_format.constants import GROUP_SIZE, Encoding
from colibri_format.errors import RuntimeModelError
from colibri_format.quant import QuantizedTensor, dequantize

LANES = GROUP_SIZE // 2

# Kinds of prepared weights understood by the kernels.
KIND_INT4 = 0
KIND_INT8 = 1
KIND_F32 = 2


@dataclass(frozen=True)
class PreparedWeight:
    """A weight matrix in the layout the kernels read: rows = output features, groups of 64 along the input.

    int4: data uint8 (out, groups*32); int8: data int8 (out, groups*64); f32: data float32 (out, groups*64)
    zero-padded. `scales` is float32 (out, groups) (ones for f32, unused). `in_features` is the logical width.
    """

    kind: int
    data: np.ndarray
    scales: np.ndarray
    out_features: int
    in_features: int
    groups: int

    @property
    def nbytes(self) -> int:
        """Bytes the kernel streams per pass over the weight (packed data plus scales as stored)."""
        scale_bytes = 0 if self.kind == KIND_F32 else self.scales.size * 2
        return int(self.data.nbytes + scale_bytes)


def _padded_width(width: int) -> int:
    return -(-width // GROUP_SIZE) * GROUP_SIZE


def prepare_weight(qt: QuantizedTensor) -> PreparedWeight:
    """Kernel-ready view of a 2-D encoded weight. Quantized data stays zero-copy (mmap views are kept as they are);
    float encodings are widened once to float32 and padded to whole groups."""
    if len(qt.shape) != 2:
        raise RuntimeModelError(f"a linear weight must be 2-D, got shape {qt.shape}")
    out_f, in_f = (int(d) for d in qt.shape)
    groups = -(-in_f // GROUP_SIZE)
    if qt.encoding == Encoding.INT4_GS64:
        data = np.ascontiguousarray(qt.data, dtype=np.uint8).reshape(out_f, groups * LANES)
        scales = np.ascontiguousarray(qt.scales).reshape(out_f, groups).astype(np.float32)
        return PreparedWeight(KIND_INT4, data, scales, out_f, in_f, groups)
    if qt.encoding == Encoding.INT8_GS64:
        data = np.ascontiguousarray(qt.data).view(np.int8).reshape(out_f, groups * GROUP_SIZE)
        scales = np.ascontiguousarray(qt.scales).reshape(out_f, groups).astype(np.float32)
        return PreparedWeight(KIND_INT8, data, scales, out_f, in_f, groups)
    if qt.encoding in (Encoding.F32, Encoding.F16, Encoding.BF16):
        dense = dequantize(qt)
        data = np.zeros((out_f, groups * GROUP_SIZE), dtype=np.float32)
        data[:, :in_f] = dense
        return PreparedWeight(KIND_F32, data, np.ones((out_f, groups), np.float32), out_f, in_f, groups)
    raise RuntimeModelError(f"encoding {qt.encoding!r} is not supported by the runtime kernels")


def prepare_dense(w: np.ndarray) -> PreparedWeight:
    """Kernel-ready float32 weight from a plain (out, in) array."""
    return prepare_weight(QuantizedTensor(Encoding.F32, tuple(w.shape), np.ascontiguousarray(w, np.float32)))


def pad_activations(x: np.ndarray, width: int) -> np.ndarray:
    """float32 C-contiguous (n, groups*64) copy/view of x (n, width), zero-padded on the right."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    padded = _padded_width(width)
    if x.shape[1] == padded:
        return x
    out = np.zeros((x.shape[0], padded), dtype=np.float32)
    out[:, :width] = x
    return out


# --- compiled kernels ---------------------------------------------------------------------------------------------


@numba.njit(cache=True, inline="always")
def _reduce_lanes(acc):  # pragma: no cover - compiled
    # Fixed pairwise tree over 32 lanes.
    t16 = np.empty(16, np.float32)
    for j in range(16):
        t16[j] = acc[j] + acc[j + 16]
    for j in range(8):
        t16[j] = t16[j] + t16[j + 8]
    for j in range(4):
        t16[j] = t16[j] + t16[j + 4]
    a = t16[0] + t16[2]
    b = t16[1] + t16[3]
    return a + b


@numba.njit(cache=True, inline="always")
def _decode_row_int4(data, o, groups, codes):  # pragma: no cover - compiled
    for g in range(groups):
        for j in range(32):
            byte = data[o, g * 32 + j]
            codes[g * 64 + j] = np.float32(np.int32(byte & 15) - 8)
            codes[g * 64 + j + 32] = np.float32(np.int32(byte >> 4) - 8)


@numba.njit(cache=True, inline="always")
def _decode_row_int8(data, o, groups, codes):  # pragma: no cover - compiled
    for k in range(groups * 64):
        codes[k] = np.float32(data[o, k])


@numba.njit(cache=True, inline="always")
def _dot_codes(xrow, codes, scales, o, groups, acc):  # pragma: no cover - compiled
    for j in range(32):
        acc[j] = np.float32(0.0)
    for g in range(groups):
        s = scales[o, g]
        base = g * 64
        for j in range(32):
            acc[j] += s * (xrow[base + j] * codes[base + j] + xrow[base + j + 32] * codes[base + j + 32])
    return _reduce_lanes(acc)


@numba.njit(cache=True, parallel=True)
def _matmul_int4_one(x, data, scales, groups, bias, has_bias, y):  # pragma: no cover - compiled
    out_f = data.shape[0]
    for o in numba.prange(out_f):
        acc = np.empty(32, np.float32)
        for j in range(32):
            acc[j] = np.float32(0.0)
        for g in range(groups):
            s = scales[o, g]
            base = g * 64
            for j in range(32):
                byte = data[o, g * 32 + j]
                lo = np.float32(np.int32(byte & 15) - 8)
                hi = np.float32(np.int32(byte >> 4) - 8)
                acc[j] += s * (x[0, base + j] * lo + x[0, base + j + 32] * hi)
        r = _reduce_lanes(acc)
        if has_bias:
            r = r + bias[o]
        y[0, o] = r


@numba.njit(cache=True, parallel=True)
def _matmul_int8_one(x, data, scales, groups, bias, has_bias, y):  # pragma: no cover - compiled
    out_f = data.shape[0]
    for o in numba.prange(out_f):
        acc = np.empty(32, np.float32)
        for j in range(32):
            acc[j] = np.float32(0.0)
        for g in range(groups):
            s = scales[o, g]
            base = g * 64
            for j in range(32):
                lo = np.float32(data[o, base + j])
                hi = np.float32(data[o, base + j + 32])
                acc[j] += s * (x[0, base + j] * lo + x[0, base + j + 32] * hi)
        r = _reduce_lanes(acc)
        if has_bias:
            r = r + bias[o]
        y[0, o] = r


@numba.njit(cache=True, parallel=True)
def _matmul_f32_one(x, data, scales, groups, bias, has_bias, y):  # pragma: no cover - compiled
    out_f = data.shape[0]
    for o in numba.prange(out_f):
        acc = np.empty(32, np.float32)
        for j in range(32):
            acc[j] = np.float32(0.0)
        for g in range(groups):
            s = scales[o, g]
            base = g * 64
            for j in range(32):
                acc[j] += s * (x[0, base + j] * data[o, base + j] + x[0, base + j + 32] * data[o, base + j + 32])
        r = _reduce_lanes(acc)
        if has_bias:
            r = r + bias[o]
        y[0, o] = r


@numba.njit(cache=True, parallel=True)
def _matmul_many(x, kind, data_u8, data_i8, data_f32, scales, groups, bias, has_bias, y):  # pragma: no cover
    n = x.shape[0]
    out_f = y.shape[1]
    width = groups * 64
    for o in numba.prange(out_f):
        acc = np.empty(32, np.float32)
        if kind == 2:
            codes = data_f32[o]
        else:
            codes = np.empty(width, np.float32)
            if kind == 0:
                _decode_row_int4(data_u8, o, groups, codes)
            else:
                _decode_row_int8(data_i8, o, groups, codes)
        for i in range(n):
            r = _dot_codes(x[i], codes, scales, o, groups, acc)
            if has_bias:
                r = r + bias[o]
            y[i, o] = r


_EMPTY_U8 = np.zeros((1, 1), np.uint8)
_EMPTY_I8 = np.zeros((1, 1), np.int8)
_EMPTY_F32 = np.zeros((1, 1), np.float32)
_NO_BIAS = np.zeros(1, np.float32)


def linear(x: np.ndarray, w: PreparedWeight, bias: np.ndarray | None = None) -> np.ndarray:
    """y[n, out] = x[n, in] @ W.T (+ bias), float32, deterministic (see the module docstring)."""
    if x.ndim != 2 or x.shape[1] != w.in_features:
        raise RuntimeModelError(f"activation shape {x.shape} does not fit a weight of shape "
                                f"({w.out_features}, {w.in_features})")
    n = x.shape[0]
    y = np.empty((n, w.out_features), dtype=np.float32)
    if n == 0:
        return y
    xp = pad_activations(x, w.in_features)
    has_bias = bias is not None
    b = _NO_BIAS if bias is None else np.ascontiguousarray(bias, dtype=np.float32)
    if n == 1:
        if w.kind == KIND_INT4:
            _matmul_int4_one(xp, w.data, w.scales, w.groups, b, has_bias, y)
        elif w.kind == KIND_INT8:
            _matmul_int8_one(xp, w.data, w.scales, w.groups, b, has_bias, y)
        else:
            _matmul_f32_one(xp, w.data, w.scales, w.groups, b, has_bias, y)
        return y
    u8 = w.data if w.kind == KIND_INT4 else _EMPTY_U8
    i8 = w.data if w.kind == KIND_INT8 else _EMPTY_I8
    f32 = w.data if w.kind == KIND_F32 else _EMPTY_F32
    _matmul_many(xp, w.kind, u8, i8, f32, w.scales, w.groups, b, has_bias, y)
    return y


def warm_up() -> None:
    """Compile (or load from the on-disk cache) every kernel once."""
    rng = np.random.default_rng(0)
    from colibri_format.quant import quantize

    w = rng.standard_normal((4, 70)).astype(np.float32)
    for enc in (Encoding.INT4_GS64, Encoding.INT8_GS64, Encoding.F32):
        pw = prepare_weight(quantize(w, enc))
        for n in (1, 3):
            linear(rng.standard_normal((n, 70)).astype(np.float32), pw, np.ones(4, np.float32))
