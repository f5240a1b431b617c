"""RMSNorm over the last dimension (GGUF converters already fold Gemma's/Qwen's +1 into weights)."""
from __future__ import annotations

from typing import Callable

import torch

from .attention import ROWWISE_MAX
from .triton_norms import fits as triton_norm_fits
from .triton_norms import norm_rows_triton


def _sum_last(t: torch.Tensor) -> torch.Tensor:
    return t.sum(-1, keepdim=True)


def _mean_last(t: torch.Tensor) -> torch.Tensor:
    return t.mean(-1, keepdim=True)


def token_rows_reduce(reduce: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    """reduce(t), a sum or mean over the last dimension, with each token's (dim 0's) bits independent
    of how many tokens share t.

    On a GPU torch's reduction sizes its thread block from the number of rows it reduces (CUDA's
    ReduceConfig::set_block_dimension: 512 lanes per row for one 5120-wide row, 128 for four, 32
    for sixteen), so a row of a k-token verify batch is summed in another order than the same row
    in a lone decode step: a last-bit difference in every norm, which greedy speculation turns into
    tokens that differ from plain decoding at near ties. Batches of 2..ROWWISE_MAX tokens off the
    CPU therefore reduce one token at a time, in the shape a lone step has ([1, ...]); prompts take
    the whole tensor. The CPU's reduction is the same per row whatever the batch (tested there), so
    it keeps one call."""
    n = t.shape[0] if t.dim() > 1 else 1
    if t.device.type == "cpu" or n == 1 or n > ROWWISE_MAX:
        return reduce(t)
    # a lone step reduces a fresh (aligned) tensor; a row slice is as aligned when its bytes are
    # a multiple of 16 (torch's vectorized reduction sums a misaligned head apart), else copy it
    aligned = t[0].numel() * t.element_size() % 16 == 0 and t.is_contiguous()
    rows = (t[i:i + 1] if aligned else t[i:i + 1].clone(memory_format=torch.contiguous_format) for i in range(n))
    return torch.cat([reduce(r) for r in rows])


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    # computed in float32 whatever the storage dtype: the reduction is where precision is lost
    if x.is_cuda and triton_norm_fits(x):       # one launch instead of six (per token in a batch)
        return norm_rows_triton(x, weight, eps, mean=True)
    xf = x.float()
    y = xf * torch.rsqrt(token_rows_reduce(_mean_last, xf.pow(2)) + eps)
    return y * weight if weight is not None else y


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (gated delta net q and k)."""
    if x.is_cuda and triton_norm_fits(x):
        return norm_rows_triton(x, None, eps, mean=False)
    return x * torch.rsqrt(token_rows_reduce(_sum_last, x.pow(2)) + eps)
