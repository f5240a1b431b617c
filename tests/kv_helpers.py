"""Shared by the attention tests: random K / V caches in each storage a session's cache can take."""
from __future__ import annotations

import torch


def random_kv_caches(cache: str, n_ctx: int, n_kv: int, d: int):
    """Random keys and values ([n_ctx, n_kv, d], standard normal, from torch's current seed) stored
    as `cache` ("f32", "f16", "bf16" tensors or "q8_0" Q8Rows): the (keys, values) pair attend reads."""
    from hybridrt.runtime.kv_cache import Q8Rows

    keys, vals = torch.randn(n_ctx, n_kv, d), torch.randn(n_ctx, n_kv, d)
    if cache == "q8_0":
        kc, vc = Q8Rows(n_ctx, n_kv, d, "cpu"), Q8Rows(n_ctx, n_kv, d, "cpu")
        kc[0:n_ctx], vc[0:n_ctx] = keys, vals
        return kc, vc
    dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[cache]
    return keys.to(dtype), vals.to(dtype)
