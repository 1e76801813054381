"""Matrix kernels of the runtime: float32 activations times an encoded weight, deterministic by construction.

`linear(x, w)` computes y[n, out] = x[n, in] @ W[out, in].T for a weight prepared by `prepare_weight` from a
QuantizedTensor (int4_gs64, int8_gs64, f32, f16, bf16).

Determinism (the reason these kernels exist instead of BLAS): every output element y[i, o] is computed by one
thread in one fixed order that depends on neither the other rows of x nor the thread count.
- The input dimension is walked in blocks of 64 (one quantization group; the activations are zero-padded to a
  whole number of groups, matching the zero codes stored in the padding).
- Inside a block, 32 float32 lanes each form x[j] * c[j] + x[j+32] * c[j+32] (c: the integer code as float32, or the
  float weight), multiply by the group's float16 scale (1 for float weights) and add to their running sum. Every
  operation is a separate IEEE float32 multiply or add (never fused): the bits do not depend on the instruction set.
- After the last group the 32 lanes are summed pairwise in a fixed tree (lane j + lane j+16, then halves of 8, of 4,
  then (t0 + t2) + (t1 + t3)), then the bias (if any) is added.
Work is split across threads by output feature only, so the thread count cannot change a sum. The one-row path
(decode) and the many-row path (prefill) evaluate the same expression for each element, hence the same bits: the
many-row path merely decodes a weight row once to float32 codes (exactly) and reuses it for every activation row.

Speed. The per-row dot product is emitted as explicit 16-wide vector LLVM IR (a numba intrinsic): the 32 lanes are
two <16 x float> registers carried across groups, int4 nibbles become floats by OR-ing them into the mantissa of
2^23 and subtracting 2^23 + 8 (exact), and the weight stream is prefetched a few KiB ahead. Plain numba loops would be
vectorized 8 wide at best and keep the lanes in memory; the intrinsic runs at several GB/s of packed int4 per core.
All numba kernels release the GIL, so expert reader threads overlap with compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

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

_JIT = {"cache": True, "nogil": True, "error_model": "numpy", "boundscheck": False}

# Bytes of weights prefetched ahead of the one being read (into the next rows at the end of a row: harmless).
PREFETCH_AHEAD = 4096
# Packed bytes of one group of 64 weights, per kind.
_GROUP_BYTES = {KIND_INT4: 32, KIND_INT8: 64, KIND_F32: 256}
# int4: float32 with bits 0x4B000000 | n is 2^23 + n exactly; subtracting 2^23 + 8 gives the code n - 8 exactly.
_INT4_MAGIC_BITS = 0x4B000000
_INT4_MAGIC_OFFSET = 8388616.0

_F32 = ir.FloatType()
_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_V16F = ir.VectorType(_F32, 16)
_V16I8 = ir.VectorType(_I8, 16)
_V16I32 = ir.VectorType(_I32, 16)


def _const_vec(vt, value):
    return ir.Constant(vt, [value] * vt.count)


def _splat(builder, value, vt):
    undef = ir.Constant(vt, ir.Undefined)
    one = builder.insert_element(undef, value, _I32(0))
    return builder.shuffle_vector(one, undef, _const_vec(ir.VectorType(_I32, vt.count), 0))


def _half(builder, v, upper):
    n = v.type.count // 2
    idx = list(range(n, 2 * n)) if upper else list(range(n))
    return builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), ir.Constant(ir.VectorType(_I32, n), idx))


def _prefetch(builder, ptr):
    i8p = _I8.as_pointer()
    fnty = ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
    builder.call(fn, [builder.bitcast(ptr, i8p), _I32(0), _I32(3), _I32(1)])  # read, high locality, data


def _load_vec(builder, base, offset, vt):
    return builder.load(builder.bitcast(builder.gep(base, [offset]), vt.as_pointer()), align=1)


def _group_codes(builder, kind, wp, g):
    """Group g's 64 weights as four <16 x float> (elements 0-15, 16-31, 32-47, 48-63), unscaled codes."""
    if kind == KIND_INT4:
        base = builder.mul(g, _I64(32))
        magic = _const_vec(_V16I32, _INT4_MAGIC_BITS)
        offset = _const_vec(_V16F, _INT4_MAGIC_OFFSET)
        low, high = [], []
        for half in range(2):
            w = builder.zext(_load_vec(builder, wp, builder.add(base, _I64(16 * half)), _V16I8), _V16I32)
            lo = builder.or_(builder.and_(w, _const_vec(_V16I32, 15)), magic)
            hi = builder.or_(builder.lshr(w, _const_vec(_V16I32, 4)), magic)
            low.append(builder.fsub(builder.bitcast(lo, _V16F), offset))
            high.append(builder.fsub(builder.bitcast(hi, _V16F), offset))
        return low + high
    base = builder.mul(g, _I64(64))
    if kind == KIND_INT8:
        return [builder.sitofp(_load_vec(builder, wp, builder.add(base, _I64(16 * q)), _V16I8), _V16F)
                for q in range(4)]
    return [_load_vec(builder, wp, builder.add(base, _I64(16 * q)), _V16F) for q in range(4)]


