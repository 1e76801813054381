"""Quantizers: the numba quantizer equals the reference bit for bit; dequantization error stays within its bound;
the worked example of specs/QUANT.md holds byte for byte."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_format.errors import QuantizationError
from colibri_format.quant import (
    dequantize,
    f32_to_bf16_bits,
    bf16_bits_to_f32,
    quantize,
    quantize_reference,
    relative_rmse,
)

SHAPES = [(1, 1), (3, 64), (5, 70), (2, 3, 130), (17, 127), (4, 192), (9, 65), (128,)]


@pytest.mark.parametrize("encoding", ["int4_gs64", "int8_gs64"])
@pytest.mark.parametrize("shape", SHAPES)
def test_fast_quantizer_matches_reference_bit_for_bit(shape, encoding):
    rng = np.random.default_rng(hash(shape) % 2**32)
    x = (rng.standard_t(3, size=shape) * rng.uniform(0.01, 10)).astype(np.float32)
    x.reshape(-1)[: min(x.size, 7)] = 0.0  # zero runs and an all-zero group when the row is short
    ref, fast = quantize_reference(x, encoding), quantize(x, encoding)
    assert ref.shape == fast.shape == shape
    np.testing.assert_array_equal(ref.data, fast.data)
    np.testing.assert_array_equal(ref.scales.view(np.uint16), fast.scales.view(np.uint16))


@pytest.mark.parametrize("encoding", ["int4_gs64", "int8_gs64"])
def test_dequantization_error_within_half_a_step(encoding):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 200)).astype(np.float32)
    t = quantize(x, encoding)
    y = dequantize(t)
    assert y.shape == x.shape and y.dtype == np.float32
    groups = -(-x.shape[1] // 64)
    step = np.repeat(np.abs(t.scales.astype(np.float32)), 64, axis=1)[:, : x.shape[1]]
    # Half a quantization step, plus the float16 rounding of the scale (relative 2**-11) times the largest code.
    top = 8 if encoding == "int4_gs64" else 127
    slack = np.repeat(np.abs(t.scales.astype(np.float32)), 64, axis=1)[:, : x.shape[1]] * top * 2**-10
    err = np.abs(y - x)
    if encoding == "int8_gs64":
        assert (err <= step / 2 + slack + 1e-7).all()
    else:
        # int4 codes run -8..7 and the group's extreme maps to -8, so a value of the opposite sign near the extreme
        # clamps at +7: at most one full step off; every other value is within half a step.
        assert (err <= step + slack + 1e-7).all()
        assert np.mean(err > step / 2 + slack + 1e-7) < 0.01
    assert t.scales.shape == (64, groups)
    bound = 0.12 if encoding == "int4_gs64" else 0.01
    assert relative_rmse(x, t) < bound


def test_worked_example_of_the_spec():
    x = (np.arange(64, dtype=np.float32) - 20) / 16
    x[5] = -3.0
    t = quantize_reference(x[None, :], "int4_gs64")
    assert t.scales.view(np.uint16)[0, 0] == 0x3600
    expected = "a5 a5 a5 b5 b5 b0 b6 b6 b6 c6 c6 c7 c7 c7 c7 d7 d7 d8 d8 d8 d8 e8 e8 e9 e9 e9 e9 f9 f9 fa fa fa"
    assert " ".join(f"{b:02x}" for b in t.data[0]) == expected


def test_partial_group_padding_is_zero_code():
    x = np.ones((2, 70), dtype=np.float32)
    t = quantize(x, "int4_gs64")
    assert t.data.shape == (2, 64)
    codes_second_group = np.concatenate([t.data[:, 32:] & 15, t.data[:, 32:] >> 4], axis=1)
    assert (codes_second_group[:, 6:32] == 8).all() and (codes_second_group[:, 32 + 6 :] == 8).all()
    np.testing.assert_allclose(dequantize(t), x, rtol=0, atol=0)


@pytest.mark.parametrize("encoding", ["f32", "f16", "bf16"])
def test_plain_encodings_round_trip(encoding):
    x = np.random.default_rng(2).standard_normal((3, 5)).astype(np.float32)
    y = dequantize(quantize(x, encoding))
    tol = {"f32": 0, "f16": 1e-3, "bf16": 1e-2}[encoding]
    np.testing.assert_allclose(y, x, rtol=tol, atol=0)


def test_bf16_rounds_to_nearest_even():
    x = np.array([1.0, -2.5], dtype=np.float32)
    np.testing.assert_array_equal(bf16_bits_to_f32(f32_to_bf16_bits(x)), x)
    assert f32_to_bf16_bits(np.array([1.00390625], dtype=np.float32))[0] == 0x3F80  # tie -> even
    assert f32_to_bf16_bits(np.array([1.01171875], dtype=np.float32))[0] == 0x3F82  # tie -> even (up)


@pytest.mark.parametrize("bad", [np.array([[1.0, np.nan]]), np.array([[np.inf, 0.0]]), np.zeros((0, 4))])
def test_non_finite_and_empty_tensors_are_refused(bad):
    with pytest.raises(QuantizationError):
        quantize(bad.astype(np.float32), "int4_gs64")


def test_unknown_encoding_is_refused():
    with pytest.raises(QuantizationError, match="unknown encoding"):
        quantize(np.ones((2, 2), np.float32), "int3_gs32")
