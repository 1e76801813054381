"""Tensor encodings of specs/QUANT.md: int4 and int8 with group size 64, and plain f32/f16/bf16.

Two quantizers produce the same bytes: `quantize_reference` in plain numpy (the executable form of the spec) and
`quantize` (numba), which must match it bit for bit. Codes are computed in float32 arithmetic only, with the scale
first rounded to float16, so the stored scale is exactly the one the codes were computed against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .constants import (
    GROUP_SIZE,
    INT4_BYTES_PER_GROUP,
    INT4_CODE_MAX,
    INT4_CODE_MIN,
    INT4_SCALE_DIVISOR,
    INT4_ZERO_CODE,
    INT8_CODE_MAX,
    INT8_SCALE_DIVISOR,
    Encoding,
)
from .errors import QuantizationError

_HALF = np.float32(0.5)


@dataclass(frozen=True)
class QuantizedTensor:
    """One encoded tensor: `data` (and `scales` for the grouped encodings) in their stored dtypes and shapes.

    `shape` is the logical shape of the tensor. For the grouped encodings the rows are the product of all but the
    last dimension; `data` is (rows, groups * bytes_per_group) and `scales` is float16 (rows, groups).
    For bf16, `data` holds the raw bits as uint16.
    """

    encoding: str
    shape: tuple[int, ...]
    data: np.ndarray
    scales: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + (0 if self.scales is None else self.scales.nbytes))

    def dequantize(self) -> np.ndarray:
        return dequantize(self)


def num_groups(width: int) -> int:
    """Groups per row for an input width; the last group may be partial (zero-padded in storage)."""
    return -(-width // GROUP_SIZE)


def stored_layout(encoding: str, shape: tuple[int, ...]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The stored arrays of a tensor as ((numpy dtype name, shape), ...): data first, then scales if any."""
    if encoding in (Encoding.INT4_GS64, Encoding.INT8_GS64):
        if len(shape) < 1 or shape[-1] < 1:
            raise QuantizationError(f"grouped encoding {encoding} needs a tensor with a last dimension, got {shape}")
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        groups = num_groups(shape[-1])
        if encoding == Encoding.INT4_GS64:
            return (("uint8", (rows, groups * INT4_BYTES_PER_GROUP)), ("float16", (rows, groups)))
        return (("int8", (rows, groups * GROUP_SIZE)), ("float16", (rows, groups)))
    if encoding == Encoding.F32:
        return (("float32", tuple(shape)),)
    if encoding == Encoding.F16:
        return (("float16", tuple(shape)),)
    if encoding == Encoding.BF16:
        return (("uint16", tuple(shape)),)
    raise QuantizationError(f"unknown encoding {encoding!r}; known encodings: {', '.join(Encoding.ALL)}")


def stored_nbytes(encoding: str, shape: tuple[int, ...]) -> int:
    return sum(int(np.dtype(dt).itemsize * math.prod(s)) for dt, s in stored_layout(encoding, shape))


# --- bf16 bit conversions (round to nearest even) -----------------------------------------------------------------


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    out = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = np.uint16(0x7FC0)
    return out


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


# --- the reference quantizer (plain numpy: the spec, executable) --------------------------------------------------


def _as_groups(x: np.ndarray) -> tuple[np.ndarray, int]:
    """Rows x groups x 64 float32 view of a tensor, the last group zero-padded."""
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    groups = num_groups(width)
    pad = groups * GROUP_SIZE - width
    if pad:
        rows = np.concatenate([rows, np.zeros((rows.shape[0], pad), dtype=np.float32)], axis=1)
    return rows.reshape(rows.shape[0], groups, GROUP_SIZE), width


def _check_input(x: np.ndarray, encoding: str) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim < 1 or x.shape[-1] < 1 or x.size == 0:
        raise QuantizationError(f"cannot encode an empty tensor of shape {x.shape} as {encoding}")
    if not np.isfinite(x).all():
        raise QuantizationError(f"tensor of shape {x.shape} holds NaN or infinite values; refusing to encode it")
    return x


def int4_scales(groups: np.ndarray) -> np.ndarray:
    """float16 scale per group: the signed value of largest magnitude divided by -8 (first one on ties)."""
    idx = np.abs(groups).argmax(axis=-1)
    signed_max = np.take_along_axis(groups, idx[..., None], axis=-1)[..., 0]
    return (signed_max / np.float32(INT4_SCALE_DIVISOR)).astype(np.float16)


