"""`llama` (SmolLM2, Llama 2/3) and `qwen3` (dense): pre-norm attention + SwiGLU blocks.

qwen3 differs only in a per-head RMSNorm of q and k and NeoX rotary pairing.
"""
from __future__ import annotations

import math

import torch

from ..backends import WeightBinder
from ..gguf_file import GGUFFile
from .base import Model
from .common import AttentionSpec, RopeSpec, attention_block, ffn_block, rope_scale


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
            self.layers.append((attention_block(binder, p, spec, cache_index=i),
                                ffn_block(binder, p, "silu", self.eps)))

    def forward(self, state, tokens: torch.Tensor, start_pos: int) -> torch.Tensor:
        pos_list = list(range(start_pos, start_pos + tokens.shape[0]))
        h = self.embed(tokens)
        for attn, ffn in self.layers:        # each half: h + f(rms_norm(h)), norm and residual included
            h = ffn(attn(h, state, pos_list))
        return self.final_norm(h)


class Qwen3(Llama):
    arch = "qwen3"
    qk_norm = True
    neox = True
