"""y = x W^T for up to 16 tokens, W as raw GGUF blocks on the device: one fused Triton launch.

The torch tile path (qlinear.py) decodes a tile of W into a float scratch with a dozen kernels and
then runs one GEMV per token: launch bound, and the decoded tile makes a round trip through memory.
Here each program owns BLOCK_N output rows and walks their K dimension one 256-weight chunk at a
time (one K-quant super-block, or eight 32-weight legacy blocks): it loads the chunk's bytes once,
decodes them into float32 registers and dots them with every token before moving on
(weight-stationary), so W is read from memory exactly once per call whatever k is. Rows of 32-weight
blocks may end inside a chunk (SmolLM2's 576, Gemma 3's 640): the last chunk is then decoded whole,
over the next row's first bytes (`device_rows` leaves slack after the last row), and its weights
past the row are zeroed before the dot.

Bit stability: speculative decoding needs a token's row to be bitwise the same alone or inside a
k-token verify batch. k is a runtime loop bound (never specialized), so every k runs the same
compiled code; the per-token work in the loop body does not depend on k, and token t's accumulator
row only ever receives its own partial sums, in chunk order. The launch comes from matvec_table:
by card, type, shape class and k class, with the fields that order a row's float operations
(matvec_table.BITS_FIELDS: tile order, split-K, dot mode) the same for every k of a matrix.

Split-K (a launch's split_k > 1): a block of rows gets split_k programs, each summing a contiguous
run of the row's chunks into a scratch slot; the last of them to finish (an atomic count per block)
adds the slots in split order and writes y, so the sum's grouping depends on split_k, never on
which program finished first or on k. Dot modes (MatvecParams.dot): "loop" takes each token in turn
(a multiply, an add and a fixed-shape tree reduction per chunk); "ieee" and "tf32x3" multiply the
decoded pieces with all K_MAX tokens' activations in one tl.dot (tokens past k read as zeros; a
token's column of the product does not depend on the others).

Exact decoding: every weight is computed as gguf-py computes it, the same float32 operations in the
same order (e.g. Q4_K is (d*sc)*q - (dmin*m)), and kernels launch with enable_fp_fusion=False so the
compiler cannot contract a multiply and an add into one FMA (which would round once where gguf-py
rounds twice). The dot is float32: per chunk and token a fixed-shape tree reduction (or one tl.dot
per piece), added to the running sum chunk by chunk.

Layout: within a chunk the weights are taken as two pieces of G groups of L weights sharing one
scale (G * L = 128), in whatever order the bytes pack them (e.g. a Q4_K piece is the low nibbles of
its 128 quant bytes); each piece comes with the offsets of its weights inside the chunk, which pick
the matching activations. So every quant byte is loaded once and the loads are contiguous runs
within a row. A piece is [BLOCK_N, G, L] or [G, BLOCK_N, L] (rows in the middle), whichever lets
Triton give each thread a single row for the type's load widths (matvec_table.ROWS_FIRST_TYPES).
"""
from __future__ import annotations

import torch

from cpu_kernels.formats import QUANT_TYPES, TRITON_DECODER, type_name

from .matvec_table import K_MAX, MatvecParams, check_plan, table_for_device
from .quant import IQ4_LEVELS, block_shape, row_bytes
from .triton_support import Launches, have_triton, require_triton

CHUNK = 256         # weights per row decoded per loop step; K_MAX (16) tokens per launch

# the types with a fused kernel (formats.QUANT_TYPES rows with DeviceKernel.triton)
TRITON_MATVEC_TYPES: frozenset[int] = frozenset(t.qtype for t in QUANT_TYPES if t.device.triton)


def _iq4_table() -> tuple[int, int]:
    """The 16 IQ4 levels as two 64-bit words of int8 lanes (level i in byte i % 8 of word i // 8):
    a level is then a select, a shift and a sign extension, with no table in memory."""
    lanes = [v & 0xFF for v in IQ4_LEVELS]
    lo, hi = (sum(b << (8 * i) for i, b in enumerate(lanes[h:h + 8])) for h in (0, 8))
    return lo - (1 << 64) * (lo >> 63), hi - (1 << 64) * (hi >> 63)      # as signed int64 literals


def tail_slack(qtype: int, n_in: int) -> int:
    """Bytes the kernel reads past a row's end: rows of 32-weight blocks whose width is not a
    multiple of CHUNK decode their last chunk whole (the rest zeroed), so the last row needs this
    much readable memory after it (`device_rows` allocates it)."""
    elems, nbytes = block_shape(qtype)
    rem = n_in % CHUNK
    return 0 if rem == 0 else (CHUNK - rem) // elems * nbytes