def int8_scales(groups: np.ndarray) -> np.ndarray:
    """float16 scale per group: the largest magnitude divided by 127."""
    return (np.abs(groups).max(axis=-1) / np.float32(INT8_SCALE_DIVISOR)).astype(np.float16)


def _codes(groups: np.ndarray, scales16: np.ndarray, lo: int, hi: int) -> np.ndarray:
    s = scales16.astype(np.float32)[..., None]
    safe = np.where(s == 0, np.float32(1), s)
    q = np.floor(groups / safe + _HALF)
    q = np.where(s == 0, np.float32(0), q)
    return np.clip(q, lo, hi).astype(np.int8)


def quantize_reference(x: np.ndarray, encoding: str) -> QuantizedTensor:
    """Encode a float tensor exactly as specs/QUANT.md says, in plain numpy."""
    shape = tuple(int(d) for d in np.shape(x))
    if encoding == Encoding.F32:
        return QuantizedTensor(encoding, shape, _check_input(x, encoding).copy())
    if encoding == Encoding.F16:
        return QuantizedTensor(encoding, shape, _check_input(x, encoding).astype(np.float16))
    if encoding == Encoding.BF16:
        return QuantizedTensor(encoding, shape, f32_to_bf16_bits(_check_input(x, encoding)))
    if encoding not in Encoding.QUANTIZED:
        stored_layout(encoding, shape)  # raises the unknown-encoding error
    x = _check_input(x, encoding)
    groups, _ = _as_groups(x)
    if encoding == Encoding.INT4_GS64:
        scales = int4_scales(groups)
        nibbles = (_codes(groups, scales, INT4_CODE_MIN, INT4_CODE_MAX) + INT4_ZERO_CODE).astype(np.uint8)
        half = GROUP_SIZE // 2
        packed = nibbles[..., :half] | (nibbles[..., half:] << 4)
        return QuantizedTensor(encoding, shape, packed.reshape(groups.shape[0], -1), scales)
    scales = int8_scales(groups)
    codes = _codes(groups, scales, -INT8_CODE_MAX, INT8_CODE_MAX)
    return QuantizedTensor(encoding, shape, codes.reshape(groups.shape[0], -1), scales)


# --- the fast quantizer (numba), bit-identical to the reference ---------------------------------------------------


def _numba_kernels():
    import numba

    @numba.njit(cache=True, parallel=True)
    def int4_pack(rows, scales, out):  # pragma: no cover - compiled
        n_rows, width = rows.shape
        n_groups = scales.shape[1]
        half = np.float32(0.5)
        for r in numba.prange(n_rows):
            for g in range(n_groups):
                s = np.float32(scales[r, g])
                base = g * 64
                for j in range(32):
                    low = 8
                    high = 8
                    col = base + j
                    if s != 0 and col < width:
                        low = int(min(max(math.floor(rows[r, col] / s + half), -8.0), 7.0)) + 8
                    col = base + j + 32
                    if s != 0 and col < width:
                        high = int(min(max(math.floor(rows[r, col] / s + half), -8.0), 7.0)) + 8
                    out[r, g * 32 + j] = np.uint8(low | (high << 4))

    @numba.njit(cache=True, parallel=True)
    def int8_codes(rows, scales, out):  # pragma: no cover - compiled
        n_rows, width = rows.shape
        n_groups = scales.shape[1]
        half = np.float32(0.5)
        for r in numba.prange(n_rows):
            for g in range(n_groups):
                s = np.float32(scales[r, g])
                for j in range(64):
                    col = g * 64 + j
                    q = 0
                    if s != 0 and col < width:
                        v = math.floor(rows[r, col] / s + half)
                        q = int(min(max(v, -127.0), 127.0))
                    out[r, col] = np.int8(q)

    @numba.njit(cache=True, parallel=True)
    def group_extremes(rows, signed, out):  # pragma: no cover - compiled
        # signed=True: the element of largest magnitude with its sign (first on ties); else the largest magnitude.
        n_rows, width = rows.shape
        n_groups = out.shape[1]
        for r in numba.prange(n_rows):
            for g in range(n_groups):
                best = np.float32(0.0)
                best_abs = np.float32(-1.0)
                for col in range(g * 64, min(width, g * 64 + 64)):
                    v = rows[r, col]
                    a = abs(v)
                    if a > best_abs:
                        best_abs = a
                        best = v
                out[r, g] = best if signed else best_abs

    return int4_pack, int8_codes, group_extremes


