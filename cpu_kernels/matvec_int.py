"""The k-input quantized matvec on int8 activations: integer dot products, as llama.cpp does.

Why: with float activations every weight must become a float32 before its fma (matvec.py), about
half an instruction per weight, so the float kernel is decode-bound at 15-25 % of read bandwidth.
Here the activations are quantized once per call (quantize_act: int8 blocks with a float scale)
and a weight block only has to become bytes: nibbles masked and shifted into 64-byte vectors in
element order, then multiplied with the activation bytes 64 at a time (simd_int: vpdpbusd), the
K-quant sub-block scales applied to the raw sums (two chunks' packed to int16, one vpdpwssd; IQ4_XS,
whose looked-up level bytes reach 241, in int32). IQ4_NL / IQ4_XS levels come from one vpshufb.
Every weight stream is prefetched a kilobyte ahead (the rows are short, side by side streams).

Per (token, row) every path computes the same exact integers and applies the same float steps in
the same order (the numerics block below): one float lane per (token, row), so a token's result is
bit-identical whatever k is, where the token sits in the batch, how many threads run, and which
of the kernels below computed it (tested for every type):

    k <= 5      block_dots, register groups: a group of rows by tokens (4 rows x 1 token for
                decode, 4 x 2 or 2 x 4 for verify batches; a single row where SINGLE_ROWS says
                this CPU streams short rows faster one at a time), each row's step decoded into
                registers once and dotted with each token in 64-byte vectors (integers over 16
                lanes), the group's lanes folded (exactly) and packed into one vector: one sitofp
                + fma per term for the whole group, so the float steps cost little per (row, token).
                Where TWO_PHASES says so (Q8_0's short rows on AMD Zen), a group's rows are read
                one after another, their block sums kept in a stack buffer for the group's float
                steps: side by side, short rows stream from memory at half speed there.
    k >= 6      tiled, token quads (matvec_tiled): rows in tiles, columns in chunks whose
                activations stay in L1, each step decoded once per 16 tokens; one vpdpbusd per
                64 products, each token's integers in its own 4 lanes.
    row lanes   on AVX-512 VNNI and avx2 (ROW_LANES_HOST), in place of both above from 1-4 tokens (per
                type) to the token lanes' k: block_dots takes 16 rows at a time, transposed so
                each lane holds one row (matvec_rowlanes): one vpdpbusd multiplies 4 weights of
                16 rows by a token's broadcast activation dword, nothing is folded, and a step's
                transposes are shared by the tokens of a pass (up to 8). Q8_0 on the 27B FFN
                shapes: 8 tokens cost 1.2-1.5x one, against 2.2-2.9x in the token quads. On the
                avx2 lowering (ymm halves) most types from 4 tokens up to a full pass of 8, where
                the token quads take over (matvec_tiled.YMM_ROW_LANES_MAX_K).
    k >= 12     tiled, token lanes (matvec_tiled; legacy types: k >= 10), the prompt GEMM: the
                activations transposed, 16 tokens' 4-byte groups in one vector, so one vpdpbusd
                adds 4 products for each of 16 tokens, every integer in its token's lane.

Accuracy: the integer parts are exact, so the result is the float64 product of the dequantized
weights with the *dequantized int8 activations* up to float32 rounding of the scaling steps; vs
float activations it carries the activation quantization error (|x - q dx| <= dx / 2 per value),
as llama.cpp's CPU backend does. matvec(..., exact=True) keeps the float kernel.
"""
from __future__ import annotations

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .formats import QUANT_TYPES, type_tag
from .int_blocks import INT_TYPES, types_tag  # noqa: F401  (public here: matvec's users import them from here)
from .int_blocks import (_by_type, _c64, _c_2d, _concat_all, _decoded, _loop, _max_k_lookup, _qtype_arg, _steps,
                         _Tokens, _weight_row, act_block, n_row_groups)
from .matvec_rowlanes import PASS_TOKENS, ROW_LANES, row_lanes_dot, row_lanes_from
from .matvec_simd import _array, _fma, _load_vec
from .matvec_tiled import _matvec_tiled_kernel, quantize_tiled, tiled_min_k, tiling
from .quantize_act import QK_K, quantize_rows
from .simd_int import CACHE, F32, I8, I16, I32, I64, ISA, _concat, _intrinsic, dpbusd, dpwssd, packs, pmaddwd


