"""The CPU side: matrices and FFN layers that stay quantized in the mmap'd file, run by the k-input
Numba kernels (one weight pass for all k rows of a batch), token embeddings gathered from the mmap,
and a MoE layer's routed experts grouped by expert.
"""
from __future__ import annotations

import numpy as np
import torch

from cpu_kernels.dequant import RowGather
from cpu_kernels.ffn import ffn_glu
from cpu_kernels.formats import format_of
from cpu_kernels.matvec import matvec

from ...files.gguf_file import GGUFFile
from .protocols import Placement


def cpu_f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(device="cpu", dtype=torch.float32).contiguous()


class CpuQuantLinear:
    """y = W x for k rows of x, W quantized in the mmap (ggml layout: one output row per row)."""

    def __init__(self, raw: np.ndarray, qtype: int, n_in: int, n_out: int, name: str = "",
                 exact: bool | None = None, residual: bool = False):
        format_of(qtype)    # fail at load time, naming the type, not at the first token
        self.raw, self.qtype, self.n_in, self.n_out, self.name = raw, qtype, n_in, n_out, name
        self.exact = exact  # float32 activations (True), int8 (False), matvec.EXACT_DEFAULT (None)
        self.residual = residual   # int8 activations take the second pass (residual_activations)
        self.nbytes = raw.nbytes

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        xc = cpu_f32(x)
        if out is None or out.device.type != "cpu":
            y = torch.empty(xc.shape[0], self.n_out, dtype=torch.float32)
        else:
            y = out
        matvec(self.raw, self.qtype, xc.numpy(), y.numpy(), exact=self.exact, residual=self.residual)
        if out is not None and y is not out:
            out.copy_(y)
            return out
        return y.to(x.device) if x.device.type != "cpu" else y


class CpuGluFFN:
    """A whole FFN layer (gate, up, down) in the mmap: the fused k-row Numba path."""
    placement = Placement.MMAP

    def __init__(self, gate: CpuQuantLinear, up: CpuQuantLinear, down: CpuQuantLinear, act: str):
        self.gate, self.up, self.down, self.act = gate, up, down, act
        self.nbytes = gate.nbytes + up.nbytes + down.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xc = cpu_f32(x)
        y = ffn_glu(xc.numpy(), self.gate.raw, self.gate.qtype, self.up.raw, self.up.qtype,
                    self.down.raw, self.down.qtype, act=self.act, exact=self.gate.exact,
                    down_residual=self.down.residual)
        y = torch.from_numpy(y)
        return y.to(x.device) if x.device.type != "cpu" else y


class RoutedExperts:
    """A MoE layer's routed experts, each a gated FFN bound where the plan put its layer.

    `experts(x, top_e, weights)` is sum_j weights[:, j] * expert_{top_e[:, j]}(x). The batch's tokens
    are grouped by expert: each touched expert runs once over the rows routed to it (on the CPU one
    k-input fused FFN, its weights read once for all of them), and every token adds its experts in
    ascending id order from zero, so a token's output bits do not depend on which other tokens share
    the batch (the k-input kernels are bit-stable across k)."""

    def __init__(self, experts: list):
        self.experts = experts
        self.placement = Placement.of(e.placement for e in experts)
        self.nbytes = sum(e.nbytes for e in experts)
        self.n_embd = experts[0].down.n_out

    def __call__(self, x: torch.Tensor, top_e: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape[0], self.n_embd, dtype=torch.float32, device=x.device)
        ids = top_e.cpu()       # which experts run is a host decision: one small copy, not one per expert
        picks = [(e, *(ids == e).nonzero(as_tuple=True)) for e in torch.unique(ids).tolist()]    # ascending
        if not picks:
            return out
        # every expert's (row, slot) pairs go back to x's device in one copy: on a GPU two small
        # pageable copies per expert were 16 host waits per layer between its kernel launches
        index = torch.cat([torch.stack((rows, slot)) for _, rows, slot in picks], dim=1).to(x.device)
        for (e, _, _), (rows, slot) in zip(picks, index.split([len(p[1]) for p in picks], dim=1)):
            out.index_add_(0, rows, self.experts[e](x[rows]) * weights[rows, slot, None])
        return out


class Embedding:
    """Token embedding rows gathered from the mmap (a step needs only k rows of it). Inside a step the
    plan's executor captures, the rows are gathered into its host buffer and copied up from there:
    the gather is a host job at every replay, reading the step's token ids from its buffer."""

    def __init__(self, gguf: GGUFFile, name: str, device: torch.device, executor=None):
        info = gguf.tensors[name]
        self.gather, self.device = RowGather(gguf.tensor_bytes(name), info.qtype, info.shape[0]), device
        self.executor, self.n_embd = executor, info.shape[0]

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.executor is None or not self.executor.capturing:
            # a pageable copy the host waits for: the next prompt chunk's gather cannot overwrite
            # rows a queued copy has not read yet (a replay waits on its stream before the gather)
            ids = tokens.to("cpu", torch.int64).numpy()
            return torch.from_numpy(self.gather(ids)).to(self.device)
        rows = self.executor.host_buffer("token_embd", tokens.shape[0], self.n_embd)
        self.executor.on_host(self._gather, tokens, rows, out=rows)
        return self.executor.to_device(rows, "token_embd")

    def _gather(self, tokens: torch.Tensor, rows: torch.Tensor) -> None:
        rows.copy_(torch.from_numpy(self.gather(tokens.to("cpu", torch.int64).numpy())))
