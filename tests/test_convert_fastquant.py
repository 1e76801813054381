"""The converter's bf16 encoder gives the library quantizer's bytes, and both error paths agree."""

from __future__ import annotations

import numpy as np
import pytest
from colibri_convert.fastquant import encode_bf16, relative_error

from colibri_format.errors import QuantizationError
from colibri_format.quant import bf16_bits_to_f32, quantize, quantize_reference, relative_rmse


def _bf16(x: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _awkward(shape, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * np.float32(0.02)
    flat = x.reshape(-1)
    flat[:64] = 0.0  # an all-zero group
    flat[64:70] = 1e-30  # scales that underflow float16
    if flat.size > 300:
        flat[200] = -flat[201]  # a tie between +m and -m: the first one wins
        flat[256:320] = np.linspace(-3.0, 3.0, 64)  # large values and exact halves
    return x


@pytest.mark.parametrize("shape", [(64, 192), (7, 80), (3, 5, 130), (4, 64), (2, 1), (33, 1000)])
@pytest.mark.parametrize("encoding", ["int4_gs64", "int8_gs64"])
def test_encode_bf16_matches_library_quantizer(shape, encoding):
    bits = _bf16(_awkward(shape))
    x = bf16_bits_to_f32(bits)
    ours, rmse = encode_bf16(bits, encoding)
    for ref in (quantize(x, encoding), quantize_reference(x, encoding)):
        assert ours.shape == ref.shape and ours.encoding == ref.encoding
        assert ours.data.dtype == ref.data.dtype and ours.scales.dtype == ref.scales.dtype
        np.testing.assert_array_equal(ours.data, ref.data)
        np.testing.assert_array_equal(ours.scales, ref.scales)
    assert rmse == relative_error(x, ours)
    assert rmse == pytest.approx(relative_rmse(x, ours), rel=1e-12, abs=1e-300)


def test_encode_bf16_refuses_non_finite():
    bits = _bf16(np.ones((2, 64), dtype=np.float32))
    bits[1, 5] = 0x7FC0  # NaN
    with pytest.raises(QuantizationError):
        encode_bf16(bits, "int4_gs64")
    bits[1, 5] = 0xFF80  # -inf
    with pytest.raises(QuantizationError):
        encode_bf16(bits, "int8_gs64")
