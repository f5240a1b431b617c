"""A step over several sequences: which rows of the batch belong to which session, at which positions.

One forward reads every weight once for all its rows (the k-input kernels), so the sessions `serve`
runs side by side can share a step (issue 57). Rows are laid out sequence after sequence; the
matrices run over all of them at once, and only rotary, the KV writes and the attention go sequence
by sequence, each on its own cache at its own positions (models.base.Model.forward_batch).

Exactness rests on two facts. A row's result from the projections, norms and activations does not
depend on the other rows of the call (the kernels' bit identity across k: cpu_kernels/matvec_int.py's
"numerics" block, layer_fused.py's docstring). And the numerics a row gets do depend on the size of
the call in one way: a forward of more than ROWWISE_MAX rows is a prompt batch (the torch block
path, one int8 pass on the activations instead of two), of at most ROWWISE_MAX rows a decode or
verify batch (the fused kernels, the residual pass). So a shared forward holds at most ROWWISE_MAX
rows, and a sequence that brings more (a prompt chunk) runs alone, as it would in `Session.eval`
(`pack_rows`).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from gpu_kernels.attention import ROWWISE_MAX


@dataclass(frozen=True)
class BatchSeq:
    """One sequence's part of a batch: its session's state (models.common.ModelState), the
    position of its first row, and its number of rows."""
    state: object
    start: int
    n: int

    @property
    def positions(self) -> list[int]:
        return list(range(self.start, self.start + self.n))


@dataclass(frozen=True)
class StepBatch:
    """The sequences of one forward, their rows laid out one sequence after another."""
    seqs: tuple[BatchSeq, ...]

    def __post_init__(self):
        if not self.seqs or any(s.n < 1 for s in self.seqs):
            raise ValueError("a batch needs at least one sequence, each with at least one row")
        if len({id(s.state) for s in self.seqs}) != len(self.seqs):
            raise ValueError("a sequence appears twice in one batch")

    @cached_property
    def rows(self) -> tuple[slice, ...]:
        """Each sequence's rows of the batch."""
        out, lo = [], 0
        for s in self.seqs:
            out.append(slice(lo, lo + s.n))
            lo += s.n
        return tuple(out)

    @property
    def n_rows(self) -> int:
        return self.rows[-1].stop


def pack_rows(counts: list[int], max_rows: int = ROWWISE_MAX) -> list[list[int]]:
    """Sequence indices grouped into forwards: a sequence of more than max_rows rows alone (the
    prompt path it takes alone), the others first-fit, in order, into groups of at most max_rows rows
    (the decode / verify path each takes alone). Every index appears once."""
    groups: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(counts):
        if n > max_rows:
            groups.append([i])
            room.append(0)
            continue
        for g, free in enumerate(room):
            if free >= n:
                groups[g].append(i)
                room[g] -= n
                break
        else:
            groups.append([i])
            room.append(max_rows - n)
    return groups
