"""What hybridrt knows about each architecture it runs: one `ArchSpec` per `general.architecture`
name, in `ARCH_SPECS`, read by everything that used to keep its own list or `if arch == ...`: the
loader (which class builds the model), the model files (activation, norms, rotary pairing, layer
pattern), the planner's profile (`model_profile.py`: plannable, the layer pattern), the MTP head
(`mtp_head.py`: which targets a trained head can have, and its block's shape) and train-mtp's torch
teacher (`train_mtp/torch_model.py`). An architecture missing from the table is refused by each of
them with one error line naming the supported ones (`arch_spec`).

The table lives here, not in the model files, because `hybridrt info` and `hybridrt plan` read it
and must not import torch, which every model file does; each model class points at its entry
(`Llama.spec = ARCH_SPECS["llama"]`), and `tests/test_arch_spec.py` checks that the two agree.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from ..errors import UserError

# a trunk layer's mixer half: attention over the KV cache, or a Gated DeltaNet recurrence
# (placement.profile.LAYER_KINDS names the same two)
ATTENTION, GDN = "attention", "gdn"
# layer patterns: every layer full attention; attention with a sliding window except every
# `swa_period`-th layer (gemma3); Gated DeltaNet with full attention every
# `full_attention_interval`-th layer (a GGUF key; qwen35's family)
PATTERNS = ("attention", "sliding_window", "hybrid")
ACTIVATIONS = ("silu", "gelu_tanh")      # the gated FFN's gate activation


@dataclass(frozen=True)
class ArchSpec:
    name: str                   # general.architecture
    model: str                  # "module:Class" that builds it (imported on first use)
    act: str = "silu"           # the gated FFN's activation
    ffn_norm: str = "ffn_norm"  # the pre-FFN norm's tensor (qwen35's family: post_attention_norm)
    post_norms: bool = False    # gemma3: RMSNorm of the attention and FFN outputs (sandwich norms)
    qk_norm: bool = False       # per-head RMSNorm of q and k
    rope_neox: bool = False     # rotary pairs (i, i + d/2) rather than (2i, 2i + 1)
    rope_base: float = 10000.0  # rope.freq_base when the file has none
    gated_attention: bool = False   # attn_q holds [q | gate] per head; out *= sigmoid(gate)
    scaled_embedding: bool = False  # embedding rows times sqrt(n_embd) (gemma3)
    pattern: str = "attention"  # one of PATTERNS
    swa_period: int = 0         # "sliding_window": layer i is global iff i % swa_period == swa_period - 1
    attention_interval: int = 0     # "hybrid": full_attention_interval when the file has none
    gdn_tiled_heads: bool = True    # "hybrid": value head j reads key head j % Hk (else j // (Hv / Hk))
    mtp_target: bool = False    # train-mtp / --mtp-head can make and bind a head for it
    torch_teacher: bool = False     # train-mtp's batched torch teacher runs it (dense attention only)
    plannable: bool = True      # hybridrt plan / --vram can place it

    def __post_init__(self):
        if self.act not in ACTIVATIONS:
            raise ValueError(f"{self.name}: unknown activation '{self.act}' (known: {', '.join(ACTIVATIONS)})")
        if self.pattern not in PATTERNS:
            raise ValueError(f"{self.name}: unknown layer pattern '{self.pattern}' (known: {', '.join(PATTERNS)})")
        if (self.pattern == "sliding_window") != (self.swa_period > 0) \
                or (self.pattern == "hybrid") != (self.attention_interval > 0):
            raise ValueError(f"{self.name}: a {self.pattern} pattern needs its own period, and only that")

    @property
    def recurrent(self) -> bool:
        """Some layers keep a recurrent state (which rolls back only inside the last verify batch)."""
        return self.pattern == "hybrid"

    @property
    def attn_post_norm(self) -> str | None:
        """The tensor of the attention output's norm, None without one."""
        return "post_attention_norm" if self.post_norms else None

    @property
    def ffn_post_norm(self) -> str | None:
        return "post_ffw_norm" if self.post_norms else None

    def mixer_kinds(self, n_layer: int, get: Callable[[str, object], object]) -> list[str]:
        """Each trunk layer's mixer, ATTENTION or GDN; `get(key, default)` reads the file's
        metadata (GGUFFile.get)."""
        if self.pattern != "hybrid":
            return [ATTENTION] * n_layer
        interval = int(get("full_attention_interval", self.attention_interval))
        return [ATTENTION if (i + 1) % interval == 0 else GDN for i in range(n_layer)]

    def sliding(self, layer: int) -> bool:
        """Whether attention layer `layer` sees a sliding window (given the file has one)."""
        p = self.swa_period
        return p > 0 and layer % p < p - 1


_QWEN35 = ArchSpec("qwen35", "hybridrt.models.qwen35:Qwen35", ffn_norm="post_attention_norm", qk_norm=True,
                   rope_neox=True, rope_base=1e7, gated_attention=True, pattern="hybrid", attention_interval=4,
                   mtp_target=True)
ARCH_SPECS: dict[str, ArchSpec] = {s.name: s for s in (
    ArchSpec("llama", "hybridrt.models.llama:Llama", mtp_target=True, torch_teacher=True),
    ArchSpec("qwen3", "hybridrt.models.llama:Qwen3", qk_norm=True, rope_neox=True, mtp_target=True,
             torch_teacher=True),
    ArchSpec("gemma3", "hybridrt.models.gemma3:Gemma3", act="gelu_tanh", post_norms=True, qk_norm=True,
             rope_neox=True, rope_base=1e6, scaled_embedding=True, pattern="sliding_window", swa_period=6,
             mtp_target=True, torch_teacher=True),
    _QWEN35,
    # qwen35's trunk with an MoE FFN in every layer (its MTP block's too): no trained head, whose
    # block would be an MoE
    replace(_QWEN35, name="qwen35moe", model="hybridrt.models.qwen35:Qwen35Moe", mtp_target=False),
    # the same MoE FFN; beta/alpha packed in one ssm_ba, value heads grouped rather than tiled
    replace(_QWEN35, name="qwen3next", model="hybridrt.models.qwen35:Qwen3Next", gdn_tiled_heads=False,
            mtp_target=False),
)}


def arch_spec(arch: str, path: str = "") -> ArchSpec:
    """The architecture's entry; one error line naming the supported ones for any other."""
    spec = ARCH_SPECS.get(arch)
    if spec is None:
        where = f"{path}: " if path else ""
        raise UserError(f"{where}unsupported architecture '{arch or '(none)'}' "
                        f"(supported: {', '.join(ARCH_SPECS)})")
    return spec
