"""GGUF block formats decoded with plain torch tensor ops, on whatever device holds the bytes.

Each decoder reads the raw blocks of a tensor as a uint8 (n_blocks, block_bytes) tensor and fills
a float32 (n_blocks, block_elems) one. The arithmetic is float32 and follows gguf-py's numpy reference
operation by operation (scale products first, then one multiply and one add/subtract, never a
fused multiply-add), so the values are bitwise those of `gguf.quants.dequantize` (a NaN stays a
NaN but its payload is not kept). Everything is whole-tensor: views, shifts, masks and gathers over
all blocks at once, no loop over blocks. The scaling runs in place on the one float32 tensor each
decoder fills (the caller's output when it is float32), so a tile's working set beyond it is a
few byte-sized tensors.
"""
from __future__ import annotations

import torch

from cpu_kernels.formats import QUANT_TYPES, TORCH_DECODER, format_of, type_name

# The 16 non-linear levels shared by IQ4_NL and IQ4_XS (ggml's kvalues_iq4nl).
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def block_shape(qtype: int) -> tuple[int, int]:
    """(weights per block, bytes per block) of a supported GGUF type (formats.QUANT_TYPES)."""
    fmt = format_of(qtype)
    return fmt.block_elems, fmt.block_bytes


def row_bytes(qtype: int, n_cols: int) -> int:
    return format_of(qtype).row_bytes(n_cols)


def _f16(blocks: torch.Tensor, off: int) -> torch.Tensor:
    """The float16 at byte `off` of every block, as float32 (n_blocks, 1)."""
    return blocks[:, off:off + 2].view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., m) bytes -> (..., 2, m): low nibbles first, then high nibbles."""
    return torch.stack((qs & 15, qs >> 4), dim=-2)


def _put_nibbles(dst: torch.Tensor, qs: torch.Tensor) -> None:
    """Low then high nibbles of qs (..., m) converted straight into dst (..., 2, m)."""
    dst.select(-2, 0).copy_(qs & 15)
    dst.select(-2, 1).copy_(qs >> 4)


def _fields(packed: torch.Tensor, width: int, dim: int = -2) -> torch.Tensor:
    """(..., m) bytes -> their 8/width bit fields of `width` bits, lowest first, stacked at `dim`.
    (One op per field with a scalar shift: much faster than a broadcast tensor shift on the CPU.)"""
    mask = (1 << width) - 1
    return torch.stack([(packed >> s) & mask for s in range(0, 8, width)], dim=dim)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """(..., m) bytes -> (..., 8, m): bit b of byte j at [..., b, j]."""
    return _fields(packed, 1)


# Each decoder fills dst, float32 (n_blocks, block_elems), from b, uint8 (n_blocks, block_bytes):
# the integer levels are converted straight into dst and scaled there, in place.

def _q4_0(b: torch.Tensor, dst: torch.Tensor) -> None:
    _put_nibbles(dst.view(-1, 2, 16), b[:, 2:18])
    dst.sub_(8).mul_(_f16(b, 0))


def _q4_1(b: torch.Tensor, dst: torch.Tensor) -> None:
    _put_nibbles(dst.view(-1, 2, 16), b[:, 4:20])
    dst.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q5_levels(b: torch.Tensor, qh_off: int) -> torch.Tensor:
    """5-bit values of a Q5_0/Q5_1 block: nibble | (bit j of the little-endian u32 qh) << 4."""
    high = _fields(b[:, qh_off:qh_off + 4], 1, dim=-1).view(-1, 32)   # bit j = byte j/8, bit j%8
    low = _nibbles(b[:, qh_off + 4:qh_off + 20]).view(-1, 32)
    return low | (high << 4)


def _q5_0(b: torch.Tensor, dst: torch.Tensor) -> None:
    dst.copy_(_q5_levels(b, 2))
    dst.sub_(16).mul_(_f16(b, 0))


def _q5_1(b: torch.Tensor, dst: torch.Tensor) -> None:
    dst.copy_(_q5_levels(b, 4))
    dst.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q8_0(b: torch.Tensor, dst: torch.Tensor) -> None:
    dst.copy_(b[:, 2:34].view(torch.int8))
    dst.mul_(_f16(b, 0))


def _q2_k(b: torch.Tensor, dst: torch.Tensor) -> None:
    scales = b[:, 0:16]
    dl = (_f16(b, 80) * (scales & 15).float()).unsqueeze(-1)          # (n, 16, 1)
    ml = (_f16(b, 82) * (scales >> 4).float()).unsqueeze(-1)
    # each 32-byte half of qs holds 4 crumbs per byte: 128 weights, in 8 groups of 16
    dst.view(-1, 2, 4, 32).copy_(_fields(b[:, 16:80].view(-1, 2, 32), 2))
    dst.view(-1, 16, 16).mul_(dl).sub_(ml)


def _q3_k(b: torch.Tensor, dst: torch.Tensor) -> None:
    sc = b[:, 96:108]
    low = _nibbles(sc[:, 0:8]).view(-1, 16)
    high = _fields(sc[:, 8:12], 2).view(-1, 16)
    scales = ((low | (high << 4)).view(torch.int8) - 32).float()
    dl = (_f16(b, 108) * scales).unsqueeze(-1)                         # (n, 16, 1)
    ql = _fields(b[:, 32:96].view(-1, 2, 32), 2)
    # a clear hmask bit means "minus 4"
    minus4 = ((_bits(b[:, 0:32]) ^ 1) << 2).view(-1, 2, 4, 32)
    dst.view(-1, 2, 4, 32).copy_(ql.view(torch.int8) - minus4.view(torch.int8))
    dst.view(-1, 16, 16).mul_(dl)


def _k_scale_min(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 packed bytes -> the 8 six-bit sub-block scales and mins, as float32."""
    d, m, md = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scale = torch.cat((d & 63, (md & 15) | ((d >> 2) & 48)), dim=1)
    mins = torch.cat((m & 63, (md >> 4) | ((m >> 2) & 48)), dim=1)
    return scale.float(), mins.float()


