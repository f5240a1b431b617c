"""The integer operations of cpu_kernels.simd_int (maddubs, pmaddwd, dpwssd, dpbusd, packs, lut16) in
every lowering this CPU runs, against numpy's integers on fresh random operands over the whole range
each caller may pass.

They are all that differs between the lowerings: each lowers at compile time from simd_int.ISA, so a
small kernel compiled while the test patches ISA is that lowering's code (seconds, where whole
kernels in another lowering take minutes: test_matvec_int.py's test_every_lowering_gives_the_same_bits
runs the kernels themselves, in avx2 in the default suite and in every lowering under -m slow).
"""
from __future__ import annotations

import numpy as np
import pytest
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from cpu_kernels import simd_int
from cpu_kernels.matvec_simd import _array, _load_vec
from cpu_kernels.simd_int import I8, I16, I32, ISAS, host_isa, runnable_isas

IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)

# name -> (the op on loaded vectors, operand element types and lane counts, result lanes)
OPS = {
    "maddubs": (lambda b, u, s: simd_int.maddubs(b, u, s), ((I8, 64), (I8, 64)), 32),
    "pmaddwd16": (lambda b, a, c: simd_int.pmaddwd(b, a, c), ((I16, 16), (I16, 16)), 8),
    "pmaddwd32": (lambda b, a, c: simd_int.pmaddwd(b, a, c), ((I16, 32), (I16, 32)), 16),
    "dpwssd": (lambda b, acc, a, c: simd_int.dpwssd(b, acc, a, c), ((I32, 16), (I16, 32), (I16, 32)), 16),
    "dpbusd": (lambda b, acc, u, s: simd_int.dpbusd(b, acc, u, s), ((I32, 16), (I8, 64), (I8, 64)), 16),
    "dpbusd_wide": (lambda b, acc, u, s: simd_int.dpbusd(b, acc, u, s, wide=True),
                    ((I32, 16), (I8, 64), (I8, 64)), 16),
    "packs": (lambda b, x, y: simd_int.packs(b, x, y), ((I32, 16), (I32, 16)), 32),
    "lut16_32": (lambda b, idx: simd_int.lut16(b, idx, IQ4_LEVELS), ((I8, 32),), 32),
    "lut16_64": (lambda b, idx: simd_int.lut16(b, idx, IQ4_LEVELS), ((I8, 64),), 64),
}


def _compiled(name: str):
    """A fresh njit kernel out[:] = op(*operands), lowered when first called (under the patched ISA)."""
    op, operands, n_out = OPS[name]

    @intrinsic
    def apply(typingctx, out, args):
        def codegen(context, builder, sig, llargs):
            arys = [sig.args[0], *sig.args[1].types]
            values = [llargs[0], *(builder.extract_value(llargs[1], i) for i in range(len(operands)))]
            vecs = [_load_vec(builder, _array(context, builder, t, v).data, el, n, 1)
                    for t, v, (el, n) in zip(arys[1:], values[1:], operands)]
            res = op(builder, *vecs)
            assert res.type.count == n_out
            dst = _array(context, builder, arys[0], values[0]).data
            builder.store(res, builder.bitcast(dst, res.type.as_pointer()), align=1)
            return context.get_dummy_value()
        return types.void(out, args), codegen

    @njit
    def kernel(out, args):
        apply(out, args)
    return kernel


def _pairs(p: np.ndarray) -> np.ndarray:
    return p[0::2] + p[1::2]


def _operands(name: str, rng) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """Random operands in the range simd_int promises each op, and numpy's result."""
    s8 = lambda n: rng.integers(-128, 128, n).astype(np.int8)          # noqa: E731
    i16 = lambda n: rng.integers(-32767, 32768, n).astype(np.int16)     # noqa: E731 (-32768^2 x 2 would wrap)
    acc = rng.integers(-2**28, 2**28, 16).astype(np.int32)
    if name == "maddubs":        # callers keep a pair's sum inside int16: u <= 127 does for any s
        u, s = rng.integers(0, 128, 64).astype(np.uint8), s8(64)
        return (u, s), _pairs(u.astype(np.int32) * s).astype(np.int16)
    if name.startswith("pmaddwd"):
        n = int(name[-2:])
        a, c = i16(n), i16(n)
        return (a, c), _pairs(a.astype(np.int64) * c).astype(np.int32)
    if name == "dpwssd":
        a, c = i16(32), i16(32)
        return (acc, a, c), (acc + _pairs(a.astype(np.int64) * c)).astype(np.int32)
    if name.startswith("dpbusd"):
        u = rng.integers(0, 256 if name.endswith("wide") else 128, 64).astype(np.uint8)
        u[:4] = 255 if name.endswith("wide") else 127                   # the extremes of each range
        s = s8(64)
        s[:4] = -128
        return (acc, u, s), (acc + (u.astype(np.int64) * s).reshape(16, 4).sum(1)).astype(np.int32)
    if name == "packs":          # callers keep every value inside int16
        x, y = (rng.integers(-32768, 32768, 16).astype(np.int32) for _ in range(2))
        order = np.concatenate([np.concatenate((x[4 * lane:4 * lane + 4], y[4 * lane:4 * lane + 4]))
                                for lane in range(4)])
        return (x, y), order.astype(np.int16)
    n = int(name[-2:])
    idx = rng.integers(0, 16, n).astype(np.uint8)
    return (idx,), IQ4_LEVELS[idx]


@pytest.mark.parametrize("isa", runnable_isas())
def test_every_op_gives_numpys_integers(monkeypatch, isa):
    monkeypatch.setattr(simd_int, "ISA", isa)
    rng = np.random.default_rng()
    for name in OPS:
        kernel = _compiled(name)
        for _ in range(50):
            args, want = _operands(name, rng)
            out = np.zeros_like(want)
            kernel(out, args)
            assert np.array_equal(out, want), f"{name} in {isa}: {out} != {want}"


def test_runnable_isas_start_with_the_hosts():
    isas = runnable_isas()
    assert isas[0] == host_isa() and set(isas) <= set(ISAS) and "portable" in isas


def test_the_patched_isa_is_the_lowering():
    """The test above is only worth something if patching ISA changes the code: portable's dpbusd
    is generic IR, avx2's and the VNNI forms call x86 intrinsics."""
    seen = {}
    for isa in ("portable", "avx2"):
        simd_before = simd_int.ISA
        simd_int.ISA = isa
        try:
            m = ir.Module()
            fn = ir.Function(m, ir.FunctionType(ir.VoidType(), []), name="f")
            b = ir.IRBuilder(fn.append_basic_block())
            zero = ir.Constant(ir.VectorType(I8, 64), [0] * 64)
            simd_int.dpbusd(b, ir.Constant(ir.VectorType(I32, 16), [0] * 16), zero, zero)
            b.ret_void()
            seen[isa] = str(m)
        finally:
            simd_int.ISA = simd_before
    assert "llvm.x86" not in seen["portable"] and "llvm.x86.avx2" in seen["avx2"]
