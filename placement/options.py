"""Everything a plan is computed from, as one frozen data class (shared by the planner and the
speed model, so neither imports the other's module for it)."""
from __future__ import annotations

from dataclasses import dataclass

from .profile import ModelProfile

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class PlanOptions:
    vram_bytes: int = 12 * GiB
    margin_bytes: int = 512 * MiB
    n_ctx: int = 4096
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    spec_type: str = "none"
    spec_draft_n_max: int = 3
    draft: ModelProfile | None = None   # the draft model's profile (spec_type draft-simple)
    accept_rate: float = 0.8            # per-draft acceptance probability
    gpu_bw: float = 500e9               # bytes/s
    cpu_bw: float = 40e9                # bytes/s
    k_max: int | None = None            # largest batch evaluated at once; None: N + 1 (a verify batch)
    decode_depth: int | None = None     # context depth the speed is predicted at; None: n_ctx // 2
    layer_overhead_s: float = 30e-6     # per layer per step: kernel launches and Python dispatch
    handoff_overhead_s: float = 20e-6   # per CPU FFN layer per step: two small copies and a sync
    split_ffn: bool = True              # give the VRAM left after whole layers to part of the next one
    n_cpu_moe: int = 0                  # llama.cpp's --n-cpu-moe: the routed experts of trunk layers
                                        # 0..N-1 stay on the CPU (MoE models; ignored for dense ones)
    op_offload: bool = True             # llama.cpp's op offload (--no-op-offload: off): VRAM for one
                                        # CPU FFN layer's weights, copied up for each prompt batch
    n_seq: int = 1                      # sessions held at once (serve's --parallel): each has its own
                                        # KV cache, recurrent state, snapshot ring and draft KV / state;
                                        # one step at a time for all, so weights and scratch count once

    @property
    def n_draft(self) -> int:
        return 0 if self.spec_type == "none" else self.spec_draft_n_max

    @property
    def batch(self) -> int:
        return self.k_max if self.k_max is not None else self.n_draft + 1

    @property
    def depth(self) -> int:
        return self.decode_depth if self.decode_depth is not None else self.n_ctx // 2