_KERNELS = None


def _kernels():
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = _numba_kernels()
    return _KERNELS


def _group_scales_fast(rows: np.ndarray, encoding: str) -> np.ndarray:
    """Same scales as int4_scales/int8_scales: the extremes in numba, the (small) division and rounding in numpy."""
    extremes = np.empty((rows.shape[0], num_groups(rows.shape[1])), dtype=np.float32)
    _kernels()[2](rows, encoding == Encoding.INT4_GS64, extremes)
    if encoding == Encoding.INT4_GS64:
        return (extremes / np.float32(INT4_SCALE_DIVISOR)).astype(np.float16)
    return (extremes / np.float32(INT8_SCALE_DIVISOR)).astype(np.float16)


def quantize(x: np.ndarray, encoding: str) -> QuantizedTensor:
    """Encode a float tensor; same bytes as `quantize_reference`, several times faster for large tensors."""
    if encoding not in Encoding.QUANTIZED:
        return quantize_reference(x, encoding)
    x = _check_input(x, encoding)
    shape = tuple(int(d) for d in x.shape)
    rows = x.reshape(-1, shape[-1])
    scales = _group_scales_fast(rows, encoding)
    scales32 = scales.astype(np.float32)
    int4_pack, int8_codes, _ = _kernels()
    if encoding == Encoding.INT4_GS64:
        out = np.empty((rows.shape[0], scales.shape[1] * INT4_BYTES_PER_GROUP), dtype=np.uint8)
        int4_pack(rows, scales32, out)
    else:
        out = np.empty((rows.shape[0], scales.shape[1] * GROUP_SIZE), dtype=np.int8)
        int8_codes(rows, scales32, out)
    return QuantizedTensor(encoding, shape, out, scales)


# --- dequantization ----------------------------------------------------------------------------------------------


def int4_codes(packed: np.ndarray) -> np.ndarray:
    """Signed codes (rows, groups*64) from packed int4 bytes (rows, groups*32)."""
    rows = packed.shape[0]
    by_group = packed.reshape(rows, -1, INT4_BYTES_PER_GROUP)
    low = (by_group & 0x0F).astype(np.int8)
    high = (by_group >> 4).astype(np.int8)
    return (np.concatenate([low, high], axis=-1) - INT4_ZERO_CODE).reshape(rows, -1)


def dequantize(t: QuantizedTensor) -> np.ndarray:
    """The float32 tensor an encoded tensor stands for."""
    if t.encoding == Encoding.F32:
        return np.asarray(t.data, dtype=np.float32).reshape(t.shape)
    if t.encoding == Encoding.F16:
        return np.asarray(t.data).astype(np.float32).reshape(t.shape)
    if t.encoding == Encoding.BF16:
        return bf16_bits_to_f32(t.data).reshape(t.shape)
    if t.encoding not in Encoding.QUANTIZED:
        raise QuantizationError(f"unknown encoding {t.encoding!r}; known encodings: {', '.join(Encoding.ALL)}")
    codes = int4_codes(t.data) if t.encoding == Encoding.INT4_GS64 else np.asarray(t.data, dtype=np.int8)
    rows, groups = t.scales.shape
    values = codes.reshape(rows, groups, GROUP_SIZE).astype(np.float32) * t.scales.astype(np.float32)[..., None]
    return values.reshape(rows, groups * GROUP_SIZE)[:, : t.shape[-1]].reshape(t.shape)


def relative_rmse(original: np.ndarray, t: QuantizedTensor) -> float:
    """Reconstruction error of an encoding: RMS(error) / RMS(original)."""
    x = np.asarray(original, dtype=np.float32)
    err = dequantize(t).astype(np.float64) - x
    denom = math.sqrt(float(np.mean(x.astype(np.float64) ** 2))) or 1.0
    return math.sqrt(float(np.mean(err**2))) / denom
