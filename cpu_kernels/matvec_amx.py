"""Verify batches on AMX tiles: the k-input integer matvec for up to 16 tokens with matvec_int's bits.

Why: a verify batch of k tokens costs the AVX-512 integer kernels (matvec_int) k times the
multiply-adds in vector instructions, so time(k) grows with k (1.4x at k = 4, 2.4x at k = 8 on the
27B shapes) although the weights are read once. CPUs with AMX-INT8 (Sapphire Rapids and later Xeons)
multiply a 16-row x 64-byte tile by a 64 x 16 tile in one instruction (tdpbusd: unsigned weight
bytes by signed activation bytes, exact int32 sums) on a unit beside the vector ports, so the
multiply-adds of 16 rows x up to 16 tokens cost about what one token's do. uses_amx says which
calls take the tiles (where they measured faster than matvec_int: BENCHMARKS.md, "AMX tiles").

Per 16 weight rows and one step (a K super-block, or two legacy block pairs):
    decode   each row's step to unsigned bytes in element order (matvec_int's own decoders) in a
             buffer the tiles load from, its scales in small arrays
    tiles    one tile product per block that has its own scale (32 weights: Q4_K / Q5_K sub-blocks,
             legacy blocks): C (16 rows x N tokens, N = 4, 8 or 16) = A (16 rows x 32 bytes) . B
             (the tokens' activation bytes, laid out as 4-byte groups per token), 4 C tiles in flight,
             then stored
    finish   matvec_int's numerics block replayed per (row, token) in vectors of 16 / N rows x N
             tokens: the integer sums (sub-block scales, offsets, mins) exactly, then the same fmas
             in the same order, so every token's result is bit-identical to matvec_int's, whatever k
The tile products of a step run while the vector units decode the next step (software pipeline),
and each row stream is prefetched two super-blocks ahead (16 short streams at once lose the
hardware prefetcher).

Linux hands out the tile state on request (arch_prctl(ARCH_REQ_XCOMP_PERM), once per process);
each thread loads the tile palette (ldtilecfg) at the start of its work. AMX is used when the CPU
has AMX-INT8, the kernel grants the state, the integer lowering is AVX-512 VNNI (the finish is 512-bit
code) and HYBRIDRT_AMX is not 0; otherwise matvec_int's own kernels run, with the same bits.
"""
from __future__ import annotations

import ctypes

import numba
import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from hybridrt.runtime.config import ENV

from .formats import QUANT_TYPES, type_tag
from .int_blocks import SPECS, _k_scales_mins16
from .matvec_int import block_dots
from .matvec_simd import _fma, _load_vec
from .quantize_act import QK_K, QK_LEGACY, quantize_rows
from .simd_int import CACHE, F32, I32, I64, ISA, ISA_FORCED, IntBlockIR, host_features, prefetch

V16I, V16F = ir.VectorType(I32, 16), ir.VectorType(F32, 16)
_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA, _SYS_ARCH_PRCTL = 0x1023, 18, 158

# qtype -> (family, offset of the decoded bytes, has a min): the types with an AMX kernel
# (formats.QUANT_TYPES rows with IntKernel.amx). K: 32-weight sub-blocks with 6-bit scales and mins
# (Q4_K, Q5_K); IQ4_XS (offset bytes, scales without mins) takes the K path with -128 sc_j where
# Q4_K has its mins, folded into isum.
AMX_TYPES = {t.qtype: (t.integer.family, t.integer.amx.offset, t.integer.amx.has_min)
             for t in QUANT_TYPES if t.integer and t.integer.amx}
MAX_TOKENS = 16
# Fewest tokens and columns for which the tiles beat matvec_int's register groups / token quads
# (measured, BENCHMARKS.md "AMX tiles"): a row tile's first decode and its writes are not
# overlapped with anything, which short rows (Gemma 3's 640-wide output layer: 1.5x slower at
# k = 4) cannot pay for
MIN_TOKENS = {"k": 5, "pair": 3}
MIN_COLS = 4096
PREFETCH_FROM = 256     # each row stream is prefetched from this many bytes (and >= 2 steps) ahead


