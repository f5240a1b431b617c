"""How many threads the CPU kernels use, chosen while decoding when -t is not given.

The kernels' OpenMP threads spin at each parallel region's barrier. When other processes hold some
of the cores, a waiting thread can keep the core its partner needs, and a 2-thread SmolLM2 decode
falls from ~118 t/s to 32-44 t/s beside one busy process and to 1-7 t/s beside two, where one
thread decodes at 84 and 52-58 t/s (docs/history.md, "The thread governor"; BENCHMARKS.md, "Threads
on a busy machine"). No wait policy wins both idle and loaded, so the count itself adapts: the first
step runs on the cores other runnable tasks leave free (/proc/loadavg), decode and verify steps are
timed, and the governor tries half as many threads (or, once a core is free again, twice as many)
for a couple of steps when the steps have slowed or when a probe is due, keeping whichever is
faster. The kernels' results do not depend on the thread count (each output row is one thread's), so
switching never changes a token.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from statistics import median
from typing import Callable

GOVERNED_MAX_TOKENS = 32     # decode and verify steps; prompt chunks run at the current count, untimed


def _runnable_here(task_dir: str) -> int:
    """This process's threads that are running or runnable (state R in /proc/self/task/*/stat): the
    kernels' OpenMP threads spin a while after each parallel region and count in /proc/loadavg."""
    n = 0
    for tid in os.listdir(task_dir):
        try:
            with open(os.path.join(task_dir, tid, "stat")) as f:
                n += f.read().rsplit(")", 1)[1].split()[0] == "R"
        except (OSError, IndexError):
            pass
    return n


def busy_elsewhere(path: str = "/proc/loadavg", task_dir: str = "/proc/self/task", reads: int = 9) -> int:
    """How many tasks of other processes are running or waiting for a core now: the runnable count of
    /proc/loadavg's fourth field ("3/93": 3 runnable) less this process's runnable threads (the
    reader among them), the median of reads 1 ms apart. 0 where the files cannot be read (not Linux)."""
    counts = []
    try:
        for _ in range(reads):
            with open(path) as f:
                total = int(f.read().split()[3].split("/")[0])
            counts.append(total - _runnable_here(task_dir))
            time.sleep(0.001)       # ~10 ms in all: a task runnable for a moment is not a busy process
    except (OSError, IndexError, ValueError):
        return 0
    return max(0, int(median(counts)))


