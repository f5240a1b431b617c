"""Integer multiply-add building blocks for the quantized-activation matvec, as LLVM IR.

The kernels (matvec_int) are written once, over logical 64-byte vectors, with four operations
(and packs, vpackssdw on values that fit int16):

    maddubs(u8 x64, s8 x64) -> i16 x32    lane i = u[2i] s[2i] + u[2i+1] s[2i+1]
    dpwssd(acc i32 x16, a i16 x32, c i16 x32) -> acc[j] + a[2j] c[2j] + a[2j+1] c[2j+1]
    dpbusd(acc i32 x16, u8 x64, s8 x64)     -> acc[j] + sum over i < 4 of u[4j+i] s[4j+i]
    pmaddwd(a i16 x16, c i16 x16) -> i32 x8 lane j = a[2j] c[2j] + a[2j+1] c[2j+1]

and ISA picks how each lowers, once at import from the host CPU's features:

    avx512vnni  vpmaddubsw zmm, vpdpwssd zmm, vpdpbusd zmm (AVX-512 BW + VNNI: Ice Lake, Zen 4+)
    avxvnni     the same on two ymm halves, VEX vpdpwssd / vpdpbusd (Alder Lake and later)
    avx2        vpmaddubsw + vpmaddwd + vpaddd on ymm halves (Haswell, Zen 1-3)
    portable    generic widen / multiply / add IR: LLVM picks the target's instructions

Every lowering computes the same integer in every lane (the kernels keep all operands inside
vpmaddubsw's int16 range, and dpbusd on avx2 takes a nibble split when u can exceed 127), so the
float work after it — and the kernel's result — is bit-identical whatever the ISA.
HYBRIDRT_INT_ISA=avx2|portable|... forces a lowering (for tests); it must be one the CPU runs.
"""
from __future__ import annotations

import numba
from llvmlite import binding as llvm
from llvmlite import ir

from hybridrt.runtime.config import ENV

from .matvec_simd import BlockIR, _load_vec, _splat

ISAS = ("avx512vnni", "avxvnni", "avx2", "portable")

I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F32 = ir.FloatType()


def host_features() -> set[str]:
    """The CPU features LLVM reports for this host ("avx512vnni", "amx-bf16", ...); empty where it
    cannot read them."""
    try:
        flat = llvm.get_host_cpu_features().flatten()
    except RuntimeError:        # llvmlite cannot read this host's features
        return set()
    return {f[1:] for f in flat.split(",") if f.startswith("+")}


def host_isa() -> str:
    """The best lowering this CPU runs, from the features LLVM reports for it."""
    if numba.config.CPU_NAME not in (None, "host"):
        return "portable"       # compiling for another CPU (NUMBA_CPU_NAME): target intrinsics may not exist there
    f = host_features()
    if {"avx512f", "avx512bw", "avx512vnni"} <= f:
        return "avx512vnni"
    if {"avx2", "avxvnni"} <= f:
        return "avxvnni"
    if "avx2" in f:
        return "avx2"
    return "portable"


def runnable_isas() -> list[str]:
    """Every lowering this CPU executes, the host's own first (tests force the others)."""
    f = host_features()
    isas = ["portable"]
    if "avx2" in f:
        isas.append("avx2")
    if {"avx2", "avxvnni"} <= f or {"avx512vnni", "avx512vl"} <= f:
        isas.append("avxvnni")     # the VEX ymm forms; AVX512-VL VNNI runs the same IR
    if {"avx512f", "avx512bw", "avx512vnni"} <= f:
        isas.append("avx512vnni")
    host = host_isa()
    return [host, *(i for i in isas if i != host)]


def _selected_isa() -> tuple[str, bool]:
    forced = ENV.int_isa
    if not forced:
        return host_isa(), False
    if forced not in ISAS:
        raise ValueError(f"HYBRIDRT_INT_ISA={forced!r}: expected one of {', '.join(ISAS)}")
    return forced, True


ISA, ISA_FORCED = _selected_isa()
# A forced lowering must not land in (or come from) the on-disk cache, which is keyed by the CPU,
# not by this choice: kernels that inline these ops compile with cache=CACHE.
CACHE = not ISA_FORCED


def _vec(el, n):
    return ir.VectorType(el, n)


def _intrinsic(builder, name, ret, args):
    fn = builder.module.globals.get(name)
    if fn is None:
        fn = ir.Function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name=name)
    return builder.call(fn, args)