def _offset_in_mins(qtype_count: int) -> bool:
    """Whether a K type's mins' lanes hold its offset coefficients (IQ4_XS: off sc_j, off = -128):
    k_row_to_tiles writes them there and finish_k adds their sum to isum (no -dmin term)."""
    return AMX_TYPES[qtype_count][1] != 0


def _amx_refusal() -> str | None:
    """None when this process can run the tile kernels, else why not."""
    if not ENV.amx:
        return "HYBRIDRT_AMX=0"
    if ISA != "avx512vnni" or ISA_FORCED:
        return f"integer lowering {ISA}{' (forced)' if ISA_FORCED else ''}, not avx512vnni"
    if not {"amx-tile", "amx-int8"} <= host_features():
        return "no AMX-INT8 on this CPU"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
            return f"the OS refused the AMX tile state (errno {ctypes.get_errno()})"
    except (OSError, AttributeError) as e:
        return f"cannot ask the OS for the AMX tile state ({e})"
    llvm.initialize_native_asmparser()     # the tile instructions are inline assembly
    return None


AMX_REFUSAL = _amx_refusal()
AMX = AMX_REFUSAL is None


def uses_amx(qtype: int, k: int, rows: int, cols: int) -> bool:
    """Whether a (rows, cols) matrix of `qtype` times k activation rows runs on the tiles."""
    spec = AMX_TYPES.get(int(qtype))
    return (AMX and spec is not None and MIN_TOKENS[spec[0]] <= k <= MAX_TOKENS and rows >= 16
            and cols >= MIN_COLS)


# --------------------------------------------------------------------------- tile instructions

def _asm(builder, text, constraints, args):
    fnty = ir.FunctionType(ir.VoidType(), [a.type for a in args])
    builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=True), args)


def _data(context, builder, aty, value):
    return context.make_array(aty)(context, builder, value=value).data


def _row_ptr(context, builder, aty, w, r, off):
    """i8* to byte `off` of row r of a 2-D uint8 array, and the row stride."""
    wa = context.make_array(aty)(context, builder, value=w)
    stride = builder.extract_value(wa.strides, 0)
    return builder.gep(wa.data, [builder.add(builder.mul(r, stride), off)]), stride


@intrinsic
def tile_config(typingctx, cfg):
    """ldtilecfg from a 64-byte palette (tile_palette): per thread, before any other tile op."""
    def codegen(context, builder, sig, args):
        _asm(builder, "ldtilecfg ($0)", "r,~{memory}", [_data(context, builder, sig.args[0], args[0])])
    return types.void(cfg), codegen


@intrinsic
def tile_release(typingctx):
    def codegen(context, builder, sig, args):
        _asm(builder, "tilerelease", "~{memory}", [])
    return types.void(), codegen


@intrinsic(prefer_literal=True)
def tile_load(typingctx, t, arr, off, stride):
    """tmm<t> <- rows of `stride` bytes from element `off` of arr (t a literal)."""
    def codegen(context, builder, sig, args):
        p = builder.gep(_data(context, builder, sig.args[1], args[1]), [args[2]])
        _asm(builder, f"tileloadd ($0,$1,1), %tmm{t.literal_value}", "r,r,~{memory}", [p, args[3]])
    return types.void(t, arr, types.intp, types.intp), codegen


@intrinsic(prefer_literal=True)
def tile_store(typingctx, t, arr, off, stride):
    def codegen(context, builder, sig, args):
        p = builder.gep(_data(context, builder, sig.args[1], args[1]), [args[2]])
        _asm(builder, f"tilestored %tmm{t.literal_value}, ($0,$1,1)", "r,r,~{memory}", [p, args[3]])
    return types.void(t, arr, types.intp, types.intp), codegen


@intrinsic(prefer_literal=True)
def tile_zero(typingctx, t):
    def codegen(context, builder, sig, args):
        _asm(builder, f"tilezero %tmm{t.literal_value}", "", [])
    return types.void(t), codegen


