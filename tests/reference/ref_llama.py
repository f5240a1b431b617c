"""Float64 reference forward for the dense ``llama`` and ``qwen3`` archs.

llama: pre-norm blocks (attn_norm, ffn_norm), rotary in ggml's "norm" mode (adjacent pairs) on
``rope.dimension_count`` dims, GQA, SwiGLU. qwen3 adds per-head RMSNorm on q and k (attn_q_norm,
attn_k_norm) before NeoX rotary, and its head dim comes from ``attention.key_length``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .common import GGUFWeights, KVCache, attend, output_head, rms_norm, rope, swiglu_ffn


class RefLlama:
    def __init__(self, path: str | Path):
        W = self.W = GGUFWeights(path)
        if W.arch not in ("llama", "qwen3"):
            raise ValueError(f"RefLlama handles llama and qwen3, not {W.arch}")
        self.n_embd = W.arch_meta("embedding_length")
        self.n_layer = W.arch_meta("block_count")
        self.n_head = W.arch_meta("attention.head_count")
        self.n_head_kv = W.arch_meta("attention.head_count_kv", self.n_head)
        self.head_dim = W.arch_meta("attention.key_length", self.n_embd // self.n_head)
        self.n_rot = W.arch_meta("rope.dimension_count", self.head_dim)
        self.rope_base = W.arch_meta("rope.freq_base", 10000.0)
        self.eps = W.arch_meta("attention.layer_norm_rms_epsilon")
        self.neox = W.arch == "qwen3"

    def _attention(self, il: int, x: np.ndarray, positions: np.ndarray, cache: KVCache):
        W, p, T, d = self.W, f"blk.{il}", x.shape[0], self.head_dim
        q = (x @ W(f"{p}.attn_q.weight").T).reshape(T, self.n_head, d)
        k = (x @ W(f"{p}.attn_k.weight").T).reshape(T, self.n_head_kv, d)
        v = (x @ W(f"{p}.attn_v.weight").T).reshape(T, self.n_head_kv, d)
        if W.has(f"{p}.attn_q_norm.weight"):
            q = rms_norm(q, W(f"{p}.attn_q_norm.weight"), self.eps)
            k = rms_norm(k, W(f"{p}.attn_k_norm.weight"), self.eps)
        q = rope(q, positions, self.n_rot, self.rope_base, self.neox)
        k = rope(k, positions, self.n_rot, self.rope_base, self.neox)
        o = attend(q, k, v, positions, cache).reshape(T, self.n_head * d)
        return o @ W(f"{p}.attn_output.weight").T

    def hidden(self, tokens) -> np.ndarray:
        """Post-output_norm hidden states [T, n_embd]."""
        W = self.W
        tokens = np.asarray(tokens, dtype=np.int64)
        positions = np.arange(len(tokens))
        h = W("token_embd.weight")[tokens]
        for il in range(self.n_layer):
            p = f"blk.{il}"
            h = h + self._attention(il, rms_norm(h, W(f"{p}.attn_norm.weight"), self.eps),
                                    positions, KVCache())
            h = h + swiglu_ffn(W, p, rms_norm(h, W(f"{p}.ffn_norm.weight"), self.eps))
        return rms_norm(h, W("output_norm.weight"), self.eps)

    def forward(self, tokens) -> np.ndarray:
        """Teacher-forced logits [T, n_vocab], float64."""
        return self.hidden(tokens) @ output_head(self.W).T
