"""Encoding for the converter: grouped int4/int8 straight from bf16 source bits, with the reconstruction error.

`encode_bf16` gives the same bytes as `colibri_format.quant.quantize(bf16_bits_to_f32(bits), encoding)` (tests check
it bit for bit) without a float32 copy of the tensor: one pass finds each group's extreme on the raw bits (|x| of a
bf16 orders like its low 15 bits), a second writes the codes and sums the squared error and the squared values in
float64 as it goes. `error_sums` computes the same two sums for a float32 tensor already encoded by the library (any
other source dtype), in the same order, so both paths report the same error for the same values.

The kernels are serial and release the GIL: the converter runs them on a few threads of its own, which behaves far
better than numba's parallel loops on a small machine shared with other work.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from colibri_format.constants import (
    GROUP_SIZE,
    INT4_BYTES_PER_GROUP,
    INT4_SCALE_DIVISOR,
    INT8_SCALE_DIVISOR,
    Encoding,
)
from colibri_format.errors import QuantizationError
from colibri_format.quant import QuantizedTensor, bf16_bits_to_f32, num_groups

FAST_ENCODINGS = (Encoding.INT4_GS64, Encoding.INT8_GS64)


@numba.njit(cache=True, nogil=True)
def bf16_extremes(bits, signed, out):  # pragma: no cover - compiled
    # Per group: the bits of the element of largest magnitude (first on ties), or of its magnitude.
    # Returns False if any element is NaN or infinite.
    n_rows, width = bits.shape
    n_groups = out.shape[1]
    finite = True
    for r in range(n_rows):
        for g in range(n_groups):
            stop = min(width, g * 64 + 64)
            best_mag = 0
            for col in range(g * 64, stop):
                best_mag = max(best_mag, np.int32(bits[r, col]) & 0x7FFF)
            best = 0
            for col in range(g * 64, stop):
                if np.int32(bits[r, col]) & 0x7FFF == best_mag:
                    best = np.int32(bits[r, col])
                    break
            if best_mag >= 0x7F80:
                finite = False
            out[r, g] = np.uint16(best if signed else best_mag)
    return finite

@numba.njit(cache=True, nogil=True)
def widen_row(bits, r, wide):  # pragma: no cover - compiled
    for c in range(bits.shape[1]):
        wide[c] = np.uint32(bits[r, c]) << np.uint32(16)

@numba.njit(cache=True, nogil=True)
def row_codes(xs, width, scales, r, lo, hi, codes):  # pragma: no cover - compiled
    # codes[col] = clamp(floor(x / s + 0.5), lo, hi), 0 where the scale is 0 and in the padding.
    # |x / s| <= ~8.01 whenever s != 0, so float32 floor and clamp equal the integer ones of the spec.
    half = np.float32(0.5)
    flo = np.float32(lo)
    fhi = np.float32(hi)
    for g in range(scales.shape[1]):
        s = scales[r, g]
        base = g * 64
        stop = min(width, base + 64)
        if s != 0:
            for col in range(base, stop):
                codes[col] = np.int8(min(max(np.floor(xs[col] / s + half), flo), fhi))
        else:
            for col in range(base, stop):
                codes[col] = 0
        for col in range(stop, base + 64):
            codes[col] = 0

@numba.njit(cache=True, nogil=True)
def row_error(xs, codes, scales, r, acc):  # pragma: no cover - compiled
    # Adds (dequantized - x)^2 and x^2 of a zero-padded row into acc[0, j] and acc[1, j], j = column mod 64. Each
    # term is exact in float64 (a bf16 or float32 x, an int4/int8 code times a float16 scale), and each of the 128
    # accumulators is a plain sequential sum, so the result does not depend on how the compiler vectorizes this.
    for g in range(scales.shape[1]):
        s = scales[r, g]
        base = g * 64
        for j in range(64):
            x = np.float64(xs[base + j])
            d = np.float64(np.float32(codes[base + j]) * s) - x
            acc[0, j] += d * d
            acc[1, j] += x * x


@numba.njit(cache=True, nogil=True)
def lane_sums(acc):  # pragma: no cover - compiled
    err = 0.0
    sq = 0.0
    for j in range(64):
        err += acc[0, j]
        sq += acc[1, j]
    return err, sq


@numba.njit(cache=True, nogil=True)
def bf16_int4(bits, scales, out):  # pragma: no cover - compiled
    n_rows, width = bits.shape
    n_groups = scales.shape[1]
    wide = np.zeros(n_groups * 64, np.uint32)  # the row as float32 bits, zero-padded to whole groups
    xs = wide.view(np.float32)
    codes = np.zeros(n_groups * 64, np.int8)
    acc = np.zeros((2, 64), np.float64)
    for r in range(n_rows):
        widen_row(bits, r, wide)
        row_codes(xs, width, scales, r, -8.0, 7.0, codes)
        for g in range(n_groups):
            for j in range(32):
                low = np.uint8(codes[g * 64 + j] + 8)
                high = np.uint8(codes[g * 64 + j + 32] + 8)
                out[r, g * 32 + j] = low | (high << np.uint8(4))
        row_error(xs, codes, scales, r, acc)
    return lane_sums(acc)

@numba.njit(cache=True, nogil=True)
def bf16_int8(bits, scales, out):  # pragma: no cover - compiled
    n_rows, width = bits.shape
    n_groups = scales.shape[1]
    wide = np.zeros(n_groups * 64, np.uint32)  # the row as float32 bits, zero-padded to whole groups
    xs = wide.view(np.float32)
    codes = np.zeros(n_groups * 64, np.int8)
    acc = np.zeros((2, 64), np.float64)
    for r in range(n_rows):
        widen_row(bits, r, wide)
        row_codes(xs, width, scales, r, -127.0, 127.0, codes)
        for col in range(n_groups * 64):
            out[r, col] = codes[col]
        row_error(xs, codes, scales, r, acc)
    return lane_sums(acc)

@numba.njit(cache=True, nogil=True)
def int4_error(rows, data, scales):  # pragma: no cover - compiled
    n_rows, width = rows.shape
    n_groups = scales.shape[1]
    codes = np.zeros(n_groups * 64, np.int8)
    xs = np.zeros(n_groups * 64, np.float32)
    acc = np.zeros((2, 64), np.float64)
    for r in range(n_rows):
        xs[:width] = rows[r]
        for g in range(n_groups):
            for j in range(32):
                byte = np.int32(data[r, g * 32 + j])
                codes[g * 64 + j] = np.int8((byte & 15) - 8)
                codes[g * 64 + j + 32] = np.int8((byte >> 4) - 8)
        row_error(xs, codes, scales, r, acc)
    return lane_sums(acc)

@numba.njit(cache=True, nogil=True)
def int8_error(rows, data, scales):  # pragma: no cover - compiled
    n_rows, width = rows.shape
    n_groups = scales.shape[1]
    codes = np.zeros(n_groups * 64, np.int8)
    xs = np.zeros(n_groups * 64, np.float32)
    acc = np.zeros((2, 64), np.float64)
    for r in range(n_rows):
        xs[:width] = rows[r]
        for col in range(n_groups * 64):
            codes[col] = data[r, col]
        row_error(xs, codes, scales, r, acc)
    return lane_sums(acc)

def kernels():
    return bf16_extremes, bf16_int4, bf16_int8, int4_error, int8_error


def _relative(err: float, sq: float, count: int) -> float:
    denom = math.sqrt(sq / count) or 1.0
    return math.sqrt(err / count) / denom


def encode_bf16(bits: np.ndarray, encoding: str) -> tuple[QuantizedTensor, float]:
    """Encode a tensor of raw bf16 bits (uint16) as int4_gs64 or int8_gs64; returns it and its relative RMSE."""
    if encoding not in FAST_ENCODINGS:
        raise QuantizationError(f"encode_bf16 handles {', '.join(FAST_ENCODINGS)}, not {encoding!r}")
    bits = np.asarray(bits)
    shape = tuple(int(d) for d in bits.shape)
    if bits.ndim < 1 or bits.size == 0 or shape[-1] < 1:
        raise QuantizationError(f"cannot encode an empty tensor of shape {shape} as {encoding}")
    rows = np.ascontiguousarray(bits.reshape(-1, shape[-1]), dtype=np.uint16)
    extremes, int4, int8, _, _ = kernels()
    groups = num_groups(rows.shape[1])
    int4_wanted = encoding == Encoding.INT4_GS64
    ext = np.empty((rows.shape[0], groups), dtype=np.uint16)
    if not extremes(rows, int4_wanted, ext):
        raise QuantizationError(f"tensor of shape {shape} holds NaN or infinite values; refusing to encode it")
    ext32 = bf16_bits_to_f32(ext)
    if int4_wanted:
        scales = (ext32 / np.float32(INT4_SCALE_DIVISOR)).astype(np.float16)
        out = np.empty((rows.shape[0], groups * INT4_BYTES_PER_GROUP), dtype=np.uint8)
        err, sq = int4(rows, scales.astype(np.float32), out)
    else:
        scales = (ext32 / np.float32(INT8_SCALE_DIVISOR)).astype(np.float16)
        out = np.empty((rows.shape[0], groups * GROUP_SIZE), dtype=np.int8)
        err, sq = int8(rows, scales.astype(np.float32), out)
    return QuantizedTensor(encoding, shape, out, scales), _relative(err, sq, rows.size)


def relative_error(x: np.ndarray, qt: QuantizedTensor) -> float:
    """RMS(dequantized - x) / RMS(x) of a float32 tensor and its encoding (0 for float encodings)."""
    if qt.encoding not in FAST_ENCODINGS:
        if qt.encoding == Encoding.F32:
            return 0.0
        from colibri_format.quant import relative_rmse

        return relative_rmse(x, qt)
    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, qt.shape[-1])
    _, _, _, int4_err, int8_err = kernels()
    fn = int4_err if qt.encoding == Encoding.INT4_GS64 else int8_err
    err, sq = fn(rows, qt.data, qt.scales.astype(np.float32))
    return _relative(err, sq, rows.size)


def warm_up() -> None:
    """Compile (or load from the cache) every kernel on a tiny tensor."""
    bits = np.full((1, 70), 0x3F80, dtype=np.uint16)
    for enc in FAST_ENCODINGS:
        qt, _ = encode_bf16(bits, enc)
        relative_error(bf16_bits_to_f32(bits), qt)
