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
row only ever receives its own partial sums, in chunk order. The launch shape (BLOCK_N, num_warps)
depends on the matrix, never on k.

Exact decoding: every weight is computed as gguf-py computes it, the same float32 operations in the
same order (e.g. Q4_K is (d*sc)*q - (dmin*m)), and kernels launch with enable_fp_fusion=False so the
compiler cannot contract a multiply and an add into one FMA (which would round once where gguf-py
rounds twice). The dot is float32: per chunk and token
a fixed-shape tree reduction, added to the running sum chunk by chunk.

Layout: within a chunk the weights are taken as two pieces of G groups of L weights sharing one
scale (G * L = 128), in whatever order the bytes pack them (e.g. a Q4_K piece is the low nibbles of
its 128 quant bytes); each piece comes with the offsets of its weights inside the chunk, which pick
the matching activations. So every quant byte is loaded once and the loads are contiguous runs
within a row. A piece is [BLOCK_N, G, L] or [G, BLOCK_N, L] (rows in the middle), whichever lets
Triton give each thread a single row for the type's load widths (see ROWS_FIRST_TYPES).
"""
from __future__ import annotations

import torch

from cpu_kernels.formats import QUANT_TYPES, TRITON_DECODER, type_name

from .quant import IQ4_LEVELS, block_shape, row_bytes
from .triton_support import Launches, have_triton, require_triton

K_MAX = 16          # tokens per launch: the accumulator is [BLOCK_N, K_MAX] whatever k is
CHUNK = 256         # weights per row decoded per loop step

# the types with a fused kernel (formats.QUANT_TYPES rows with DeviceKernel.triton)
TRITON_MATVEC_TYPES: frozenset[int] = frozenset(t.qtype for t in QUANT_TYPES if t.device.triton)


def _iq4_table() -> tuple[int, int]:
    """The 16 IQ4 levels as two 64-bit words of int8 lanes (level i in byte i % 8 of word i // 8):
    a level is then a select, a shift and a sign extension, with no table in memory."""
    lanes = [v & 0xFF for v in IQ4_LEVELS]
    lo, hi = (sum(b << (8 * i) for i, b in enumerate(lanes[h:h + 8])) for h in (0, 8))
    return lo - (1 << 64) * (lo >> 63), hi - (1 << 64) * (hi >> 63)      # as signed int64 literals


# Tile order, from the sm_90 PTX of each type (no layout conversion is left inside the token loop
# either way; what differs is the shuffles a token's reduction costs). Q4_K and Q5_K keep their
# quant bytes at 16-byte aligned offsets (144- and 176-byte blocks, quants at 16 and 48): the byte
# loads are 16-byte vectors and a [BLOCK_N, G, L] tile (rows first) gives each thread one row, 3
# shuffles a token. The types that load bytes singly or in pairs get 4 rows a thread from a
# rows-first tile (20 shuffles) but one row from a [G, BLOCK_N, L] tile (rows in the middle, 2
# shuffles). Q4_1, Q5_1 and IQ4_XS (4- and 8-byte aligned) are not clean either way; rows first
# needs fewer barriers per chunk.
ROWS_FIRST_TYPES = frozenset(t.qtype for t in QUANT_TYPES if t.device.rows_first)      # DeviceKernel.rows_first


def launch_config(qtype: int, n_out: int) -> tuple[int, int, bool]:
    """(BLOCK_N, num_warps, rows_mid) for a matrix of n_out rows of this type.

    GEMV is memory bound: the GPU needs many programs in flight to cover DRAM latency (an H100 has
    132 SMs), and each program's chunk is BLOCK_N x 256 weights held in registers. Rows first: 16
    rows and 4 warps keep that at 32 weights a thread (no spills) and give a 17408-row FFN matrix
    1088 programs; a 5120-row matrix would get only 320 (2.4 per SM), so narrower matrices take 8
    rows and 2 warps (640 programs, same weights per thread). Rows in the middle: 16 rows and
    2 warps (64 weights a thread, 1088 and 320 programs), the shape whose PTX keeps one row a
    thread without spills."""
    if int(qtype) not in ROWS_FIRST_TYPES:
        return 16, 2, True
    return (16, 4, False) if n_out >= 8192 else (8, 2, False)


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


def matvec_grid(n_out: int, block_n: int) -> tuple[int]:
    """The launch grid: one program per BLOCK_N output rows, all on axis 0 (CUDA allows 2^31 - 1
    programs there, but only 65535 on axes 1 and 2: a 248320-row output head would not fit)."""
    return (-(-n_out // block_n),)


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

    @triton.jit(do_not_specialize=["k"])
    def _matvec_kernel(raw, x, y, n_out, n_in, row_bytes, k,
                       DECODE: tl.constexpr, CHUNK_BYTES: tl.constexpr, BLOCK_N: tl.constexpr,
                       KT: tl.constexpr, ROWS_MID: tl.constexpr, TAIL: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        # the last program re-reads row n_out - 1 for its missing rows instead of masking every
        # load; those rows are not stored
        src = tl.minimum(rows, n_out - 1).to(tl.int64) * row_bytes
        # the decoders' tiles broadcast p against [G, 1] and [1, L] offsets: [BLOCK_N, G, L] for
        # p [BLOCK_N, 1, 1], [G, BLOCK_N, L] for p [1, BLOCK_N, 1] (see ROWS_FIRST_TYPES)
        if ROWS_MID:
            p = raw + src[None, :, None]
        else:
            p = raw + src[:, None, None]
        tok = tl.arange(0, KT)[None, :]
        # [BLOCK_N, KT], rows first, so a token's partial sums broadcast into it in the layout the
        # reduction left them in (the transpose costs a trip through shared memory per token)
        acc = tl.zeros((BLOCK_N, KT), dtype=tl.float32)
        n_full = n_in // 256
        for c in range(0, n_full):
            wa, wb, xa, xb = DECODE(p + c * CHUNK_BYTES)
            acc = _chunk_dot(acc, wa, wb, xa, xb, x + c * 256, n_in, k, tok, ROWS_MID, False)
        if TAIL:
            # rows of 32-weight blocks whose width is not a multiple of 256 (SmolLM2's 576, Gemma
            # 3's 640): the last chunk is decoded whole, over the next row's first bytes (or the
            # slack past the last row, tail_slack), and what lies past the row is zeroed
            wa, wb, xa, xb = DECODE(p + n_full * CHUNK_BYTES)
            wa = tl.where(n_full * 256 + xa < n_in, wa, 0.0)
            wb = tl.where(n_full * 256 + xb < n_in, wb, 0.0)
            acc = _chunk_dot(acc, wa, wb, xa + n_full * 256, xb + n_full * 256, x, n_in, k, tok, ROWS_MID, True)
        tl.store(y + tok * n_out + rows[:, None], acc, mask=(tok < k) & (rows[:, None] < n_out))


def matvec_triton(raw: torch.Tensor, qtype: int, n_in: int, x: torch.Tensor,
                  out: torch.Tensor | None = None, *, block_n: int | None = None,
                  num_warps: int | None = None, rows_mid: bool | None = None,
                  fp_fusion: bool = False) -> torch.Tensor:
    """y = x W^T with W as GGUF rows, uint8 [n_out, row_bytes] (ggml layout), in one Triton launch.

    x: float32 [k, n_in] on raw's device, 1 <= k <= 16; n_in a multiple of 256, or for 32-weight
    types of 32 with tail_slack bytes readable past raw (device_rows). Returns float32 [k, n_out] (written into
    `out`, a contiguous float32 [k, n_out] on the same device, when given). A token's row is bitwise
    the same for every k.

    Tuning knobs for benchmarks: block_n / num_warps / rows_mid override `launch_config` (a token's
    bits depend on them, never on k); fp_fusion=True lets the compiler contract multiply-adds into FMAs (fewer
    instructions; weights then differ from gguf-py's by up to a rounding)."""
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
    launch = MatvecLaunch(raw.contiguous(), qtype, n_in, block_n=block_n, num_warps=num_warps, rows_mid=rows_mid,
                          fp_fusion=fp_fusion)
    launch(x.contiguous(), out)
    return out


class MatvecLaunch:
    """matvec_triton's launch for one matrix, checked and configured once: a decode step calls
    each matrix once per layer, and the per-call checks and configuration were a fifth of the
    host time of a call (scripts/bench_gpu_launch.py --stub). `launch(x, out)` takes what
    matvec_triton takes, unchecked: x contiguous float32 [k <= K_MAX, n_in], out contiguous
    float32 [k, n_out], both on raw's device."""

    def __init__(self, raw: torch.Tensor, qtype: int, n_in: int, *, block_n: int | None = None,
                 num_warps: int | None = None, rows_mid: bool | None = None, fp_fusion: bool = False):
        elems, nbytes = block_shape(qtype)
        n_out = raw.shape[0]
        default_n, default_warps, default_mid = launch_config(qtype, n_out)
        block_n, num_warps = block_n or default_n, num_warps or default_warps
        slack = tail_slack(qtype, n_in)
        if slack and readable_past_end(raw) < slack:
            raise ValueError(f"matvec_triton: rows of {n_in} {type_name(qtype)} weights need {slack} readable bytes "
                             f"past the last row (allocate them with device_rows)")
        self.raw, self.n_out, self.n_in, self.row_bytes = raw, n_out, n_in, raw.shape[1]
        self.grid = matvec_grid(n_out, block_n)
        self.constexprs = dict(DECODE=_DECODERS[int(qtype)], CHUNK_BYTES=CHUNK // elems * nbytes, BLOCK_N=block_n,
                               KT=K_MAX, ROWS_MID=default_mid if rows_mid is None else rows_mid, TAIL=slack > 0)
        self.options = dict(num_warps=num_warps, enable_fp_fusion=fp_fusion)
        self.launches = Launches(_matvec_kernel)

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        if not self.n_out:
            return
        args = (self.raw, x, out, self.n_out, self.n_in, self.row_bytes, x.shape[0])
        # what Triton specializes on among the arguments that change: the alignment of x and out
        # (k is not specialized)
        key = (x.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0)
        self.launches(key, self.grid, args, self.constexprs, self.options, 2)
