"""Adaptive draft length: how many drafts to propose this step, from what the run has measured.

Proposing n drafts costs one verify of n + 1 tokens plus n draft steps, and yields 1 + a + ... + a^n
tokens on average for a per-draft acceptance a (draft i counts only if drafts 1..i all do). So the
length that maximizes tokens per second is

    argmax over n in 0..n_max of  (1 + a + ... + a^n) / (t_verify(n + 1) + n t_draft)

with a, t_verify(k) and t_draft estimated online. n = 0 is a plain decode step: a draft source
that stops paying (an adversarial prompt) costs little more than plain decoding. Greedy output does
not depend on the length chosen, only the speed does.

Estimates: a step that proposed n drafts and kept m gives m successes and, when m < n, one failure
(drafts after the first rejection were never judged); a is their exponentially weighted ratio.
t_verify(k) is an exponentially weighted mean per k; a k never measured is extrapolated from the
nearest measured one at the measured per-token slope (or 10 % of a token's cost per extra token
before two sizes are known: a memory-bound verify of k tokens reads the weights once). t_draft is
the weighted mean per proposed draft. While n = 0 is chosen nothing about drafts is learned, so
every `probe_every` plain steps one step proposes a single draft; and every `explore_every` drafting
steps one tries a length next to the best, so the cost curve is measured around where it is used.
"""
from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.9             # weight of the past in every running estimate (~10 steps of memory)


@dataclass
class DraftLengthPolicy:
    n_max: int
    prior_accept: float = 0.6
    probe_every: int = 16
    explore_every: int = 8
    accept_hits: float = 0.0
    accept_trials: float = 0.0
    verify_s: dict[int, float] = field(default_factory=dict)     # k -> weighted mean seconds
    draft_s: float | None = None                                   # seconds per proposed draft
    plain_streak: int = 0
    drafting_steps: int = 0

    @property
    def acceptance(self) -> float:
        # the prior counts as two trials, so a couple of steps move it but not all the way
        return (self.accept_hits + 2 * self.prior_accept) / (self.accept_trials + 2)

    def verify_cost(self, k: int) -> float:
        known = sorted(self.verify_s)
        if not known:
            return 1.0 + 0.1 * (k - 1)      # relative units: only the shape matters before data
        if k in self.verify_s:
            return self.verify_s[k]
        lo = max((q for q in known if q < k), default=None)
        hi = min((q for q in known if q > k), default=None)
        if lo is not None and hi is not None:         # interpolate
            w = (k - lo) / (hi - lo)
            return (1 - w) * self.verify_s[lo] + w * self.verify_s[hi]
        if len(known) >= 2:
            a, b = known[0], known[-1]
            slope = max(0.0, (self.verify_s[b] - self.verify_s[a]) / (b - a))
        else:
            slope = 0.1 * self.verify_s[known[0]] / known[0]
        near = lo if lo is not None else hi
        return max(1e-9, self.verify_s[near] + slope * (k - near))

    def expected_rate(self, n: int) -> float:
        """Expected tokens per second (or per unit of cost before timings exist) when proposing n."""
        a = self.acceptance
        tokens = sum(a ** i for i in range(n + 1))
        draft = self.draft_s if self.draft_s is not None else 0.02 * self.verify_cost(1)
        return tokens / (self.verify_cost(n + 1) + n * draft)

    def choose(self) -> int:
        if self.n_max == 0:
            return 0
        best = max(range(self.n_max + 1), key=self.expected_rate)
        if best == 0:
            self.plain_streak += 1
            if self.plain_streak >= self.probe_every:
                self.plain_streak = 0
                return 1
            return 0
        self.plain_streak = 0
        self.drafting_steps += 1
        if self.drafting_steps % self.explore_every == 0:       # a neighbour, alternately up and down
            up = (self.drafting_steps // self.explore_every) % 2 == 1
            return min(best + 1, self.n_max) if up or best == 1 else best - 1
        return best

    def observe(self, n_proposed: int, n_accepted: int, verify_s: float, draft_s: float) -> None:
        k = n_proposed + 1
        old = self.verify_s.get(k)
        self.verify_s[k] = verify_s if old is None else DECAY * old + (1 - DECAY) * verify_s
        if n_proposed:
            per_draft = draft_s / n_proposed
            self.draft_s = per_draft if self.draft_s is None else DECAY * self.draft_s + (1 - DECAY) * per_draft
            self.accept_hits = DECAY * self.accept_hits + n_accepted
            self.accept_trials = DECAY * self.accept_trials + n_accepted + (n_accepted < n_proposed)
