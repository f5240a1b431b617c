"""What every architecture provides, and the plumbing they share (loading weights, logits)."""
from __future__ import annotations

import functools
import math
from typing import Protocol

import numpy as np
import torch

from gpu_kernels.attention import ROWWISE_MAX

from ..runtime.backends import WeightBinder
from ..errors import UserError
from ..files.gguf_file import GGUFFile
from ..runtime.kv_cache import KVCache, cache_dtype, kv_cache_type
from ..runtime.session import Session
from .arch_spec import ArchSpec
from .common import Layer, ModelState


def _one_value(gguf: GGUFFile, key: str, default: int | None = None) -> int:
    """A head count or size, which llama.cpp also accepts as one value per layer (the planner reads
    such arrays, model_profile._per_layer): the layers here all share one, so an array must hold a
    single value (0 entries: layers without attention)."""
    value = gguf.get(key, default)
    if value is None:
        raise UserError(f"missing {gguf.arch}.{key}")
    if isinstance(value, (np.ndarray, list)):
        values = {int(v) for v in value} - {0}
        if len(values) != 1:
            raise UserError(f"{gguf.arch}.{key} differs between layers ({sorted(values)}); "
                            f"hybridrt needs one value for every layer")
        return values.pop()
    return int(value)


class MTPHead(Protocol):
    """An MTP (NextN) head: drafts the token after next from (token t_j, the trunk's final hidden of
    position j - 1), with a KV cache of its own kept in the session's state. Three play the role: a
    qwen35 file's built-in block (`models.qwen35.NextNHead`), a trained head from `train-mtp`
    (`mtp_head.TrainedMTPHead`), and the built-in one over a reduced vocabulary
    (`speculative.draft_vocab.SequenceDraftHead`); `speculative.draft_mtp.MTPSource` drafts with
    any of them. Logits row i is token draft_ids[i] (None: token i)."""
    n_out: int                                  # logits rows a draft computes now
    max_out: int                                # rows a logits buffer must hold (a growing vocabulary's most)
    draft_ids: torch.Tensor | None = None       # token id of each row; None: the full vocabulary

    def step(self, state, tokens: torch.Tensor, hidden: torch.Tensor, start_pos: int, logits: bool = True,
             out: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """tokens [n] at positions [start_pos, +n), each with the hidden of the position before it
        (the trunk's, or the previous step's output for a chained draft); writes the head's KV
        there. Returns (logits [n, n_out] or None, the head's output hidden [n, n_embd])."""

    def draft(self, state, tokens: torch.Tensor, hidden: torch.Tensor, start_pos: int,
              out: torch.Tensor) -> torch.Tensor:
        """step(), the last token's logits into out [1, >= n_out]; returns its output hidden [1, n_embd]."""

    def write_kv(self, state, tokens: torch.Tensor, hidden: torch.Tensor, start_pos: int) -> None:
        """Only the KV rows step() writes for these tokens, the same values (a catch-up on committed
        tokens, whose outputs nobody reads)."""

    def head(self, normed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits rows [n, n_out] of output hiddens."""


class Model:
    """A loaded architecture. Subclasses point `spec` at their arch_spec.ARCH_SPECS entry, build
    `layers` in `__init__` and implement `forward(state, tokens, start_pos) -> hidden` returning the
    final-normed hidden states."""

    spec: ArchSpec
    layers: list[Layer]
    n_attention_layers: int      # KV cache layers
    # set by the loader, never read here: who runs a step (hybridrt.runtime.executor) and the plan it follows
    executor = None
    plan = None
    mtp: MTPHead | None = None   # the head draft-mtp drafts with: built in (qwen35), or --mtp-head's

    def __init__(self, gguf: GGUFFile, binder: WeightBinder):
        self.gguf, self.binder, self.device = gguf, binder, binder.device
        self.n_embd = int(gguf.get("embedding_length"))
        self.n_layer = int(gguf.get("block_count")) - int(gguf.get("nextn_predict_layers", 0) or 0)
        self.eps = float(gguf.get("attention.layer_norm_rms_epsilon", 1e-6))
        self.n_ctx_train = int(gguf.get("context_length", 4096))
        # attention shape (every architecture here has attention layers; KV caches are sized from it)
        self.n_head = _one_value(gguf, "attention.head_count")
        self.n_kv = _one_value(gguf, "attention.head_count_kv", self.n_head)
        self.head_dim = _one_value(gguf, "attention.key_length", self.n_embd // self.n_head)
        self.head_dim_v = _one_value(gguf, "attention.value_length", self.head_dim)
        self.tok_embd = binder.embedding("token_embd.weight")
        self.embed_scale = math.sqrt(self.n_embd) if self.spec.scaled_embedding else 1.0
        self.output_norm = binder.dense("output_norm.weight")
        # one compiled call on a plain CPU trunk: torch's seven ops took ~75 us of a SmolLM2 step
        # (~5 ms) right after the layers had streamed their weights through the caches, this ~22
        self.norm = binder.norm_kernel()
        head = "output.weight" if binder.has("output.weight") else "token_embd.weight"
        self.output = binder.linear(head)
        self.n_vocab = self.output.n_out

    @property
    def arch(self) -> str:
        return self.spec.name

    # --- text and sessions -----------------------------------------------------------------
    @functools.cached_property
    def tokenizer(self):
        from ..files.tokenizer import Tokenizer

        return Tokenizer.from_gguf(self.gguf.metadata)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode(list(ids))

    def session(self, n_ctx: int | None = None, cache_type: str | None = None, k_max: int | None = None) -> Session:
        """A new sequence: its own KV cache (+ recurrent state and snapshot ring). The cache type and
        the largest verify batch default to the plan's for a placed model, else f32 and 4."""
        planned = self.plan.options if self.plan is not None else None
        if cache_type is None:
            cache_type = kv_cache_type(planned.cache_type_k, planned.cache_type_v) if planned else "f32"
        if k_max is None:
            k_max = planned.batch if planned else 4
        return Session(self, n_ctx, cache_type, k_max)

    # --- state -------------------------------------------------------------------------------
    def new_state(self, n_ctx: int, cache_type: str = "f32", k_max: int = 4) -> ModelState:
        kv = KVCache(self.n_attention_layers, n_ctx, self.n_kv, self.head_dim, self.head_dim_v,
                     cache_dtype(cache_type), self.device)
        return ModelState(n_ctx=n_ctx, kv=kv)

    def truncate_state(self, state: ModelState, n: int) -> None:
        """Forget everything after the first n tokens (attention needs nothing: positions >= n
        are simply overwritten before they are read again)."""

    # --- compute -----------------------------------------------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        e = self.tok_embd(tokens)
        return e * self.embed_scale if self.spec.scaled_embedding else e

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h, self.output_norm, self.eps)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.output(hidden, out=out)

    def begin_step(self, state: ModelState, start_pos: int, n: int) -> bool:
        """The host's bookkeeping of a forward of n tokens at start_pos, apart from its device work
        (a replayed step graph runs it, then the graph): none for attention-only trunks."""
        return True

    def forward(self, state: ModelState, tokens: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Attention-only trunks (a recurrent one overrides it): each half is h + f(norm(h)), its
        norm and residual included."""
        pos_list = list(range(start_pos, start_pos + tokens.shape[0]))
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer.ffn(layer.mixer(h, state, pos_list))
        return self.final_norm(h)

    def forward_batch(self, batch, tokens: torch.Tensor) -> torch.Tensor:
        """forward() of several sequences in one step (runtime.batch.StepBatch; tokens: its rows, one
        sequence after another): every matrix runs once over all the rows, rotary, the KV writes and
        attention (and a recurrent layer's conv and recurrence) sequence by sequence on its own
        state (batched_layers). A row's result is the one forward() gives it alone, bit for bit,
        while the batch holds at most ROWWISE_MAX rows: more would make it a prompt batch, whose
        numerics are another path's (runtime/batch.py). A placed model batches alike: its device
        kernels give a row the bits it gets alone in any batch of up to ROWWISE_MAX rows (what its
        verify batches already rest on: gpu_kernels/qlinear.py, triton_matvec.py), and its CPU FFN
        layers are the same k-input kernels."""
        if tokens.shape[0] != batch.n_rows:
            raise ValueError(f"{tokens.shape[0]} tokens for a batch of {batch.n_rows} rows")
        if len(batch.seqs) == 1:
            seq = batch.seqs[0]
            return self.forward(seq.state, tokens, seq.start)
        if batch.n_rows > ROWWISE_MAX:
            raise ValueError(f"a batch of {batch.n_rows} rows: sequences share a step of at most {ROWWISE_MAX} rows")
        return self.final_norm(self.batched_layers(batch, self.embed(tokens)))

    def batched_layers(self, batch, h: torch.Tensor) -> torch.Tensor:
        """The layers over several sequences' embedded rows (forward()'s loop; a recurrent trunk
        overrides it): each half's `batched`."""
        for layer in self.layers:
            h = layer.ffn(layer.mixer.batched(h, batch))
        return h

    # --- description for the planner / bench ---------------------------------------------------
    @property
    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads (all matrices once + embedding row)."""
        return sum(t.nbytes for name, t in self.gguf.tensors.items()
                   if name != "token_embd.weight" or not self.binder.has("output.weight"))
