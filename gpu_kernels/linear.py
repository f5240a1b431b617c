"""Dense matmul on the trunk device for weights placed there (dequantized copies)."""
from __future__ import annotations

import torch


def linear_rows(x: torch.Tensor, weight: torch.Tensor, rowwise: bool) -> torch.Tensor:
    """y = x W^T for x [k, n_in], W [n_out, n_in]; float32 result.

    BLAS picks its blocking from the shape, so x W^T for k rows need not equal, bit for bit, the
    k products computed alone. With `rowwise` every row runs the same GEMV a lone decode step runs,
    which keeps verify batches bit-identical to plain decoding; prompts use one GEMM.
    """
    xw = x.to(weight.dtype)
    if not rowwise:
        return torch.matmul(xw, weight.t()).float()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32, device=weight.device)
    for i in range(x.shape[0]):
        out[i] = torch.mv(weight, xw[i]).float()
    return out
