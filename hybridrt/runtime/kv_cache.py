"""Attention KV cache: preallocated for the whole context, rolled back by moving its length.

K and V each have a storage type: a float dtype (f32, f16, bf16) or q8_0, ggml's 34-byte block of
32 values (an f16 scale, then 32 int8). A q8_0 cache is quantized row by row as it is written and
dequantized by the attention kernel as it is read (`gpu_kernels.attention`), so its memory is
34/128 of an f32 cache (34/64 of f16) and nothing else in the model changes.

A session takes one cache-type string: "f16" for both, or "K/V" such as "q8_0/f16" when they differ
(`kv_cache_type` builds it from -ctk/-ctv).
"""
from __future__ import annotations

from typing import NamedTuple, Union

import numpy as np
import torch

from gpu_kernels.attention import Q8_0_BLOCK, Q8_0_BYTES, q8_0_quantize
from placement.constants import CACHE_TYPES

from ..errors import UserError

# the float cache types' storage (placement.constants.CACHE_TYPES names them all, q8_0 too)
CACHE_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}

Storage = Union[torch.dtype, str]       # a float dtype, or "q8_0"


class KVTypes(NamedTuple):
    k: Storage
    v: Storage


def kv_cache_type(k: str, v: str) -> str:
    """The session cache-type string for -ctk K -ctv V; an unsupported type is a UserError here,
    before any model loads."""
    name = k if k == v else f"{k}/{v}"
    cache_dtype(name)
    return name


def _storage(name: str) -> Storage:
    if name == "q8_0":
        return name
    try:
        return CACHE_DTYPES[name]
    except KeyError:
        raise UserError(f"unsupported KV cache type '{name}' (supported: {', '.join(CACHE_TYPES)})") from None


def cache_dtype(name: str) -> KVTypes:
    """Storage of K and V for a cache-type string ("f16", "q8_0", "q8_0/f16": K/V)."""
    parts = name.split("/")
    if len(parts) > 2:
        raise UserError(f"unsupported KV cache type '{name}' (one type, or K/V such as q8_0/f16)")
    return KVTypes(_storage(parts[0]), _storage(parts[-1]))


def state_zeros(*shape: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """A session's zeroed buffer (KV rows, recurrent state, snapshot ring). On the CPU it comes from
    calloc (numpy's zeros): a large block is zero pages the OS maps only where they are written, so
    a 4096-token cache costs page faults for the rows a session uses. torch.zeros writes every byte:
    ~0.2 s for a 27B session's ~850 MiB, paid before its first token."""
    n = int(np.prod(shape, dtype=np.int64))
    if torch.device(device).type != "cpu" or n == 0:
        return torch.zeros(*shape, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(n * dtype.itemsize, np.uint8)).view(dtype).reshape(shape)


class Q8Rows:
    """A [n_ctx, n_kv, head_dim] cache tensor kept as q8_0 blocks, bytes laid out as ggml's
    block_q8_0: `blocks` is uint8 [n_ctx, n_kv, head_dim / 32, 34]. Assigning float rows to a
    slice quantizes them; `gpu_kernels.attention` dequantizes the rows it reads."""

    def __init__(self, n_ctx: int, n_kv: int, head_dim: int, device: torch.device | str):
        if head_dim % Q8_0_BLOCK:
            raise UserError(f"q8_0 KV cache needs a head size that is a multiple of {Q8_0_BLOCK}, got {head_dim}")
        self.shape = torch.Size((n_ctx, n_kv, head_dim))
        self.blocks = state_zeros(n_ctx, n_kv, head_dim // Q8_0_BLOCK, Q8_0_BYTES, dtype=torch.uint8, device=device)

    def __setitem__(self, rows: slice, values: torch.Tensor) -> None:
        self.blocks[rows] = q8_0_quantize(values)

    def index_copy_(self, dim: int, index: torch.Tensor, values: torch.Tensor) -> None:
        self.blocks.index_copy_(dim, index, q8_0_quantize(values))

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()


CacheRows = Union[torch.Tensor, Q8Rows]


def _new_rows(storage: Storage, n_ctx: int, n_kv: int, head_dim: int, device) -> CacheRows:
    if storage == "q8_0":
        return Q8Rows(n_ctx, n_kv, head_dim, device)
    return state_zeros(n_ctx, n_kv, head_dim, dtype=storage, device=device)


def _write_at(rows: CacheRows, at: torch.Tensor, values: torch.Tensor) -> None:
    """rows[at] = values, cast (or quantized) to the cache's storage as slice assignment does."""
    rows.index_copy_(0, at, values if isinstance(rows, Q8Rows) else values.to(rows.dtype))


def _nbytes(t: CacheRows) -> int:
    return t.nbytes if isinstance(t, Q8Rows) else t.numel() * t.element_size()


class KVCache:
    """Keys and values of every attention layer: [n_ctx, n_kv, head_dim] each, per layer."""

    def __init__(self, n_layers: int, n_ctx: int, n_kv: int, head_dim_k: int, head_dim_v: int,
                 dtype: KVTypes | torch.dtype, device: torch.device | str):
        types = dtype if isinstance(dtype, KVTypes) else KVTypes(dtype, dtype)
        self.n_ctx, self.types = n_ctx, types
        self.k = [_new_rows(types.k, n_ctx, n_kv, head_dim_k, device) for _ in range(n_layers)]
        self.v = [_new_rows(types.v, n_ctx, n_kv, head_dim_v, device) for _ in range(n_layers)]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor, at: torch.Tensor | None = None) -> None:
        """Rows [start, start + n) of a layer's keys and values; at the positions in `at` (a device
        tensor: what a replayed graph writes at) when given."""
        if at is not None:
            _write_at(self.k[layer], at, k)
            _write_at(self.v[layer], at, v)
            return
        end = start + k.shape[0]
        self.k[layer][start:end] = k
        self.v[layer][start:end] = v

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(t) for t in self.k + self.v)
