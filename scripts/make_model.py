#!/usr/bin/env python3
"""Synthetic GGUF model files in exactly the layout llama.cpp's converter and quantizer write.

Real Qwen3.5/3.6 GDN-hybrid MTP models cannot be downloaded here, so tests and the VRAM planner
use files built by this script:

* tiny models with random weights (``qwen35`` and ``qwen35moe`` with optional MTP block,
  ``qwen3``, ``llama``, ``gemma3``, ``qwen3next``), f32 / q8_0 / q4_k_m / iq4_xs mixes, deterministic for
  a seed, loadable by llama.cpp and by hybridrt;
* full-size preset files (``--preset qwen3.6-27b-mtp``, ``--preset qwen3.6-35b-a3b``): the
  complete header, metadata, tokenizer and tensor table of a Q4_K_M file (~16.8 GB for the 27B,
  ~21.7 GB for the 35B-A3B) with random data that runs: quantized blocks with valid f16 scales,
  sized like ``draw_tensor``'s weights (matrices ~ 1/sqrt(row length), residual writes further
  / sqrt(2 * block_count), the embedding 0.5), taken from a few MB of random blocks per type and
  scale (:class:`BlockPools`), so the file is written at about disk speed; float32 tensors are
  ``draw_tensor``'s. Same ``--seed``, same bytes. ``--sparse`` writes the same header and table
  with the data region left as a hole (``truncate``): the real apparent size in a few MB of disk.
  ``--layers N`` keeps only N trunk layers (the per-layer shapes and the MTP block stay), for
  machines whose RAM cannot hold the whole file.

Layout facts (checked against llama.cpp's ``src/models/qwen35.cpp`` loader, ``gguf-py`` constants,
the converter's Qwen3.5 path and ``src/llama-quant.cpp``):

* ggml shapes are ``{ne0 = row length, ne1 = rows}``; numpy arrays are ``[rows, row length]``;
* qwen35 tensors: GDN layers carry ``attn_qkv``, ``attn_gate``, ``ssm_conv1d`` {K, conv_dim},
  ``ssm_dt.bias``, ``ssm_a`` (no suffix, already ``-exp(A_log)``), ``ssm_beta``, ``ssm_alpha``,
  ``ssm_norm`` {head_dim}, ``ssm_out``; attention layers ``attn_q`` (query and gate interleaved
  per head), ``attn_k``, ``attn_v``, ``attn_output``, ``attn_q_norm``, ``attn_k_norm``; every layer
  ``attn_norm``, ``post_attention_norm``, ``ffn_{gate,up,down}``; the MTP block at ``blk.{n_layer}``
  is a full-attention layer plus ``nextn.{eh_proj,enorm,hnorm,shared_head_norm}``;
* norms are stored with the converter's +1 already applied (plain ``x / rms * w``);
* value heads are in the converter's tiled order (value head j reads key head ``j % Hk``);
* qwen3next (checked against llama.cpp's ``src/models/qwen3next.cpp`` and gguf-py's tensor list):
  the qwen35 layout except that beta and alpha come packed in one ``ssm_ba`` {n_embd, 2*Hv} whose
  output rows are, per key head g, [beta of its Hv/Hk value heads | alpha of them]; value heads
  keep the grouped order (value head j reads key head ``j // (Hv/Hk)``); and the FFN is always a
  mixture of experts: ``ffn_gate_inp`` {n_embd, n_expert} (softmax router, top-k renormalised),
  ``ffn_{gate,up}_exps`` {n_embd, n_ff_exp, n_expert}, ``ffn_down_exps`` {n_ff_exp, n_embd,
  n_expert}, and a shared SwiGLU expert ``ffn_{gate,up,down}_shexp`` scaled by
  sigmoid(``ffn_gate_inp_shexp`` {n_embd} . x); llama.cpp refuses a qwen3next file without experts;
* qwen35moe (``src/models/qwen35moe.cpp``): qwen35's trunk exactly (separate ``ssm_beta`` /
  ``ssm_alpha``, tiled value heads, ``rope.dimension_sections``) with qwen3next's MoE FFN in every
  layer, the MTP block included (a gated full-attention block whose FFN is the same MoE); metadata
  ``expert_count``, ``expert_used_count``, ``expert_feed_forward_length``,
  ``expert_shared_feed_forward_length``; no ``expert_weights_scale`` (weights renormalised only);
* gemma3 (``src/models/gemma3.cpp`` and its hparams loader): tied embeddings, q/k norms,
  ``post_attention_norm`` and ``post_ffw_norm`` after the mixer/FFN outputs, ``ffn_norm`` before the
  GELU-tanh FFN; metadata has ``attention.sliding_window`` and ``attention.key_length`` but no
  ``rope.dimension_count``; llama.cpp hard-codes the rest (layer i global iff i % 6 == 5, local
  layers rope base 10000, embeddings scaled by sqrt(n_embd), attention scale 1/sqrt(key_length));
* the Q4_K_M type choice follows llama-quantize: tensors in sorted-name order (its weights map is
  a ``std::map``), ``output.weight`` Q6_K, ``attn_v``/``attn_qkv`` and ``ffn_down`` Q6_K where
  ``use_more_bits(i, n)``, other 2-D weights Q4_K, 1-D tensors / ``*_norm`` / ``ssm_conv1d`` /
  ``ssm_a`` / ``ssm_dt.bias`` F32, and the fallback Q4_K -> Q5_0, Q6_K -> Q8_0 for rows that are
  not a multiple of 256. For a MoE model llama-quantize takes ``ffn_down``'s use_more_bits index
  from the tensor name's block number (out of the block count), so ``ffn_down_exps`` and
  ``ffn_down_shexp`` of a layer share it; qwen35moe files follow that (qwen3next files keep the
  running count, so existing test files keep their bytes). Its n_expert == 8 bumps (attn_k/attn_v
  Q8_0, attn_output Q5_K) are not modelled: the files here have 16 or 256 experts.

Importing from tests: ``tests/conftest.py`` puts ``scripts/`` on ``sys.path`` and does
``import make_model``; use ``make_model.write_model(...)``, ``make_model.write_preset(...)`` /
``make_model.write_sparse_preset(...)``, or ``make_model.write_preset_dims(...)`` for a preset's
layout at reduced dims (``dataclasses.replace`` of its :class:`ModelDims`).

CLI (errors are one ``error: ...`` line on stderr, exit status 2; a preset's progress goes to
stderr, the path written to stdout)::

    python scripts/make_model.py --preset qwen3.6-27b-mtp --out /work/models/q36-27b.gguf
    python scripts/make_model.py --preset qwen3.6-35b-a3b --layers 20 --seed 1 --out /tmp/a3b-l20.gguf
    python scripts/make_model.py --preset qwen3.6-27b-mtp --sparse --out /tmp/q36.gguf
    python scripts/make_model.py --preset qwen3.6-35b-a3b --sparse --layers 4 --out /tmp/q36moe.gguf
    python scripts/make_model.py --arch qwen35moe --mtp --mix q4_k_m --out /tmp/tiny-moe.gguf
    python scripts/make_model.py --arch qwen35 --mtp --mix f32 --seed 0 --out /tmp/tiny.gguf
    python scripts/make_model.py --arch llama --dims n_embd=128,n_layer=4 --out /tmp/l.gguf
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import gguf
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as QT

ARCHS = ("qwen35", "qwen35moe", "qwen3", "llama", "gemma3", "qwen3next")
HYBRID_ARCHS = ("qwen35", "qwen35moe", "qwen3next")     # Gated DeltaNet + gated full attention
MTP_ARCHS = ("qwen35", "qwen35moe")
MIXES = ("f32", "q8_0", "q4_k_m", "iq4_xs")
# llama_ftype values written as general.file_type
FILE_TYPE = {"f32": 0, "q8_0": 7, "q4_k_m": 15, "iq4_xs": 30}


@dataclass(frozen=True)
class ModelDims:
    arch: str
    n_embd: int
    n_layer: int                 # trunk layers (block_count = n_layer + n_mtp)
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    n_vocab: int                 # tiny models: the tokenizer decides (0 = use it)
    rope_base: float
    rms_eps: float = 1e-6
    context_length: int = 4096
    tied: bool = False           # no output.weight: the head reuses token_embd
    n_mtp: int = 0               # qwen35 / qwen35moe: NextN blocks appended after the trunk
    sliding_window: int = 0      # gemma3 only: local layers see the last `sliding_window` positions
    # qwen3next / qwen35moe: mixture-of-experts FFN
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    # qwen35 / qwen35moe / qwen3next
    full_attention_interval: int = 4
    ssm_conv: int = 4
    ssm_head_dim: int = 0        # ssm.state_size: GDN head dim (keys and values)
    ssm_k_heads: int = 0         # ssm.group_count
    ssm_v_heads: int = 0         # ssm.time_step_rank
    rope_sections: tuple[int, int, int, int] = (0, 0, 0, 0)
    name: str = "tiny"

    @property
    def block_count(self) -> int:
        return self.n_layer + self.n_mtp

    def is_recurrent(self, il: int) -> bool:
        return (self.arch in HYBRID_ARCHS and il < self.n_layer
                and (il + 1) % self.full_attention_interval != 0)


TINY_DEFAULTS: dict[str, ModelDims] = {
    # 8 layers with interval 4: layers 3 and 7 are full attention, the rest Gated DeltaNet
    "qwen35": ModelDims(arch="qwen35", n_embd=64, n_layer=8, n_ff=128, n_head=4, n_head_kv=2,
                        head_dim=16, n_rot=8, n_vocab=0, rope_base=1e7, ssm_head_dim=16,
                        ssm_k_heads=2, ssm_v_heads=4, rope_sections=(2, 1, 1, 0),
                        name="tiny-qwen35"),
    "qwen3": ModelDims(arch="qwen3", n_embd=64, n_layer=4, n_ff=128, n_head=4, n_head_kv=2,
                       head_dim=32, n_rot=32, n_vocab=0, rope_base=1e6, name="tiny-qwen3"),
    # tied like SmolLM2; llama's rotary pairs adjacent dims (ggml's "norm" mode)
    "llama": ModelDims(arch="llama", n_embd=64, n_layer=4, n_ff=128, n_head=4, n_head_kv=2,
                       head_dim=16, n_rot=16, n_vocab=0, rope_base=1e4, rms_eps=1e-5,
                       tied=True, name="tiny-llama"),
    # 8 layers: layer 5 is global, the others slide over 8 positions; key_length 32 != n_embd/n_head
    "gemma3": ModelDims(arch="gemma3", n_embd=64, n_layer=8, n_ff=128, n_head=4, n_head_kv=1,
                        head_dim=32, n_rot=32, n_vocab=0, rope_base=1e6, tied=True,
                        sliding_window=8, name="tiny-gemma3"),
    # qwen35's trunk with grouped V heads, a packed ssm_ba and 4 experts (2 used) + a shared expert
    "qwen3next": ModelDims(arch="qwen3next", n_embd=64, n_layer=8, n_ff=64, n_head=4, n_head_kv=2,
                           head_dim=16, n_rot=8, n_vocab=0, rope_base=1e7, ssm_head_dim=16,
                           ssm_k_heads=2, ssm_v_heads=4, n_expert=4, n_expert_used=2, n_ff_exp=32,
                           n_ff_shexp=64, name="tiny-qwen3next"),
    # qwen35's trunk (tiled V heads, separate beta/alpha) with 16 experts (4 used) + a shared
    # expert: enough experts that k <= 8 verify tokens share some and miss others
    "qwen35moe": ModelDims(arch="qwen35moe", n_embd=64, n_layer=8, n_ff=64, n_head=4, n_head_kv=2,
                           head_dim=16, n_rot=8, n_vocab=0, rope_base=1e7, ssm_head_dim=16,
                           ssm_k_heads=2, ssm_v_heads=4, rope_sections=(2, 1, 1, 0), n_expert=16,
                           n_expert_used=4, n_ff_exp=32, n_ff_shexp=64, name="tiny-qwen35moe"),
}

PRESETS: dict[str, tuple[ModelDims, str]] = {
    # Qwen3.6-27B with its MTP block, as a Q4_K_M file (config.json of Qwen/Qwen3.6-27B)
    "qwen3.6-27b-mtp": (ModelDims(
        arch="qwen35", n_embd=5120, n_layer=64, n_ff=17408, n_head=24, n_head_kv=4, head_dim=256,
        n_rot=64, n_vocab=248320, rope_base=1e7, rms_eps=1e-6, context_length=262144, n_mtp=1,
        full_attention_interval=4, ssm_conv=4, ssm_head_dim=128, ssm_k_heads=16, ssm_v_heads=48,
        rope_sections=(11, 11, 10, 0), name="Qwen3.6-27B"), "q4_k_m"),
    # Qwen3.6-35B-A3B with its MTP block, as a Q4_K_M file. These dims are the public
    # Qwen3.5-35B-A3B config as recalled (hidden 2048, 40 layers = 30 GDN + 10 attention, 16 q / 2 kv
    # heads of 256, 64 rotary dims, GDN 16 key / 32 value heads of 128, 256 experts with 8 used,
    # expert and shared-expert FFN 512, vocabulary 248320, one MTP layer): verify them against a
    # real file when one is available. feed_forward_length is not read by llama.cpp's qwen35moe
    # loader (the expert widths are); 512 stands in for it.
    "qwen3.6-35b-a3b": (ModelDims(
        arch="qwen35moe", n_embd=2048, n_layer=40, n_ff=512, n_head=16, n_head_kv=2, head_dim=256,
        n_rot=64, n_vocab=248320, rope_base=1e7, rms_eps=1e-6, context_length=262144, n_mtp=1,
        full_attention_interval=4, ssm_conv=4, ssm_head_dim=128, ssm_k_heads=16, ssm_v_heads=32,
        rope_sections=(11, 11, 10, 0), n_expert=256, n_expert_used=8, n_ff_exp=512, n_ff_shexp=512,
        name="Qwen3.6-35B-A3B"), "q4_k_m"),
}


# ---------------------------------------------------------------- tensor table

@dataclass(frozen=True)
class TensorSpec:
    name: str
    ne: tuple[int, ...]          # ggml order: ne[0] is the row length
    kind: str   # how to draw it: matrix | qkv | conv_qkv | embd | norm | ssm_norm | ssm_a | dt_bias


def _attention_tensors(p: str, d: ModelDims) -> list[TensorSpec]:
    gated = d.arch in HYBRID_ARCHS
    q_rows = d.n_head * d.head_dim * (2 if gated else 1)   # gated: [q_h | gate_h] per head
    kv_rows = d.n_head_kv * d.head_dim
    out = [TensorSpec(f"{p}.attn_q.weight", (d.n_embd, q_rows), "matrix"),
           TensorSpec(f"{p}.attn_k.weight", (d.n_embd, kv_rows), "matrix"),
           TensorSpec(f"{p}.attn_v.weight", (d.n_embd, kv_rows), "matrix"),
           TensorSpec(f"{p}.attn_output.weight", (d.n_head * d.head_dim, d.n_embd), "matrix")]
    if d.arch != "llama":
        out += [TensorSpec(f"{p}.attn_q_norm.weight", (d.head_dim,), "norm"),
                TensorSpec(f"{p}.attn_k_norm.weight", (d.head_dim,), "norm")]
    return out


def _gdn_tensors(p: str, d: ModelDims) -> list[TensorSpec]:
    key_dim = d.ssm_k_heads * d.ssm_head_dim
    value_dim = d.ssm_v_heads * d.ssm_head_dim
    conv_dim = 2 * key_dim + value_dim
    if d.arch == "qwen3next":
        beta_alpha = [TensorSpec(f"{p}.ssm_ba.weight", (d.n_embd, 2 * d.ssm_v_heads), "matrix")]
    else:
        beta_alpha = [TensorSpec(f"{p}.ssm_beta.weight", (d.n_embd, d.ssm_v_heads), "matrix"),
                      TensorSpec(f"{p}.ssm_alpha.weight", (d.n_embd, d.ssm_v_heads), "matrix")]
    return [TensorSpec(f"{p}.attn_qkv.weight", (d.n_embd, conv_dim), "qkv"),
            TensorSpec(f"{p}.attn_gate.weight", (d.n_embd, value_dim), "matrix"),
            TensorSpec(f"{p}.ssm_conv1d.weight", (d.ssm_conv, conv_dim), "conv_qkv"),
            TensorSpec(f"{p}.ssm_dt.bias", (d.ssm_v_heads,), "dt_bias"),
            TensorSpec(f"{p}.ssm_a", (d.ssm_v_heads,), "ssm_a"),
            *beta_alpha,
            TensorSpec(f"{p}.ssm_norm.weight", (d.ssm_head_dim,), "ssm_norm"),
            TensorSpec(f"{p}.ssm_out.weight", (value_dim, d.n_embd), "matrix")]


def _ffn_tensors(p: str, d: ModelDims) -> list[TensorSpec]:
    if d.n_expert:
        return [TensorSpec(f"{p}.ffn_gate_inp.weight", (d.n_embd, d.n_expert), "router"),
                TensorSpec(f"{p}.ffn_gate_exps.weight", (d.n_embd, d.n_ff_exp, d.n_expert), "matrix"),
                TensorSpec(f"{p}.ffn_up_exps.weight", (d.n_embd, d.n_ff_exp, d.n_expert), "matrix"),
                TensorSpec(f"{p}.ffn_down_exps.weight", (d.n_ff_exp, d.n_embd, d.n_expert), "matrix"),
                TensorSpec(f"{p}.ffn_gate_inp_shexp.weight", (d.n_embd,), "router"),
                TensorSpec(f"{p}.ffn_gate_shexp.weight", (d.n_embd, d.n_ff_shexp), "matrix"),
                TensorSpec(f"{p}.ffn_up_shexp.weight", (d.n_embd, d.n_ff_shexp), "matrix"),
                TensorSpec(f"{p}.ffn_down_shexp.weight", (d.n_ff_shexp, d.n_embd), "matrix")]
    return [TensorSpec(f"{p}.ffn_gate.weight", (d.n_embd, d.n_ff), "matrix"),
            TensorSpec(f"{p}.ffn_up.weight", (d.n_embd, d.n_ff), "matrix"),
            TensorSpec(f"{p}.ffn_down.weight", (d.n_ff, d.n_embd), "matrix")]


def tensor_table(d: ModelDims) -> list[TensorSpec]:
    """All tensors of the model in llama-quantize's output order (sorted by name)."""
    specs = [TensorSpec("token_embd.weight", (d.n_embd, d.n_vocab), "embd"),
             TensorSpec("output_norm.weight", (d.n_embd,), "norm")]
    if not d.tied:
        specs.append(TensorSpec("output.weight", (d.n_embd, d.n_vocab), "matrix"))
    for il in range(d.block_count):
        p = f"blk.{il}"
        specs.append(TensorSpec(f"{p}.attn_norm.weight", (d.n_embd,), "norm"))
        if d.arch in HYBRID_ARCHS:
            specs.append(TensorSpec(f"{p}.post_attention_norm.weight", (d.n_embd,), "norm"))
            specs += _gdn_tensors(p, d) if d.is_recurrent(il) else _attention_tensors(p, d)
        else:
            specs.append(TensorSpec(f"{p}.ffn_norm.weight", (d.n_embd,), "norm"))
            specs += _attention_tensors(p, d)
            if d.arch == "gemma3":     # norms of the attention and FFN outputs
                specs += [TensorSpec(f"{p}.post_attention_norm.weight", (d.n_embd,), "norm"),
                          TensorSpec(f"{p}.post_ffw_norm.weight", (d.n_embd,), "norm")]
        specs += _ffn_tensors(p, d)
        if il >= d.n_layer:     # NextN / MTP block
            specs += [TensorSpec(f"{p}.nextn.eh_proj.weight", (2 * d.n_embd, d.n_embd), "matrix"),
                      TensorSpec(f"{p}.nextn.enorm.weight", (d.n_embd,), "norm"),
                      TensorSpec(f"{p}.nextn.hnorm.weight", (d.n_embd,), "norm"),
                      TensorSpec(f"{p}.nextn.shared_head_norm.weight", (d.n_embd,), "norm")]
    return sorted(specs, key=lambda s: s.name)


