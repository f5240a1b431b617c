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

Confidence gate (`keep_draft`, installed as the draft picker's gate for model drafts): within a
step, each draft whose row the head has computed is kept only if the step's expected tokens per
second rise with it, its chance of acceptance read from its top-1 probability through a calibration
table learned online (acceptance per tenth of top-1 probability). A head that is right 25 % of the
time on average is right far more often where it is confident: those steps draft, the rest verify
one token. Which length is chosen then becomes a choice between plain steps and gated drafting
steps, compared by the tokens per second each has measured (a gated step may verify one token).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

DECAY = 0.9             # weight of the past in every running estimate (~10 steps of memory)
N_BINS = 10             # calibration table: top-1 probability in tenths
CONF_DECAY = 0.98       # the head's calibration changes slowly: ~50 judged drafts of memory


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
    gating: bool = False            # keep_draft is installed: drafting steps are gated
    bin_hits: list = field(default_factory=lambda: [0.0] * N_BINS)
    bin_trials: list = field(default_factory=lambda: [0.0] * N_BINS)
    gated_tokens: float = 0.0             # decayed sum of the tokens of gated drafting steps
    gated_s: float = 0.0                  # and of their seconds (draft + verify)
    step_tokens: float = 1.0              # the step being drafted: expected tokens so far
    step_prob: float = 1.0                # and the chance that every draft so far is accepted

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

    def accept_given(self, top1: float) -> float:
        """Estimated acceptance of a draft whose row's top-1 probability is top1 (prior: top1 itself,
        worth two judged drafts)."""
        b = min(int(top1 * N_BINS), N_BINS - 1)
        return (self.bin_hits[b] + 2 * (b + 0.5) / N_BINS) / (self.bin_trials[b] + 2)

    def keep_draft(self, i: int, top1: float) -> bool:
        """Gate for draft i (0-based) of this step: keep it iff the expected tokens per second of the
        step rise. Its row is already computed, so only the longer verify is weighed."""
        if i == 0:
            self.step_tokens, self.step_prob = 1.0, 1.0
        prob = self.step_prob * self.accept_given(top1)
        sunk = (i + 1) * (self.draft_s if self.draft_s is not None else 0.02 * self.verify_cost(1))
        before = self.step_tokens / (self.verify_cost(i + 1) + sunk)
        after = (self.step_tokens + prob) / (self.verify_cost(i + 2) + sunk)
        if after <= before:
            return False
        self.step_tokens, self.step_prob = self.step_tokens + prob, prob
        return True

    def choose(self) -> int:
        if self.n_max == 0:
            return 0
        if 1 not in self.verify_s and self.drafting_steps:
            # a plain step's cost is measured, not extrapolated: from a 4-token verify at 10 % per
            # token it looked 0.93x of it where it is ~0.5x, and drafting never stopped paying
            return 0
        best = max(range(self.n_max + 1), key=self.expected_rate)
        if self.gating:
            # gated drafting against plain steps, on what each has measured (untried: drafting)
            best = max(range(1, self.n_max + 1), key=self.expected_rate)
            if self.gated_s > 0.0 and self.gated_tokens / self.gated_s < 1.0 / self.verify_cost(1):
                best = 0
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

    def observe(self, n_proposed: int, n_accepted: int, verify_s: float, draft_s: float,
                conf: Sequence[float] = (), gated: bool = False) -> None:
        """One step: n_proposed drafts verified (k = n_proposed + 1 tokens), n_accepted kept; `conf`
        the top-1 probabilities of the proposed drafts and `gated` a further row turned down by
        keep_draft (both from a gated step)."""
        k = n_proposed + 1
        old = self.verify_s.get(k)
        self.verify_s[k] = verify_s if old is None else DECAY * old + (1 - DECAY) * verify_s
        for j, top1 in enumerate(conf[:n_accepted + 1]):     # drafts past the first rejection: unjudged
            b = min(int(top1 * N_BINS), N_BINS - 1)
            self.bin_hits = [CONF_DECAY * h for h in self.bin_hits]
            self.bin_trials = [CONF_DECAY * t for t in self.bin_trials]
            self.bin_hits[b] += j < n_accepted
            self.bin_trials[b] += 1
        rows = n_proposed + gated
        if self.gating and rows:
            # a ratio of decayed sums, not a decayed mean started at the first step: one turned-down
            # first step (1 token in a verify plus a draft) then weighed 90 % against every later
            # probe, and a head accepting 64 % of its drafts (1.28x plain at N = 1) was left
            # plain for the whole run; with sums, a second and third step count as much as the first
            self.gated_tokens = DECAY * self.gated_tokens + 1 + n_accepted
            self.gated_s = DECAY * self.gated_s + verify_s + draft_s
        if rows:
            per_draft = draft_s / rows
            self.draft_s = per_draft if self.draft_s is None else DECAY * self.draft_s + (1 - DECAY) * per_draft
        if n_proposed:
            self.accept_hits = DECAY * self.accept_hits + n_accepted
            self.accept_trials = DECAY * self.accept_trials + n_accepted + (n_accepted < n_proposed)