@intrinsic(prefer_literal=True)
def tdpbusd(typingctx, c, a, b):
    """tmm<c> += tmm<a> (u8, a row per output row) . tmm<b> (s8, 4-byte groups per column)."""
    text = f"tdpbusd %tmm{b.literal_value}, %tmm{a.literal_value}, %tmm{c.literal_value}"

    def codegen(context, builder, sig, args):
        _asm(builder, text, "", [])
    return types.void(c, a, b), codegen


def tile_palette(shapes) -> np.ndarray:
    """The 64-byte ldtilecfg operand (palette 1) for tiles 0.. of (rows, bytes per row) each."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    for t, (rows, colsb) in enumerate(shapes):
        cfg[16 + 2 * t] = colsb
        cfg[48 + t] = rows
    return cfg


def palette(n: int) -> np.ndarray:
    """C tiles 0-3 (16 rows x n tokens int32), A tiles 4-5 (16 rows x 32 weight bytes), B tiles 6-7
    (8 groups of 4 activation bytes x n tokens)."""
    return tile_palette([(16, 4 * n)] * 4 + [(16, 32)] * 2 + [(8, 4 * n)] * 2)


# --------------------------------------------------------------------------- decode

def _prefetch_row(builder, row, step_bytes):
    """One prefetch per cache line a step advances, two steps (at least PREFETCH_FROM bytes) ahead."""
    ahead = max(PREFETCH_FROM, 2 * step_bytes)
    for line in range(-(-step_bytes // 64)):
        prefetch(builder, builder.gep(row, [ir.Constant(I64, ahead + 64 * line)]))


@intrinsic
def k_row_to_tiles(typingctx, qtype, w, r, base, abuf, a_off, scm, s_off, dw, mw, d_off):
    """Q4_K / Q5_K super-block at byte `base` of row r: its 4 element-order 64-weight chunks ->
    abuf[a_off + 1024 c:] (sub-block 2c in the first 32 bytes, 2c + 1 in the last: A tiles of
    stride 64), scales (0-7) and mins (8-15) as int32 -> scm[s_off:], d -> dw[d_off], -dmin ->
    mw[d_off]."""
    _, decoder, step_bytes = SPECS[qtype.count]
    off, offset_in_mins = AMX_TYPES[qtype.count][1], _offset_in_mins(qtype.count)

    def codegen(context, builder, sig, args):
        row, _ = _row_ptr(context, builder, sig.args[1], args[1], args[2], args[3])
        _prefetch_row(builder, row, step_bytes)
        v = IntBlockIR(builder, row, None)
        blk = decoder(v)
        if offset_in_mins:      # IQ4_XS: lanes 8-15 the offset coefficients off * sc_j
            scm16 = v.concat(blk.sub_sc, v.bmul(blk.sub_sc, off))
            negdmin = ir.Constant(F32, 0.0)
        else:
            scm16, negdmin = _k_scales_mins16(v), blk.negdmin
        pa = _data(context, builder, sig.args[4], args[4])
        for c in range(4):
            at = builder.gep(pa, [builder.add(args[5], ir.Constant(I64, 1024 * c))])
            builder.store(blk.chunks[c], builder.bitcast(at, blk.chunks[c].type.as_pointer()), align=1)
        at = builder.gep(_data(context, builder, sig.args[6], args[6]), [args[7]])
        builder.store(builder.sext(scm16, V16I), builder.bitcast(at, V16I.as_pointer()), align=4)
        builder.store(blk.d, builder.gep(_data(context, builder, sig.args[8], args[8]), [args[10]]))
        builder.store(negdmin, builder.gep(_data(context, builder, sig.args[9], args[9]), [args[10]]))
        return context.get_dummy_value()
    return (types.void(qtype, w, types.intp, types.intp, abuf, types.intp, scm, types.intp, dw, mw, types.intp),
            codegen)


@intrinsic(prefer_literal=True)
def pairs_row_to_tiles(typingctx, qtype, n_pairs, last_blocks, w, r, base, abuf, a_off, dw, mw, d_off):
    """n_pairs (1 or 2) legacy block pairs from byte `base` of row r, the last with last_blocks
    blocks (1: a row's odd last block, the second zeros with d = 0, as matvec_int takes it): pair
    p's 64 element-order bytes (offset-encoded as matvec_int's decoders make them) -> abuf[a_off +
    1024 p:], its blocks' d -> dw[d_off + 32 p + 16 h], their mins (types with one) -> mw likewise."""
    _, decoder, block_bytes = SPECS[qtype.count]
    np_, last = n_pairs.literal_value, last_blocks.literal_value

    def codegen(context, builder, sig, args):
        row, _ = _row_ptr(context, builder, sig.args[3], args[3], args[4], args[5])
        _prefetch_row(builder, row, 4 * block_bytes)
        pa = _data(context, builder, sig.args[6], args[6])
        pd, pm = _data(context, builder, sig.args[8], args[8]), _data(context, builder, sig.args[9], args[9])
        for p in range(np_):
            v = IntBlockIR(builder, builder.gep(row, [ir.Constant(I64, 2 * block_bytes * p)]), None)
            blk = decoder(v, last if p == np_ - 1 else 2)
            at = builder.gep(pa, [_add(builder, args[7], 1024 * p)])
            builder.store(blk.w, builder.bitcast(at, blk.w.type.as_pointer()), align=1)
            for h in range(2):
                at = _add(builder, args[10], 32 * p + 16 * h)
                builder.store(builder.extract_element(blk.d2, ir.Constant(I32, h)), builder.gep(pd, [at]))
                if blk.m2 is not None:
                    builder.store(builder.extract_element(blk.m2, ir.Constant(I32, h)), builder.gep(pm, [at]))
        return context.get_dummy_value()
    return (types.void(qtype, n_pairs, last_blocks, w, types.intp, types.intp, abuf, types.intp, dw, mw, types.intp),
            codegen)