# ---------------------------------------------------------------- quant type choice

def _quantizable(spec: TensorSpec) -> bool:
    # llama-quantize leaves 1-D tensors, norms, conv kernels, MoE routers and non-".weight"
    # tensors alone
    return (len(spec.ne) >= 2 and spec.name.endswith("weight") and "_norm.weight" not in spec.name
            and "ssm_conv1d" not in spec.name and "ffn_gate_inp" not in spec.name)


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


_FALLBACK = {QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0}


def _fit_row(qtype: QT, row: int) -> QT:
    """llama-quantize's fallback when the row length is not a multiple of the block size."""
    block = GGML_QUANT_SIZES[qtype][0]
    if row % block == 0:
        return qtype
    qtype = _FALLBACK.get(qtype, QT.F16)
    return qtype if row % GGML_QUANT_SIZES[qtype][0] == 0 else QT.F16


def assign_types(specs: list[TensorSpec], mix: str, d: ModelDims) -> list[QT]:
    """Per-tensor ggml type for a mix, in the order of ``specs`` (which must be name-sorted)."""
    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r}; expected one of {MIXES}")
    n_wv = sum(1 for s in specs if "attn_v.weight" in s.name or "attn_qkv.weight" in s.name)
    n_down = sum(1 for s in specs if "ffn_down" in s.name)
    down_by_block = d.arch == "qwen35moe"     # llama-quantize's MoE rule (see the module notes)
    i_wv = i_down = 0
    types = []
    for s in specs:
        if mix == "f32" or not _quantizable(s):
            types.append(QT.F32)
            continue
        if mix == "q8_0":
            types.append(_fit_row(QT.Q8_0, s.ne[0]))
            continue
        if mix == "iq4_xs":     # every matrix IQ4_XS, IQ4_NL where a row is not a 256-multiple
            types.append(QT.IQ4_XS if s.ne[0] % 256 == 0 else QT.IQ4_NL)
            continue
        qtype = QT.Q4_K
        is_head = s.name == "output.weight" or (d.tied and s.name == "token_embd.weight")
        if is_head:
            qtype = QT.Q6_K if s.ne[0] % 256 == 0 else QT.Q8_0
        elif "attn_v.weight" in s.name or "attn_qkv.weight" in s.name:
            qtype = QT.Q6_K if _use_more_bits(i_wv, n_wv) else QT.Q4_K
            i_wv += 1
        elif "ffn_down" in s.name and down_by_block:
            block = int(s.name.split(".")[1])
            qtype = QT.Q6_K if _use_more_bits(block, d.block_count) else QT.Q4_K
        elif "ffn_down" in s.name:
            qtype = QT.Q6_K if _use_more_bits(i_down, n_down) else QT.Q4_K
            i_down += 1
        types.append(_fit_row(qtype, s.ne[0]))
    return types


