"""The acceptance rule: which drafted tokens the target keeps, and the token that follows them.

Greedy (temp 0): a draft is kept while it equals the target's argmax, so the output is exactly
plain greedy decoding. Sampled (temp > 0): exact speculative sampling (Leviathan et al. 2023,
Chen et al. 2023). With p the target's and q the draft's transformed distribution at a position,
the draft x is kept with probability min(1, p(x) / q(x)); the first rejection is replaced by a
sample of norm(max(0, p - q)); when every draft is kept a bonus token is sampled from p at the
last position. Every emitted token is then distributed exactly as plain sampling from p.

p and q are both `sampling.filtered_probs` of their logits under the same SamplerConfig, so the
temperature / top-k / top-p / min-p transforms are identical on both sides. A deterministic
draft (n-gram lookup, argmax) has q = one-hot: keep with probability p(x), residual p minus x.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import SamplerConfig, argmax_rows, filtered_probs
from .draft import Draft


@dataclass
class Verdict:
    n_accepted: int      # drafts kept (a prefix of the proposal)
    next_token: int      # the correction after a rejection, or the bonus token: next step's certain token


def accept_greedy(logits: torch.Tensor, drafts: list[int]) -> Verdict:
    """logits [n + 1, V]: rows 0..n-1 verify drafts[0..n-1]; row n follows the last draft."""
    argmax = argmax_rows(logits[:len(drafts) + 1])
    for i, d in enumerate(drafts):
        if argmax[i] != d:
            return Verdict(i, argmax[i])
    return Verdict(len(drafts), argmax[len(drafts)])


class SampledAcceptor:
    """Exact speculative sampling. Holds one vocabulary-sized scratch row, reused every step, to
    look up q at the target's candidate ids without allocating per step."""

    def __init__(self, n_vocab: int, cfg: SamplerConfig, gen: torch.Generator):
        self.cfg, self.gen = cfg, gen
        self._q_dense = torch.zeros(n_vocab, dtype=torch.float32)

    def __call__(self, logits: torch.Tensor, draft: Draft) -> Verdict:
        n = len(draft)
        p_ids, p_probs = filtered_probs(logits[:n + 1], self.cfg)
        self.last_p = (p_ids[n], p_probs[n])      # the last row's p, for `acceptance_chance`
        for i, x in enumerate(draft.tokens):
            p_x = float(p_probs[i][p_ids[i] == x].sum())
            q_x = 1.0 if draft.q_ids is None else float(draft.q_probs[i][draft.q_ids[i] == x].sum())
            # u < p/q with u in [0, 1): q_x > 0 always holds since x was drawn from q
            if q_x * float(torch.rand((), generator=self.gen)) < p_x:
                continue
            return Verdict(i, self._sample_residual(p_ids[i], p_probs[i], draft, i, x))
        return Verdict(n, self._sample(p_ids[n], p_probs[n]))

    def acceptance_chance(self, q_ids: torch.Tensor, q_probs: torch.Tensor) -> float:
        """Chance that a draft drawn from q at the last call's last row would have been kept:
        sum over x of q(x) min(1, p(x) / q(x)) = sum of min(p, q). Draws nothing."""
        p_ids, p_probs = self.last_p
        self._q_dense.index_copy_(0, q_ids, q_probs)
        chance = float(torch.minimum(p_probs, self._q_dense[p_ids]).sum())
        self._q_dense.index_fill_(0, q_ids, 0.0)
        return chance

    def _sample(self, ids: torch.Tensor, probs: torch.Tensor) -> int:
        return int(ids[torch.multinomial(probs, 1, generator=self.gen)])

    def _sample_residual(self, p_ids: torch.Tensor, p_probs: torch.Tensor, draft: Draft, i: int, x: int) -> int:
        # max(0, p - q) is zero wherever p is, so the target's candidates are its whole support
        if draft.q_ids is None:
            residual = p_probs.masked_fill(p_ids == x, 0.0)
        else:
            q_ids = draft.q_ids[i]
            self._q_dense.index_copy_(0, q_ids, draft.q_probs[i])
            residual = (p_probs - self._q_dense[p_ids]).clamp_(min=0.0)
            self._q_dense.index_fill_(0, q_ids, 0.0)
        if not float(residual.sum()) > 0.0:
            # only reachable through rounding (a rejection implies p(y) > q(y) somewhere)
            residual = p_probs.masked_fill(p_ids == x, 0.0) if p_probs.numel() > 1 else p_probs
        return self._sample(p_ids, residual)


def sample_and_match(logits: torch.Tensor, draft: Draft, cfg: SamplerConfig, gen: torch.Generator) -> Verdict:
    """llama.cpp server's rule, for comparison only: sample the target at each position and keep
    the draft while it equals the sample. Exact, but accepts less often than `SampledAcceptor`."""
    ids, probs = filtered_probs(logits[:len(draft) + 1], cfg)
    for i, x in enumerate(draft.tokens):
        t = int(ids[i][torch.multinomial(probs[i], 1, generator=gen)])
        if t != x:
            return Verdict(i, t)
    n = len(draft)
    return Verdict(n, int(ids[n][torch.multinomial(probs[n], 1, generator=gen)]))
