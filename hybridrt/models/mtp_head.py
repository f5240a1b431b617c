"""A trained MTP (NextN) head in a GGUF of its own, loaded next to a target that has none.

`hybridrt train-mtp` writes it; `load_model(..., mtp_head=PATH)` (`--mtp-head`) binds it as
`model.mtp`, and `speculative.draft_mtp.MTPSource` drafts with it through the same `step` / `head`
calls it makes on qwen35's built-in head.

The block is qwen35's NextN layout with a block of the target's own kind:
  e = RMSNorm(embed(t); enorm), hn = RMSNorm(h; hnorm), x = eh_proj [e ; hn],
  x = block(x)  (the target's attention + FFN layer shape, attention over the head's own KV),
  logits = head(RMSNorm(x; head_norm))
where h is the target's final-normed hidden of the position before t. The output layer may cover
only a draft vocabulary (`mtp_head.draft_vocab`, token ids): drafts are then only ever those
tokens, and `MTPSource` maps the head's row index back to the token id.

Tensor names: mtp.{enorm,hnorm,eh_proj,head_norm,head}.weight and the block's own names under the
`mtp` prefix (attn_norm, attn_q/k/v/output, attn_q_norm/attn_k_norm, ffn_norm, ffn_gate/up/down,
and gemma3's post_attention_norm / post_ffw_norm).
"""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np
import torch


from ..runtime.backends import WeightBinder
from ..errors import UserError
from ..files.gguf_file import GGUFError, GGUFFile
from ..runtime.kv_cache import KVCache
from .arch_spec import ARCH_SPECS, ArchSpec
from .base import MTPHead
from .common import AttentionSpec, ModelState, attention_block, ffn_block

HEAD_ARCH = "mtp_head"
PREFIX = "mtp"
HEAD_STATE_KEY = "mtp_head_state"    # ModelState.extra entry holding the head's own state (its KV cache)


def head_target(arch: str) -> ArchSpec:
    """The target's ArchSpec, whose block the head carries (activation, norms: the target's own),
    if train-mtp can make a head for it (ArchSpec.mtp_target)."""
    spec = ARCH_SPECS.get(arch)
    if spec is None or not spec.mtp_target:
        supported = [name for name, s in ARCH_SPECS.items() if s.mtp_target]
        raise UserError(f"train-mtp / --mtp-head: {arch} targets are not supported "
                        f"(one of: {', '.join(supported)})")
    return spec


def head_attention_spec(model) -> tuple[int, AttentionSpec]:
    """The index and attention spec of the target's last full-context attention layer: the layer the
    head's block copies its shape (and its initial weights) from."""
    for i in reversed(range(len(model.layers))):
        attn = model.layers[i].attention
        if attn is not None and attn.spec.window == 0:
            return i, dataclasses.replace(attn.spec, first_pos=1)
    raise UserError(f"{model.arch}: no full-attention layer to build an MTP head from")


def target_fingerprint(gguf: GGUFFile) -> str:
    """sha256 of the output matrix's bytes (the token embedding when it is tied): what the head's
    draft logits are trained against, so a head refuses any other target's weights."""
    name = "output.weight" if "output.weight" in gguf.tensors else "token_embd.weight"
    return hashlib.sha256(gguf.tensor_bytes(name).tobytes()).hexdigest()


