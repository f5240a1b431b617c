"""RMSNorm over the last dimension (GGUF converters already fold Gemma's/Qwen's +1 into weights)."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    # computed in float32 whatever the storage dtype: the reduction is where precision is lost
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y * weight if weight is not None else y


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (gated delta net q and k)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
