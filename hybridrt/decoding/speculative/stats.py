"""Per-step record of a speculative run and the figures reported from it."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    source: str
    n_max: int
    drafted: list[int] = field(default_factory=list)     # drafts proposed, per step
    accepted: list[int] = field(default_factory=list)    # drafts kept, per step
    chosen: list[int] = field(default_factory=list)      # drafts asked for (the adaptive length), per step
    by_source: dict[str, list[int]] = field(default_factory=dict)  # a chain's source -> [steps, drafted, accepted]
    draft_s: float = 0.0       # proposing (draft model / MTP forwards, n-gram lookups)
    verify_s: float = 0.0      # the target's k-token forwards
    other_s: float = 0.0       # acceptance, sampling, bookkeeping

    def record(self, n_drafted: int, n_accepted: int, n_chosen: int | None = None, source: str = "") -> None:
        """`source`: which source of a chain drafted the step ("" for a lone source or no draft)."""
        self.drafted.append(n_drafted)
        self.accepted.append(n_accepted)
        self.chosen.append(self.n_max if n_chosen is None else n_chosen)
        if source:
            counts = self.by_source.setdefault(source, [0, 0, 0])
            counts[0] += 1
            counts[1] += n_drafted
            counts[2] += n_accepted

    @property
    def steps(self) -> int:
        return len(self.accepted)

    @property
    def acceptance_rate(self) -> float:
        total = sum(self.drafted)
        return sum(self.accepted) / total if total else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens produced per target forward (accepted drafts + the token each step adds)."""
        return (sum(self.accepted) + self.steps) / self.steps if self.steps else 0.0

    @property
    def histogram(self) -> list[int]:
        """histogram[a] = steps that kept exactly a drafts."""
        return _count(self.accepted, self.n_max)

    @property
    def chosen_histogram(self) -> list[int]:
        """chosen_histogram[n] = steps that asked for n drafts (all n_max without adaptive length)."""
        return _count(self.chosen, self.n_max)

    def to_dict(self) -> dict:
        return {"source": self.source, "n_max": self.n_max, "steps": self.steps,
                "drafted": sum(self.drafted), "accepted": sum(self.accepted),
                "acceptance_rate": self.acceptance_rate, "tokens_per_step": self.tokens_per_step,
                "histogram": self.histogram, "chosen_histogram": self.chosen_histogram, "draft_s": self.draft_s, "verify_s": self.verify_s,
                "other_s": self.other_s,
                "by_source": {k: {"steps": s, "drafted": d, "accepted": a} for k, (s, d, a) in self.by_source.items()}}

    def summary(self) -> str:
        total = self.draft_s + self.verify_s + self.other_s
        share = (lambda t: f"{100 * t / total:.0f}%") if total else (lambda t: "-")
        return (f"speculative ({self.source}, n_max {self.n_max}): {self.steps} steps, "
                f"accepted {sum(self.accepted)}/{sum(self.drafted)} drafts ({100 * self.acceptance_rate:.1f}%), "
                f"{self.tokens_per_step:.2f} tokens/step, accepted-per-step histogram {_compact(self.histogram)}, "
                + (f"chosen lengths {_compact(self.chosen_histogram)}, " if any(self.chosen_histogram[:-1]) else "")
                + "".join(f"{k} accepted {a}/{d} in {s} steps, " for k, (s, d, a) in self.by_source.items()) +
                f"time draft {self.draft_s * 1e3:.0f} ms ({share(self.draft_s)}) / verify {self.verify_s * 1e3:.0f} ms "
                f"({share(self.verify_s)}) / other {self.other_s * 1e3:.0f} ms ({share(self.other_s)})")


def _compact(histogram: list[int]) -> str:
    """[5, 0, 0, 3] -> '{0: 5, 3: 3}': long n_max stays one short line."""
    return "{" + ", ".join(f"{i}: {n}" for i, n in enumerate(histogram) if n) + "}"


def _count(values: list[int], n_max: int) -> list[int]:
    h = [0] * (n_max + 1)
    for v in values:
        h[v] += 1
    return h
