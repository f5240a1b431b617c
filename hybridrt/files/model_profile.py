"""An opened GGUF described to the planner as plain data (`placement.ModelProfile`).

Roles come from the tensor names every supported architecture shares (llama.cpp's naming): the
token embedding, `output.weight`, `blk.N.ffn_*` (a dense FFN, or a MoE layer's routed experts
`ffn_*_exps`, flagged `expert`; its router and shared expert are `moe_shared`, trunk-side),
`*norm.weight`, and the mixer tensors of each layer, whose kind (attention or gated delta net) is
the architecture's layer pattern (`ArchSpec.mixer_kinds`, as the model files build them). Blocks at
index >= n_layer are NextN (MTP) blocks. Widths come from the tensor shapes where they can, so a
profile matches the file even when metadata is sparse.
"""
from __future__ import annotations

import os

import numpy as np

from placement import AttentionShape, GDNShape, LayerProfile, ModelProfile, TensorEntry

from ..errors import UserError
from .gguf_file import GGUFFile
from ..models.arch_spec import ARCH_SPECS, GDN


def _per_layer(value, layer: int, default=None):
    """A metadata value that is either one number or one number per layer."""
    if value is None:
        return default
    if isinstance(value, (np.ndarray, list)):
        return int(value[layer])
    return int(value)


def _split_name(name: str) -> tuple[int | None, str]:
    """'blk.12.ffn_up.weight' -> (12, 'ffn_up.weight'); global tensors -> (None, name)."""
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        if idx.isdigit():
            return int(idx), rest
    return None, name


def _is_norm(part: str) -> bool:
    return "norm" in part.split(".")[0] and not part.startswith("ssm_norm")


def _is_expert(part: str) -> bool:
    return "_exps." in part


def _role(layer: int | None, part: str, n_layer: int, kinds: dict[int, str], tied: bool, moe: set[int]) -> str:
    if layer is None:
        if part.startswith("token_embd."):
            return "output" if tied else "embedding"
        if part.startswith("output."):
            return "output"
        return "norm" if _is_norm(part) else "other"
    if layer >= n_layer:
        return "embedding" if part.startswith("nextn.embed_tokens") else "mtp"
    if _is_norm(part):
        return "norm"
    if part.startswith("ffn_"):
        return "moe_shared" if layer in moe and not _is_expert(part) else "ffn"
    return kinds.get(layer, "other")


def _ffn_width(shapes: dict[str, tuple[int, ...]], n_used: int) -> int:
    """Per-token intermediate width of one layer's FFN (dense up, or used experts + shared expert)."""
    width = 0
    for part, shape in shapes.items():
        if part.startswith("ffn_up.") or part.startswith("ffn_up_shexp."):
            width += shape[1]
        elif part.startswith("ffn_up_exps."):
            width += shape[1] * max(n_used, 1)
    return width


def profile_from_gguf(f: GGUFFile) -> ModelProfile:
    arch = f.arch
    spec = ARCH_SPECS.get(arch)
    if spec is None or not spec.plannable:
        plannable = [name for name, s in ARCH_SPECS.items() if s.plannable]
        raise UserError(f"{f.path}: cannot plan architecture '{arch or '(none)'}' "
                        f"(supported: {', '.join(plannable)})")
    if "token_embd.weight" not in f.tensors:
        raise UserError(f"{f.path}: no token_embd.weight tensor")
    block_count = int(f.get("block_count", 0))
    n_mtp = int(f.get("nextn_predict_layers", 0) or 0)
    n_layer = block_count - n_mtp
    if n_layer <= 0:
        raise UserError(f"{f.path}: block_count {block_count} leaves no trunk layers")

    by_layer: dict[int, dict[str, tuple[int, ...]]] = {}
    for name, t in f.tensors.items():
        layer, part = _split_name(name)
        if layer is not None:
            if layer >= block_count:
                raise UserError(f"{f.path}: tensor {name} is beyond block_count {block_count}")
            by_layer.setdefault(layer, {})[part] = t.shape
    kinds = dict(enumerate(spec.mixer_kinds(n_layer, f.get)))
    tied = "output.weight" not in f.tensors
    moe = {i for i, parts in by_layer.items() if any(_is_expert(p) for p in parts)}
    n_embd, n_vocab = f.tensors["token_embd.weight"].shape[:2]

    head_count, head_count_kv = f.get("attention.head_count"), f.get("attention.head_count_kv")
    key_len, value_len = f.get("attention.key_length"), f.get("attention.value_length")

    def attention(i: int) -> AttentionShape:
        n_head = _per_layer(head_count, i)
        if not n_head:
            raise UserError(f"{f.path}: missing {arch}.attention.head_count")
        dk = _per_layer(key_len, i, n_embd // n_head)
        return AttentionShape(n_head=n_head, n_head_kv=_per_layer(head_count_kv, i, n_head),
                              head_dim_k=dk, head_dim_v=_per_layer(value_len, i, dk))

    def gdn(i: int) -> GDNShape:
        shapes = by_layer.get(i, {})
        conv = shapes.get("ssm_conv1d.weight")
        if conv is None:
            raise UserError(f"{f.path}: GDN layer {i} has no ssm_conv1d.weight")
        n_v_heads = int(f.get("ssm.time_step_rank", 0)) or shapes["ssm_a"][0]
        head_dim = int(f.get("ssm.state_size", 0)) or shapes["ssm_norm.weight"][0]
        return GDNShape(n_v_heads=n_v_heads, head_dim=head_dim, conv_channels=conv[1], conv_kernel=conv[0])

    def layer_profile(i: int) -> LayerProfile:
        if kinds[i] == GDN:
            return LayerProfile("gdn", gdn=gdn(i))
        return LayerProfile("attention", attention=attention(i))

    tensors, mixer = [], []
    for name, t in f.tensors.items():
        layer, part = _split_name(name)
        role = _role(layer, part, n_layer, kinds, tied, moe)
        tensors.append(TensorEntry(name, role, t.nbytes, layer, expert=_is_expert(part)))
        if role in ("attention", "gdn", "mtp") and len(t.shape) == 2 and not part.startswith("ffn_"):
            mixer.append(t.shape[1])

    n_used = int(f.get("expert_used_count", 0) or 0)
    mtp_parts = set().union(*(by_layer.get(i, {}) for i in range(n_layer, block_count))) if n_mtp else set()
    notes = []
    if spec.pattern == "sliding_window":
        notes.append("sliding-window layers keep the full context in the KV cache (as the runtime does)")
    return ModelProfile(
        name=os.path.basename(f.path),
        arch=arch,
        n_embd=int(n_embd),
        n_vocab=int(n_vocab),
        n_ff=max((_ffn_width(by_layer.get(i, {}), n_used) for i in range(block_count)), default=0),
        mixer_width=max(mixer, default=n_embd),
        layers=tuple(layer_profile(i) for i in range(n_layer)),
        tensors=tuple(tensors),
        mtp_layers=tuple(LayerProfile("attention", attention=attention(i)) for i in range(n_layer, block_count)),
        n_expert=int(f.get("expert_count", 0) or 0),
        n_expert_used=n_used,
        output_tied=tied,
        mtp_has_head=any(p.startswith("nextn.shared_head_head") for p in mtp_parts),
        n_ctx_train=int(f.get("context_length", 4096)),
        notes=tuple(notes),
    )


def load_profile(path: str | os.PathLike) -> ModelProfile:
    return profile_from_gguf(GGUFFile(path))