def tensor_nbytes(ne: tuple[int, ...], qtype: QT) -> int:
    block, type_size = GGML_QUANT_SIZES[qtype]
    n = int(np.prod(ne, dtype=np.int64))
    assert ne[0] % block == 0, (ne, qtype)
    return n // block * type_size


# ---------------------------------------------------------------- tokenizer

def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@dataclass
class Tokenizer:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    pre: str
    bos_id: int
    eos_id: int
    pad_id: int
    add_bos: bool
    chat_template: str


SPECIALS = {"qwen": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            "llama": ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]}
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
                   "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}")

# Training text for the tiny BPE: English, code and digits, so merges look like a real vocab's.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. The cat sat on the mat, and the dog sat on the log.
In the beginning there was the word, and the word was with the model. It is what it is.
Speculative decoding drafts several tokens and verifies them in one pass of the target model.
A gated delta network keeps a state matrix per head and updates it with the delta rule.
def forward(self, tokens, positions):
    hidden = self.embed(tokens)
    for layer in self.layers:
        hidden = layer(hidden, positions)
    return self.norm(hidden)
Numbers: 0 1 2 3 4 5 6 7 8 9 10 12 42 100 256 1024 2048 4096 3.14159 2.71828
Hello, world! How are you today? I am fine, thank you. Where is the station? Here it is.
the theory of the thing is that there is then another thing in the other room with them.
"""


def _pretokenize(text: str) -> list[str]:
    return re.findall(r"'(?:s|t|re|ve|m|ll|d)| ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+", text)


def _train_bpe(n_merges: int) -> list[tuple[str, str]]:
    """Greedy byte-level BPE on the built-in corpus (ties broken by the pair's text)."""
    b2u = bytes_to_unicode()
    words: dict[tuple[str, ...], int] = {}
    for w in _pretokenize(_CORPUS):
        key = tuple(b2u[b] for b in w.encode("utf-8"))
        words[key] = words.get(key, 0) + 1
    merges = []
    for _ in range(n_merges):
        counts: dict[tuple[str, str], int] = {}
        for w, c in words.items():
            for pair in zip(w[:-1], w[1:]):
                counts[pair] = counts.get(pair, 0) + c
        if not counts:
            break
        best = min(counts, key=lambda pr: (-counts[pr], pr))
        if counts[best] < 2:
            break
        merges.append(best)
        new_words: dict[tuple[str, ...], int] = {}
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] = new_words.get(tuple(out), 0) + c
        words = new_words
    return merges


