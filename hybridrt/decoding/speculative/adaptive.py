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
t_verify(k) is the median of its last RECENT_TIMES measurements per k (a weighted mean let one
stalled step of a shared machine move t(1) by ~20 %, enough to make drafts that were never accepted
look as if they paid); a k never measured is extrapolated from the nearest measured one at the
measured per-token slope (or 10 % of a token's cost per extra token before two sizes are known: a
memory-bound verify of k tokens reads the weights once); and no t_verify(k) is below a shorter
verify's. t_draft is the weighted mean per proposed draft. The first timing of each verify size
and of the drafts is dropped: in a fresh process it includes loading the kernels' machine code. While drafting barely pays on the
estimates (less than REFRESH_GAIN) or t(1) is above the chosen verify's, a t(1) older than
REFRESH_STEPS steps is measured again by a plain step, which replaces its old timings: otherwise an
estimate too high from a slow stretch is never corrected, as no step verifies one token (a t(1) of
one or two timings above a longer verify's is measured again at once). While n = 0 is chosen
nothing about drafts is learned, so a plain stretch lasts until, after `probe_every` plain steps,
one step proposes a single draft (then after twice as many, up to four times, while plain steps
keep winning); and every `explore_every` drafting steps one tries a length next to the best, so
the cost curve is measured around where it is used.

Shared steps (serve's continuous batching): a step that runs with `others` other sequences gives
them a token each too, and its time is the shared forward's. Expected rates count their tokens (a
draft pays only for what it adds to all of them), and verify costs are kept per sharing level
(`share`).

Confidence gate (`keep_draft`, installed as the draft picker's gate for model drafts): within a
step, each draft whose row the head has computed is kept only if the step's expected tokens per
second rise with it, its chance of acceptance read from its top-1 probability through a calibration
table learned online (acceptance per tenth of top-1 probability, from every judged draft, the
turned-down ones included: the loop judges those against the verify's last row). A head that is
right 25 % of the time on average is right far more often where it is confident: those steps draft,
the rest verify one token. A chained row is not even computed (`worth_row`, the picker's `worth`)
unless the step's expected rate is higher with it than without, over the top-1 probabilities
chained rows have shown. Whether to compute a first row at
all is then the choice between plain
and gated steps, made on the same model rather than on measured step rates: over the first rows'
top-1 probabilities of recent steps, the expected gain of what the gate would do with each (keep:
1 + p tokens for a 2-token verify; turn down: a plain step plus the row) against plain steps, which
win only when that gain is below minus most of a head row (PLAIN_MARGIN).
Measured rates of gated steps were too noisy to choose with: a refused first row and two rejected
probes kept a Gemma 3 run (qa/text, 80 % accepted at N = 1) plain for 48 of its 64 steps.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

DECAY = 0.9             # weight of the past in every running estimate (~10 steps of memory)
N_BINS = 10             # calibration table: top-1 probability in tenths
CONF_DECAY = 0.98       # the head's calibration changes slowly: ~50 judged drafts of memory
RECENT_ROWS = 32        # first rows whose top-1 probabilities decide between plain and gated steps
MIN_ROWS = 4            # gated steps before plain ones may win: one costs at most a head row more
# Plain steps win only where gated ones are expected to lose at least this share of a head row per
# step (a stretch whose every row is refused loses exactly one): a plain stretch lasts until a probe,
# 16-64 steps, while a gated step risks at most its row. On the 32 held-out prompts the break-even
# (0) left adaptive at 0.964-0.966 of N = 1 on Gemma 3 and 0.937 on SmolLM2; a row's worth (0.1
# token) at 0.985-0.995 and 0.950, adversarial prompts unchanged (1.00x plain).
PLAIN_MARGIN = 0.75
RECENT_TIMES = 5        # verify timings per k whose median is t_verify(k)
SURE_TIMES = 3          # timings of t(1) from which one slow step cannot move its median
REFRESH_STEPS = 16      # steps without a plain one after which a stale t(1) is measured again,
REFRESH_GAIN = 1.1      # where drafting's expected rate is under this times a plain step's


def tenth(top1: float) -> int:
    """The calibration table's bin of a top-1 probability (1.0 in the last)."""
    return min(int(top1 * N_BINS), N_BINS - 1)


@dataclass
class DraftLengthPolicy:
    n_max: int
    prior_accept: float = 0.6
    probe_every: int = 16
    explore_every: int = 8
    accept_hits: float = 0.0
    accept_trials: float = 0.0
    verify_s: dict[int, float] = field(default_factory=dict)     # k -> median seconds (recent)
    verify_recent: dict[int, deque] = field(default_factory=dict)  # k -> the last RECENT_TIMES timings
    since_plain: int = 0            # steps since t(1) was last measured
    draft_s: float | None = None                                   # seconds per proposed draft
    plain_streak: int = 0
    probe_gap: int = 0              # plain steps before the next probe (0: probe_every)
    drafting_steps: int = 0
    gating: bool = False            # keep_draft is installed: drafting steps are gated
    bin_hits: list = field(default_factory=lambda: [0.0] * N_BINS)
    bin_trials: list = field(default_factory=lambda: [0.0] * N_BINS)
    judged_hits: float = 0.0              # all judged drafts, decayed as the table: kept ones
    judged_top1: float = 0.0              # and the sum of their top-1 probabilities
    first_top1: deque = field(default_factory=lambda: deque(maxlen=RECENT_ROWS))   # of gated steps
    # the same rows per tenth: decayed as gated_gain weighs them (DECAY per row back) and counted,
    # kept as rows come and go so a step reads ten sums rather than the rows (choose() runs after a
    # verify has streamed the weights through the caches, where each Python object it touches is a miss)
    first_weights: list = field(default_factory=lambda: [0.0] * N_BINS)
    first_counts: list = field(default_factory=lambda: [0] * N_BINS)
    chain_bins: list = field(default_factory=lambda: [0.0] * N_BINS)   # chained rows' top-1 tenths, decayed
    # the other sequences sharing this one's steps (serve's continuous batching: members of the step
    # batcher besides this one), one token each a step: a longer verify slows their tokens too, so a
    # draft must pay for the time it adds to all of them, not only to its own sequence's (share())
    others: int = 0
    step_tokens: float = 1.0              # the step being drafted: expected tokens so far
    step_prob: float = 1.0                # and the chance that every draft so far is accepted
    # The first timing of each verify size and of the drafts is not a cost: in a fresh process the
    # first call of a kernel loads (or compiles) its machine code. Kept, a `run` with a trained head
    # started from a first draft of ~100 ms and stayed plain for 120 of its 128 steps (SmolLM2: 134
    # t/s against N = 1's 160). False: every timing counts (the unit tests' simulated sources).
    skip_first_timings: bool = True
    timed_k: set = field(default_factory=set)     # verify sizes whose first timing has been seen
    draft_timed: bool = False                     # and the drafts'
    _costs: list | None = field(default=None, init=False, repr=False, compare=False)   # verify_cost(0 ..), anew each step
    # the verify timings of the other sharing levels (others -> verify_s, verify_recent, since_plain)
    _levels: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        self.probe_gap = self.probe_gap or self.probe_every

    def new_run(self) -> None:
        """Continue into another sequence (a server's next request on the same session): what was
        learned about the machine and the head (verify and draft costs, acceptance, calibration,
        the recent first rows) carries over; the stretch and probe of the last sequence do not.
        A policy learned afresh in every 128-token run trailed one kept across 32 of them by 1-3 %
        on SmolLM2's head (docs/history.md, "Where adaptive length trails a fixed N = 1"): each run
        paid for its first plain steps and chose plain stretches on a handful of rows."""
        self.plain_streak, self.probe_gap = 0, self.probe_every
        self.step_tokens, self.step_prob = 1.0, 1.0

    def share(self, others: int) -> None:
        """This step shares its forward with `others` other sequences (0: alone). A step's time
        depends on how many share it, so verify costs are kept per sharing level: in serve, the
        warm-up's timings of a session alone (SmolLM2: t(4) ~2x t(1)) read next to a shared step's
        t(1) (~4x a lone one's at 8 streams) made drafts look free until a session had drafted a
        few times (BENCHMARKS.md, "Serving: concurrent streams")."""
        if others == self.others:
            return
        self._levels[self.others] = (self.verify_s, self.verify_recent, self.since_plain)
        self.verify_s, self.verify_recent, self.since_plain = self._levels.pop(others, ({}, {}, 0))
        self.others = others
        self._costs = None

    def seed_verify_costs(self, times: dict[int, list[float]]) -> None:
        """Start from verify timings measured before the run (its warm-up's, with every kernel
        loaded): kept as observed ones are, and the drafts' first timing counted as genuine too."""
        for k, ts in times.items():
            for seconds in ts:
                self._record_verify(k, seconds)
            self.timed_k.add(k)
        self.draft_timed = True

    def _record_verify(self, k: int, seconds: float) -> None:
        """One timing of a k-token verify: t_verify(k) is the median of the recent ones."""
        recent = self.verify_recent.setdefault(k, deque(maxlen=RECENT_TIMES))
        recent.append(seconds)
        self.verify_s[k] = sorted(recent)[(len(recent) - 1) // 2]     # of an even count the lower
        self._costs = None

    @property
    def acceptance(self) -> float:
        # the prior counts as two trials, so a couple of steps move it but not all the way
        return (self.accept_hits + 2 * self.prior_accept) / (self.accept_trials + 2)

    def verify_cost(self, k: int) -> float:
        """t_verify(k), never below a measured shorter verify's: a k-token verify does all of a
        shorter one's work, so a median below one (a stale t(1) from a slow stretch, or a t(2)
        from a fast one) is a stale estimate, and taken as it is it made a 2-token verify plus a
        head row look cheaper than a plain step (Gemma 3 on random tokens: 26 gated steps with
        no draft ever accepted, 0.92x plain). Made once per observed step (the policy asks for
        it ~30 times a step)."""
        costs = self._costs
        if costs is None or k >= len(costs):
            costs = self._costs = self._monotone_costs(max(k, self.n_max + 1))
        return costs[k]

    def _monotone_costs(self, k_max: int) -> list[float]:
        costs = [0.0]
        for k in range(1, k_max + 1):
            costs.append(max(costs[-1], self._raw_verify_cost(k)))
        return costs

    def _raw_verify_cost(self, k: int) -> float:
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
        tokens = self.others + sum(a ** i for i in range(n + 1))
        return tokens / (self.verify_cost(n + 1) + n * self._draft_cost())

    def accept_given(self, top1: float) -> float:
        """Estimated acceptance of a draft whose row's top-1 probability is top1. Prior, worth two
        judged drafts: top1 itself times the head's measured calibration (judged acceptance over
        judged top-1 mass, prior 1), so that a head sure of itself and wrong is found out in a few
        drafts rather than in a few per tenth."""
        return self._accept_in(tenth(top1), self._calibration())

    def _calibration(self) -> float:
        """Judged acceptance over judged top-1 mass (1 before any): the bins' prior scale."""
        return (self.judged_hits + 1.0) / (self.judged_top1 + 1.0)

    def _accept_in(self, b: int, scale: float) -> float:
        """accept_given for a top-1 probability in tenth b, the calibration scale given."""
        return (self.bin_hits[b] + 2 * min(1.0, scale * (b + 0.5) / N_BINS)) / (self.bin_trials[b] + 2)

    def _draft_cost(self) -> float:
        return self.draft_s if self.draft_s is not None else 0.02 * self.verify_cost(1)

    def _pays(self, i: int, prob: float, step_tokens: float, row_sunk: bool = True) -> bool:
        """Does keeping draft i (reached with chance `prob`) raise the step's expected tokens per
        second? The rows before it are computed; its own too when row_sunk (then only the verify
        grows), else its row counts against it."""
        before = self._step_rate(step_tokens, i + 1, i + row_sunk)
        return self._step_rate(step_tokens + prob, i + 2, i + 1) > before

    def _step_rate(self, tokens: float, k: int, rows: int) -> float:
        """Expected tokens per second of a step that verifies k tokens after computing `rows` head rows."""
        return (self.others + tokens) / (self.verify_cost(k) + rows * self._draft_cost())

    def _add_first_row(self, top1: float) -> None:
        """A gated step's first row joins the recent ones (the oldest leaving at RECENT_ROWS)."""
        rows, weights, counts = self.first_top1, self.first_weights, self.first_counts
        if len(rows) == RECENT_ROWS:
            old = tenth(rows[0])
            weights[old] = max(0.0, weights[old] - DECAY ** (RECENT_ROWS - 1))
            counts[old] -= 1
        rows.append(top1)
        for b in range(N_BINS):
            weights[b] *= DECAY
        b = tenth(top1)
        weights[b] += 1.0
        counts[b] += 1

    def keep_draft(self, i: int, top1: float) -> bool:
        """Gate for draft i (0-based) of this step: keep it iff the expected tokens per second of the
        step rise."""
        if i == 0:
            self.step_tokens, self.step_prob = 1.0, 1.0
            self._add_first_row(top1)
        else:
            self.chain_bins = [CONF_DECAY * w for w in self.chain_bins]
            self.chain_bins[tenth(top1)] += 1.0
        prob = self.step_prob * self.accept_given(top1)
        if not self._pays(i, prob, self.step_tokens):
            return False
        self.step_tokens, self.step_prob = self.step_tokens + prob, prob
        return True

    def worth_row(self, i: int) -> bool:
        """Before the head computes draft i's row (i >= 1, the drafts before it kept): is the step's
        expected tokens per second higher with the row computed (and then kept or refused by the
        gate, whichever pays at its top-1 probability) than without it? Over the top-1 tenths
        chained rows have shown (chain_bins; before any, the first rows'). Asking only whether it
        could pay at the best calibrated acceptance computed rows the gate then refused: SmolLM2's
        chained rows are seldom confident, and each is 8-10 % of a plain step."""
        tokens = self.step_tokens
        refused = self._step_rate(tokens, i + 1, i + 1)
        expected = sum(w * max(refused, self._step_rate(tokens + self.step_prob * self.accept_given((b + 0.5) / N_BINS),
                                                        i + 2, i + 1))
                       for b, w in enumerate(self._chain_weights()) if w)
        return expected > self._step_rate(tokens, i + 1, i)

    def _chain_weights(self) -> list[float]:
        """How a chained row's top-1 probability falls in tenths: the chained rows seen (decayed),
        with the recent first rows' tenths as a prior worth two rows (uniform before any)."""
        n_prior = len(self.first_top1)
        prior = [2.0 * c / n_prior for c in self.first_counts] if n_prior else [2.0 / N_BINS] * N_BINS
        weights = [c + p for c, p in zip(self.chain_bins, prior)]
        total = sum(weights)
        return [w / total for w in weights]

    def gated_gain(self) -> float:
        """Expected tokens a gated step gains over the plain steps of the same time, over the recent
        first rows' top-1 probabilities, the newest weighing most (DECAY per step back: text
        changes); the first draft only, as the gate adds later ones only where they pay."""
        d, v1, v2 = self._draft_cost(), self.verify_cost(1), self.verify_cost(2)
        # per tenth of top-1 probability (accept_given depends on nothing finer): what a first row
        # gains, kept where _pays(0, p, 1.0) would keep it (written out: this runs every step, and
        # the policy's Python was ~2 % of a SmolLM2 step), weighed by the recent rows in that tenth
        # (with `others`, o tokens a plain step: a kept row gains p of o + p, in this sequence's plain steps)
        scale = self._calibration()
        o = 1.0 + self.others
        plain, gated = o / (v1 + d), v2 + d
        gain = 0.0
        for b, w in enumerate(self.first_weights):
            if w:
                p = self._accept_in(b, scale)
                gain += w * (1 + p / o - gated / v1 if (o + p) / gated > plain else -d / v1)
        return gain / sum(self.first_weights)

    def choose(self) -> int:
        if self.n_max == 0:
            return 0
        if 1 not in self.verify_s and self.drafting_steps:
            # a plain step's cost is measured, not extrapolated: from a 4-token verify at 10 % per
            # token it looked 0.93x of it where it is ~0.5x, and drafting never stopped paying
            return 0
        if 0 < self.plain_streak < self.probe_gap - 1:
            # a plain stretch lasts until its probe: plain steps teach nothing about drafts, only
            # t(1) moves, and a fresh t(1) against a stale t(2) flipped single steps back to drafting
            # (each resetting the probe gap: Gemma 3 on random tokens, 9 such steps in 128)
            self.plain_streak += 1
            return 0
        if self.gating:
            # gated drafting against plain steps (untried: drafting)
            best = max(range(1, self.n_max + 1), key=self.expected_rate) if self.n_max > 1 else 1
            row = self._draft_cost() / self.verify_cost(1)         # a head row, in plain steps
            if len(self.first_top1) >= MIN_ROWS and self.gated_gain() < -PLAIN_MARGIN * row:
                best = 0
        else:
            best = max(range(self.n_max + 1), key=self.expected_rate)
        if best == 0:
            self.plain_streak += 1
            if self.plain_streak >= self.probe_gap:
                # each probe that leaves plain steps the winner doubles the gap to the next, up to 4x:
                # on text no draft predicts a probe costs about half a plain step (Gemma 3: the MTP
                # catch-up 3 ms, the draft 1.5 ms, the longer verify 2 ms, against a 13 ms step)
                self.plain_streak = 0
                self.probe_gap = min(2 * self.probe_gap, 4 * self.probe_every)
                return 1
            return 0
        inverted = self.verify_cost(1) >= self.verify_cost(best + 1)      # t(1) at or above a longer verify's
        if inverted and len(self.verify_recent.get(1, ())) < SURE_TIMES:
            return 0                # a t(1) of one or two timings (the run's first steps'): measure it again now
        if self.since_plain >= REFRESH_STEPS and (inverted or
                                                  self.expected_rate(best) < REFRESH_GAIN * self.expected_rate(0)):
            return 0                # re-measure t(1): the choice hangs on it, or it is above a longer verify's
        self.plain_streak, self.probe_gap = 0, self.probe_every
        self.drafting_steps += 1
        if self.drafting_steps % self.explore_every == 0:       # a neighbour, alternately up and down
            up = (self.drafting_steps // self.explore_every) % 2 == 1
            return min(best + 1, self.n_max) if up or best == 1 else best - 1
        return best

    def observe(self, n_proposed: int, n_accepted: int, verify_s: float, draft_s: float,
                conf: Sequence[float] = (), gated: bool = False,
                refused: tuple[float, float] | None = None) -> None:
        """One step: n_proposed drafts verified (k = n_proposed + 1 tokens), n_accepted kept; `conf`
        the top-1 probabilities of the proposed drafts and `gated` a further row turned down by
        keep_draft (both from a gated step); `refused` (top-1 probability, chance it would have
        been kept) judges that row where the verify's last row could (every draft kept)."""
        k = n_proposed + 1
        first_verify = self.skip_first_timings and k not in self.timed_k
        self.timed_k.add(k)
        if not first_verify:
            if k == 1 and self.since_plain >= REFRESH_STEPS and 1 in self.verify_recent:
                self.verify_recent[1].clear()          # a re-measure: the old timings are stale
            self._record_verify(k, verify_s)
        self.since_plain = 0 if k == 1 else self.since_plain + 1
        judged = [(top1, float(j < n_accepted)) for j, top1 in enumerate(conf[:n_accepted + 1])]
        if refused is not None:
            # without these the table learned only from drafts the gate let through, so a tenth it
            # turned down kept its prior for good (Gemma 3's head is right more often than its top-1
            # says below 0.5: 32 / 41 / 53 % at top-1 0.2-0.3 / 0.3-0.4 / 0.4-0.5)
            judged.append(refused)
        for top1, hit in judged:     # drafts past the first rejection: unjudged
            b = tenth(top1)
            self.bin_hits = [CONF_DECAY * h for h in self.bin_hits]
            self.bin_trials = [CONF_DECAY * t for t in self.bin_trials]
            self.bin_hits[b] += hit
            self.bin_trials[b] += 1
            self.judged_hits = CONF_DECAY * self.judged_hits + hit
            self.judged_top1 = CONF_DECAY * self.judged_top1 + top1
        rows = n_proposed + gated
        if rows and self.skip_first_timings and not self.draft_timed:
            self.draft_timed = True
        elif rows:
            per_draft = draft_s / rows
            self.draft_s = per_draft if self.draft_s is None else DECAY * self.draft_s + (1 - DECAY) * per_draft
        if n_proposed:
            self.accept_hits = DECAY * self.accept_hits + n_accepted
            self.accept_trials = DECAY * self.accept_trials + n_accepted + (n_accepted < n_proposed)
