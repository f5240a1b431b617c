"""Elementwise transcendentals (exp, sigmoid, softplus, SiLU, softmax) that give a token the same
bits whether it is evaluated alone or inside a small batch.

torch's CPU kernels run a vector body over blocks of twice the SIMD width and a scalar tail, and
the two round these functions differently. Which elements fall in the tail depends on the tensor's
total size, so a gate computed for k tokens at once can differ in its last bit from the same gate
of a lone decode step (seen on qwen35's [k, Hv] decay and beta at k = 8). Small batches therefore
apply the function to one token's row at a time, the very loop a lone step runs; prompts (more
than ROWWISE_MAX tokens) take the whole tensor.
"""
from __future__ import annotations

from typing import Callable

import torch

from .attention import ROWWISE_MAX


def per_token(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise (or last-dimension) fn, computed row by row over dim 0 when
    1 < x.shape[0] <= ROWWISE_MAX."""
    n = x.shape[0]
    if n == 1 or n > ROWWISE_MAX:
        return fn(x)
    return torch.stack([fn(x[i]) for i in range(n)])