def _finish_tokenizer(arch: str, tokens: list[str], merges: list[str]) -> Tokenizer:
    family = "llama" if arch in ("llama", "gemma3") else "qwen"
    specials = SPECIALS[family]
    first_special = len(tokens)
    tokens = tokens + specials
    types = [1] * first_special + [3] * len(specials)   # NORMAL, CONTROL
    pre = {"qwen35": "qwen35", "qwen35moe": "qwen35", "qwen3": "qwen2", "qwen3next": "qwen2", "llama": "llama-bpe",
           "gemma3": "default"}[arch]
    if family == "qwen":
        return Tokenizer(tokens, types, merges, pre, bos_id=first_special, eos_id=first_special + 2,
                         pad_id=first_special, add_bos=False, chat_template=CHATML)
    return Tokenizer(tokens, types, merges, pre, bos_id=first_special, eos_id=first_special + 2,
                     pad_id=first_special + 1, add_bos=True, chat_template=LLAMA3_TEMPLATE)


def tiny_tokenizer(arch: str, n_merges: int = 200) -> Tokenizer:
    """256 byte tokens, up to ``n_merges`` trained merges, then the special tokens."""
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    merge_pairs = _train_bpe(n_merges)
    tokens += [a + b for a, b in merge_pairs]
    return _finish_tokenizer(arch, tokens, [f"{a} {b}" for a, b in merge_pairs])


