"""What the planner knows about a model: plain data, filled in by the model side (hybridrt).

A `ModelProfile` is the tensor table with a role per tensor, the kind and cache shape of every trunk
layer, and the few widths that size scratch buffers. Everything the planner derives (bytes per role,
KV bytes per token, recurrent state per sequence) is computed here from that data, so a profile can
be written by hand in a test as easily as it is read from a 27B GGUF header.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .constants import CACHE_TYPES

# Tensor roles. "attention" and "gdn" are the trunk's mixer projections (and their small vectors),
# "ffn" is a trunk layer's feed-forward block as the planner moves it: a dense FFN whole, or a MoE
# layer's routed experts; "moe_shared" is the rest of a MoE layer's FFN (router, shared expert and
# its gate): small and read by every token, so it stays with the trunk; "mtp" is everything of the
# NextN blocks appended after the trunk, "other" is any trunk tensor the model side could not name
# (kept on the GPU with the trunk).
ROLES = ("embedding", "attention", "gdn", "norm", "output", "ffn", "moe_shared", "mtp", "other")
LAYER_KINDS = ("attention", "gdn")

F32 = 4


def cache_row_bytes(cache_type: str, n: int) -> int:
    """Bytes of one cached head row of n elements (a q8_0 row must be whole 32-element blocks)."""
    try:
        block, size = CACHE_TYPES[cache_type]
    except KeyError:
        raise ValueError(f"unknown cache type '{cache_type}' (known: {', '.join(CACHE_TYPES)})") from None
    if n % block:
        raise ValueError(f"cache type {cache_type} needs head dims that are multiples of {block}, got {n}")
    return n // block * size


@dataclass(frozen=True)
class TensorEntry:
    name: str
    role: str
    nbytes: int
    layer: int | None = None     # block index (trunk layer, or n_layer + j for the j-th MTP block)
    expert: bool = False         # a routed-expert tensor: a token reads only its experts' share

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"{self.name}: unknown role '{self.role}'")


@dataclass(frozen=True)
class AttentionShape:
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int

    def kv_bytes_per_token(self, cache_type_k: str, cache_type_v: str) -> int:
        return self.n_head_kv * (cache_row_bytes(cache_type_k, self.head_dim_k)
                                 + cache_row_bytes(cache_type_v, self.head_dim_v))

    def kv_f32_bytes_per_token(self) -> int:
        return F32 * self.n_head_kv * (self.head_dim_k + self.head_dim_v)


@dataclass(frozen=True)
class GDNShape:
    """One gated-delta-net layer's recurrent state: S is n_v_heads x head_dim x head_dim, plus the
    causal conv's last (conv_kernel - 1) inputs over conv_channels; both float32."""
    n_v_heads: int
    head_dim: int
    conv_channels: int
    conv_kernel: int

    @property
    def state_bytes(self) -> int:
        return F32 * (self.n_v_heads * self.head_dim * self.head_dim
                      + (self.conv_kernel - 1) * self.conv_channels)


@dataclass(frozen=True)
class LayerProfile:
    kind: str                                # "attention" | "gdn"
    attention: AttentionShape | None = None  # set for attention layers
    gdn: GDNShape | None = None              # set for gdn layers

    def __post_init__(self):
        if self.kind not in LAYER_KINDS:
            raise ValueError(f"unknown layer kind '{self.kind}'")
        if (self.kind == "attention") != (self.attention is not None) or (self.kind == "gdn") != (self.gdn is not None):
            raise ValueError(f"a {self.kind} layer needs exactly its own shape")


@dataclass(frozen=True)
class ModelProfile:
    name: str
    arch: str
    n_embd: int
    n_vocab: int
    n_ff: int                    # FFN intermediate width one token uses (MoE: used experts + shared)
    mixer_width: int             # widest mixer projection output (scratch per token)
    layers: tuple[LayerProfile, ...]             # trunk layers, in order
    tensors: tuple[TensorEntry, ...]
    mtp_layers: tuple[LayerProfile, ...] = ()    # NextN blocks (full attention), after the trunk
    n_expert: int = 0
    n_expert_used: int = 0
    output_tied: bool = False    # no output.weight: the token embedding is also the output head
    mtp_has_head: bool = False   # the MTP block has its own output head (else it uses the trunk's)
    n_ctx_train: int = 4096      # the context the model was trained for (GGUF context_length)
    notes: tuple[str, ...] = field(default=())

    @property
    def n_layer(self) -> int:
        return len(self.layers)

    @property
    def has_mtp(self) -> bool:
        return bool(self.mtp_layers)

    @property
    def n_gdn_layers(self) -> int:
        return sum(1 for layer in self.layers if layer.kind == "gdn")

    @property
    def n_attention_layers(self) -> int:
        return sum(1 for layer in self.layers if layer.kind == "attention")

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def in_mtp(self, t: TensorEntry) -> bool:
        """A tensor of the NextN blocks (their embedding too, which has role "embedding")."""
        return t.role == "mtp" or (t.layer is not None and t.layer >= self.n_layer)

    def role_bytes(self, role: str) -> int:
        return sum(t.nbytes for t in self.tensors if t.role == role)

    def ffn_layer_bytes(self) -> dict[int, int]:
        """Bytes of each trunk layer's FFN as the planner moves it (a dense FFN, or a MoE layer's
        routed experts), by layer index (layers without one omitted)."""
        out: dict[int, int] = {}
        for t in self.tensors:
            if t.role == "ffn":
                out[t.layer] = out.get(t.layer, 0) + t.nbytes
        return dict(sorted(out.items()))

    def kv_bytes_per_token(self, cache_type_k: str, cache_type_v: str) -> int:
        """Main KV cache bytes per context token over all trunk attention layers."""
        return sum(layer.attention.kv_bytes_per_token(cache_type_k, cache_type_v)
                   for layer in self.layers if layer.attention is not None)

    def mtp_kv_bytes_per_token(self, cache_type_k: str, cache_type_v: str) -> int:
        return sum(layer.attention.kv_bytes_per_token(cache_type_k, cache_type_v) for layer in self.mtp_layers)

    @property
    def recurrent_state_bytes(self) -> int:
        """One sequence's recurrent state (every GDN layer's S and conv state), float32."""
        return sum(layer.gdn.state_bytes for layer in self.layers if layer.gdn is not None)

    @property
    def attention_shapes(self) -> list[AttentionShape]:
        return [layer.attention for layer in self.layers + self.mtp_layers if layer.attention is not None]
