"""y = x W^T with W kept on the device as its GGUF blocks, dequantized one row tile at a time.

The planner budgets device weights at their GGUF size (Q4_K: 4.5 bits per weight); a dequantized
float16 copy would be 3.5x that. So the device holds the raw bytes, and each call decodes a tile of
output rows into a scratch buffer right before the tile's matmul. One `TileScratch` is shared by all
the linears of a device and compute dtype, so the whole model adds a single tile to device memory
(plus the float32 working set of one decode, freed after each tile).

Bit stability: batches of up to ROWWISE_MAX rows run one GEMV per row and tile, the same ops on the
same shapes whatever the batch size, so a token's output is bitwise the same alone or in a verify
batch. Larger batches (prompts) use one GEMM per tile.

On a CUDA device the small batches take the fused Triton kernel instead (triton_matvec.py: decode
and dot in one launch, W read once for up to 16 tokens), when Triton is installed and the type has
a kernel. It is bit-stable in the same sense, and batches of 17..ROWWISE_MAX rows run it 16 rows
at a time, so every verify batch gives each token the bits it gets alone. It computes in float32
whatever the compute dtype. `kernel="triton"` forces it for every batch (tests run it on CPU tensors
under TRITON_INTERPRET=1); `kernel="torch"` keeps the tile path everywhere.
"""
from __future__ import annotations

import math

import torch

from cpu_kernels.formats import QUANT_TYPES, type_name
from placement.constants import DEQUANT_TILE_ELEMS

from .attention import ROWWISE_MAX
from .quant import QUANTIZED_TYPES, dequantize_torch, row_bytes
from .triton_act_quant import RoundTripLaunch
from .triton_matvec import K_MAX, MatvecLaunch, SplitScratch, readable_past_end, tail_slack, width_fits
from .triton_support import have_triton, require_triton

KERNELS = ("auto", "triton", "torch")

TILE_ELEMS = DEQUANT_TILE_ELEMS     # weights per dequantized tile (the plan reserves one)


