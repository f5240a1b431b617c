"""`llama` (SmolLM2, Llama 2/3) and `qwen3` (dense): pre-norm attention + SwiGLU blocks.

qwen3 differs only in a per-head RMSNorm of q and k and NeoX rotary pairing (its ArchSpec).
"""
from __future__ import annotations

import math

from ..runtime.backends import WeightBinder
from ..files.gguf_file import GGUFFile
from .arch_spec import ARCH_SPECS, ATTENTION
from .base import Model
from .common import AttentionSpec, Layer, RopeSpec, attention_block, ffn_block, rope_scale


class Llama(Model):
    spec = ARCH_SPECS["llama"]

    def __init__(self, gguf: GGUFFile, binder: WeightBinder):
        super().__init__(gguf, binder)
        a = self.spec
        self.n_attention_layers = self.n_layer
        rope = RopeSpec(n_rot=int(gguf.get("rope.dimension_count", self.head_dim)),
                        base=float(gguf.get("rope.freq_base", a.rope_base)), neox=a.rope_neox,
                        scale=rope_scale(gguf))
        spec = AttentionSpec(n_head=self.n_head, n_kv=self.n_kv, head_dim=self.head_dim,
                             head_dim_v=self.head_dim_v, scale=1.0 / math.sqrt(self.head_dim),
                             eps=self.eps, rope=rope, qk_norm=a.qk_norm)
        self.layers = []
        for i in range(self.n_layer):
            p = f"blk.{i}"
            self.layers.append(Layer(ATTENTION, attention_block(binder, p, spec, cache_index=i),
                                     ffn_block(binder, p, a.act, self.eps, norm=a.ffn_norm)))


class Qwen3(Llama):
    spec = ARCH_SPECS["qwen3"]