# --------------------------------------------------------------------------- numerics
# Every path computes, per (token, row), the same exact integers and the same float operations in
# the same order (bit identity across k, batch position, threads and kernels):
#
#   K step (super-block) i:  isum = sum_e q_e a_e sc(e) [+ sum_g off_g bs_g]  msum = sum_g m_g bs_g
#                            y = fma(float(isum), d dx, y);  y = fma(float(msum), -dmin dx, y)
#   legacy block b (A, B of a pair step, in order):
#                            isum = sum_e q_e a_e + off bs_b
#                            y = fma(float(isum), d_b dx_b, y);  y = fma(float(bs_b), m_b dx_b, y)
#
# starting from y = 0 (the msum / bs_b terms only for the types with mins). One float lane per
# (token, row): the kernels differ only in how they reach the integers and which lanes hold which
# tokens.

K_FOLD = ((16, range(8), range(8, 16)), (8, range(4), range(4, 8)), (4, [0, 1], [2, 3]), (2, [0], [1]))
# legacy: lanes 0-7 block A, 8-15 block B -> per token [A, B]
PAIR_FOLD = ((16, [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]), (8, [0, 1, 4, 5], [2, 3, 6, 7]),
             (4, [0, 2], [1, 3]))


def _fold(b, vecs, per, lo, hi):
    """vecs hold whole tokens of `per` lanes each. Returns vectors holding, token by token in the
    same order, the lanes v[lo] + v[hi]; each pair of input vectors becomes one output vector."""
    out = []
    for j in range(0, len(vecs), 2):
        u = vecs[j]
        w = vecs[j + 1] if j + 1 < len(vecs) else None
        n = u.type.count
        toks = [t * per for t in range(n // per)] + ([] if w is None else [n + t * per for t in range(n // per)])

        def idx(sel):
            lanes = [base + x for base in toks for x in sel]
            return ir.Constant(ir.VectorType(I32, len(lanes)), lanes)
        other = u if w is None else w
        out.append(b.add(b.shuffle_vector(u, other, idx(lo)), b.shuffle_vector(u, other, idx(hi))))
    return out


def _fold_all(b, vecs, stages):
    for per, lo, hi in stages:
        vecs = _fold(b, vecs, per, list(lo), list(hi))
    assert len(vecs) == 1
    return vecs[0]


def _lanes(b, vec, idx):
    return b.shuffle_vector(vec, ir.Constant(vec.type, ir.Undefined), ir.Constant(ir.VectorType(I32, len(idx)), idx))


def _vec1(b, x):
    return b.insert_element(ir.Constant(ir.VectorType(x.type, 1), ir.Undefined), x, ir.Constant(I32, 0))


# --------------------------------------------------------------------------- lane groups
# A group is g (1, 2 or 4) (row, token) pairs, one float lane each: g tokens of one row (k = 2..15)
# or g rows for one token (k = 1). Each pair's step is dotted in 64-byte vectors (its integers
# spread over 16 lanes), folded exactly to one lane (two for a legacy pair: A, B), and the group
# scaled together: one sitofp + fma per term for g pairs. An entry is (vb, (q, d, s)): the decoded
# step of its row, (v, blk) or a function emitting the decoder (rows decoded one after the other,
# each next to its dot product: 4 decoded blocks at once would not fit the registers), and its
# token's activation row pointers.


def _k_group(b, entries, i, facc):
    """facc (g lanes) after super-block i."""
    g = len(entries)
    accs, bss, dxs, ds, ms, m16 = [], [], [], [], [], []
    for vb, (q, d, s) in entries:
        v, blk = _decoded(vb)
        a_ptr = b.gep(q, [b.mul(i, _c64(QK_K))])
        # raw sums of 4 products per lane (vpdpbusd), two chunks' packed to int16 (exact: at most
        # 4 x 63 x 127) and scaled with one vpdpwssd: lane 4L + j of chunk c holds elements of
        # 128-bit lane L, whose scale is sc16[c]'s pair lane 8 L (16 elements: 8 pair lanes)
        raws = [dpbusd(b, v.zeros(I32, 16), blk.chunks[c], _load_vec(b, b.gep(a_ptr, [_c64(64 * c)]), I8, 64, 1),
                       blk.wide) for c in range(4)]
        acc = v.zeros(I32, 16)
        if blk.wide:
            for c in range(4):
                acc = b.add(acc, b.mul(raws[c], blk.sc32(v, c)))
        else:
            for c in (0, 2):
                scw = v.shuf(blk.sc16[c], [x for L in range(4) for x in [8 * L] * 4 + [32 + 8 * L] * 4], blk.sc16[c + 1])
                acc = dpwssd(b, acc, packs(b, raws[c], raws[c + 1]), scw)
        bs = _load_vec(b, b.gep(s, [b.mul(i, _c64(16))]), I16, 16, 2)
        if blk.off16 is not None:
            acc = b.add(acc, v.concat(pmaddwd(b, blk.off16, bs), v.zeros(I32, 8)))
        accs.append(acc)
        bss.append(bs)
        dxs.append(_vec1(b, b.load(b.gep(d, [i]))))
        ds.append(_vec1(b, blk.d))
        ms.append(None if blk.min16 is None else _vec1(b, blk.negdmin))
        m16.append(blk.min16)
    fv = ir.VectorType(F32, g)
    dx = _concat_all(b, dxs)
    isum = _fold_all(b, accs, K_FOLD)
    facc = _fma(b, b.sitofp(isum, fv), b.fmul(_concat_all(b, ds), dx), facc)
    if ms[0] is not None:
        mins = []
        for j in range(0, g, 2):
            if j + 1 < g:
                mins.append(pmaddwd(b, _concat(b, m16[j], m16[j + 1]), _concat(b, bss[j], bss[j + 1])))
            else:
                mins.append(pmaddwd(b, m16[j], bss[j]))
        msum = _fold_all(b, mins, K_FOLD[1:])
        facc = _fma(b, b.sitofp(msum, fv), b.fmul(_concat_all(b, ms), dx), facc)
    return facc


def _pair_dot(b, v, blk, q, i):
    """The raw integer sums of block pair i of a decoded weight step with one token: 16 lanes of
    4-product sums (vpdpbusd), block A's in lanes 0-7, B's in 8-15."""
    a = _load_vec(b, b.gep(q, [b.mul(i, _c64(64))]), I8, 64, 1)
    return dpbusd(b, v.zeros(I32, 16), blk.w, a, blk.wide)


def _pair_group(b, entries, i, facc):
    """facc (g lanes) after block pair i: block A's terms, then block B's."""
    accs, d2, m2 = [], [], []
    for vb, (q, d, s) in entries:
        v, blk = _decoded(vb)
        accs.append(_pair_dot(b, v, blk, q, i))
        d2.append(blk.d2)
        m2.append(blk.m2)
    ab = _fold_all(b, accs, PAIR_FOLD)         # 2g lanes: pair 0 A, pair 0 B, pair 1 A, ...
    return _pair_terms(b, ab, [t for _, t in entries], d2, m2 if blk.m2 is not None else None, blk.off, i, facc)


def _pair_terms(b, ab, toks, d2, m2, off, i, facc):
    """facc after block pair i, from the entries' block sums (ab: entry e's blocks A and B in lanes
    2e, 2e + 1), each entry's token's activation rows (toks: (q, d, s) pointers), its weight scales
    d2 and mins m2 (None: the type has none) and the type's integer offset: the offset and the
    float steps (the numerics block)."""
    g = len(toks)
    bs2, dx2 = [], []
    for q, d, s in toks:
        bs2.append(b.sext(_load_vec(b, b.gep(s, [b.mul(i, _c64(2))]), I16, 2, 2), ir.VectorType(I32, 2)))
        dx2.append(_load_vec(b, b.gep(d, [b.mul(i, _c64(2))]), F32, 2, 4))
    fv = ir.VectorType(F32, g)
    bs = _concat_all(b, bs2)
    if off:                 # the type's constants: the same for every entry
        ab = b.add(ab, b.mul(bs, ir.Constant(bs.type, [off] * (2 * g))))
    dx, dw = _concat_all(b, dx2), _concat_all(b, d2)
    mw = None if m2 is None else _concat_all(b, m2)
    for h in range(2):
        sel = [2 * u + h for u in range(g)]
        dxh = _lanes(b, dx, sel)
        facc = _fma(b, b.sitofp(_lanes(b, ab, sel), fv), b.fmul(_lanes(b, dw, sel), dxh), facc)
        if mw is not None:
            facc = _fma(b, b.sitofp(_lanes(b, bs, sel), fv), b.fmul(_lanes(b, mw, sel), dxh), facc)
    return facc


# block pairs a two-phase group reads per row before folding them: a Q8_0 row shorter than
# TWO_PHASE_BYTES whole (rows read in chunks side by side stream as badly as in steps: 27B's
# 5440-byte rows at 49 % of bandwidth in chunks of 32 pairs)
PHASE_STEPS = 64
PHASE_ROWS = 4       # most rows of a two-phase group (its buffers' size)


def _two_phase_pairs(b, decode, nbytes, wrows, rb, trows, n_steps, zero, bufs):
    """facc of a legacy group (len(wrows) rows by len(trows) tokens) after its steps, computed in
    two phases per chunk of PHASE_STEPS block pairs: each row's chunk read on its own, its block
    sums for every token (the row's lanes folded: integers, the same sums in any order) and its
    scales written to `bufs` (stack buffers: i32, f32, f32); then the group's offset and float
    steps per block pair from there, as _pair_group's. The same bits as reading the rows side by
    side, which on AMD Zen 4 streams short rows from memory at about half speed (four streams 680
    bytes apart: 16-20 GB/s against 36-40 for one, a plain byte-reading loop measured the same)."""
    n_rows, n_toks = len(wrows), len(trows)
    raw, dws, mws = bufs
    vrow, v2 = ir.VectorType(I32, 2 * n_toks), ir.VectorType(F32, 2)
    meta = {}       # the type's offset and whether it has mins: known once a step is decoded

    def at(base, slot, j, width, vty):
        idx = b.mul(b.add(b.mul(slot, _c64(n_rows)), _c64(j)), _c64(width))
        return b.bitcast(b.gep(base, [idx]), vty.as_pointer())

    def chunk(c, state):
        c0 = b.mul(c, _c64(PHASE_STEPS))
        c1 = b.add(c0, _c64(PHASE_STEPS))
        c1 = b.select(b.icmp_signed("<", c1, n_steps), c1, n_steps)
        for j in range(n_rows):
            def read(vbs, i, _, j=j):
                v, blk = _decoded(vbs[0])
                slot = b.sub(i, c0)
                sums = _fold_all(b, [_pair_dot(b, v, blk, tr[0], i) for tr in trows], PAIR_FOLD)
                b.store(sums, at(raw, slot, j, 2 * n_toks, vrow), align=8)
                b.store(blk.d2, at(dws, slot, j, 2, v2), align=8)
                if blk.m2 is not None:
                    b.store(blk.m2, at(mws, slot, j, 2, v2), align=8)
                meta["off"], meta["min"] = blk.off, blk.m2 is not None
                return []
            # one row's chunk, then the next row's: the lookahead runs on into it (rb bytes on)
            _steps(b, "pair", decode, nbytes, [wrows[j]], rb, c0, c1, [], read, rb)

        def fold(i, st):
            slot = b.sub(i, c0)
            ab = _concat_all(b, [b.load(at(raw, slot, j, 2 * n_toks, vrow), align=8) for j in range(n_rows)])
            d2 = [b.load(at(dws, slot, j, 2, v2), align=8) for j in range(n_rows) for _ in trows]
            m2 = [b.load(at(mws, slot, j, 2, v2), align=8) for j in range(n_rows) for _ in trows] \
                if meta["min"] else None
            return [_pair_terms(b, ab, [t for _ in range(n_rows) for t in trows], d2, m2, meta["off"], i, st[0])]
        return _loop(b, c0, c1, state, fold)
    n_chunks = b.sdiv(b.add(n_steps, _c64(PHASE_STEPS - 1)), _c64(PHASE_STEPS))
    return _loop(b, _c64(0), n_chunks, [zero], chunk)[0]


def _make_grid_dot(name: str, shapes: dict, two_phase: dict | None = None):
    """A register kernel: `name`(qtype, n, w, r, xq, xd, xs, t0, out, oc) computes the lane group
    shapes[n] = (n_rows, n_toks, n_real): out[t0 + u, oc + j] = (row r + j) . (activation row
    t0 + u) for j < n_rows, u < n_real, one lane per (row, token), float state in registers for the
    whole row; lanes u >= n_real (groups are powers of two) repeat token n_real - 1 and are not
    stored (at compile time: their integer work folds away where it duplicates another lane's).
    Each row's step is decoded once (next to its first dot product) and dotted with every token
    of the group; the fold and the float steps run once per group for all its lanes, so wider
    groups spend less per (row, token) on them. Every lane takes the numerics block's steps
    whatever the group, so the bits are the same in any shape. two_phase (default: this CPU's
    TWO_PHASES): qtype -> the most tokens of a legacy group whose rows, when shorter than
    TWO_PHASE_BYTES, are read one after another (_two_phase_pairs) instead of side by side."""

    def lane_dot(typingctx, qtype, n_lanes, w, r, xq, xd, xs, t0, out, oc):
        if not _c_2d(w, xq, xd, xs, out):
            return None
        qt_type, only = _qtype_arg(qtype)
        sig = types.void(qt_type, types.intp, w, types.intp, xq, xd, xs, types.intp, out, types.intp)

        def codegen(context, builder, signature, args):
            b = builder
            qt_, n_, w_, r_, xq_, xd_, xs_, t0_, out_, oc_ = args
            done = b.append_basic_block(f"{name}.done")
            phases = TWO_PHASES if two_phase is None else two_phase

            def phase_bufs():
                """The two-phase buffers, allocated where the pass runs (the caller frees them with
                llvm.stackrestore): as entry-block allocas their 12 KB in every frame of the fused
                layer kernels cost Gemma 3's FFN half 25 % more time, where no row takes them."""
                out = []
                for elty, n in ((I32, 2 * GRID_TOKENS), (F32, 2), (F32, 2)):
                    p = b.alloca(ir.ArrayType(elty, PHASE_STEPS * PHASE_ROWS * n))
                    p.align = 64
                    out.append(b.bitcast(p, elty.as_pointer()))
                return out

            def emit(qt, kind, decode, nbytes):
                by_n = b.switch(n_, done)
                for n, (n_rows, n_toks, n_real) in shapes.items():
                    bb = b.append_basic_block(f"{name}.n{n}")
                    by_n.add_case(ir.Constant(I64, n), bb)
                    b.position_at_end(bb)
                    # lanes past the n_real tokens repeat the last one and are not stored (groups
                    # are powers of two). A legacy group's fold ends in 2 lanes per (row, token):
                    # at most 8 fit one vector, so a wider group runs as passes over the tokens.
                    toks = [b.add(t0_, _c64(min(u, n_real - 1))) for u in range(n_toks)]
                    per_pass = n_toks if kind == "k" else max(1, min(n_toks, 8 // n_rows))
                    for u0 in range(0, n_toks, per_pass):
                        if u0 < n_real:
                            group_pass(qt, kind, decode, nbytes, n_rows, toks[u0:u0 + per_pass], n_real - u0)
                    b.branch(done)
                b.position_at_end(b.append_basic_block(f"{name}.unreachable"))

            def group_pass(qt, kind, decode, nbytes, n_rows, toks, n_store):
                n_toks = len(toks)
                rows = [b.add(r_, _c64(j)) for j in range(n_rows)]
                wrows, rbs = zip(*[_weight_row(context, b, signature.args[2], w_, x) for x in rows])
                tok = _Tokens(context, b, signature.args[4:7], (xq_, xd_, xs_))
                trows = [tok.rows(t) for t in toks]
                group = _k_group if kind == "k" else _pair_group
                n_steps = b.sdiv(rbs[0], _c64(nbytes))
                if kind != "k":
                    n_steps = b.sdiv(b.add(n_steps, _c64(1)), _c64(2))

                def step(vbs, i, state):
                    entries = [(vb, t) for vb in vbs for t in trows]      # lane j * n_toks + u
                    return [group(b, entries, i, state[0])]
                g = n_rows * n_toks
                zero = ir.Constant(ir.VectorType(F32, g), [0.0] * g)
                # after this pass the caller takes the next rows (row_dot: the next row)
                nxt = b.mul(rbs[0], _c64(n_rows))
                if kind == "pair" and 1 < n_rows <= PHASE_ROWS and n_toks <= phases.get(qt, 0):
                    short = b.icmp_signed("<", rbs[0], _c64(TWO_PHASE_BYTES))
                    with b.if_else(short) as (linear, side_by_side):
                        with linear:
                            sp = _intrinsic(b, "llvm.stacksave", I8.as_pointer(), [])
                            f_lin = _two_phase_pairs(b, decode, nbytes, wrows, rbs[0], trows, n_steps, zero,
                                                     phase_bufs())
                            _intrinsic(b, "llvm.stackrestore", ir.VoidType(), [sp])
                            bb_lin = b.basic_block
                        with side_by_side:
                            (f_sbs,) = _steps(b, kind, decode, nbytes, list(wrows), rbs[0], _c64(0), n_steps, [zero],
                                              step, nxt)
                            bb_sbs = b.basic_block
                    facc = b.phi(zero.type)
                    facc.add_incoming(f_lin, bb_lin)
                    facc.add_incoming(f_sbs, bb_sbs)
                else:
                    (facc,) = _steps(b, kind, decode, nbytes, list(wrows), rbs[0], _c64(0), n_steps, [zero], step, nxt)
                O = _array(context, b, signature.args[8], out_)
                width = cgutils.unpack_tuple(b, O.shape, 2)[1]
                for j in range(n_rows):
                    for u in range(min(n_toks, n_store)):
                        lane = ir.Constant(I32, j * n_toks + u)
                        b.store(b.extract_element(facc, lane),
                                b.gep(O.data, [b.add(b.mul(toks[u], width), b.add(oc_, _c64(j)))]))

            _by_type(b, qt_, done, emit, only)
            b.position_at_end(done)
            return context.get_dummy_value()
        return sig, codegen
    lane_dot.__name__ = name
    return intrinsic(lane_dot)


# row_dot(qtype, n, w, r, xq, xd, xs, t0, out, oc): out[t0 + u, oc] = (row r of W) . (activation row
# t0 + u) for u < n (1 to 4). w: (rows, row_bytes) uint8 of type qtype; xq int8, xd float32, xs
# int16 rows from quantize_act.quantize_rows with the block act_block(qtype); out float32 (k, >= oc
# + 1). Unchecked: the caller validated shapes.
row_dot = _make_grid_dot("row_dot", {4: (1, 4, 4), 3: (1, 4, 3), 2: (1, 2, 2), 1: (1, 1, 1)})
# rows_dot(qtype, n, w, r0, xq, xd, xs, t, out, oc0): out[t, oc0 + u] = (row r0 + u) . (activation
# row t): the k = 1 kernel, the lane folding shared by n rows, each step of each row decoded once.
rows_dot = _make_grid_dot("rows_dot", {4: (4, 1, 1), 2: (2, 1, 1), 1: (1, 1, 1)})
# grid_dot(qtype, n, w, r0, xq, xd, xs, t0, out, oc0): n tokens t0 .. t0 + n - 1 of rows r0 ..:
# 4 rows by 2 tokens (n = 2), 2 rows by 4 tokens (n = 3, 4; for 3 the fourth lane repeats the
# third token, unstored), out[t0 + u, oc0 + j]: verify-sized batches, 8 lanes a group.
grid_dot = _make_grid_dot("grid_dot", {4: (2, 4, 4), 3: (2, 4, 3), 2: (4, 2, 2)})


GRID_TOKENS = 4      # most tokens a grid_dot pass takes (2 rows by 4 tokens: 8 lanes)

# Single-row groups. On AMD Zen (LLVM's host CPU "znver*"), with both cores streaming from memory,
# rows shorter than SINGLE_ROW_BYTES read faster one row at a time than in groups of 4 side by
# side: Zen 4, 2 threads, k = 1, GB/s of 33.8 (docs/history.md, "A Zen 4 machine: single-row groups"):
# Q8_0 262144 x 640 (Gemma 3's output layer) 18.7 -> 31.0, Q6_K 17408 x 5120 18 -> 33, Q4_K 25 ->
# 34, while the 17408-input rows (9.8-18 KB) keep their speed in groups of 4 and the light legacy
# types (Q4_0 .. Q5_1, IQ4_NL), whose single rows are bound by their folds, run slower alone. At
# k = 2 single rows win for Q6_K only: Q8_0's short rows take two-phase groups (below), and its
# 3072-8192-byte rows read faster in groups of 4 rows x 2 tokens (cold, 2 threads, 2026-11-25:
# 17408 x 5120 3.85 vs 5.08 ms, 4096 x 7680 1.39 vs 1.94; 8192 x 3072 and 14336 x 4096 level),
# where Q6_K's lose by half (17408 x 5120 3.63 vs 2.33 ms in groups). The Xeon measurements of
# 2026-11-23/24 (and where no measurement says otherwise) keep the groups of 4. The bits are the
# same either way.
SINGLE_ROW_BYTES = 8192
SINGLE_ROW_CPUS = ("znver",)
# formats.QUANT_TYPES holds the numbers (IntKernel.single_row_max_k)
SINGLE_ROW_MAX_K = {t.qtype: t.integer.single_row_max_k for t in QUANT_TYPES if t.integer and t.integer.single_row_max_k}
# Q8_0's rows under TWO_PHASE_BYTES on the same CPUs: groups again, each row read on its own before
# the group's float steps (_two_phase_pairs), for k <= 2. Zen 4, 2 threads, from memory, best of 3
# `bench_matvec.py` runs against single rows (docs/history.md, "Q8_0's short rows in two-phase
# groups (Zen 4)"): 262144 x 640 (Gemma 3's output layer) k = 1 4.57 vs 5.13 ms, k = 2 5.81 vs 6.84;
# 131072 x 1536 and 98304 x 2048 k = 1 within 2 %, k = 2 15 % faster; 3072 columns k = 2 faster but
# k = 1 slower (6.60 vs 5.67 ms), so those rows (3264 bytes) stay single. The lighter legacy types
# lose by it (their folds, not their bytes, bound them: Q4_0 640 columns k = 1 3.95 vs 3.70 ms in
# groups side by side).
TWO_PHASE_BYTES = 3072
# (IntKernel.two_phase_max_k)
TWO_PHASE_MAX_K = {t.qtype: t.integer.two_phase_max_k for t in QUANT_TYPES if t.integer and t.integer.two_phase_max_k}


# On a Zen lowering without AVX-512 (Zen 3, avx2: 2-3 more instructions per dot where vpdpbusd is
# missing) Q8_0's rows are bound by their work, not by how their rows stream: its 5120-column rows
# read faster at k = 1 in groups of 4 side by side (AMD EPYC znver3, 2 threads, cold, `bench_matvec.py
# --types Q8_0 --ks 1,2 --baseline`, two runs 2026-11-29, ms single rows against groups: 17408 x 5120
# 4.66-5.62 vs 3.65-4.17, 5120 x 6144 1.67-2.93 vs 1.31-2.07). Its short rows keep their two-phase
# groups (262144 x 640 and 131072 x 1536 level at k = 1 and 2, within the runs' spread), and the
# K-quants their single rows (Q6_K 17408 x 5120 k = 1 4.18 vs 5.15 ms in groups; Q4_K level).
YMM_GROUPED = frozenset(t.qtype for t in QUANT_TYPES if t.integer and t.integer.family == "pair")


def single_row_table(cpu_name: str, isa: str = ISA) -> dict[int, int]:
    """qtype -> the largest k (1 or 2) read a row at a time on this CPU and integer lowering
    (simd_int.ISA); absent: groups of rows."""
    if not cpu_name.startswith(SINGLE_ROW_CPUS):
        return {}
    return {qt: k for qt, k in SINGLE_ROW_MAX_K.items() if isa == "avx512vnni" or qt not in YMM_GROUPED}


def two_phase_table(cpu_name: str) -> dict[int, int]:
    """qtype -> the largest k whose short rows are read in two-phase groups on this CPU."""
    return dict(TWO_PHASE_MAX_K) if cpu_name.startswith(SINGLE_ROW_CPUS) else {}


# this host's, fixed at import: they enter the compiled kernels (whose on-disk cache is per CPU)
SINGLE_ROWS = single_row_table(llvm.get_host_cpu_name())
TWO_PHASES = two_phase_table(llvm.get_host_cpu_name())


single_row_max_k = _max_k_lookup(SINGLE_ROWS, "single_row_max_k")      # SINGLE_ROWS[qtype]
two_phase_max_k = _max_k_lookup(TWO_PHASES, "two_phase_max_k")         # TWO_PHASES[qtype]


@njit(cache=CACHE, nogil=True, inline="always")
def single_rows(qtype, k, row_bytes):
    """Whether rows of row_bytes read one at a time for k tokens: where SINGLE_ROWS lists the type
    up to k, for rows shorter than SINGLE_ROW_BYTES, unless two-phase groups take them."""
    if row_bytes < TWO_PHASE_BYTES and two_phase_max_k(qtype) >= k:
        return False
    return single_row_max_k(qtype) >= k and row_bytes < SINGLE_ROW_BYTES


@njit(cache=CACHE, nogil=True)
def block_dots(qtype, w, r0, n_rows, xq, xd, xs, out, oc0, cold=True):
    """out[t, oc0 + j] for every token t and j < n_rows: rows r0 .. r0 + n_rows - 1. The types of
    ROW_LANES_HOST, from its k on: 16 rows at a time in row lanes (matvec_rowlanes), tokens in
    passes of up to PASS_TOKENS, and the rows past a multiple of 16 as the others: tokens in passes
    of up to GRID_TOKENS, each pass over the rows in grid_dot groups (a row left over: row_dot),
    a last single token by rows_dots. The same bits for any rows and tokens asked (a row or a token
    at a time included), with fewer fold and float steps per (row, token): for k = 2 about the time of
    k = 1 on small matrices (the float and fold steps, not the weights, bound those).
    cold: row r0's group of 16 was not prefetched by a call on the rows just before it (row lanes
    prefetch the next group as they go; a cold group is asked for whole before its first step)."""
    k = xq.shape[0]
    if k >= row_lanes_from(qtype):
        n16 = n_rows - n_rows % ROW_LANES
        for j in range(0, n16, ROW_LANES):
            t0 = 0
            while t0 < k:
                n = min(PASS_TOKENS, k - t0)
                row_lanes_dot(qtype, n, w, r0 + j, xq, xd, xs, t0, out, oc0 + j, cold and j == 0 and t0 == 0)
                t0 += n
        r0, n_rows, oc0 = r0 + n16, n_rows - n16, oc0 + n16
    t0 = 0
    while t0 < k:
        if k - t0 < 2:
            rows_dots(qtype, w, r0, n_rows, xq, xd, xs, t0, out, oc0)
            t0 += 1
            continue
        nt = min(k - t0, GRID_TOKENS)
        j = 0
        rstep = 4 if nt == 2 else 2
        if nt == 2 and single_rows(qtype, 2, w.shape[1]):
            rstep = n_rows + 1      # a row at a time (row_dot below)
        while n_rows - j >= rstep:
            grid_dot(qtype, nt, w, r0 + j, xq, xd, xs, t0, out, oc0 + j)
            j += rstep
        while j < n_rows:
            row_dot(qtype, nt, w, r0 + j, xq, xd, xs, t0, out, oc0 + j)
            j += 1
        t0 += nt


@njit(cache=CACHE, nogil=True, inline="always")
def rows_dots(qtype, w, r0, n_rows, xq, xd, xs, t, out, oc0):
    """out[t, oc0 + j] for j < n_rows: rows r0 .. r0 + n_rows - 1 for token t, in passes of 4, 2, 1
    rows (less float and fold work per row than a row at a time; the same bits), or a row at a
    time where SINGLE_ROWS says this CPU streams short rows faster so."""
    single = single_rows(qtype, 1, w.shape[1])
    j = 0
    while j < n_rows:
        n = 1 if single else (4 if n_rows - j >= 4 else (2 if n_rows - j >= 2 else 1))
        rows_dot(qtype, n, w, r0 + j, xq, xd, xs, t, out, oc0 + j)
        j += n


@njit(cache=CACHE, nogil=True, parallel=True)
def _matvec_int_kernel(w, qtype, xq, xd, xs, out, n_groups):
    rows = w.shape[0]
    for g in prange(n_groups):
        lo, hi = group_rows(g, n_groups, rows)
        block_dots(qtype, w, lo, hi - lo, xq, xd, xs, out, lo)


@njit(cache=True, nogil=True, inline="always")
def group_rows(g, n_groups, rows):
    """Rows lo .. hi - 1 of parallel work item g of n_groups: whole groups of ROW_LANES rows (the
    last item takes what is left), so row lanes cover every row of a multiple of 16."""
    n = rows // ROW_LANES
    lo = g * n // n_groups * ROW_LANES
    hi = rows if g == n_groups - 1 else (g + 1) * n // n_groups * ROW_LANES
    return lo, hi


def quantize_for(qtype: int, x: np.ndarray):
    """x's rows quantized as the integer kernel of `qtype` reads them: (q, d, s)."""
    return quantize_rows(x, act_block(qtype))


def matvec_int_into(w: np.ndarray, qtype: int, x: np.ndarray, out: np.ndarray, xq=None) -> np.ndarray:
    """out = W x on int8 activations. Operands already checked (matvec.check_operands); xq: x
    already quantized for this type by quantize_for (k < tiled_min_k(qtype)) or quantize_tiled."""
    k = x.shape[0]
    if k < tiled_min_k(qtype):
        q, d, s = quantize_for(qtype, x) if xq is None else xq
        _matvec_int_kernel(w, type_tag(qtype), q, d, s, out, n_row_groups(w.shape[0]))
        return out
    xa, xb, xc, k_pad = quantize_tiled(qtype, x) if xq is None else xq
    _matvec_tiled_kernel(w, type_tag(qtype), xa, xb, xc, k_pad, out, *tiling(qtype, w.shape, k))
    return out