def generated_tokenizer(arch: str, n_vocab: int) -> Tokenizer:
    """A valid byte-level BPE vocabulary of exactly ``n_vocab`` tokens, built without training.

    Token 256 + k is a pair or triple of byte symbols with its merge; cheap enough for 248k tokens.
    """
    b2u = bytes_to_unicode()
    sym = [b2u[b] for b in range(256)]
    n_special = len(SPECIALS["llama" if arch in ("llama", "gemma3") else "qwen"])
    n_merged = n_vocab - 256 - n_special
    tokens, merges = list(sym), []
    for k in range(n_merged):
        if k < 256 * 256:
            a, b = sym[k // 256], sym[k % 256]
        else:
            j = k - 256 * 256
            a, b = sym[(j // 256) // 256] + sym[(j // 256) % 256], sym[j % 256]
        tokens.append(a + b)
        merges.append(f"{a} {b}")
    return _finish_tokenizer(arch, tokens, merges)


# ---------------------------------------------------------------- metadata

def _add_metadata(w: gguf.GGUFWriter, d: ModelDims, tok: Tokenizer, mix: str) -> None:
    a = d.arch
    w.add_name(d.name)
    w.add_type("model")
    w.add_uint32(f"{a}.block_count", d.block_count)
    w.add_uint32(f"{a}.context_length", d.context_length)
    w.add_uint32(f"{a}.embedding_length", d.n_embd)
    w.add_uint32(f"{a}.feed_forward_length", d.n_ff)
    w.add_uint32(f"{a}.attention.head_count", d.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", d.n_head_kv)
    w.add_float32(f"{a}.rope.freq_base", d.rope_base)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", d.rms_eps)
    if a != "llama" or d.head_dim != d.n_embd // d.n_head:     # llama's converter writes it only then
        w.add_uint32(f"{a}.attention.key_length", d.head_dim)
        w.add_uint32(f"{a}.attention.value_length", d.head_dim)
    if a == "llama":
        w.add_uint32(f"{a}.vocab_size", len(tok.tokens))
    if a == "gemma3":       # like the converter: no rotary dims key (all of key_length rotates)
        w.add_uint32(f"{a}.attention.sliding_window", d.sliding_window)
    else:
        w.add_uint32(f"{a}.rope.dimension_count", d.n_rot)
    if d.n_expert:
        w.add_uint32(f"{a}.expert_count", d.n_expert)
        w.add_uint32(f"{a}.expert_used_count", d.n_expert_used)
        w.add_uint32(f"{a}.expert_feed_forward_length", d.n_ff_exp)
        w.add_uint32(f"{a}.expert_shared_feed_forward_length", d.n_ff_shexp)
    if a in MTP_ARCHS:
        w.add_array(f"{a}.rope.dimension_sections", list(d.rope_sections))
    if a in HYBRID_ARCHS:
        w.add_uint32(f"{a}.ssm.conv_kernel", d.ssm_conv)
        w.add_uint32(f"{a}.ssm.state_size", d.ssm_head_dim)
        w.add_uint32(f"{a}.ssm.group_count", d.ssm_k_heads)
        w.add_uint32(f"{a}.ssm.time_step_rank", d.ssm_v_heads)
        w.add_uint32(f"{a}.ssm.inner_size", d.ssm_v_heads * d.ssm_head_dim)
        w.add_uint32(f"{a}.full_attention_interval", d.full_attention_interval)
        if d.n_mtp:
            w.add_uint32(f"{a}.nextn_predict_layers", d.n_mtp)
    w.add_file_type(FILE_TYPE[mix])
    if mix != "f32":
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tok.pre)
    w.add_token_list(tok.tokens)
    w.add_token_types(tok.token_types)
    w.add_token_merges(tok.merges)
    w.add_bos_token_id(tok.bos_id)
    w.add_eos_token_id(tok.eos_id)
    w.add_pad_token_id(tok.pad_id)
    w.add_add_bos_token(tok.add_bos)
    w.add_chat_template(tok.chat_template)


# ---------------------------------------------------------------- tiny models with weights

def tiny_dims(arch: str, mtp: bool = False, mix: str = "f32", overrides: dict | None = None) -> ModelDims:
    """Default tiny dims for an arch; the q4_k_m mix widens rows to 256 so K-quants apply, the
    iq4_xs mix the FFN's (so both IQ4 types occur)."""
    if arch not in TINY_DEFAULTS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    d = TINY_DEFAULTS[arch]
    if mix == "iq4_xs":     # ffn_down's rows become 256-multiples: IQ4_XS there, IQ4_NL elsewhere
        d = dataclasses.replace(d, n_ff=256, n_ff_exp=256 if d.n_expert else 0, n_ff_shexp=256 if d.n_expert else 0)
    if mix == "q4_k_m":
        d = dataclasses.replace(d, n_embd=256, n_ff=512, n_ff_exp=256 if d.n_expert else 0,
                                n_ff_shexp=512 if d.n_expert else 0)
    if mtp:
        if arch not in MTP_ARCHS:
            raise ValueError(f"--mtp is only defined for {' and '.join(MTP_ARCHS)}")
        d = dataclasses.replace(d, n_mtp=1)
    return dataclasses.replace(d, **(overrides or {}))


# matrices that write into the residual stream: their spread is scaled down by the depth
_RESIDUAL_WRITES = ("ssm_out.weight", "attn_output.weight", "ffn_down.weight",
                    "ffn_down_exps.weight", "ffn_down_shexp.weight")


def draw_tensor(spec: TensorSpec, rng: np.random.Generator, d: ModelDims) -> np.ndarray:
    """Random float32 weights with realistic scales, numpy shape = reversed ggml shape."""
    shape = tuple(reversed(spec.ne))
    if spec.kind in ("matrix", "qkv"):      # keeps activations O(1) through each projection
        x = rng.standard_normal(shape) / np.sqrt(spec.ne[0])
        if spec.name.endswith(_RESIDUAL_WRITES):
            x /= np.sqrt(2 * d.block_count)      # GPT-2 style: residual writes scaled by depth
    elif spec.kind == "router":    # logits of O(1) spread, so the top-k choice is rarely a near tie
        x = 2.0 * rng.standard_normal(shape) / np.sqrt(spec.ne[0])
    elif spec.kind == "embd":
        x = 0.5 * rng.standard_normal(shape)
    elif spec.kind in ("norm", "ssm_norm"):
        x = 1.0 + 0.1 * rng.standard_normal(shape)
    elif spec.kind == "ssm_a":     # stored as -exp(A_log): a negative decay rate per value head
        x = -rng.uniform(0.1, 2.0, shape)
    elif spec.kind == "dt_bias":
        x = rng.uniform(-1.0, 1.0, shape)
    elif spec.kind == "conv_qkv":
        x = rng.standard_normal(shape) / np.sqrt(spec.ne[0])
    else:
        raise ValueError(spec.kind)
    if spec.kind in ("qkv", "conv_qkv"):
        # GDN: rows [q; k; v]. Independent random q and k make q.k pass near zero, and the
        # per-head ssm_norm then blows tiny activation errors up (a q8_0 file loses top-1 on a
        # quarter of positions); trained models align q and k, so draw k close to q.
        kd = d.ssm_k_heads * d.ssm_head_dim
        x[kd:2 * kd] = 0.8 * x[:kd] + 0.6 * x[kd:2 * kd]
    return x.astype(np.float32)


def quantize(x: np.ndarray, qtype: QT) -> np.ndarray:
    """float32 [rows, cols] -> the stored array (float32/float16, or uint8 blocks)."""
    if qtype == QT.F32:
        return np.ascontiguousarray(x, dtype=np.float32)
    if qtype == QT.F16:
        return x.astype(np.float16)
    try:
        from cpu_kernels.quantize import quantize as cpu_quantize
    except ImportError:
        cpu_quantize = None
    if cpu_quantize is not None:
        q = np.asarray(cpu_quantize(np.ascontiguousarray(x, dtype=np.float32), int(qtype)))
    elif qtype in (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0):
        q = gguf.quants.quantize(x, qtype)
    else:
        raise RuntimeError(f"{qtype.name} needs cpu_kernels.quantize, which is not importable")
    q = q.view(np.uint8).reshape(x.shape[0], -1)
    assert q.shape[1] == tensor_nbytes((x.shape[1],), qtype), (q.shape, qtype)
    return q


def write_model(path: str | Path, arch: str, mtp: bool = False, mix: str = "f32", seed: int = 0,
                dims: dict | None = None) -> Path:
    """A tiny random model of ``arch`` in llama.cpp's layout; same seed and args, same bytes."""
    d = tiny_dims(arch, mtp, mix, dims)
    tok = tiny_tokenizer(arch) if d.n_vocab == 0 else generated_tokenizer(arch, d.n_vocab)
    d = dataclasses.replace(d, n_vocab=len(tok.tokens))
    specs = tensor_table(d)
    types = assign_types(specs, mix, d)
    rng = np.random.default_rng(seed)
    path = Path(path)
    w = gguf.GGUFWriter(path, d.arch)
    _add_metadata(w, d, tok, mix)
    for s, t in zip(specs, types):
        x = draw_tensor(s, rng, d)
        data = quantize(x.reshape(-1, s.ne[0]), t)
        if data.dtype == np.uint8:      # the writer reads ggml's shape off the byte shape
            w.add_tensor(s.name, data.reshape(x.shape[:-1] + (-1,)), raw_dtype=t)
        else:
            w.add_tensor(s.name, data.reshape(x.shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------- preset files (full size)

POOL_BYTES = 8 << 20          # per quant type and scale: random blocks the tensors take rows from
PROGRESS_BYTES = 2 << 30      # a progress line this often

# Where a block keeps its f16 scale: the offset of d, then (offset, multiple of d) of the f16
# fields that centre the block's values on zero (Q4_1/Q5_1 m = -centre*d, Q4_K/Q5_K dmin with
# every sub-block's min equal to its scale). F16 is a "block" of one value that is its own d.
_SCALE_FIELDS: dict[QT, tuple[int, tuple[tuple[int, float], ...]]] = {
    QT.F16: (0, ()), QT.Q4_0: (0, ()), QT.Q5_0: (0, ()), QT.Q8_0: (0, ()),
    QT.IQ4_NL: (0, ()), QT.IQ4_XS: (0, ()),
    QT.Q4_1: (0, ((2, -7.5),)), QT.Q5_1: (0, ((2, -15.5),)),
    QT.Q4_K: (0, ((2, 7.5),)), QT.Q5_K: (0, ((2, 15.5),)), QT.Q6_K: (208, ()),
}


def preset_dims(preset: str, layers: int | None = None) -> tuple[ModelDims, str]:
    """A preset's dims and mix; ``layers``: keep only that many trunk layers (the MTP block and the
    per-layer shapes stay, ``full_attention_interval`` keeps its pattern: 4 layers = 3 GDN + 1
    attention)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    d, mix = PRESETS[preset]
    if layers is not None:
        if not 1 <= layers <= d.n_layer:
            raise ValueError(f"--layers {layers}: {preset} has 1 to {d.n_layer} trunk layers")
        d = dataclasses.replace(d, n_layer=layers)
    return d, mix


def weight_std(spec: TensorSpec, d: ModelDims) -> float:
    """The spread :func:`draw_tensor` gives a matrix, embedding or router."""
    if spec.kind == "embd":
        return 0.5
    if spec.kind == "router":
        return 2.0 / np.sqrt(spec.ne[0])
    if spec.kind not in ("matrix", "qkv"):
        raise ValueError(f"{spec.name}: kind {spec.kind} is drawn as float32")
    std = 1.0 / np.sqrt(spec.ne[0])
    return std / np.sqrt(2 * d.block_count) if spec.name.endswith(_RESIDUAL_WRITES) else std


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: six-bit scales and mins [n, 8] -> the 12 packed bytes of each block [n, 12]."""
    q = np.empty((len(sc), 12), np.uint8)
    q[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    q[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    q[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return q


class BlockPools:
    """Random quantized blocks with valid scales, a few MB per (type, weight spread).

    Per type: random quants (and sub-block scales of a moderate range, mins equal to the scales so
    the values centre on zero), each block's f16 d drawn around 1; the rms of those blocks'
    values (gguf-py's dequantize of a sample) calibrates d so that a pool scaled for ``std``
    dequantizes to values of that rms. Tensors take their rows from a pool starting at a random
    block (wrapping around), so writing costs no more than copying memory to the file."""

    def __init__(self, seed: int, pool_bytes: int = POOL_BYTES):
        self.seed, self.pool_bytes = seed, pool_bytes
        self._unit: dict[QT, tuple[np.ndarray, np.ndarray, float]] = {}
        self._scaled: dict[tuple[QT, float], np.ndarray] = {}

    def _unit_pool(self, qtype: QT) -> tuple[np.ndarray, np.ndarray, float]:
        if qtype not in self._unit:
            if qtype not in _SCALE_FIELDS:
                raise ValueError(f"no random blocks for {qtype.name}")
            rng = np.random.default_rng([self.seed, 0, int(qtype)])
            size = GGML_QUANT_SIZES[qtype][1]
            n = max(1, self.pool_bytes // size)
            blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
            d = rng.standard_normal(n) if qtype == QT.F16 else rng.uniform(0.75, 1.25, n)
            if qtype in (QT.Q4_K, QT.Q5_K):
                sc = rng.integers(8, 32, (n, 8), dtype=np.uint8)
                blocks[:, 4:16] = _pack_k_scales(sc, sc)
            elif qtype == QT.Q6_K:      # int8 sub-block scales of either sign
                sc = rng.integers(8, 32, (n, 16)) * rng.choice(np.array([-1, 1]), (n, 16))
                blocks[:, 192:208] = sc.astype(np.int8).view(np.uint8)
            _set_scales(blocks, qtype, d)
            x = gguf.quants.dequantize(blocks[:4096], qtype)
            self._unit[qtype] = blocks, d, float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))
        return self._unit[qtype]

    def blocks(self, qtype: QT, std: float) -> np.ndarray:
        """[n, type_size] uint8 blocks whose dequantized values have rms ``std``."""
        key = (qtype, float(std))
        if key not in self._scaled:
            unit, d, rms = self._unit_pool(qtype)
            blocks = unit.copy()
            _set_scales(blocks, qtype, d * (std / rms))
            self._scaled[key] = blocks
        return self._scaled[key]

    def write(self, f, qtype: QT, std: float, nbytes: int, rng: np.random.Generator) -> None:
        """``nbytes`` of blocks of rms ``std`` to ``f``, from a random block of the pool on."""
        pool = self.blocks(qtype, std)
        data = memoryview(pool.reshape(-1))
        pos = int(rng.integers(len(pool))) * pool.shape[1]
        while nbytes:
            k = min(nbytes, len(data) - pos)
            f.write(data[pos:pos + k])
            nbytes -= k
            pos = 0


def _set_scales(blocks: np.ndarray, qtype: QT, d: np.ndarray) -> None:
    off, centring = _SCALE_FIELDS[qtype]
    d16 = d.astype(np.float16)
    blocks[:, off:off + 2] = d16.view(np.uint8).reshape(-1, 2)
    for o, mult in centring:
        blocks[:, o:o + 2] = (d16.astype(np.float64) * mult).astype(np.float16).view(np.uint8).reshape(-1, 2)


def write_preset_dims(path: str | Path, d: ModelDims, mix: str, sparse: bool = False, seed: int = 0,
                      log=None) -> Path:
    """A ``mix`` file of dims ``d`` with a generated tokenizer of ``d.n_vocab`` tokens.

    ``sparse``: the data region is a hole. Otherwise every tensor gets random data: quantized
    tensors rows of :class:`BlockPools` blocks scaled to :func:`weight_std`, float32 ones
    :func:`draw_tensor`'s values; same seed, same bytes. The header and tensor table are the same
    either way. The data streams to the file tensor by tensor (a few tens of MB of memory);
    ``log(line)`` gets a progress line every ``PROGRESS_BYTES`` and a last one with the rate."""
    path = Path(path)
    tok = generated_tokenizer(d.arch, d.n_vocab)
    specs = tensor_table(d)
    types = assign_types(specs, mix, d)
    w = gguf.GGUFWriter(path, d.arch)
    _add_metadata(w, d, tok, mix)
    for s, t in zip(specs, types):
        # element shape in numpy order; a non-uint8 dtype tells the writer it is not a byte shape
        w.add_tensor_info(s.name, tuple(reversed(s.ne)), np.dtype(np.float32),
                          tensor_nbytes(s.ne, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    assert w.fout is not None
    f = w.fout[0]
    align = w.data_alignment
    data_start = gguf.GGUFWriter.ggml_pad(f.tell(), align)
    sizes = [tensor_nbytes(s.ne, t) for s, t in zip(specs, types)]
    data_size = sum(gguf.GGUFWriter.ggml_pad(n, align) for n in sizes)
    if sparse:
        f.truncate(data_start + data_size)
        w.close()
        return path
    f.write(bytes(data_start - f.tell()))
    pools = BlockPools(seed)
    t0, done, next_log = time.perf_counter(), 0, PROGRESS_BYTES
    for s, t, n in zip(specs, types, sizes):
        rng = np.random.default_rng([seed, 1, zlib.crc32(s.name.encode())])
        if t == QT.F32:     # norms, conv kernels, ssm_a, dt_bias, routers: small
            f.write(draw_tensor(s, rng, d).tobytes())
        else:
            pools.write(f, t, weight_std(s, d), n, rng)
        f.write(bytes(gguf.GGUFWriter.ggml_pad(n, align) - n))
        done += n
        if log is not None and done >= next_log:
            log(f"{done / 1e9:7.1f} / {data_size / 1e9:.1f} GB  "
                f"{done / 1e9 / (time.perf_counter() - t0):.2f} GB/s")
            next_log += PROGRESS_BYTES
    w.close()
    if log is not None:
        dt = time.perf_counter() - t0
        log(f"wrote {data_size / 1e9:.2f} GB of tensor data in {dt:.1f} s "
            f"({data_size / 1e9 / dt:.2f} GB/s)")
    return path


def write_preset(path: str | Path, preset: str = "qwen3.6-27b-mtp", sparse: bool = False,
                 seed: int = 0, layers: int | None = None, log=None) -> Path:
    """A preset's file (see :func:`preset_dims` for ``layers``, :func:`write_preset_dims`)."""
    d, mix = preset_dims(preset, layers)
    return write_preset_dims(path, d, mix, sparse=sparse, seed=seed, log=log)


def write_sparse_preset(path: str | Path, preset: str = "qwen3.6-27b-mtp") -> Path:
    """Header, metadata, tokenizer and tensor table of a full-size file; data left as a hole."""
    return write_preset(path, preset, sparse=True)


# ---------------------------------------------------------------- CLI

def parse_dims(text: str) -> dict:
    """``"n_embd=128,n_layer=4,tied=1"`` -> overrides for :class:`ModelDims`."""
    fields = {f.name: f.type for f in dataclasses.fields(ModelDims)}
    out: dict = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, _, value = item.partition("=")
        if key not in fields:
            raise ValueError(f"unknown dim {key!r}; known: {', '.join(fields)}")
        if key == "rope_sections":
            out[key] = tuple(int(v) for v in value.split(":"))
        elif key in ("rope_base", "rms_eps"):
            out[key] = float(value)
        elif key == "tied":
            out[key] = value.lower() in ("1", "true", "yes")
        elif key in ("arch", "name"):
            out[key] = value
        else:
            out[key] = int(value)
    return out


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):      # one line, no usage block
        _fail(message)


def _fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    ap = _Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--preset", choices=sorted(PRESETS),
                    help="a full-size Q4_K_M file: random weights with valid scales (~17 GB for "
                         "the 27B, ~22 GB for the 35B-A3B), written at about disk speed")
    ap.add_argument("--sparse", action="store_true",
                    help="with --preset: header and tensor table only, the data region a hole")
    ap.add_argument("--layers", type=int, metavar="N",
                    help="with --preset: only N trunk layers (same shapes; the MTP block stays; "
                         "4 = 3 GDN + 1 attention)")
    ap.add_argument("--arch", choices=ARCHS, help="a tiny model of this architecture")
    ap.add_argument("--mtp", action="store_true", help="qwen35, qwen35moe: append one MTP (NextN) block")
    ap.add_argument("--mix", choices=MIXES, default="f32", help="tiny models' quantization mix")
    ap.add_argument("--seed", type=int, default=0, help="weights (tiny models and --preset files)")
    ap.add_argument("--dims", default="", help="tiny models: overrides, e.g. n_embd=256,n_ff=512,n_layer=4")
    args = ap.parse_args(argv)
    if args.preset and args.arch:
        _fail("pass --preset or --arch, not both")
    if not args.preset and (args.sparse or args.layers is not None):
        _fail(f"{'--sparse' if args.sparse else '--layers'} needs --preset")
    if args.preset and (args.mtp or args.dims or args.mix != "f32"):
        _fail("--mtp, --mix and --dims are for --arch models; a preset fixes them")
    try:
        if args.preset:
            log = None if args.sparse else (lambda line: print(line, file=sys.stderr, flush=True))
            path = write_preset(args.out, args.preset, sparse=args.sparse, seed=args.seed,
                                layers=args.layers, log=log)
        elif args.arch:
            path = write_model(args.out, args.arch, mtp=args.mtp, mix=args.mix, seed=args.seed,
                               dims=parse_dims(args.dims))
        else:
            _fail("pass --preset NAME [--sparse] [--layers N] or --arch ARCH")
    except (ValueError, OSError) as e:
        _fail(str(e))
    print(path)


if __name__ == "__main__":
    main()
