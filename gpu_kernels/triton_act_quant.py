"""The int8 activation round trip of a device linear (qlinear.int8_round_trip) in one Triton launch.

Why: a placed model's device layers quantize their activations as the CPU's integer kernels do, so
both halves of a plan share one numerics. In torch that is about twenty small ops per linear call
(abs, amax, two wheres, a division, round, clamp, products, the float16 scale), and with the
second pass on the rounding error forty: on a GPU each is a kernel launch, and the first GPU run
(BENCHMARKS, "GPU check") showed the decode step bound by exactly these launches. Here one program
reads BLOCKS_PER_PROGRAM activation blocks of one token, computes both passes in registers and
writes the values the integer kernel effectively multiplies.

The arithmetic is cpu_kernels.quantize_act's, operation for operation: inv = 127 / max|x| (a
correctly rounded division), q = rint(x * inv) clamped to +-127, and the scale as ggml stores it
(1 / inv for 256-value blocks, max|x| / 127 rounded to float16 for 32-value ones). rint is the
2^23 + 2^22 trick (exact for |v| < 2^22, ties to even, as np.rint and torch.round); kernels launch
with enable_fp_fusion=False so x * inv is rounded before that addition, as the CPU rounds it.
"""
from __future__ import annotations

import torch

from .triton_support import Launches, have_triton, interpreting, require_triton

BLOCKS_PER_PROGRAM = {32: 32, 256: 4}      # 1024 activations per program for either block size
DIRECT_MAX_TOKENS = 32     # batches up to this size launch directly once checked (RoundTripLaunch)


def act_round_trip_grid(n_tokens: int, n_blocks: int, block: int) -> tuple[int, int]:
    """(block groups, tokens): the long dimension on axis 0; axis 1 (65535 at most on CUDA) holds
    the tokens of one call, at most a prompt chunk."""
    return -(-n_blocks // BLOCKS_PER_PROGRAM[block]), n_tokens


if have_triton():
    import triton
    import triton.language as tl

    @triton.jit
    def _round_trip(x, F16_SCALE: tl.constexpr):
        """x [G, BLOCK] -> the dequantized int8 values, one scale per row of the tile."""
        amax = tl.max(tl.abs(x), axis=1)
        nonzero = amax > 0
        inv = tl.where(nonzero, tl.math.div_rn(tl.full(amax.shape, 127.0, tl.float32),
                                               tl.where(nonzero, amax, 1.0)), 0.0)
        v = x * inv[:, None]
        q = (v + 12582912.0) - 12582912.0             # rint: 1.5 * 2^23 pushes the fraction out
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        if F16_SCALE:
            d = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32)).to(tl.float16).to(tl.float32)
        else:
            d = tl.where(nonzero, tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32),
                                                 tl.where(nonzero, inv, 1.0)), 0.0)
        return q * d[:, None]

    @triton.jit(do_not_specialize=["n_blocks"])
    def _act_round_trip_kernel(x_ptr, y_ptr, n_blocks, stride_x, stride_y, BLOCK: tl.constexpr,
                               G: tl.constexpr, RESIDUAL: tl.constexpr, F16_SCALE: tl.constexpr):
        tok = tl.program_id(1).to(tl.int64)
        blocks = tl.program_id(0) * G + tl.arange(0, G)
        cols = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        mask = blocks[:, None] < n_blocks
        x = tl.load(x_ptr + tok * stride_x + cols, mask=mask, other=0.0)
        first = _round_trip(x, F16_SCALE)
        if RESIDUAL:
            out = first + _round_trip(x - first, F16_SCALE)
        else:
            out = first
        tl.store(y_ptr + tok * stride_y + cols, out, mask=mask)


def act_round_trip_triton(x: torch.Tensor, block: int, residual: bool) -> torch.Tensor:
    """x float32 [k, n] (rows contiguous, n a multiple of `block`, 32 or 256) -> a new float32
    [k, n]: int8_round_trip(x, block), plus int8_round_trip of its error when `residual`."""
    require_triton("the fused activation round trip")
    if block not in BLOCKS_PER_PROGRAM:
        raise ValueError(f"act_round_trip_triton: block must be 32 or 256, got {block}")
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] % block or x.stride(1) != 1:
        raise ValueError(f"act_round_trip_triton: x must be float32 [k, n] with rows contiguous and n a "
                         f"multiple of {block}, got {x.dtype} {tuple(x.shape)} strides {x.stride()}")
    if not x.is_cuda and not interpreting():
        raise ValueError(f"the Triton kernels need CUDA tensors (got {x.device}); on the CPU use "
                         f"int8_round_trip, or set TRITON_INTERPRET=1 before importing gpu_kernels")
    return RoundTripLaunch(x.shape[1], block)(x, residual)


class RoundTripLaunch:
    """The round trip for one linear's input width (QuantLinear makes one), its checks made once.
    After the first JIT launch for a (residual, k, layout of x) it launches through the compiled
    kernel's own launcher (triton_support.checked_runner), skipping the JIT's per-call binding.
    `launch(x, residual)` takes x as act_round_trip_triton does, unchecked."""

    OPTIONS = dict(num_warps=4, enable_fp_fusion=False)

    def __init__(self, n: int, block: int):
        self.n_blocks, self.block, self.g = n // block, block, BLOCKS_PER_PROGRAM[block]
        self.launches = Launches(_act_round_trip_kernel)

    def __call__(self, x: torch.Tensor, residual: bool) -> torch.Tensor:
        y = torch.empty_like(x)
        k = x.shape[0]
        if k == 0 or self.n_blocks == 0:
            return y
        grid = act_round_trip_grid(k, self.n_blocks, self.block)
        args = (x, y, self.n_blocks, x.stride(0), y.stride(0))
        constexprs = dict(BLOCK=self.block, G=self.g, RESIDUAL=residual, F16_SCALE=self.block == 32)
        # what Triton specializes on among what changes: pointer alignments and x's row stride
        # (y is x's shape, fresh: its stride follows from x's); the grid follows k
        key = (residual, k, x.data_ptr() % 16 == 0, y.data_ptr() % 16 == 0, x.stride(0))
        # direct launches for decode and verify batches only: a prompt's many lengths would each
        # cost a trial launch and a synchronize, for launches that are a small part of its time
        self.launches(key, grid, args, constexprs, self.OPTIONS, 1, try_direct=k <= DIRECT_MAX_TOKENS)
        return y