# --------------------------------------------------------------------------- finish (the numerics)

def _lanes(builder, vec, idx):
    return builder.shuffle_vector(vec, ir.Constant(vec.type, ir.Undefined), ir.Constant(ir.VectorType(I32, 16), idx))


def _transpose16(builder, vecs):
    """16 vectors of 16 lanes -> their transpose (4 stages of two-source shuffles)."""
    vecs = list(vecs)
    for blk in (8, 4, 2, 1):
        for i in range(16):
            if (i // blk) % 2:
                continue
            a, b = vecs[i], vecs[i + blk]
            lo = [j if (j // blk) % 2 == 0 else 16 + j - blk for j in range(16)]
            hi = [j + blk if (j // blk) % 2 == 0 else 16 + j for j in range(16)]
            vecs[i] = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(I32, 16), lo))
            vecs[i + blk] = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(I32, 16), hi))
    return vecs


def _vec(builder, p, off, el=I32):
    return _load_vec(builder, builder.gep(p, [off if isinstance(off, ir.Value) else ir.Constant(I64, off)]), el, 16, 4)


def _add(builder, off, k):
    return builder.add(off, ir.Constant(I64, k))


@intrinsic(prefer_literal=True)
def finish_k(typingctx, qtype, n_tok, y, cbuf, scm, s_off, bs, bs_off, dw, mw, d_off, dx, dx_off):
    """matvec_int's K step for 16 rows x N tokens (vectors of 16 / N rows by N tokens; y and the C
    tiles in cbuf [row][token]): isum = sum_j sc_j C_j, msum = sum_j m_j bs_j (bs: 8 vectors of the
    tokens' 32-weight sums), y = fma(float(isum), d dx, y), then y = fma(float(msum), -dmin dx, y);
    for a type with an offset (IQ4_XS: m_j = -128 sc_j) msum is part of isum, one fma."""
    n = n_tok.literal_value
    fold = _offset_in_mins(qtype.count)
    per = 16 // n                       # rows per vector

    def codegen(context, builder, sig, args):
        args = args[1:]     # the qtype is a compile-time choice
        py, pc, ps = [_data(context, builder, sig.args[j + 1], args[j]) for j in (1, 2, 3)]
        pb, pd, pw, px = [_data(context, builder, sig.args[j + 1], args[j]) for j in (5, 7, 8, 10)]
        tok = [j % n for j in range(16)]
        dxv = _lanes(builder, _vec(builder, px, args[11], F32), tok)
        bsv = [_lanes(builder, _vec(builder, pb, _add(builder, args[6], 16 * j)), tok) for j in range(8)]
        scm_t = _transpose16(builder, [_vec(builder, ps, _add(builder, args[4], 16 * r)) for r in range(16)])
        dwv, mwv = _vec(builder, pd, args[9], F32), _vec(builder, pw, args[9], F32)
        for v in range(n):
            rows = [v * per + j // n for j in range(16)]
            isum = msum = None
            for j in range(8):
                p = builder.mul(_lanes(builder, scm_t[j], rows), _vec(builder, pc, 16 * n * j + 16 * v))
                isum = p if isum is None else builder.add(isum, p)
                p = builder.mul(_lanes(builder, scm_t[8 + j], rows), bsv[j])
                msum = p if msum is None else builder.add(msum, p)
            yp = builder.bitcast(builder.gep(py, [ir.Constant(I64, 16 * v)]), V16F.as_pointer())
            yv = builder.load(yp, align=4)
            if fold:
                isum = builder.add(isum, msum)
            yv = _fma(builder, builder.sitofp(isum, V16F), builder.fmul(_lanes(builder, dwv, rows), dxv), yv)
            if not fold:
                yv = _fma(builder, builder.sitofp(msum, V16F), builder.fmul(_lanes(builder, mwv, rows), dxv), yv)
            builder.store(yv, yp, align=4)
        return context.get_dummy_value()
    return (types.void(qtype, n_tok, y, cbuf, scm, types.intp, bs, types.intp, dw, mw, types.intp, dx, types.intp),
            codegen)


@intrinsic(prefer_literal=True)
def finish_pair(typingctx, qtype, n_tok, n_blk, y, cbuf, bs, bs_off, dw, mw, d_off, dx, dx_off):
    """matvec_int's legacy steps for n_blk blocks (C tile b at cbuf[16 N b:], its 16 rows' d at
    dw[d_off + 16 b:], the tokens' 32-sums at bs[bs_off + 16 b:] and scales at dx[dx_off + 16 b:]),
    block after block: isum = C + off bs, y = fma(float(isum), d dx, y), then for the types with a
    min y = fma(float(bs), m dx, y)."""
    _, off, with_min = AMX_TYPES[qtype.count]
    n, nb = n_tok.literal_value, n_blk.literal_value
    per = 16 // n

    def codegen(context, builder, sig, args):
        py, pc, pb = [_data(context, builder, sig.args[j], args[j]) for j in (3, 4, 5)]
        pd, pw, px = [_data(context, builder, sig.args[j], args[j]) for j in (7, 8, 10)]
        tok = [j % n for j in range(16)]
        ys = [builder.load(builder.bitcast(builder.gep(py, [ir.Constant(I64, 16 * v)]), V16F.as_pointer()), align=4)
              for v in range(n)]
        for b in range(nb):
            dxv = _lanes(builder, _vec(builder, px, _add(builder, args[11], 16 * b), F32), tok)
            bsv = _lanes(builder, _vec(builder, pb, _add(builder, args[6], 16 * b)), tok)
            dwv = _vec(builder, pd, _add(builder, args[9], 16 * b), F32)
            mwv = _vec(builder, pw, _add(builder, args[9], 16 * b), F32) if with_min else None
            for v in range(n):
                rows = [v * per + j // n for j in range(16)]
                isum = _vec(builder, pc, 16 * n * b + 16 * v)
                if off:
                    isum = builder.add(isum, builder.mul(bsv, ir.Constant(V16I, [off] * 16)))
                ys[v] = _fma(builder, builder.sitofp(isum, V16F), builder.fmul(_lanes(builder, dwv, rows), dxv), ys[v])
                if with_min:
                    ys[v] = _fma(builder, builder.sitofp(bsv, V16F), builder.fmul(_lanes(builder, mwv, rows), dxv), ys[v])
        for v in range(n):
            builder.store(ys[v], builder.bitcast(builder.gep(py, [ir.Constant(I64, 16 * v)]), V16F.as_pointer()), align=4)
        return context.get_dummy_value()
    return (types.void(qtype, n_tok, n_blk, y, cbuf, bs, types.intp, dw, mw, types.intp, dx, types.intp),
            codegen)


# --------------------------------------------------------------------------- kernels

@njit(cache=CACHE, nogil=True, inline="always")
def _finish_k(qtype, n, y, cbuf, scm, s_off, bsp, bs_off, dw, mw, d_off, dxp, dx_off):
    if n == 4:
        finish_k(qtype, 4, y, cbuf, scm, s_off, bsp, bs_off, dw, mw, d_off, dxp, dx_off)
    elif n == 8:
        finish_k(qtype, 8, y, cbuf, scm, s_off, bsp, bs_off, dw, mw, d_off, dxp, dx_off)
    else:
        finish_k(qtype, 16, y, cbuf, scm, s_off, bsp, bs_off, dw, mw, d_off, dxp, dx_off)


@njit(cache=CACHE, nogil=True)
def _k_tiles(qtype, w, sb_bytes, xb, dxp, bsp, out, cfg, n, g, n_groups):
    """Rows of 16-row tiles g * n_tiles / n_groups .. of a Q4_K / Q5_K / IQ4_XS matrix (see the module
    docstring): step i's tile products, then step i + 1's decode, then step i's finish."""
    k, nsb, n_tiles = out.shape[0], w.shape[1] // sb_bytes, w.shape[0] // 16
    cb = 4 * n
    tile_config(cfg)
    abuf = np.zeros(8192, np.uint8)         # two steps' decoded rows
    cbuf = np.zeros(8 * 16 * 16, np.int32)
    scm = np.zeros(512, np.int32)
    dw = np.zeros(32, np.float32)
    mw = np.zeros(32, np.float32)
    y = np.zeros(16 * 16, np.float32)
    for tile in range(g * n_tiles // n_groups, (g + 1) * n_tiles // n_groups):
        r0 = tile * 16
        y[:] = 0.0
        for r in range(16):
            k_row_to_tiles(qtype, w, r0 + r, 0, abuf, 64 * r, scm, 16 * r, dw, mw, r)
        for i in range(nsb):
            o = i % 2
            ab, an = 4096 * o, 4096 * (1 - o)
            for j0 in range(0, 8, 4):       # sub-block j = 2c + h at abuf[ab + 1024 c + 32 h], stride 64
                xo = (i * 64 + 8 * j0) * cb
                tile_zero(0)
                tile_zero(1)
                tile_zero(2)
                tile_zero(3)
                tile_load(4, abuf, ab + 512 * j0, 64)
                tile_load(6, xb, xo, cb)
                tdpbusd(0, 4, 6)
                tile_load(5, abuf, ab + 512 * j0 + 32, 64)
                tile_load(7, xb, xo + 8 * cb, cb)
                tdpbusd(1, 5, 7)
                tile_load(4, abuf, ab + 512 * j0 + 1024, 64)
                tile_load(6, xb, xo + 16 * cb, cb)
                tdpbusd(2, 4, 6)
                tile_load(5, abuf, ab + 512 * j0 + 1056, 64)
                tile_load(7, xb, xo + 24 * cb, cb)
                tdpbusd(3, 5, 7)
                if i + 1 < nsb:             # half of the next step's rows while the tiles multiply
                    for r in range(j0 * 2, j0 * 2 + 8):
                        k_row_to_tiles(qtype, w, r0 + r, (i + 1) * sb_bytes, abuf, an + 64 * r, scm,
                                       256 * (1 - o) + 16 * r, dw, mw, 16 * (1 - o) + r)
                tile_store(0, cbuf, 16 * n * j0, cb)
                tile_store(1, cbuf, 16 * n * (j0 + 1), cb)
                tile_store(2, cbuf, 16 * n * (j0 + 2), cb)
                tile_store(3, cbuf, 16 * n * (j0 + 3), cb)
            _finish_k(qtype, n, y, cbuf, scm, 256 * o, bsp, 128 * i, dw, mw, 16 * o, dxp, 16 * i)
        for t in range(k):
            for r in range(16):
                out[t, r0 + r] = y[n * r + t]
    tile_release()


@njit(cache=CACHE, nogil=True, parallel=True)
def _k_kernel(qtype, w, sb_bytes, xb, dxp, bsp, out, cfg, n, n_groups):
    for g in prange(n_groups):
        _k_tiles(qtype, w, sb_bytes, xb, dxp, bsp, out, cfg, n, g, n_groups)


@njit(cache=CACHE, nogil=True, inline="always")
def _decode_pairs(qtype, w, r0, first_pair, n_pairs, nblk, block_bytes, abuf, a_off, dw, mw, d_off):
    """Pairs first_pair, first_pair + 1 (n_pairs of them) of rows r0 .. r0 + 15 -> abuf[a_off + 1024 p
    + 64 r:], their blocks' d / m -> dw, mw[d_off + 32 p + 16 h + r]."""
    base = 2 * first_pair * block_bytes
    odd = 2 * (first_pair + n_pairs) > nblk       # the last pair is a row's odd last block
    for r in range(16):
        if n_pairs == 2:
            if odd:
                pairs_row_to_tiles(qtype, 2, 1, w, r0 + r, base, abuf, a_off + 64 * r, dw, mw, d_off + r)
            else:
                pairs_row_to_tiles(qtype, 2, 2, w, r0 + r, base, abuf, a_off + 64 * r, dw, mw, d_off + r)
        elif odd:
            pairs_row_to_tiles(qtype, 1, 1, w, r0 + r, base, abuf, a_off + 64 * r, dw, mw, d_off + r)
        else:
            pairs_row_to_tiles(qtype, 1, 2, w, r0 + r, base, abuf, a_off + 64 * r, dw, mw, d_off + r)


@njit(cache=CACHE, nogil=True, inline="always")
def _finish_pairs(qtype, n, nb, y, cbuf, bsp, bs_off, dw, mw, d_off, dxp, dx_off):
    if nb == 4:
        if n == 4:
            finish_pair(qtype, 4, 4, y, cbuf, bsp, bs_off, dw, mw, d_off, dxp, dx_off)
        elif n == 8:
            finish_pair(qtype, 8, 4, y, cbuf, bsp, bs_off, dw, mw, d_off, dxp, dx_off)
        else:
            finish_pair(qtype, 16, 4, y, cbuf, bsp, bs_off, dw, mw, d_off, dxp, dx_off)
    else:
        if n == 4:
            finish_pair(qtype, 4, 2, y, cbuf, bsp, bs_off, dw, mw, d_off, dxp, dx_off)
        elif n == 8:
            finish_pair(qtype, 8, 2, y, cbuf, bsp, bs_off, dw, mw, d_off, dxp, dx_off)
        else:
            finish_pair(qtype, 16, 2, y, cbuf, bsp, bs_off, dw, mw, d_off, dxp, dx_off)


@njit(cache=CACHE, nogil=True)
def _pair_tiles(qtype, w, block_bytes, xb, dxp, bsp, out, cfg, n, g, n_groups):
    """As _k_tiles for the legacy types: a step is two block pairs (4 blocks, 4 C tiles)."""
    k, nblk, n_tiles = out.shape[0], w.shape[1] // block_bytes, w.shape[0] // 16
    n_pairs = (nblk + 1) // 2
    cb = 4 * n
    tile_config(cfg)
    abuf = np.zeros(4096, np.uint8)         # two steps' decoded rows: 2 pairs x 16 rows x 64 bytes each
    cbuf = np.zeros(4 * 16 * 16, np.int32)
    dw = np.zeros(128, np.float32)
    mw = np.zeros(128, np.float32)
    y = np.zeros(16 * 16, np.float32)
    n_steps = (n_pairs + 1) // 2
    for tile in range(g * n_tiles // n_groups, (g + 1) * n_tiles // n_groups):
        r0 = tile * 16
        y[:] = 0.0
        _decode_pairs(qtype, w, r0, 0, min(2, n_pairs), nblk, block_bytes, abuf, 0, dw, mw, 0)
        for i in range(n_steps):
            o = i % 2
            ab = 2048 * o
            np_i = min(2, n_pairs - 2 * i)
            xo = i * 32 * cb                # 4 blocks = 32 groups of 4 columns a step
            tile_zero(0)
            tile_zero(1)
            tile_load(4, abuf, ab, 64)
            tile_load(6, xb, xo, cb)
            tdpbusd(0, 4, 6)
            tile_load(5, abuf, ab + 32, 64)
            tile_load(7, xb, xo + 8 * cb, cb)
            tdpbusd(1, 5, 7)
            if np_i == 2:
                tile_zero(2)
                tile_zero(3)
                tile_load(4, abuf, ab + 1024, 64)
                tile_load(6, xb, xo + 16 * cb, cb)
                tdpbusd(2, 4, 6)
                tile_load(5, abuf, ab + 1056, 64)
                tile_load(7, xb, xo + 24 * cb, cb)
                tdpbusd(3, 5, 7)
            if i + 1 < n_steps:
                _decode_pairs(qtype, w, r0, 2 * (i + 1), min(2, n_pairs - 2 * (i + 1)), nblk, block_bytes, abuf,
                              2048 * (1 - o), dw, mw, 64 * (1 - o))
            tile_store(0, cbuf, 0, cb)
            tile_store(1, cbuf, 16 * n, cb)
            if np_i == 2:
                tile_store(2, cbuf, 32 * n, cb)
                tile_store(3, cbuf, 48 * n, cb)
            _finish_pairs(qtype, n, 2 * np_i, y, cbuf, bsp, 64 * i, dw, mw, 64 * o, dxp, 64 * i)
        for t in range(k):
            for r in range(16):
                out[t, r0 + r] = y[n * r + t]
    tile_release()


@njit(cache=CACHE, nogil=True, parallel=True)
def _pair_kernel(qtype, w, block_bytes, xb, dxp, bsp, out, cfg, n, n_groups):
    for g in prange(n_groups):
        _pair_tiles(qtype, w, block_bytes, xb, dxp, bsp, out, cfg, n, g, n_groups)


PALETTES = {n: palette(n) for n in (4, 8, 16)}


def matvec_amx_into(w: np.ndarray, qtype: int, x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = W x on int8 activations for k = x.shape[0] <= 16 tokens (where uses_amx):
    matvec_int's result bit for bit. Operands already checked (matvec.check_operands)."""
    k, cols = x.shape
    rows = w.shape[0]
    n = 4 if k <= 4 else (8 if k <= 8 else 16)
    family = AMX_TYPES[int(qtype)][0]
    block = QK_K if family == "k" else QK_LEGACY
    q, d, s = quantize_rows(x, block, pad_rows=MAX_TOKENS - k)     # 16 rows: dx and bs vectors of 16 tokens
    n_pad = q.shape[1]
    xb = np.ascontiguousarray(q[:n].reshape(n, n_pad // 4, 4).transpose(1, 0, 2)).reshape(-1).view(np.uint8)
    dxp = np.ascontiguousarray(d.T).reshape(-1)
    if family == "k":       # the 32-weight sub-block sums from the 16-weight group sums
        bsp = s.astype(np.int32).reshape(MAX_TOKENS, -1, 2).sum(-1, dtype=np.int32).T
    else:
        bsp = s.astype(np.int32).T
    bsp = np.ascontiguousarray(bsp).reshape(-1)
    rows16 = rows - rows % 16
    n_groups = max(1, min(rows16 // 16, 4 * numba.get_num_threads()))
    tag, step_bytes = type_tag(qtype), SPECS[int(qtype)][2]
    if family == "k":
        _k_kernel(tag, w, step_bytes, xb, dxp, bsp, out, PALETTES[n], n, n_groups)
    else:
        _pair_kernel(tag, w, step_bytes, xb, dxp, bsp, out, PALETTES[n], n, n_groups)
    if rows16 < rows:       # the last rows % 16 rows: matvec_int's register groups (the same bits)
        block_dots(tag, w, rows16, rows - rows16, q[:k], d[:k], s[:k], out, rows16)
    return out
