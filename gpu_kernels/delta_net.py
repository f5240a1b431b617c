"""Gated DeltaNet (linear attention) pieces: the causal depthwise conv and the delta-rule recurrence.

Both run token by token with the same ops per token whatever the batch size, so a token's output
is bitwise the same in a k-token verify batch as in a lone decode step; the recurrence can write
its state after every token into a snapshot ring for rollback.

On CUDA tensors, when Triton is installed, both run as one Triton kernel per call
(`triton_delta_net`) instead of a few torch ops per token; CPU tensors keep the torch code, the
exact baseline of the CPU runtime. `kernel="triton"|"torch"` forces a path ("auto" picks).
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from .pointwise import per_token
from .triton_support import have_triton, require_triton

Kernel = Literal["auto", "triton", "torch"]


def _use_triton(kernel: Kernel, t: torch.Tensor) -> bool:
    if kernel not in ("auto", "triton", "torch"):
        raise ValueError(f"kernel must be 'auto', 'triton' or 'torch', not {kernel!r}")
    if kernel == "auto":
        return t.is_cuda and have_triton()
    return kernel == "triton"


def _triton_kernels():
    # imported on first use: the CPU runtime never pays for importing Triton
    require_triton("the Gated DeltaNet Triton kernels (kernel='triton')")
    from . import triton_delta_net
    return triton_delta_net


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                *, kernel: Kernel = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """x [k, C] new inputs, conv_state [K-1, C] previous inputs, weight [C, K] depthwise kernel.
    out[t, c] = sum_j xs[t + j, c] * weight[c, j] over xs = [conv_state; x], then SiLU.
    Returns (out [k, C], full input history [K-1+k, C]) — the caller slices conv states from it.
    conv_state is not modified."""
    if _use_triton(kernel, x):
        history = torch.empty(conv_state.shape[0] + x.shape[0], x.shape[1],
                              dtype=torch.promote_types(x.dtype, conv_state.dtype), device=x.device)
        out = _triton_kernels().causal_conv_triton(x, conv_state, weight, history, update_state=False)
        return out, history
    n, width = x.shape[0], weight.shape[1]
    xs = torch.cat((conv_state, x), dim=0)
    out = xs[0:n] * weight[:, 0]
    for j in range(1, width):
        out = out + xs[j:j + n] * weight[:, j]
    return per_token(F.silu, out), xs


def causal_conv_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                     history_out: torch.Tensor | None = None, *, kernel: Kernel = "auto") -> torch.Tensor:
    """`causal_conv` that also keeps its state: conv_state becomes the last K-1 inputs (in place)
    and history_out [K-1+k, C], when given (the snapshot ring's slice), receives the input history.
    Returns out [k, C]. On the Triton path it is one launch, where `causal_conv` and the caller's
    two copies are three."""
    if _use_triton(kernel, x):
        return _triton_kernels().causal_conv_triton(x, conv_state, weight, history_out)
    out, history = causal_conv(x, conv_state, weight, kernel="torch")
    conv_state.copy_(history[history.shape[0] - conv_state.shape[0]:])
    if history_out is not None:
        history_out.copy_(history)
    return out


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
               beta: torch.Tensor, state: torch.Tensor, snapshots: torch.Tensor | None = None,
               *, kernel: Kernel = "auto") -> torch.Tensor:
    """Per value head h and token t (state S[h] is d_k x d_v, float32, updated in place):
        S = exp(g) S;  u = beta (v - S^T k);  S = S + k u^T;  o = S^T q
    q, k: [n, H, d_k] (already broadcast to value heads, normalised, q scaled); v: [n, H, d_v];
    log_decay g, beta: [n, H]. `snapshots` [>= n - 1, H, d_k, d_v] receives S after each token but the last
    (the last one is the live state itself).
    Returns o [n, H, d_v]."""
    if _use_triton(kernel, state):
        return _triton_kernels().delta_rule_triton(q, k, v, log_decay, beta, state, snapshots)
    n = q.shape[0]
    out = torch.empty_like(v)
    for t in range(n):
        state.mul_(torch.exp(log_decay[t])[:, None, None])     # one token's decays: batch-stable bits
        kv_mem = torch.bmm(k[t].unsqueeze(1), state).squeeze(1)            # S^T k: [H, d_v]
        u = beta[t][:, None] * (v[t] - kv_mem)
        state.add_(k[t].unsqueeze(2) * u.unsqueeze(1))                      # k u^T
        out[t] = torch.bmm(q[t].unsqueeze(1), state).squeeze(1)             # S^T q
        if snapshots is not None and t < n - 1:
            snapshots[t].copy_(state)
    return out