def readable_past_end(raw: torch.Tensor) -> int:
    """Bytes of raw's storage after its last element (a contiguous view into a larger buffer)."""
    return raw.untyped_storage().nbytes() - (raw.storage_offset() + raw.numel()) * raw.element_size()


def width_fits(qtype: int, n_in: int) -> bool:
    """Rows the kernel takes: whole chunks, or whole 32-weight blocks (a partial last chunk)."""
    return int(qtype) in TRITON_MATVEC_TYPES and (n_in % CHUNK == 0 or (block_shape(qtype)[0] == 32 and n_in % 32 == 0))


def device_rows(raw: torch.Tensor, qtype: int, n_in: int, device: torch.device | str) -> torch.Tensor:
    """A copy of GGUF rows (uint8 [n_out, row_bytes], any device) on `device`, followed by the
    tail_slack bytes the kernel may read past the last row (zeros, never used in a result)."""
    slack = tail_slack(qtype, n_in) if width_fits(qtype, n_in) else 0
    buf = torch.zeros(raw.numel() + slack, dtype=torch.uint8, device=device)
    rows = buf[:raw.numel()].view(raw.shape)
    rows.copy_(raw)
    return rows


def matvec_grid(n_out: int, block_n: int, split_k: int = 1) -> tuple[int]:
    """The launch grid: split_k programs per BLOCK_N output rows (a block's splits adjacent), all on
    axis 0 (CUDA allows 2^31 - 1 programs there, but only 65535 on axes 1 and 2: a 248320-row output
    head would not fit)."""
    return (-(-n_out // block_n) * split_k,)


class SplitScratch:
    """Split-K's scratch on one device: float32 slots for partial sums (each written before it is
    read) and int32 counts, zero between launches (a block's last program resets its count). One
    serves every matrix of a model on that device (the binder's, `qlinear.TileScratch.split`): the
    device's launches run one after another on one stream. Grown on demand; a launch keeps the
    tensors it was given, so growing never pulls them away."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.sums: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None

    def reserve(self, n_sums: int, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(sums, counts) of at least n_sums and n_blocks entries."""
        if self.sums is None or self.sums.numel() < n_sums or self.counts.numel() < n_blocks:
            n_sums = max(n_sums, self.sums.numel() if self.sums is not None else 0)
            n_blocks = max(n_blocks, self.counts.numel() if self.counts is not None else 0)
            self.sums = torch.zeros(n_sums, dtype=torch.float32, device=self.device)
            self.counts = torch.zeros(n_blocks, dtype=torch.int32, device=self.device)
        return self.sums, self.counts


if have_triton():
    import triton
    import triton.language as tl

    # globals a kernel reads must be constexpr
    _IQ4_LO, _IQ4_HI = (tl.constexpr(w) for w in _iq4_table())

    @triton.jit
    def _byte(ptr):
        return tl.load(ptr).to(tl.int32)

    @triton.jit
    def _f16(ptr):
        """The little-endian float16 at ptr, as float32 (exact: subnormals, Inf and NaN kept)."""
        bits = _byte(ptr) | (_byte(ptr + 1) << 8)
        return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _as_float(q, bias: tl.constexpr):
        """float32(q - bias) for int32 0 <= q < 2^23, exactly: q | 0x4B000000 is the float 2^23 + q.
        An OR and a subtraction at the full ALU rate, where an int->float conversion runs at a
        fraction of it."""
        return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + bias)

    @triton.jit
    def _sext8(v):
        """Sign-extend the int8 in the low byte of int32 v."""
        return ((v & 0xFF) ^ 0x80) - 0x80

    @triton.jit
    def _iq4_level(idx):
        """IQ4_NL's kvalues_iq4nl[idx] for int32 0 <= idx < 16, as float32 (the table is in registers)."""
        word = tl.where(idx < 8, _IQ4_LO, _IQ4_HI)
        lane = (word >> ((idx & 7) * 8).to(tl.int64)).to(tl.int32)
        return _sext8(lane).to(tl.float32)

    @triton.jit
    def _groups(p, G: tl.constexpr, L: tl.constexpr):
        """Group and lane indices to broadcast against the row pointers p: [1, G, 1] and [1, 1, L]
        when p is [BLOCK_N, 1, 1] (rows first), [G, 1, 1] and [1, 1, L] when p is [1, BLOCK_N, 1]."""
        lane = tl.arange(0, L)[None, None, :]
        if p.shape[0] == 1:
            g = tl.arange(0, G)[:, None, None]
        else:
            g = tl.arange(0, G)[None, :, None]
        return g, lane

    # Each decoder takes p, [BLOCK_N, 1, 1] pointers to the first byte of one 256-weight chunk of
    # each row, and returns (wa, wb, xa, xb): two [BLOCK_N, G, L] float32 pieces and the [1, G, L]
    # offsets, within the chunk, of the weights they hold.

    @triton.jit
    def _legacy_quants(p, QS_OFF: tl.constexpr, BLOCK_BYTES: tl.constexpr):
        """Eight 32-weight blocks: the block index [1, 8, 1], the low and high nibbles of each
        block's 16 quant bytes (weights j and j + 16), their weight offsets, and the quant bytes."""
        b, j = _groups(p, 8, 16)
        qs = _byte(p + b * BLOCK_BYTES + QS_OFF + j)
        return b, qs & 15, qs >> 4, b * 32 + j, b * 32 + 16 + j

    @triton.jit
    def _q5_high(p, b, j, QH_OFF: tl.constexpr, BLOCK_BYTES: tl.constexpr):
        """Q5_0/Q5_1: bits j and j + 16 of the block's little-endian u32 qh, each shifted to bit 4."""
        qh = p + b * BLOCK_BYTES + QH_OFF + j // 8
        return ((_byte(qh) >> (j % 8)) & 1) << 4, ((_byte(qh + 2) >> (j % 8)) & 1) << 4

    @triton.jit
    def _q4_0(p):
        b, lo, hi, xa, xb = _legacy_quants(p, 2, 18)
        d = _f16(p + b * 18)
        return d * _as_float(lo, 8), d * _as_float(hi, 8), xa, xb

    @triton.jit
    def _q4_1(p):
        b, lo, hi, xa, xb = _legacy_quants(p, 4, 20)
        d = _f16(p + b * 20)
        m = _f16(p + b * 20 + 2)
        return d * _as_float(lo, 0) + m, d * _as_float(hi, 0) + m, xa, xb

    @triton.jit
    def _q5_0(p):
        b, lo, hi, xa, xb = _legacy_quants(p, 6, 22)
        ha, hb = _q5_high(p, b, tl.arange(0, 16)[None, None, :], 2, 22)
        d = _f16(p + b * 22)
        return d * _as_float(lo | ha, 16), d * _as_float(hi | hb, 16), xa, xb

    @triton.jit
    def _q5_1(p):
        b, lo, hi, xa, xb = _legacy_quants(p, 8, 24)
        ha, hb = _q5_high(p, b, tl.arange(0, 16)[None, None, :], 4, 24)
        d = _f16(p + b * 24)
        m = _f16(p + b * 24 + 2)
        return d * _as_float(lo | ha, 0) + m, d * _as_float(hi | hb, 0) + m, xa, xb

    @triton.jit
    def _q8_0(p):
        b, j = _groups(p, 8, 16)
        q = p + b * 34 + 2 + j
        d = _f16(p + b * 34)
        # int8 q + 128 is the byte with its top bit flipped
        return (_as_float(_byte(q) ^ 0x80, 128) * d, _as_float(_byte(q + 16) ^ 0x80, 128) * d,
                b * 32 + j, b * 32 + 16 + j)

    @triton.jit
    def _iq4_nl(p):
        b, lo, hi, xa, xb = _legacy_quants(p, 2, 18)
        d = _f16(p + b * 18)
        return d * _iq4_level(lo), d * _iq4_level(hi), xa, xb

    @triton.jit
    def _k_scale_min(p, sub):
        """Q4_K/Q5_K: the 6-bit scale and min of sub-blocks `sub` (0..7) from the 12 bytes at p + 4."""
        a = _byte(p + 4 + (sub & 3))
        b = _byte(p + 8 + (sub & 3))
        c = _byte(p + 12 + (sub & 3))
        low = sub < 4
        sc = tl.where(low, a & 63, (c & 15) | ((a >> 6) << 4))
        m = tl.where(low, b & 63, (c >> 4) | ((b >> 6) << 4))
        return sc.to(tl.float32), m.to(tl.float32)

    @triton.jit
    def _k_affine(p, c, lo, hi):
        """Q4_K/Q5_K weights of chunk c's two sub-blocks (2c: lo, 2c + 1: hi): (d*sc)*q - (dmin*m)."""
        d = _f16(p)
        dmin = _f16(p + 2)
        sc_a, m_a = _k_scale_min(p, 2 * c)
        sc_b, m_b = _k_scale_min(p, 2 * c + 1)
        wa = (d * sc_a) * _as_float(lo, 0) - dmin * m_a
        wb = (d * sc_b) * _as_float(hi, 0) - dmin * m_b
        return wa, wb

    @triton.jit
    def _q4_k(p):
        # qs[128] @16: byte c*32 + l holds weight c*64 + l (low nibble) and c*64 + 32 + l (high)
        c, lane = _groups(p, 4, 32)
        qs = _byte(p + 16 + c * 32 + lane)
        wa, wb = _k_affine(p, c, qs & 15, qs >> 4)
        return wa, wb, c * 64 + lane, c * 64 + 32 + lane

    @triton.jit
    def _q5_k(p):
        # as Q4_K with qs @48, plus qh[32] @16: bit j of qh[l] is bit 4 of sub-block j's weight l
        c, lane = _groups(p, 4, 32)
        qs = _byte(p + 48 + c * 32 + lane)
        qh = _byte(p + 16 + lane)
        hi_a = ((qh >> (2 * c)) & 1) << 4
        hi_b = ((qh >> (2 * c + 1)) & 1) << 4
        wa, wb = _k_affine(p, c, (qs & 15) | hi_a, (qs >> 4) | hi_b)
        return wa, wb, c * 64 + lane, c * 64 + 32 + lane

    @triton.jit
    def _q6_k(p):
        # ql[128] @0, qh[64] @128, int8 scales[16] @192, d @208. Half h (128 weights) uses ql[h*64:],
        # qh[h*32:]; weight m < 64 of a half is the low nibble of ql[m] with qh bits 2*(m // 32) of
        # qh[m % 32], weight 64 + m the high nibble with bits 4 + 2*(m // 32). Group g = h*4 + m // 16.
        g, lane = _groups(p, 8, 16)
        h = g // 4
        m = (g % 4) * 16 + lane
        ql = _byte(p + g * 16 + lane)
        qh = _byte(p + 128 + h * 32 + m % 32)
        shift = (m // 32) * 2
        qa = (ql & 15) | (((qh >> shift) & 3) << 4)
        qb = (ql >> 4) | (((qh >> (shift + 4)) & 3) << 4)
        d = _f16(p + 208)
        sc_a = _sext8(_byte(p + 192 + h * 8 + g % 4)).to(tl.float32)
        sc_b = _sext8(_byte(p + 196 + h * 8 + g % 4)).to(tl.float32)
        return ((d * sc_a) * _as_float(qa, 32), (d * sc_b) * _as_float(qb, 32),
                h * 128 + m, h * 128 + 64 + m)

    @triton.jit
    def _q23_k_crumbs(p, QS_OFF: tl.constexpr, h):
        """Q2_K/Q3_K half h, as [1, 8, 16] groups g = 2s + l // 16 of shift s: the 2-bit field s of
        qs[h*32 + l] (qs at QS_OFF), the group g, l = (g % 2)*16 + lane, and the weight's offset
        h*128 + s*32 + l in the chunk."""
        g, lane = _groups(p, 8, 16)
        l = (g % 2) * 16 + lane
        q = (_byte(p + QS_OFF + h * 32 + l) >> ((g // 2) * 2)) & 3
        return q, g, l, h * 128 + g * 16 + lane

    @triton.jit
    def _by_halves(p, HALF: tl.constexpr):
        """A chunk of two 128-weight halves decoded by HALF(p, h) -> (weights, offsets)."""
        wa, xa = HALF(p, 0)
        wb, xb = HALF(p, 1)
        return wa, wb, xa, xb

    @triton.jit
    def _q2_k_half(p, h: tl.constexpr):
        # scales[16] @0 (scale nibble low, min nibble high), qs[64] @16, d @80, dmin @82
        q, g, l, xo = _q23_k_crumbs(p, 16, h)
        sc = _byte(p + h * 8 + g)
        dl = _f16(p + 80) * (sc & 15).to(tl.float32)
        ml = _f16(p + 82) * (sc >> 4).to(tl.float32)
        return dl * _as_float(q, 0) - ml, xo

    @triton.jit
    def _q3_k_half(p, h: tl.constexpr):
        # hmask[32] @0, qs[64] @32, scales[12] @96, d @108. Weight l of shift s: crumb s of qs[l],
        # plus 4 when bit 4h + s of hmask[l] is set, minus 4. Scale i = h*8 + g (6 bits, minus 32):
        # low nibble from scales[i % 8] (high nibble for i >= 8), top 2 bits from scales[8 + i % 4]
        q, g, l, xo = _q23_k_crumbs(p, 32, h)
        hbit = (_byte(p + l) >> (4 * h + g // 2)) & 1
        i = h * 8 + g
        low = (_byte(p + 96 + g) >> (4 * h)) & 15
        high = (_byte(p + 104 + i % 4) >> (2 * (i // 4))) & 3
        dl = _f16(p + 108) * ((low | (high << 4)) - 32).to(tl.float32)
        return dl * _as_float(q | (hbit << 2), 4), xo

    @triton.jit
    def _q2_k(p):
        return _by_halves(p, _q2_k_half)

    @triton.jit
    def _q3_k(p):
        return _by_halves(p, _q3_k_half)

    @triton.jit
    def _iq4_xs(p):
        # d @0, u16 scales_h @2, scales_l[4] @4, qs[128] @8: sub-block b's 32 weights are the low
        # then high nibbles of qs[b*16:], its 6-bit scale (minus 32) nibble b % 2 of scales_l[b // 2]
        # with bits 2b of scales_h on top
        b, j = _groups(p, 8, 16)
        qs = _byte(p + 8 + b * 16 + j)
        scales_h = _byte(p + 2) | (_byte(p + 3) << 8)
        low = (_byte(p + 4 + b // 2) >> (4 * (b % 2))) & 15
        high = (scales_h >> (2 * b)) & 3
        dl = _f16(p) * ((low | (high << 4)) - 32).to(tl.float32)
        return dl * _iq4_level(qs & 15), dl * _iq4_level(qs >> 4), b * 32 + j, b * 32 + 16 + j

    # the decoder of each type, passed to the kernel as a constexpr (one compiled kernel per type;
    # formats.QUANT_TYPES: _<kernel> above)
    _DECODERS = TRITON_DECODER.bind(globals())

    @triton.jit
    def _chunk_dot(acc, wa, wb, xa, xb, xc, n_in, k, tok, ROWS_MID: tl.constexpr, TAIL: tl.constexpr):
        """acc[:, t] += the chunk's dot with token t's activations, for t < k: xc + xa, xc + xb
        address the activations of the pieces' weights. TAIL: the row's last, partial chunk, xc
        the row start and xa, xb offsets within the row; activations past n_in are not read (their
        weights are zero)."""
        if TAIL:
            live_a = xa < n_in
            live_b = xb < n_in
        for t in range(0, k):
            xt = xc + t * n_in
            # Loaded at the pieces' full shape (every row reads the same activations, from L1):
            # Triton then gives x the layout of the weight bytes, so the weights stay where
            # they were decoded and the reduction runs mostly inside each thread. A [1, G, L]
            # load gets a layout of its own, and the compiler moves the weights through
            # shared memory to meet it.
            if TAIL:
                xva = tl.load(tl.broadcast_to(xt + xa, wa.shape), mask=tl.broadcast_to(live_a, wa.shape), other=0.0)
                xvb = tl.load(tl.broadcast_to(xt + xb, wb.shape), mask=tl.broadcast_to(live_b, wb.shape), other=0.0)
            else:
                xva = tl.load(tl.broadcast_to(xt + xa, wa.shape))
                xvb = tl.load(tl.broadcast_to(xt + xb, wb.shape))
            prod = wa * xva + wb * xvb
            if ROWS_MID:
                part = tl.sum(tl.sum(prod, axis=0), axis=1)        # over groups, then lanes
            else:
                part = tl.sum(tl.sum(prod, axis=2), axis=1)        # over lanes, then groups
            acc = tl.where(tok == t, acc + part[:, None], acc)
        return acc

    @triton.jit
    def _chunk_mma(acc, wa, wb, xa, xb, xc, n_in, k, ROWS_MID: tl.constexpr, TAIL: tl.constexpr,
                   DOT: tl.constexpr):
        """acc += each piece, as [BLOCK_N, 128] rows, times the activations at its weights' offsets
        for all KT tokens, [128, KT], in one tl.dot (input_precision DOT). Tokens past k (and with
        TAIL activations past n_in) read as zeros: a token's column of a product depends on its own
        activations only, so the zeros change no other token's bits."""
        if ROWS_MID:
            wa = tl.permute(wa, (1, 0, 2))
            wb = tl.permute(wb, (1, 0, 2))
            xa = tl.permute(xa, (1, 0, 2))
            xb = tl.permute(xb, (1, 0, 2))
        n: tl.constexpr = wa.shape[1] * wa.shape[2]
        tok = tl.arange(0, acc.shape[1])[None, :]
        oa = tl.reshape(xa, (n,))[:, None]
        ob = tl.reshape(xb, (n,))[:, None]
        live_a = tok < k
        live_b = tok < k
        if TAIL:
            live_a = live_a & (oa < n_in)
            live_b = live_b & (ob < n_in)
        xva = tl.load(xc + tok * n_in + oa, mask=live_a, other=0.0)
        xvb = tl.load(xc + tok * n_in + ob, mask=live_b, other=0.0)
        acc = tl.dot(tl.reshape(wa, (wa.shape[0], n)), xva, acc, input_precision=DOT)
        return tl.dot(tl.reshape(wb, (wb.shape[0], n)), xvb, acc, input_precision=DOT)

    @triton.jit
    def _chunk_sum(acc, wa, wb, xa, xb, xc, n_in, k, tok, ROWS_MID: tl.constexpr, TAIL: tl.constexpr,
                   DOT: tl.constexpr):
        if DOT == "loop":
            return _chunk_dot(acc, wa, wb, xa, xb, xc, n_in, k, tok, ROWS_MID, TAIL)
        else:
            return _chunk_mma(acc, wa, wb, xa, xb, xc, n_in, k, ROWS_MID, TAIL, DOT)

    @triton.jit(do_not_specialize=["k"])
    def _matvec_kernel(raw, x, y, n_out, n_in, row_bytes, k, sums, counts,
                       DECODE: tl.constexpr, CHUNK_BYTES: tl.constexpr, BLOCK_N: tl.constexpr,
                       KT: tl.constexpr, ROWS_MID: tl.constexpr, TAIL: tl.constexpr,
                       SPLIT_K: tl.constexpr, UNROLL: tl.constexpr, DOT: tl.constexpr):
        block = tl.program_id(0) // SPLIT_K
        split = tl.program_id(0) % SPLIT_K
        rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
        # the last program re-reads row n_out - 1 for its missing rows instead of masking every
        # load; those rows are not stored
        src = tl.minimum(rows, n_out - 1).to(tl.int64) * row_bytes
        # the decoders' tiles broadcast p against [G, 1] and [1, L] offsets: [BLOCK_N, G, L] for
        # p [BLOCK_N, 1, 1], [G, BLOCK_N, L] for p [1, BLOCK_N, 1] (matvec_table.ROWS_FIRST_TYPES)
        if ROWS_MID:
            p = raw + src[None, :, None]
        else:
            p = raw + src[:, None, None]
        tok = tl.arange(0, KT)[None, :]
        # [BLOCK_N, KT], rows first, so a token's partial sums broadcast into it in the layout the
        # reduction left them in (the transpose costs a trip through shared memory per token)
        acc = tl.zeros((BLOCK_N, KT), dtype=tl.float32)
        n_full = n_in // 256
        # this program's run of chunks: runs of cdiv(n_full, SPLIT_K), the last ones shorter or empty
        per = tl.cdiv(n_full, SPLIT_K)
        c0 = tl.minimum(split * per, n_full)
        c1 = tl.minimum(c0 + per, n_full)
        if UNROLL == 2:
            # two chunks decoded before either meets the tokens: twice the loads in flight. Each
            # token's sum still takes chunk c, then c + 1 (the same operations as one at a time)
            c_pairs = c0 + (c1 - c0) // 2 * 2
            for c in range(c0, c_pairs, 2):
                wa, wb, xa, xb = DECODE(p + c * CHUNK_BYTES)
                wa2, wb2, xa2, xb2 = DECODE(p + (c + 1) * CHUNK_BYTES)
                acc = _chunk_sum(acc, wa, wb, xa, xb, x + c * 256, n_in, k, tok, ROWS_MID, False, DOT)
                acc = _chunk_sum(acc, wa2, wb2, xa2, xb2, x + (c + 1) * 256, n_in, k, tok, ROWS_MID, False, DOT)
            c0 = c_pairs
        for c in range(c0, c1):
            wa, wb, xa, xb = DECODE(p + c * CHUNK_BYTES)
            acc = _chunk_sum(acc, wa, wb, xa, xb, x + c * 256, n_in, k, tok, ROWS_MID, False, DOT)
        if TAIL:
            if split == SPLIT_K - 1:
                # rows of 32-weight blocks whose width is not a multiple of 256 (SmolLM2's 576,
                # Gemma 3's 640): the last chunk is decoded whole, over the next row's first bytes
                # (or the slack past the last row, tail_slack), and what lies past the row is zeroed
                wa, wb, xa, xb = DECODE(p + n_full * CHUNK_BYTES)
                wa = tl.where(n_full * 256 + xa < n_in, wa, 0.0)
                wb = tl.where(n_full * 256 + xb < n_in, wb, 0.0)
                acc = _chunk_sum(acc, wa, wb, xa + n_full * 256, xb + n_full * 256, x, n_in, k, tok, ROWS_MID,
                                 True, DOT)
        out = y + tok * n_out + rows[:, None]
        live = (tok < k) & (rows[:, None] < n_out)
        if SPLIT_K == 1:
            tl.store(out, acc, mask=live)
        else:
            # this run's sums into the block's slot for this split; the block's last program to
            # count itself done adds the slots in split order (.cg: from L2, where the other
            # programs' stores are, not a stale L1 line) and resets the count for the next launch
            slots = sums + block * (SPLIT_K * BLOCK_N * KT) + tl.arange(0, BLOCK_N)[:, None] * KT + tok
            tl.store(slots + split * (BLOCK_N * KT), acc, mask=tok < k)
            tl.debug_barrier()          # every thread's slot stores before the count
            if tl.atomic_add(counts + block, 1, sem="acq_rel") == SPLIT_K - 1:
                total = tl.load(slots, mask=tok < k, other=0.0, cache_modifier=".cg")
                for s in tl.static_range(1, SPLIT_K):
                    total += tl.load(slots + s * (BLOCK_N * KT), mask=tok < k, other=0.0, cache_modifier=".cg")
                tl.store(out, total, mask=live)
                tl.store(counts + block, 0)


def matvec_triton(raw: torch.Tensor, qtype: int, n_in: int, x: torch.Tensor,
                  out: torch.Tensor | None = None, *, params: MatvecParams | None = None,
                  fp_fusion: bool = False) -> torch.Tensor:
    """y = x W^T with W as GGUF rows, uint8 [n_out, row_bytes] (ggml layout), in one Triton launch.

    x: float32 [k, n_in] on raw's device, 1 <= k <= 16; n_in a multiple of 256, or for 32-weight
    types of 32 with tail_slack bytes readable past raw (device_rows). Returns float32 [k, n_out] (written into
    `out`, a contiguous float32 [k, n_out] on the same device, when given). A token's row is bitwise
    the same for every k.

    Tuning knobs for benchmarks and tests: params overrides the device's matvec_table launch (for
    every k: a token's bits depend on it, never on k); fp_fusion=True lets the compiler contract
    multiply-adds into FMAs (fewer instructions; weights then differ from gguf-py's by up to a rounding)."""
    require_triton("the fused quantized matvec")
    qtype = int(qtype)
    if qtype not in TRITON_MATVEC_TYPES:
        raise ValueError(f"matvec_triton has no kernel for {type_name(qtype)}")
    elems, nbytes = block_shape(qtype)
    if not width_fits(qtype, n_in):
        raise ValueError(f"matvec_triton: n_in {n_in} is not a multiple of {CHUNK}"
                         + (" or of 32" if elems == 32 else ""))
    n_out = raw.shape[0]
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != row_bytes(qtype, n_in):
        raise ValueError(f"raw must be uint8 ({n_out}, {row_bytes(qtype, n_in)}) for {type_name(qtype)} "
                         f"rows of {n_in}, got {raw.dtype} {tuple(raw.shape)}")
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != n_in or not 1 <= x.shape[0] <= K_MAX:
        raise ValueError(f"x must be float32 [k <= {K_MAX}, {n_in}], got {x.dtype} {tuple(x.shape)}")
    if x.device != raw.device:
        raise ValueError(f"x is on {x.device}, the weights on {raw.device}")
    k = x.shape[0]
    if out is None:
        out = torch.empty(k, n_out, dtype=torch.float32, device=raw.device)
    elif out.dtype != torch.float32 or tuple(out.shape) != (k, n_out) or not out.is_contiguous() \
            or out.device != raw.device:
        raise ValueError(f"out must be a contiguous float32 ({k}, {n_out}) on {raw.device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    if n_out == 0:
        return out
    launch = MatvecLaunch(raw.contiguous(), qtype, n_in, plan=params, fp_fusion=fp_fusion)
    launch(x.contiguous(), out)
    return out


class _Launch:
    """One MatvecParams' launch of one matrix: the grid, the kernel's constexprs and options, the
    scratch it passes, and its Launches (the JIT, then the checked direct runner)."""

    def __init__(self, raw: torch.Tensor, qtype: int, n_in: int, params: MatvecParams, tail: bool, fp_fusion: bool,
                 split: SplitScratch):
        elems, nbytes = block_shape(qtype)
        n_out = raw.shape[0]
        n_blocks = -(-n_out // params.block_n)
        self.grid = matvec_grid(n_out, params.block_n, params.split_k)
        # without split-K the scratch is passed and never touched
        self.scratch = split.reserve(n_blocks * params.split_k * params.block_n * K_MAX if params.split_k > 1 else 1,
                                     n_blocks if params.split_k > 1 else 1)
        self.constexprs = dict(DECODE=_DECODERS[int(qtype)], CHUNK_BYTES=CHUNK // elems * nbytes,
                               BLOCK_N=params.block_n, KT=K_MAX, ROWS_MID=params.rows_mid, TAIL=tail,
                               SPLIT_K=params.split_k, UNROLL=params.unroll, DOT=params.dot)
        self.options = dict(num_warps=params.num_warps, num_stages=params.num_stages, enable_fp_fusion=fp_fusion)
        self.launches = Launches(_matvec_kernel)


class MatvecLaunch:
    """matvec_triton's launch for one matrix, checked and configured once: a decode step calls
    each matrix once per layer, and the per-call checks and configuration were a fifth of the
    host time of a call (scripts/bench_gpu_launch.py --stub). `launch(x, out)` takes what
    matvec_triton takes, unchecked: x contiguous float32 [k <= K_MAX, n_in], out contiguous
    float32 [k, n_out], both on raw's device.

    plan: the launch for each k (a sequence of K_MAX MatvecParams, index k - 1, or one for every
    k); by default the device's matvec_table plan for this type and shape. Its launches must agree
    on matvec_table.BITS_FIELDS (ValueError otherwise). split: the device's split-K scratch, shared
    by a model's matrices (None: one of its own)."""

    def __init__(self, raw: torch.Tensor, qtype: int, n_in: int, *,
                 plan: MatvecParams | tuple[MatvecParams, ...] | None = None, fp_fusion: bool = False,
                 split: SplitScratch | None = None):
        n_out = raw.shape[0]
        if plan is None:
            plan = table_for_device(raw.device).plan(qtype, n_out, n_in)
        elif isinstance(plan, MatvecParams):
            plan = (plan,) * K_MAX
        if len(plan) != K_MAX:
            raise ValueError(f"matvec plan: {len(plan)} launches, one per k = 1..{K_MAX} expected")
        check_plan(plan, f"matvec plan for {type_name(qtype)} {n_out}x{n_in}")
        slack = tail_slack(qtype, n_in)
        if slack and readable_past_end(raw) < slack:
            raise ValueError(f"matvec_triton: rows of {n_in} {type_name(qtype)} weights need {slack} readable bytes "
                             f"past the last row (allocate them with device_rows)")
        self.raw, self.n_out, self.n_in, self.row_bytes = raw, n_out, n_in, raw.shape[1]
        self.plan = tuple(plan)
        launches: dict[MatvecParams, _Launch] = {}
        split = split if split is not None else SplitScratch(raw.device)
        for params in self.plan:
            if params not in launches:
                launches[params] = _Launch(raw, qtype, n_in, params, slack > 0, fp_fusion, split)
        self.by_k = (None,) + tuple(launches[params] for params in self.plan)      # index k

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        if not self.n_out:
            return
        launch = self.by_k[x.shape[0]]
        args = (self.raw, x, out, self.n_out, self.n_in, self.row_bytes, x.shape[0], *launch.scratch)
        # what Triton specializes on among the arguments that change: the alignment of x and out
        # (k is not specialized)
        key = (x.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0)
        launch.launches(key, launch.grid, args, launch.constexprs, launch.options, 2)

    def compile(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Compile every launch of the plan for x's and out's specialization without running it
        (Triton's warmup): inside triton.runtime's AsyncCompileMode the compiles run on its executor,
        which is how the sweep compiles its variants in parallel."""
        for launch in set(self.by_k[1:]):
            args = (self.raw, x, out, self.n_out, self.n_in, self.row_bytes, x.shape[0], *launch.scratch)
            _matvec_kernel.warmup(*args, grid=launch.grid, **launch.constexprs, **launch.options)