@dataclass
class ThreadGovernor:
    max_threads: int
    # other runnable tasks now (busy_elsewhere): the first step's count, and whether a probe for more
    # threads has a core to use
    busy: Callable[[], int] | None = None
    probe_steps: int = 2          # steps a probe runs at the other count
    slowdown: float = 1.5         # steps this much slower than the best seen at this count: probe fewer
    win: float = 0.9              # a probe must take at most this fraction of the current step time
    first_interval_s: float = 0.25   # decode time before a scheduled probe (the first comes at step 1)
    max_interval_s: float = 60.0
    budget: float = 0.03          # time lost to failed probes for more threads, as a share of the run
    levels: list[int] = field(init=False)
    level: int = field(init=False, default=0)            # index into levels (0: max_threads)
    switches: list[tuple[int, int]] = field(init=False, default_factory=list)   # (step, threads)

    def __post_init__(self):
        self.levels = []
        n = max(1, self.max_threads)
        while n not in self.levels:
            self.levels.append(n)
            n = max(1, n // 2)
        self._step, self._started = 0, False
        self._reset(self.first_interval_s)
        # the first probe comes at the first step: a run that starts beside busy processes (2
        # threads: ~1 s steps, one thread ~10 ms) must not pay for a baseline first
        self._next_probe_s = 0.0

    def _reset(self, interval_s: float) -> None:
        self._recent: dict[int, list[float]] = {}     # step size -> last times at the current count
        self._best: dict[int, float] = {}             # step size -> best median seen at this count
        self._interval_s = interval_s
        self._next_probe_s = interval_s               # decode seconds at this count before a probe
        self._since_s = 0.0
        self._probe: int | None = None                # the level being tried
        self._probe_ratios: list[float] = []          # its step times over the current count's
        self._probe_lost_s = 0.0
        self._probe_start, self._probe_thin = 0, False

    def threads(self) -> int:
        """The count the next step runs at."""
        if not self._started:
            self._started = True
            if self.busy is None:
                return self.levels[0]
            # start at the cores others leave free: beside two busy processes the first 2-thread
            # steps on 2 cores take ~1 s each, more than a whole run's probes would lose
            free = self.max_threads - self.busy()
            self.level = next((i for i, n in enumerate(self.levels) if n <= max(1, free)), len(self.levels) - 1)
            if self.level:
                self.switches.append((0, self.levels[self.level]))
        return self.levels[self._probe if self._probe is not None else self.level]

    def record(self, n_tok: int, seconds: float) -> None:
        """A decode or verify step of n_tok tokens took `seconds` at threads()."""
        self._step += 1
        if self._probe is not None:
            self._probe_step(n_tok, seconds)
            return
        recent = self._recent.setdefault(n_tok, [])
        recent.append(seconds)
        del recent[:-5]
        self._since_s += seconds
        if len(recent) >= 3:
            now = median(recent)
            best = self._best[n_tok] = min(self._best.get(n_tok, now), now)
            if self.level + 1 < len(self.levels) and now > self.slowdown * best:
                self._start(self.level + 1)               # the steps slowed down: another process?
                return
        if self._since_s >= self._next_probe_s:
            self._start(self.level - 1 if self.level > 0 else self.level + 1)

    def _start(self, target: int) -> None:
        if not 0 <= target < len(self.levels) or target == self.level:
            self._since_s, self._next_probe_s = 0.0, self.max_interval_s
            return
        if target < self.level and self.busy is not None and self.levels[target] > self.max_threads - self.busy():
            # the cores are still taken: a probe would only cost (~1 s a step beside busy processes)
            self._since_s, self._next_probe_s = 0.0, self._interval_s
            return
        self._probe, self._probe_ratios, self._probe_lost_s = target, [], 0.0
        self._probe_start, self._probe_thin = self._step, False

    def _probe_step(self, n_tok: int, seconds: float) -> None:
        base = self._recent.get(n_tok)
        if base:
            self._probe_ratios.append(seconds / median(base))
            self._probe_lost_s += max(0.0, seconds - median(base))
            self._probe_thin |= len(base) < 3       # a baseline of 1-2 steps: only a clear win counts
        # far slower or far faster settles it at once
        last = self._probe_ratios[-1] if self._probe_ratios else 1.0
        done = len(self._probe_ratios) >= self.probe_steps or last > 3 or last < 0.5
        if not done and self._step - self._probe_start < 2 * self.probe_steps:
            return          # (steps of a size with no baseline at the current count do not count)
        target, ratios = self._probe, self._probe_ratios
        self._probe = None
        if ratios and median(ratios) < (0.5 if self._probe_thin else self.win):
            self.level = target
            self.switches.append((self._step, self.levels[target]))
            self._reset(self.first_interval_s)
            return
        # the probe lost: the current count stays, re-baselined (a slowdown that both counts see is
        # not a reason to probe again). Fewer threads: the next scheduled probe waits twice as long
        # (load shows up as a slowdown anyway). More threads: load leaving shows up nowhere but in a
        # probe, so probes keep coming, as often as keeps their lost time near `budget` of the run
        # (beside busy processes one 2-thread step can cost 100 one-thread steps)
        self._best = {k: median(v) for k, v in self._recent.items() if len(v) >= 3}
        if target < self.level:
            self._interval_s = min(self.max_interval_s, max(self.first_interval_s, self._probe_lost_s / self.budget))
        else:
            self._interval_s = min(2 * self._interval_s, self.max_interval_s)
        self._since_s, self._next_probe_s = 0.0, self._interval_s

    def summary(self) -> str | None:
        """One line for stderr when the count changed during the run, else None."""
        if not self.switches:
            return None
        path = " -> ".join([str(self.levels[0])] + [f"{n} ({f'step {s}' if s else 'at start'})"
                                                    for s, n in self.switches])
        return f"threads: {path}, following the cores other processes left free (-t N fixes the count)"