def _q4_k(b: torch.Tensor, dst: torch.Tensor) -> None:
    scale, mins = _k_scale_min(b[:, 4:16])
    d = (_f16(b, 0) * scale).unsqueeze(-1)                              # (n, 8, 1)
    dm = (_f16(b, 2) * mins).unsqueeze(-1)
    _put_nibbles(dst.view(-1, 4, 2, 32), b[:, 16:144].view(-1, 4, 32))
    dst.view(-1, 8, 32).mul_(d).sub_(dm)


def _q5_k(b: torch.Tensor, dst: torch.Tensor) -> None:
    scale, mins = _k_scale_min(b[:, 4:16])
    d = (_f16(b, 0) * scale).unsqueeze(-1)
    dm = (_f16(b, 2) * mins).unsqueeze(-1)
    low = _nibbles(b[:, 48:176].view(-1, 4, 32)).view(-1, 8, 32)
    high = _bits(b[:, 16:48])                                           # sub-block j takes bit j
    dst.view(-1, 8, 32).copy_(low | (high << 4))
    dst.view(-1, 8, 32).mul_(d).sub_(dm)


def _q6_k(b: torch.Tensor, dst: torch.Tensor) -> None:
    d = (_f16(b, 208) * b[:, 192:208].view(torch.int8).float()).unsqueeze(-1)   # (n, 16, 1)
    low = _nibbles(b[:, 0:128].view(-1, 2, 64)).view(-1, 8, 32)
    high = _fields(b[:, 128:192].view(-1, 2, 32), 2).view(-1, 8, 32)
    dst.view(-1, 8, 32).copy_((low | (high << 4)).view(torch.int8) - 32)
    dst.view(-1, 16, 16).mul_(d)


def _iq4_lookup(idx: torch.Tensor, dst: torch.Tensor) -> None:
    """dst (flat) = the IQ4 level of each 4-bit index."""
    levels = torch.tensor(IQ4_LEVELS, dtype=torch.float32, device=idx.device)
    torch.index_select(levels, 0, idx.reshape(-1).int(), out=dst.view(-1))


def _iq4_nl(b: torch.Tensor, dst: torch.Tensor) -> None:
    _iq4_lookup(_nibbles(b[:, 2:18]), dst)
    dst.mul_(_f16(b, 0))


def _iq4_xs(b: torch.Tensor, dst: torch.Tensor) -> None:
    low = _nibbles(b[:, 4:8]).transpose(1, 2).reshape(-1, 8)           # sub-block 2i low, 2i+1 high
    sh = b[:, 2].to(torch.int32) | (b[:, 3].to(torch.int32) << 8)       # u16 scales_h, little-endian
    high = (sh.unsqueeze(-1) >> torch.arange(0, 16, 2, dtype=torch.int32, device=b.device)) & 3
    scales = ((low.to(torch.int32) | (high << 4)) - 32).float()
    dl = (_f16(b, 0) * scales).unsqueeze(-1)                            # (n, 8, 1)
    _iq4_lookup(_nibbles(b[:, 8:136].view(-1, 8, 16)), dst)
    dst.view(-1, 8, 32).mul_(dl)


# type -> torch decoder (formats.QUANT_TYPES: _<kernel> above), float type -> its torch dtype
_DECODERS = TORCH_DECODER.bind(globals())
_FLOATS = {t.qtype: getattr(torch, t.device.dtype) for t in QUANT_TYPES if not t.quantized}

SUPPORTED_TYPES = tuple(t.qtype for t in QUANT_TYPES)
QUANTIZED_TYPES = tuple(_DECODERS)


def dequantize_torch(raw: torch.Tensor, qtype: int, n_cols: int, dtype: torch.dtype = torch.float32,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Raw GGUF rows, uint8 (rows, row_bytes) on any device -> (rows, n_cols) of `dtype`.

    Values are computed in float32 (bitwise gguf-py's) and then cast. With `out` (a (rows, n_cols)
    tensor of `dtype` on the same device) the result lands there and `out` is returned.
    """
    qtype = int(qtype)
    format_of(qtype)        # UnsupportedQuantType, naming the type
    if raw.dtype != torch.uint8 or raw.dim() != 2:
        raise ValueError(f"raw must be uint8 (rows, row_bytes), got {raw.dtype} {tuple(raw.shape)}")
    if raw.shape[1] != row_bytes(qtype, n_cols):
        raise ValueError(f"{type_name(qtype)}: {raw.shape[1]} bytes per row do not hold {n_cols} columns")
    raw = raw.contiguous()
    n_rows = raw.shape[0]
    if out is not None and (tuple(out.shape) != (n_rows, n_cols) or out.dtype != dtype):
        raise ValueError(f"out must be {dtype} {(n_rows, n_cols)}, got {out.dtype} {tuple(out.shape)}")
    direct = out is not None and out.dtype == torch.float32 and out.is_contiguous()
    values = out if direct else torch.empty(n_rows, n_cols, dtype=torch.float32, device=raw.device)
    if qtype in _FLOATS:
        values.copy_(raw.view(_FLOATS[qtype]))
    else:
        elems, nbytes = block_shape(qtype)
        _DECODERS[qtype](raw.view(-1, nbytes), values.view(-1, elems))
    if out is None:
        return values if dtype == torch.float32 else values.to(dtype)
    if not direct:
        out.copy_(values)
    return out
