"""`llama` (SmolLM2, Llama 2/3) and `qwen3` (dense): pre-norm attention + SwiGLU blocks.

qwen3 differs only in a per-head RMSNorm of q and k and NeoX rotary pairing.
"""
from __future__ import annotations

import math

import torch

from gpu_kernels.norms import rms_norm

from ..backends import WeightBinder
from ..gguf_file import GGUFFile
from .base import Model
from .common import Attention, AttentionSpec, RopeSpec, rope_scale


class Llama(Model):
    arch = "llama"
    qk_norm = False
    neox = False

    def __init__(self, gguf: GGUFFile, binder: WeightBinder):
        super().__init__(gguf, binder)
        self.n_attention_layers = self.n_layer
        rope = RopeSpec(n_rot=int(gguf.get("rope.dimension_count", self.head_dim)),
                        base=float(gguf.get("rope.freq_base", 10000.0)), neox=self.neox,
                        scale=rope_scale(gguf))
        spec = AttentionSpec(n_head=self.n_head, n_kv=self.n_kv, head_dim=self.head_dim,
                             head_dim_v=self.head_dim_v, scale=1.0 / math.sqrt(self.head_dim),
                             eps=self.eps, rope=rope, qk_norm=self.qk_norm)
        self.layers = []
        for i in range(self.n_layer):
            p = f"blk.{i}"
            self.layers.append((
                binder.dense(f"{p}.attn_norm.weight"),
                Attention(binder, p, spec, cache_index=i),
                binder.dense(f"{p}.ffn_norm.weight"),
                binder.glu_ffn(p, act="silu"),
            ))

    def forward(self, state, tokens: torch.Tensor, start_pos: int) -> torch.Tensor:
        pos_list = list(range(start_pos, start_pos + tokens.shape[0]))
        h = self.embed(tokens)
        for attn_norm, attn, ffn_norm, ffn in self.layers:
            h = h + attn(rms_norm(h, attn_norm, self.eps), state, pos_list)
            h = h + ffn(rms_norm(h, ffn_norm, self.eps))
        return self.final_norm(h)


class Qwen3(Llama):
    arch = "qwen3"
    qk_norm = True
    neox = True