class TrainedMTPHead(MTPHead):
    """The loaded head: `step` writes its KV and returns its output hidden, `head` its logits over
    the draft vocabulary (`draft_ids[i]` is row i's token; None: the full vocabulary)."""

    def __init__(self, w: WeightBinder, model, kind: ArchSpec, spec: AttentionSpec,
                 draft_ids: torch.Tensor | None):
        p = PREFIX
        self.model, self.kind, self.eps = model, kind, model.eps
        self.enorm = w.dense(f"{p}.enorm.weight")
        self.hnorm = w.dense(f"{p}.hnorm.weight")
        self.eh_proj = w.linear(f"{p}.eh_proj.weight")
        # the block's two halves as the target's layers run them: one fused call each on a CPU
        # trunk (the binder's choice), else torch ops
        self.attn_half = attention_block(w, p, spec, 0, kind.attn_post_norm)
        self.ffn_half = ffn_block(w, p, kind.act, model.eps, kind.ffn_post_norm)
        self.head_norm = w.dense(f"{p}.head_norm.weight")
        self.norm = w.norm_kernel()     # a draft's three norms are most of its small ops' time
        self.output = w.linear(f"{p}.head.weight")
        self.spec, self.draft_ids = spec, draft_ids
        self.n_out = self.max_out = self.output.n_out
        # the whole step as one compiled call where every part above runs fused (None otherwise);
        # gemma3 scales its embedding rows (embed_scale), the other targets do not
        self.fused = w.mtp_step(model.tok_embd, model.embed_scale, self.enorm, self.hnorm,
                                self.eh_proj, self.attn_half, self.ffn_half, self.head_norm, self.output, self.eps)

    def _head_state(self, state: ModelState) -> ModelState:
        """The head's own state (its KV cache, the session's rotary tables), kept with the session's
        state (qwen35 sessions already make the cache): made once, so the fused attention half's
        views of it are too."""
        head_state = state.extra.get(HEAD_STATE_KEY)
        if head_state is None:
            kv = getattr(state, "mtp_kv", None)
            if kv is None:
                s = self.spec
                kv = KVCache(1, state.n_ctx, s.n_kv, s.head_dim, s.head_dim_v, torch.float32, self.model.device)
            head_state = ModelState(n_ctx=state.n_ctx, kv=kv, rope=state.rope, rope_rows=state.rope_rows)
            state.extra[HEAD_STATE_KEY] = head_state
        return head_state

    def step(self, state: ModelState, tokens: torch.Tensor, hidden: torch.Tensor, start_pos: int,
             logits: bool = True, out: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """As qwen35's NextNHead.step: tokens at [start_pos, +n) with the hidden of the position before
        each; returns (logits or None, the head's output hidden for chaining)."""
        pos_list = list(range(start_pos, start_pos + tokens.shape[0]))
        x = self.ffn_half(self.attn_half(self._input(tokens, hidden), self._head_state(state), pos_list))
        normed = self.norm(x, self.head_norm, self.eps)
        return (self.head(normed, out=out) if logits else None), normed

    def draft(self, state: ModelState, tokens: torch.Tensor, hidden: torch.Tensor, start_pos: int,
              out: torch.Tensor) -> torch.Tensor:
        """step() for the tokens, and the logits of the last one's row into out [1, n_out] (what a
        draft proposes from); returns the last token's output hidden [1, n_embd] (a chained draft's
        input). One compiled call where the head runs fused (FusedMTPStep), else step() and head()."""
        if self.fused is not None:
            normed = self.fused(self._head_state(state), tokens, hidden, start_pos, out)
            if normed is not None:
                return normed[-1:]
        _, h = self.step(state, tokens, hidden, start_pos, logits=False)
        self.head(h[-1:], out=out)
        return h[-1:]

    def write_kv(self, state: ModelState, tokens: torch.Tensor, hidden: torch.Tensor, start_pos: int) -> None:
        """Only the head KV that step() writes for these tokens (the same values): a catch-up on
        committed tokens needs no more. Their FFN half, attention and outputs were ~5x the work
        (Gemma 3: the head's upkeep over a run of plain steps was ~2 % of the run)."""
        pos_list = list(range(start_pos, start_pos + tokens.shape[0]))
        self.attn_half.write_kv(self._input(tokens, hidden), self._head_state(state), pos_list)

    def _input(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """eh_proj [enorm(embed(tokens)) ; hnorm(hidden)]: the block's input rows."""
        e = self.norm(self.model.embed(tokens), self.enorm, self.eps)
        hn = self.norm(hidden, self.hnorm, self.eps)
        return self.eh_proj(torch.cat((e, hn), dim=-1))

    def head(self, normed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.output(normed, out=out)


# q4_1: half a q8_0 head's bytes; a draft right after a decode step reads them from memory
# (SmolLM2's head: 9.6 -> 7.7 % of a plain step, e94d4b6)
HEAD_TYPES = {"f32": "F32", "f16": "F16", "q8_0": "Q8_0", "q4_1": "Q4_1"}


def write_head(path: str | Path, tensors: dict[str, np.ndarray], target: GGUFFile, n_vocab: int,
               draft_ids: np.ndarray | None, head_type: str = "q8_0", extra: dict | None = None) -> Path:
    """Write a head GGUF: `tensors` maps names under the `mtp` prefix to float32 arrays in numpy
    order ([rows, row length]); matrices are stored as `head_type` (norms stay F32)."""
    import gguf
    from gguf import quants

    qtype = gguf.GGMLQuantizationType[HEAD_TYPES[head_type]]
    w = gguf.GGUFWriter(str(path), HEAD_ARCH)
    target_name = target.get("general.name", Path(target.path).name)
    w.add_name(f"MTP head for {target_name}")
    w.add_string(f"{HEAD_ARCH}.target.architecture", target.arch)
    w.add_uint32(f"{HEAD_ARCH}.target.n_embd", int(target.get("embedding_length")))
    w.add_uint32(f"{HEAD_ARCH}.target.n_vocab", int(n_vocab))
    w.add_string(f"{HEAD_ARCH}.target.fingerprint", target_fingerprint(target))
    w.add_string(f"{HEAD_ARCH}.target.file", Path(target.path).name)
    if draft_ids is not None:
        w.add_array(f"{HEAD_ARCH}.draft_vocab", [int(i) for i in draft_ids])
    for key, value in (extra or {}).items():
        if isinstance(value, str):
            w.add_string(f"{HEAD_ARCH}.train.{key}", value)
        elif isinstance(value, float):
            w.add_float32(f"{HEAD_ARCH}.train.{key}", value)
        else:
            w.add_uint32(f"{HEAD_ARCH}.train.{key}", int(value))
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name], dtype=np.float32)
        if a.ndim < 2 or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, a)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def _meta(f: GGUFFile, key: str):
    value = f.metadata.get(f"{HEAD_ARCH}.{key}")
    if value is None:
        raise UserError(f"--mtp-head {f.path}: not an MTP head file (no {HEAD_ARCH}.{key}); "
                        f"write one with `hybridrt train-mtp`")
    return value


