"""Attention KV cache: preallocated for the whole context, rolled back by moving its length."""
from __future__ import annotations

import torch

from .errors import UserError

CACHE_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def cache_dtype(name: str) -> torch.dtype:
    try:
        return CACHE_DTYPES[name]
    except KeyError:
        # q8_0 is plannable (`hybridrt plan -ctk q8_0`) but the runtime cache keeps float rows
        raise UserError(f"unsupported KV cache type '{name}' (supported: {', '.join(CACHE_DTYPES)})") from None


class KVCache:
    """Keys and values of every attention layer: [n_ctx, n_kv, head_dim] each, per layer."""

    def __init__(self, n_layers: int, n_ctx: int, n_kv: int, head_dim_k: int, head_dim_v: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.n_ctx = n_ctx
        self.k = [torch.zeros(n_ctx, n_kv, head_dim_k, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(n_ctx, n_kv, head_dim_v, dtype=dtype, device=device) for _ in range(n_layers)]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        end = start + k.shape[0]
        self.k[layer][start:end] = k
        self.v[layer][start:end] = v

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