def _halves(b, v):
    n = v.type.count
    idx = ir.VectorType(I32, n // 2)
    undef = ir.Constant(v.type, ir.Undefined)
    return (b.shuffle_vector(v, undef, ir.Constant(idx, list(range(n // 2)))),
            b.shuffle_vector(v, undef, ir.Constant(idx, list(range(n // 2, n)))))


def _concat(b, lo, hi):
    n = lo.type.count
    return b.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(I32, 2 * n), list(range(2 * n))))


def _split_call(b, fn, *args):
    """fn on the low and on the high halves of every argument, results concatenated (ymm ISAs)."""
    halves = [_halves(b, a) for a in args]
    return _concat(b, fn(*[h[0] for h in halves]), fn(*[h[1] for h in halves]))


def _even_odd(b, v):
    n = v.type.count
    idx = ir.VectorType(I32, n // 2)
    undef = ir.Constant(v.type, ir.Undefined)
    return (b.shuffle_vector(v, undef, ir.Constant(idx, list(range(0, n, 2)))),
            b.shuffle_vector(v, undef, ir.Constant(idx, list(range(1, n, 2)))))


def _as(b, v, el):
    """Bitcast a vector to element type `el` (same total width)."""
    n = v.type.count * v.type.element.width // el.width
    return b.bitcast(v, _vec(el, n))


# ------------------------------------------------------------------------------ the four operations

def maddubs(b, u, s):
    """Pairwise u8 x s8 products summed into i16 (callers keep |sum| <= 32767: no saturation)."""
    n = u.type.count
    if ISA == "avx512vnni":
        return _intrinsic(b, "llvm.x86.avx512.pmaddubs.w.512", _vec(I16, 32), [u, s])
    if ISA in ("avxvnni", "avx2"):
        return _split_call(b, lambda x, y: _intrinsic(b, "llvm.x86.avx2.pmadd.ub.sw", _vec(I16, 16), [x, y]), u, s)
    p = b.mul(b.zext(u, _vec(I16, n)), b.sext(s, _vec(I16, n)))
    even, odd = _even_odd(b, p)
    return _intrinsic(b, f"llvm.sadd.sat.v{n // 2}i16", _vec(I16, n // 2), [even, odd])


def pmaddwd(b, a, c):
    """Pairwise i16 x i16 products summed into i32."""
    n = a.type.count
    if ISA != "portable" and n == 16:
        return _intrinsic(b, "llvm.x86.avx2.pmadd.wd", _vec(I32, 8), [a, c])
    if ISA == "avx512vnni" and n == 32:
        return _intrinsic(b, "llvm.x86.avx512.pmaddw.d.512", _vec(I32, 16), [a, c])
    if ISA != "portable" and n == 32:
        return _split_call(b, lambda x, y: _intrinsic(b, "llvm.x86.avx2.pmadd.wd", _vec(I32, 8), [x, y]), a, c)
    p = b.mul(b.sext(a, _vec(I32, n)), b.sext(c, _vec(I32, n)))
    even, odd = _even_odd(b, p)
    return b.add(even, odd)


def dpwssd(b, acc, a, c):
    """acc + pmaddwd(a, c) (one vpdpwssd with VNNI)."""
    if ISA == "avx512vnni":
        r = _intrinsic(b, "llvm.x86.avx512.vpdpwssd.512", _vec(I32, 16), [acc, _as(b, a, I32), _as(b, c, I32)])
        return r
    if ISA == "avxvnni":
        return _split_call(b, lambda x, y, z: _intrinsic(b, "llvm.x86.avx512.vpdpwssd.256", _vec(I32, 8),
                                                         [x, _as(b, y, I32), _as(b, z, I32)]), acc, a, c)
    return b.add(acc, pmaddwd(b, a, c))


def dpbusd(b, acc, u, s, wide=False):
    """acc + sums of 4 u8 x s8 products. wide: u may exceed 127 (Q8_0's offset bytes), which on
    avx2 would saturate vpmaddubsw: u is split into nibbles, u = 16 hi + lo, each side exact."""
    n = u.type.count
    if ISA == "avx512vnni":
        return _intrinsic(b, "llvm.x86.avx512.vpdpbusd.512", _vec(I32, 16), [acc, _as(b, u, I32), _as(b, s, I32)])
    if ISA == "avxvnni":
        return _split_call(b, lambda x, y, z: _intrinsic(b, "llvm.x86.avx512.vpdpbusd.256", _vec(I32, 8),
                                                         [x, _as(b, y, I32), _as(b, z, I32)]), acc, u, s)
    if ISA == "avx2":
        ones = ir.Constant(_vec(I16, n // 2), [1] * (n // 2))
        if not wide:
            return b.add(acc, pmaddwd(b, maddubs(b, u, s), ones))
        lo = b.and_(u, ir.Constant(u.type, [15] * n))
        hi = b.lshr(u, ir.Constant(u.type, [4] * n))
        sixteen = ir.Constant(_vec(I16, n // 2), [16] * (n // 2))
        return b.add(acc, b.add(pmaddwd(b, maddubs(b, lo, s), ones), pmaddwd(b, maddubs(b, hi, s), sixteen)))
    p = b.mul(b.zext(u, _vec(I32, n)), b.sext(s, _vec(I32, n)))
    idx = ir.VectorType(I32, n // 4)
    undef = ir.Constant(p.type, ir.Undefined)
    parts = [b.shuffle_vector(p, undef, ir.Constant(idx, list(range(i, n, 4)))) for i in range(4)]
    return b.add(acc, b.add(b.add(parts[0], parts[1]), b.add(parts[2], parts[3])))


def packs(b, x, y):
    """i32 x 16 twice -> i16 x 32, per 128-bit lane L: x's 4 lanes of L, then y's (vpackssdw's
    order). Callers keep every value inside int16, so the conversion is exact on every ISA."""
    if ISA == "avx512vnni":
        return _intrinsic(b, "llvm.x86.avx512.packssdw.512", _vec(I16, 32), [x, y])
    if ISA in ("avxvnni", "avx2"):
        return _split_call(b, lambda u, w: _intrinsic(b, "llvm.x86.avx2.packssdw", _vec(I16, 16), [u, w]), x, y)
    idx = [16 * h + 4 * lane + j for lane in range(4) for h in (0, 1) for j in range(4)]
    return b.trunc(b.shuffle_vector(x, y, ir.Constant(_vec(I32, 32), idx)), _vec(I16, 32))


def lut16(b, idx, table):
    """Lane i: table[idx[i]] for byte lanes idx in 0..15 (32 or 64 of them) and 16 constant bytes:
    vpshufb, the table in every 128-bit lane (IQ4's non-linear levels: one instruction per 32 or
    64 weights). portable: a compare-and-select per table entry."""
    n = idx.type.count
    if ISA != "portable":
        tab = ir.Constant(_vec(I8, n), [int(table[j % 16]) & 0xFF for j in range(n)])
        if ISA == "avx512vnni" and n == 64:
            return _intrinsic(b, "llvm.x86.avx512.pshuf.b.512", _vec(I8, 64), [tab, idx])
        if n == 32:
            return _intrinsic(b, "llvm.x86.avx2.pshuf.b", _vec(I8, 32), [tab, idx])
        return _split_call(b, lambda t, x: _intrinsic(b, "llvm.x86.avx2.pshuf.b", _vec(I8, 32), [t, x]), tab, idx)
    out = ir.Constant(_vec(I8, n), [0] * n)
    for j in range(16):
        hit = b.icmp_unsigned("==", idx, ir.Constant(_vec(I8, n), [j] * n))
        out = b.select(hit, ir.Constant(_vec(I8, n), [int(table[j]) & 0xFF] * n), out)
    return out


def prefetch(b, ptr, locality=3):
    """Ask for the cache line at ptr (an i8*) ahead of its use: a hint, never a fault (locality 3:
    prefetcht0, into L1; 2: prefetcht1, into L2). The row kernels stream short weight rows side by
    side; the hardware prefetcher loses time finding each new stream, and a decode-heavy loop
    leaves too few loads in flight on its own."""
    fn = b.module.globals.get("llvm.prefetch.p0i8")
    if fn is None:
        fn = ir.Function(b.module, ir.FunctionType(ir.VoidType(), [I8.as_pointer(), I32, I32, I32]),
                         name="llvm.prefetch.p0i8")
    b.call(fn, [ptr, ir.Constant(I32, 0), ir.Constant(I32, locality), ir.Constant(I32, 1)])


# ------------------------------------------------------------------------------ byte-vector helpers

class IntBlockIR(BlockIR):
    """BlockIR (i32-lane scale unpacking, float helpers) plus raw byte vectors for the weights."""

    def bytes(self, off, n):
        """n raw bytes at base + off, as <n x i8>."""
        p = self.b.gep(self.base, [ir.Constant(I64, off)])
        return _load_vec(self.b, p, I8, n, 1)

    def bconst(self, value, n, el=I8):
        return ir.Constant(_vec(el, n), list(value) if isinstance(value, (list, tuple)) else [value] * n)

    def band(self, a, m):
        return self.b.and_(a, self.bconst(m, a.type.count, a.type.element))

    def bshr(self, a, s):
        return self.b.lshr(a, self.bconst(s, a.type.count, a.type.element)) if s else a

    def bshl(self, a, s):
        return self.b.shl(a, self.bconst(s, a.type.count, a.type.element)) if s else a

    def bxor(self, a, m):
        return self.b.xor(a, self.bconst(m, a.type.count, a.type.element))

    def bmul(self, a, m):
        return self.b.mul(a, self.bconst(m, a.type.count, a.type.element))

    def concat(self, lo, hi):
        return _concat(self.b, lo, hi)

    def i16(self, v):
        """i32 lanes (small values) -> i16 lanes."""
        return self.b.trunc(v, _vec(I16, v.type.count))

    def halves(self, off, shifts, mask):
        """The 32 bytes at off loaded into both halves of a 64-byte vector (one broadcast load),
        each half shifted right by its own amount (shifts: low half, high half; bits < 8) and
        masked: (q >> 0) & 15, (q >> 4) & 15 puts a nibble-packed row's two halves in element
        order in one shift and one and (LLVM: vpsrlvw + vpandd, or one GFNI affine op)."""
        q = self.bytes(off, 32)
        w = self.b.bitcast(self.concat(q, q), _vec(I16, 32))
        w = self.b.lshr(w, self.bconst([shifts[0]] * 16 + [shifts[1]] * 16, 32, I16))
        return self.band(self.b.bitcast(w, _vec(I8, 64)), mask)

    def zeros(self, el, n):
        return ir.Constant(_vec(el, n), [0] * n)

    def fsplat(self, x, n):
        return _splat(self.b, x, n)