def load_mtp_head(model, path: str | Path, tensor_devices: dict[str, str] | None = None) -> TrainedMTPHead:
    """Bind the head at `path` to `model`, refusing a head trained for another target."""
    try:
        f = GGUFFile(path)
    except (OSError, GGUFError) as exc:
        raise UserError(f"--mtp-head {path}: {exc}") from None
    if f.arch != HEAD_ARCH:
        raise UserError(f"--mtp-head {path}: not an MTP head file (architecture '{f.arch}'); "
                        f"write one with `hybridrt train-mtp`")
    target = {"architecture": str(_meta(f, "target.architecture")),
              "n_embd": int(_meta(f, "target.n_embd")),
              "n_vocab": int(_meta(f, "target.n_vocab")),
              "fingerprint": str(_meta(f, "target.fingerprint"))}
    have = {"architecture": model.arch, "n_embd": model.n_embd, "n_vocab": model.n_vocab,
            "fingerprint": target_fingerprint(model.gguf)}
    for key, want in target.items():
        if have[key] != want:
            what = f"{want[:12]}..." if key == "fingerprint" else want
            got = f"{have[key][:12]}..." if key == "fingerprint" else have[key]
            raise UserError(f"--mtp-head {path} was trained for another target: its {key} is {what}, "
                            f"the model's is {got}")
    kind = head_target(model.arch)
    _, spec = head_attention_spec(model)
    ids = f.metadata.get(f"{HEAD_ARCH}.draft_vocab")
    draft_ids = torch.from_numpy(np.asarray(ids, dtype=np.int64).copy()) if ids is not None else None
    # the fused kernels' types: the target's and the head's together, so a head whose types the
    # target already has (q8_0 heads on most files) runs the target's compiled layer kernels
    head_types = [info.qtype for info in f.tensors.values() if len(info.shape) >= 2]
    # one int8 pass on the head's activations (llama.cpp's numerics), whatever the target takes: a
    # draft's rounding only changes which tokens it proposes, never what is committed (verify
    # decides), and the second pass was ~20 % of a draft (SmolLM2: 1.135x against 1.115x at N = 1,
    # acceptance alike, 2e3497a)
    # it binds outside the target's plan: its matrices run in place, never through the executor
    config = dataclasses.replace(model.binder.config.without_plan(), act_residual=False)
    binder = WeightBinder(f, model.device, tensor_devices, device_dtype=model.binder.device_dtype, config=config,
                          fused_qtypes=model.binder.layer_qtypes() + head_types)
    head = TrainedMTPHead(binder, model, kind, spec, draft_ids)
    want_rows = len(draft_ids) if draft_ids is not None else model.n_vocab
    if head.n_out != want_rows:
        raise UserError(f"--mtp-head {path}: output layer has {head.n_out} rows for {want_rows} draft tokens")
    return head