def _make_row_dot(kind):
    """An intrinsic (x[groups*64] f32, w_row, scales_row f32, groups) -> float32 evaluating one output element in
    the documented order. w_row: uint8 packed int4 (kind int4), int8 codes or float32 weights."""

    @intrinsic
    def row_dot(typingctx, xv, w, sc, groups):
        sig = types.float32(xv, w, sc, groups)

        def codegen(context, builder, signature, args):
            xp = context.make_array(signature.args[0])(context, builder, args[0]).data
            wp = context.make_array(signature.args[1])(context, builder, args[1]).data
            sp = context.make_array(signature.args[2])(context, builder, args[2]).data
            ngroups = context.cast(builder, args[3], signature.args[3], types.int64)
            zero = _const_vec(_V16F, 0.0)
            entry = builder.basic_block
            loop = builder.append_basic_block("groups")
            done = builder.append_basic_block("reduce")
            builder.cbranch(builder.icmp_signed(">", ngroups, _I64(0)), loop, done)

            builder.position_at_end(loop)
            g = builder.phi(_I64)
            acc0 = builder.phi(_V16F)  # lanes 0-15
            acc1 = builder.phi(_V16F)  # lanes 16-31
            g.add_incoming(_I64(0), entry)
            acc0.add_incoming(zero, entry)
            acc1.add_incoming(zero, entry)
            group_bytes = _GROUP_BYTES[kind]
            wbytes = builder.bitcast(wp, _I8.as_pointer())
            for line in range(max(1, group_bytes // 64)):
                ahead = builder.add(builder.mul(g, _I64(group_bytes)), _I64(PREFETCH_AHEAD + 64 * line))
                _prefetch(builder, builder.gep(wbytes, [ahead]))
            c = _group_codes(builder, kind, wp, g)
            xbase = builder.mul(g, _I64(64))
            x = [_load_vec(builder, xp, builder.add(xbase, _I64(16 * q)), _V16F) for q in range(4)]
            s = _splat(builder, builder.load(builder.gep(sp, [g])), _V16F)
            # lane j: acc[j] += s * (x[j] * c[j] + x[j+32] * c[j+32])
            t0 = builder.fadd(builder.fmul(x[0], c[0]), builder.fmul(x[2], c[2]))
            t1 = builder.fadd(builder.fmul(x[1], c[1]), builder.fmul(x[3], c[3]))
            next0 = builder.fadd(acc0, builder.fmul(s, t0))
            next1 = builder.fadd(acc1, builder.fmul(s, t1))
            g_next = builder.add(g, _I64(1))
            body_end = builder.basic_block
            g.add_incoming(g_next, body_end)
            acc0.add_incoming(next0, body_end)
            acc1.add_incoming(next1, body_end)
            builder.cbranch(builder.icmp_signed("<", g_next, ngroups), loop, done)

            builder.position_at_end(done)
            r0 = builder.phi(_V16F)
            r1 = builder.phi(_V16F)
            for phi, value in ((r0, next0), (r1, next1)):
                phi.add_incoming(zero, entry)
                phi.add_incoming(value, body_end)
            # fixed tree: t[j] = acc[j] + acc[j+16]; t[j] + t[j+8]; t[j] + t[j+4]; (t0 + t2) + (t1 + t3)
            t = builder.fadd(r0, r1)
            t = builder.fadd(_half(builder, t, False), _half(builder, t, True))
            t = builder.fadd(_half(builder, t, False), _half(builder, t, True))
            e = [builder.extract_element(t, _I32(k)) for k in range(4)]
            return builder.fadd(builder.fadd(e[0], e[2]), builder.fadd(e[1], e[3]))

        return sig, codegen

    return row_dot


_dot_int4 = _make_row_dot(KIND_INT4)
_dot_int8 = _make_row_dot(KIND_INT8)
_dot_f32 = _make_row_dot(KIND_F32)


@numba.njit(parallel=True, **_JIT)
def _matmul_int4_one(x, data, scales, groups, bias, has_bias, y):  # pragma: no cover - compiled
    xv = x[0]
    for o in numba.prange(data.shape[0]):
        r = _dot_int4(xv, data[o], scales[o], groups)
        y[0, o] = r + bias[o] if has_bias else r


@numba.njit(parallel=True, **_JIT)
def _matmul_int8_one(x, data, scales, groups, bias, has_bias, y):  # pragma: no cover - compiled
    xv = x[0]
    for o in numba.prange(data.shape[0]):
        r = _dot_int8(xv, data[o], scales[o], groups)
        y[0, o] = r + bias[o] if has_bias else r


@numba.njit(parallel=True, **_JIT)
def _matmul_f32_one(x, data, scales, groups, bias, has_bias, y):  # pragma: no cover - compiled
    xv = x[0]
    for o in numba.prange(data.shape[0]):
        r = _dot_f32(xv, data[o], scales[o], groups)
        y[0, o] = r + bias[o] if has_bias else r


@numba.njit(inline="always", **_JIT)
def _decode_row_int4(row, groups, codes):  # pragma: no cover - compiled
    for g in range(groups):
        for j in range(32):
            b = np.uint32(row[g * 32 + j])
            lo = np.uint32((b & np.uint32(15)) | np.uint32(_INT4_MAGIC_BITS)).view(np.float32)
            hi = np.uint32((b >> np.uint32(4)) | np.uint32(_INT4_MAGIC_BITS)).view(np.float32)
            codes[g * 64 + j] = lo - np.float32(_INT4_MAGIC_OFFSET)
            codes[g * 64 + j + 32] = hi - np.float32(_INT4_MAGIC_OFFSET)


@numba.njit(inline="always", **_JIT)
def _decode_row_int8(row, groups, codes):  # pragma: no cover - compiled
    for k in range(groups * 64):
        codes[k] = np.float32(row[k])


@numba.njit(parallel=True, **_JIT)
def _matmul_many(x, kind, data_u8, data_i8, data_f32, scales, groups, bias, has_bias, y):  # pragma: no cover
    n = x.shape[0]
    out_f = y.shape[1]
    width = groups * 64
    for o in numba.prange(out_f):
        if kind == 2:
            codes = data_f32[o]
        else:
            codes = np.empty(width, np.float32)
            if kind == 0:
                _decode_row_int4(data_u8[o], groups, codes)
            else:
                _decode_row_int8(data_i8[o], groups, codes)
        sc = scales[o]
        for i in range(n):
            r = _dot_f32(x[i], codes, sc, groups)
            y[i, o] = r + bias[o] if has_bias else r


# Serial twins of the parallel kernels (same code, same per-element order, so the same bits). Below
# PARALLEL_MIN_MACS multiply-adds a call is over before a thread pool could share it out, and on a busy machine
# waking the pool costs milliseconds: small matrices (a small model, a narrow expert, a router) run serially.
PARALLEL_MIN_MACS = 1 << 21
_serial: dict = {}


def serial_twin(kernel):
    """The same compiled kernel without its thread pool (prange runs as a plain loop)."""
    twin = _serial.get(kernel)
    if twin is None:
        twin = _serial[kernel] = numba.njit(cache=True, nogil=True, error_model="numpy")(kernel.py_func)
    return twin


def pick_kernel(kernel, macs: int):
    """`kernel` for work of `macs` multiply-adds and more, its serial twin below PARALLEL_MIN_MACS."""
    return kernel if macs >= PARALLEL_MIN_MACS else serial_twin(kernel)


_pick = pick_kernel


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
    macs = n * w.out_features * w.groups * 64
    if n == 1:
        if w.kind == KIND_INT4:
            _pick(_matmul_int4_one, macs)(xp, w.data, w.scales, w.groups, b, has_bias, y)
        elif w.kind == KIND_INT8:
            _pick(_matmul_int8_one, macs)(xp, w.data, w.scales, w.groups, b, has_bias, y)
        else:
            _pick(_matmul_f32_one, macs)(xp, w.data, w.scales, w.groups, b, has_bias, y)
        return y
    u8 = w.data if w.kind == KIND_INT4 else _EMPTY_U8
    i8 = w.data if w.kind == KIND_INT8 else _EMPTY_I8
    f32 = w.data if w.kind == KIND_F32 else _EMPTY_F32
    _pick(_matmul_many, macs)(xp, w.kind, u8, i8, f32, w.scales, w.groups, b, has_bias, y)
    return y


def warm_up() -> None:
    """Compile (or load from the on-disk cache) every kernel once."""
    rng = np.random.default_rng(0)
    from colibri_format.quant import quantize

    for rows in (4, PARALLEL_MIN_MACS // 64 + 1):  # the serial and the parallel kernels
        w = rng.standard_normal((rows, 70)).astype(np.float32)
        for enc in (Encoding.INT4_GS64, Encoding.INT8_GS64, Encoding.F32):
            pw = prepare_weight(quantize(w, enc))
            for n in (1, 3):
                linear(rng.standard_normal((n, 70)).astype(np.float32), pw, np.ones(rows, np.float32))
