"""Facts about a GGUF model for `hybridrt info`: no weights are read, no torch is imported."""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from .gguf_file import GGUFFile
from ..models import check_arch
from ..models.arch_spec import ATTENTION, ArchSpec


@dataclass
class ModelInfo:
    path: str
    name: str
    architecture: str
    parameters: int
    file_bytes: int
    file_type: str
    layers: int                 # trunk layers (block_count - nextn layers)
    nextn_layers: int           # MTP / NextN layers appended after the trunk
    context_length: int
    embedding_length: int
    vocab_size: int
    tokenizer: str              # tokenizer.ggml.model (gpt2 = BPE, llama = SentencePiece-style)
    tokenizer_pre: str
    bytes_per_type: dict[str, int] = field(default_factory=dict)
    tensors_per_type: dict[str, int] = field(default_factory=dict)
    layer_kinds: dict[str, int] = field(default_factory=dict)
    experts: dict[str, int] = field(default_factory=dict)    # MoE: count, used, ffn, shared_ffn; {} if dense
    tensors: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _file_type_name(value) -> str:
    if value is None:
        return "unknown"
    try:
        from gguf.constants import LlamaFileType

        return LlamaFileType(int(value)).name.removeprefix("MOSTLY_")
    except ValueError:
        return str(value)


def layer_kinds(f: GGUFFile, spec: ArchSpec, n_layer: int) -> dict[str, int]:
    """Count attention vs gated-delta-net layers (the architecture's layer pattern)."""
    kinds = spec.mixer_kinds(n_layer, f.get)
    if not spec.recurrent:
        return {"attention": n_layer}
    n_attn = kinds.count(ATTENTION)
    return {"gated_delta_net": n_layer - n_attn, "attention": n_attn}


def moe_facts(f: GGUFFile) -> dict[str, int]:
    """Routed experts per layer, used per token, their FFN width and the shared expert's (MoE only)."""
    count = int(f.get("expert_count", 0) or 0)
    if not count:
        return {}
    return {"count": count, "used": int(f.get("expert_used_count", 0) or 0),
            "ffn": int(f.get("expert_feed_forward_length", 0) or 0),
            "shared_ffn": int(f.get("expert_shared_feed_forward_length", 0) or 0)}


def read_model_info(f: GGUFFile, with_tensors: bool = False) -> ModelInfo:
    spec = check_arch(f.arch, f.path)
    block_count = int(f.get("block_count", 0))
    nextn = int(f.get("nextn_predict_layers", 0))
    tokens = f.metadata.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens is not None else int(f.get("vocab_size", 0))
    bytes_per_type, count_per_type = Counter(), Counter()
    for t in f.tensors.values():
        bytes_per_type[t.type_name] += t.nbytes
        count_per_type[t.type_name] += 1
    return ModelInfo(
        path=f.path,
        name=str(f.metadata.get("general.name", "")),
        architecture=f.arch,
        parameters=sum(t.n_elements for t in f.tensors.values()),
        file_bytes=f.file_size,
        file_type=_file_type_name(f.metadata.get("general.file_type")),
        layers=block_count - nextn,
        nextn_layers=nextn,
        context_length=int(f.get("context_length", 0)),
        embedding_length=int(f.get("embedding_length", 0)),
        vocab_size=vocab,
        tokenizer=str(f.metadata.get("tokenizer.ggml.model", "none")),
        tokenizer_pre=str(f.metadata.get("tokenizer.ggml.pre", "")),
        bytes_per_type=dict(bytes_per_type.most_common()),
        tensors_per_type=dict(count_per_type.most_common()),
        layer_kinds=layer_kinds(f, spec, block_count - nextn),
        experts=moe_facts(f),
        tensors=[{"name": t.name, "type": t.type_name, "shape": list(t.shape), "bytes": t.nbytes}
                 for t in f.tensors.values()] if with_tensors else [],
    )
