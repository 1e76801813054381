"""Reading source tensors as float32: bf16, f16, f32 and FP8 e4m3 with 128x128 block scales (`weight_scale_inv`).

FP8 values are decoded through a 256-entry table of the e4m3fn code points and multiplied, in float32, by the scale
of their 128x128 block (DeepSeek-V3 / GLM-5 format: `name_scale_inv` holds the multiplier, despite its name).
A fused 3D tensor is read one expert slice at a time so a 3D tensor never needs a float32 copy of itself.
"""

from __future__ import annotations

import numpy as np

from colibri_format.errors import ConversionError
from colibri_format.quant import bf16_bits_to_f32

FP8_BLOCK = 128
SCALE_SUFFIX = "_scale_inv"
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
FP8_DTYPES = ("F8_E4M3",)


def _e4m3fn_table() -> np.ndarray:
    codes = np.arange(256, dtype=np.uint32)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = (codes & 0x7).astype(np.float64)
    normal = (1.0 + man / 8.0) * np.exp2(exp.astype(np.float64) - 7.0)
    subnormal = (man / 8.0) * 2.0**-6
    value = sign * np.where(exp == 0, subnormal, normal)
    value[(codes & 0x7F) == 0x7F] = np.nan
    return value.astype(np.float32)


E4M3FN = _e4m3fn_table()


def to_f32(raw: np.ndarray, dtype: str, what: str) -> np.ndarray:
    """Float32 values of raw safetensors data (BF16 arrives as uint16 bits)."""
    if dtype == "F32":
        return np.asarray(raw, dtype=np.float32)
    if dtype == "BF16":
        return bf16_bits_to_f32(raw)
    if dtype in ("F16", "F64"):
        return np.asarray(raw).astype(np.float32)
    raise ConversionError(f"tensor {what} has dtype {dtype}, which the converter cannot read as weights")


def fp8_to_f32(raw: np.ndarray, scale_inv: np.ndarray, what: str) -> np.ndarray:
    """Dequantize a 2D e4m3 tensor with its (ceil(rows/128), ceil(cols/128)) float block scales."""
    if raw.ndim != 2:
        raise ConversionError(f"FP8 tensor {what} must be 2D per scale grid, got shape {raw.shape}")
    rows, cols = raw.shape
    grid = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    scale = np.asarray(scale_inv, dtype=np.float32)
    if scale.shape != grid:
        raise ConversionError(f"{what}{SCALE_SUFFIX} has shape {scale.shape}, 128x128 blocks of {raw.shape} need {grid}")
    values = E4M3FN[np.asarray(raw, dtype=np.uint8)]
    full = np.repeat(np.repeat(scale, FP8_BLOCK, axis=0), FP8_BLOCK, axis=1)[:rows, :cols]
    return values * full