def tile_rows_of(n_in: int, n_out: int, tile_rows: int | None = None) -> int:
    """Output rows per dequantized tile of an [n_out, n_in] QuantLinear."""
    return min(n_out, tile_rows or max(1, TILE_ELEMS // n_in))


def fused_kernel_fits(qtype: int, n_in: int, raw: torch.Tensor | None = None) -> bool:
    """Whether the fused Triton matvec has a kernel for this type and row length (and, given the
    rows, whether a partial last chunk has the bytes it reads past them: triton_matvec.device_rows)."""
    if not width_fits(qtype, n_in):
        return False
    return raw is None or readable_past_end(raw.contiguous()) >= tail_slack(qtype, n_in)


# The activation block the CPU's integer kernel of each type reads (formats.IntKernel.act_block):
# Q8_K-style 256-value blocks for the K-quants and IQ4_XS, Q8_0-style 32-value blocks for the
# 32-weight types (IQ4_NL among them).
ACT_BLOCK = {t.qtype: t.integer.act_block for t in QUANT_TYPES if t.integer}
# The largest batch whose activations take the second int8 pass (cpu_kernels.quantize_act's
# RESIDUAL_MAX_TOKENS, restated likewise)
RESIDUAL_MAX_TOKENS = 32


def int8_round_trip(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [k, n] float32 quantized per `block` values to int8 and back, exactly as the CPU's
    activation quantizer does it (q = rint(x * 127 / max|x|); the scale as ggml stores it: 1 / (127 /
    max|x|) for 256-value blocks, max|x| / 127 rounded to float16 for 32-value ones): the float values
    the integer kernel effectively multiplies. Rows are independent."""
    k, n = x.shape
    xb = x.reshape(k, n // block, block)
    amax = xb.abs().amax(-1, keepdim=True)
    zero, one = torch.zeros_like(amax), torch.ones_like(amax)
    # tensor / tensor: torch evaluates `scalar / tensor` as scalar * reciprocal(tensor), an ulp off
    # the CPU quantizer's one division
    inv = torch.where(amax > 0, (one * 127.0) / torch.where(amax > 0, amax, one), zero)
    q = torch.round(xb * inv).clamp_(-127.0, 127.0)
    if block == 256:
        d = torch.where(amax > 0, one / torch.where(amax > 0, inv, one), zero)
    else:
        d = (amax / 127.0).half().float()
    return (q * d).reshape(k, n)


def _same_device(a: torch.device, b: torch.device) -> bool:
    # "cuda" (the current device, as a binder names it) and "cuda:0" (where tensors land) agree
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


class TileScratch:
    """The dequantization tile shared by every QuantLinear on one device with one compute dtype,
    and the fused kernel's split-K scratch (`split`), shared the same way.

    Linears reserve their tile size when they are built; the buffer is allocated once, at the first
    call, at the largest reserved size, and every later tile is a view into it."""

    def __init__(self, device: torch.device | str, dtype: torch.dtype):
        self.device, self.dtype = torch.device(device), dtype
        self.elems = 0
        self._buffer: torch.Tensor | None = None
        self.split = SplitScratch(self.device)

    def reserve(self, elems: int) -> None:
        if elems > self.elems:
            self.elems = elems
            self._buffer = None     # re-made at the new size on next use (only while binding)

    def tile(self, rows: int, cols: int) -> torch.Tensor:
        if rows * cols > self.elems:
            raise ValueError(f"tile {rows}x{cols} exceeds the reserved {self.elems} elements")
        if self._buffer is None:
            self._buffer = torch.empty(self.elems, dtype=self.dtype, device=self.device)
        return self._buffer[:rows * cols].view(rows, cols)

    @property
    def nbytes(self) -> int:
        return self.elems * self.dtype.itemsize


class QuantLinear:
    """A [n_out, n_in] weight held on its device as raw GGUF rows (uint8 [n_out, row_bytes]).

    kernel: "auto" (the fused Triton kernel for batches up to ROWWISE_MAX rows on a CUDA device when
    Triton is installed and fused_kernel_fits, else the tile path), "triton" (the fused kernel for
    every batch, on any device Triton runs on) or "torch" (the tile path always)."""

    def __init__(self, raw: torch.Tensor, qtype: int, n_in: int, n_out: int,
                 compute_dtype: torch.dtype = torch.float32, name: str = "",
                 scratch: TileScratch | None = None, tile_rows: int | None = None, kernel: str = "auto",
                 int8_activations: bool = False, residual: bool = False):
        if int(qtype) not in QUANTIZED_TYPES:
            raise ValueError(f"{name or 'QuantLinear'}: {type_name(qtype)} is not a quantized type")
        if kernel not in KERNELS:
            raise ValueError(f"{name or 'QuantLinear'}: kernel must be one of {KERNELS}, got {kernel!r}")
        if kernel == "triton":
            require_triton(f"{name or 'QuantLinear'} (kernel='triton')")
            if not fused_kernel_fits(qtype, n_in, raw):
                raise ValueError(f"{name or 'QuantLinear'}: no fused Triton kernel for {type_name(qtype)} "
                                 f"rows of {n_in}" + (" without the bytes past the last row it reads "
                                                      "(triton_matvec.device_rows)" if width_fits(qtype, n_in) else ""))
        expected = (n_out, row_bytes(qtype, n_in))
        if raw.dtype != torch.uint8 or tuple(raw.shape) != expected:
            raise ValueError(f"{name or 'QuantLinear'}: raw must be uint8 {expected}, "
                             f"got {raw.dtype} {tuple(raw.shape)}")
        self.raw, self.qtype, self.n_in, self.n_out, self.name = raw.contiguous(), int(qtype), n_in, n_out, name
        self.device, self.compute_dtype = raw.device, compute_dtype
        self.tile_rows = tile_rows_of(n_in, n_out, tile_rows)
        self.scratch = scratch if scratch is not None else TileScratch(raw.device, compute_dtype)
        if not _same_device(self.scratch.device, self.device) or self.scratch.dtype != compute_dtype:
            raise ValueError(f"{name or 'QuantLinear'}: scratch is {self.scratch.dtype} on {self.scratch.device}, "
                             f"weights need {compute_dtype} on {self.device}")
        self.scratch.reserve(self.tile_rows * n_in)
        self.nbytes = self.raw.numel()                                    # what the planner budgets
        self.scratch_bytes = self.tile_rows * n_in * compute_dtype.itemsize
        self.kernel = kernel
        # the largest batch the fused kernel takes; larger ones (prompts) take the tile path
        if kernel == "triton":
            self.fused_max = math.inf
        elif kernel == "auto" and raw.device.type == "cuda" and have_triton() and fused_kernel_fits(qtype, n_in, raw):
            self.fused_max = ROWWISE_MAX
        else:
            self.fused_max = 0

        # the CPU's integer kernels multiply int8-quantized activations; doing the same quantization
        # here keeps a placed model's device layers on the numerics of its mmap'd layers
        self.act_block = ACT_BLOCK.get(self.qtype) if int8_activations else None
        self.residual = residual     # and the second pass on the first one's rounding, as there
        # one Triton launch instead of ~20 torch ops (40 with the second pass) wherever the fused
        # matvec runs: on a GPU those ops' launches were most of a decode step
        self.fused_round_trip = self.act_block is not None and self.fused_max > 0 and n_in % self.act_block == 0
        self._launch = MatvecLaunch(self.raw, self.qtype, n_in, split=self.scratch.split) if self.fused_max > 0 else None
        self._round_trip = RoundTripLaunch(n_in, self.act_block) if self.fused_round_trip else None

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [k, n_in] -> float32 [k, n_out] on the weights' device (written into `out` if given)."""
        n_tok = x.shape[0]
        direct = out is not None and out.dtype == torch.float32 and out.device == self.device and out.is_contiguous()
        y = out if direct else torch.empty(n_tok, self.n_out, dtype=torch.float32, device=self.device)
        if self.act_block is not None:
            x = x.to(self.device, torch.float32)
            # the CPU sums W q1 d1 + W q2 d2 in float32; here W (q1 d1 + q2 d2): equal up to rounding
            again = self.residual and n_tok <= RESIDUAL_MAX_TOKENS
            if self._round_trip is not None:
                x = self._round_trip(x.contiguous(), again)
            else:
                first = int8_round_trip(x, self.act_block)
                x = first + int8_round_trip(x - first, self.act_block) if again else first
        if n_tok <= self.fused_max:
            self._fused(x.to(self.device, torch.float32), y)
        else:
            self._tiles(x.to(self.device, self.compute_dtype), y)
        if out is not None and not direct:
            out.copy_(y)
            return out
        return y

    def _fused(self, x: torch.Tensor, y: torch.Tensor) -> None:
        # K_MAX tokens per launch; a token's bits do not depend on which launch it is in. y is
        # contiguous (fresh, or an `out` taken as is), and so are its row slices.
        x = x.contiguous()
        if x.shape[0] <= K_MAX:
            self._launch(x, y)
            return
        for i in range(0, x.shape[0], K_MAX):
            self._launch(x[i:i + K_MAX], y[i:i + K_MAX])

    def _tiles(self, xw: torch.Tensor, y: torch.Tensor) -> None:
        n_tok = xw.shape[0]
        rowwise = n_tok <= ROWWISE_MAX
        fp32 = self.compute_dtype == torch.float32
        for r0 in range(0, self.n_out, self.tile_rows):
            r1 = min(r0 + self.tile_rows, self.n_out)
            w = dequantize_torch(self.raw[r0:r1], self.qtype, self.n_in, self.compute_dtype,
                                 out=self.scratch.tile(r1 - r0, self.n_in))
            if not rowwise:
                y[:, r0:r1] = torch.matmul(xw, w.t())
            elif fp32:
                for i in range(n_tok):
                    torch.mv(w, xw[i], out=y[i, r0:r1])
            else:
                for i in range(n_tok):
                    y[i, r0:r1] = torch.mv(w, xw[i])
