"""The thread governor (hybridrt/thread_governor.py): on simulated step times it keeps all threads on an
idle machine at a small probing cost, drops to fewer within a few steps when other processes take
cores, and comes back when they leave; on a real model, changing the count between steps changes
no logit bit (so it never changes a token)."""
from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

import make_model
from hybridrt.runtime.loader import load_draft_model, load_model
from hybridrt.runtime.thread_governor import ThreadGovernor

# seconds per decode step at (threads, machine): 2 threads are faster alone and far slower when
# other processes hold a core (docs/history.md, "The thread governor": ~118 vs 84 t/s idle, 32-44 vs
# 84 loaded)
STEP = {(2, "idle"): 0.008, (1, "idle"): 0.0112, (2, "busy"): 0.024, (1, "busy"): 0.0096}


def simulate(phases, rng, max_threads=2):
    gov, trace = ThreadGovernor(max_threads), []
    for machine, n_steps in phases:
        for _ in range(n_steps):
            n = gov.threads()
            gov.record(1, STEP[n, machine] * rng.uniform(0.95, 1.05))
            trace.append(n)
    return gov, trace


@pytest.mark.parametrize("seed", range(5))
def test_idle_then_busy_then_idle(seed):
    gov, trace = simulate([("idle", 500), ("busy", 500), ("idle", 1000)], np.random.default_rng(seed))
    idle, busy, again = trace[:500], trace[500:1000], trace[1000:]
    assert idle.count(1) <= 10                       # probes only: 2 steps at a time, interval doubling
    assert busy[:8].count(1) >= 3 and busy[8:].count(2) <= 12, busy[:16]
    assert again[-500:].count(1) <= 4                # back once the load left (a probe or two)
    first_back = again.index(2)
    assert again[first_back:].count(1) <= 12
    assert [n for _, n in gov.switches][:2] == [1, 2] and "threads: 2 -> 1 (step " in gov.summary()


def test_busy_from_the_start_drops_at_the_first_scheduled_probe():
    _, trace = simulate([("busy", 300)], np.random.default_rng(0))
    assert trace.index(1) <= 40 and trace[60:].count(2) <= 8


def test_an_idle_run_never_switches():
    gov, trace = simulate([("idle", 3000)], np.random.default_rng(1))
    assert gov.switches == [] and gov.summary() is None and trace.count(1) <= 14


def test_the_start_follows_the_cores_others_leave_free(tmp_path):
    """The first step runs on the cores that /proc/loadavg's runnable count leaves free; an idle
    machine starts at all of them (and says nothing)."""
    from hybridrt.runtime.thread_governor import busy_elsewhere

    tasks = tmp_path / "task"        # this process: the reader running, one pool thread spinning, one asleep
    for tid, state in ((101, "R"), (102, "R"), (103, "S")):
        (tasks / str(tid)).mkdir(parents=True)
        (tasks / str(tid) / "stat").write_text(f"{tid} (python3 (x)) {state} 1 2 3\n")
    for line, others in (("0.17 1.13 1.80 2/79 3356", 0), ("2.0 1.0 0.5 4/80 3400", 2), ("bad", 0)):
        (tmp_path / "loadavg").write_text(line + "\n")
        assert busy_elsewhere(str(tmp_path / "loadavg"), str(tasks)) == others
    assert busy_elsewhere(str(tmp_path / "missing"), str(tasks)) == 0
    for cores, busy, first in ((2, 0, 2), (2, 1, 1), (2, 5, 1), (16, 6, 8), (16, 9, 4)):
        gov = ThreadGovernor(cores, busy=lambda: busy)
        assert gov.threads() == first and gov.threads() == first
        assert (gov.summary() is None) == (first == cores)
    gov = ThreadGovernor(2, busy=lambda: 1)
    gov.threads()
    assert "threads: 2 -> 1 (at start)" in gov.summary()


def test_levels_halve_to_one():
    assert ThreadGovernor(16).levels == [16, 8, 4, 2, 1] and ThreadGovernor(3).levels == [3, 1]


class Alternating:
    """A governor that runs every step at the other thread count."""

    def __init__(self):
        self.n = 1

    def threads(self):
        self.n = 3 - self.n
        return self.n

    def record(self, n_tok, seconds):
        pass


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_changing_the_thread_count_between_steps_changes_no_bit(tmp_path, arch):
    """Decode steps and a verify batch at 1 and 2 threads alternately give the logits of a run at 2."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one Numba thread")
    path = make_model.write_model(tmp_path / f"{arch}.gguf", arch, mix="q4_k_m")
    tokens = [int(t) for t in np.random.default_rng(3).integers(0, 200, 12)]
    runs = []
    before = numba.get_num_threads()
    try:
        for governor in (None, Alternating()):
            numba.set_num_threads(2)
            m = load_model(path, threads=2)
            m.executor.governor = governor
            s = m.session(64)
            rows = [s.eval(tokens[:4])[-1:]] + [s.eval([t]) for t in tokens[4:8]] + [s.eval(tokens[8:])]
            runs.append(torch.cat(rows))
    finally:
        numba.set_num_threads(before)
    assert torch.equal(runs[0], runs[1])


def test_the_governor_is_on_only_for_a_cpu_trunk_without_t(tmp_path):
    path = make_model.write_model(tmp_path / "m.gguf", "llama")
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one Numba thread")
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(2)
        assert load_model(path).executor.governor is not None
        assert load_model(path, threads=2).executor.governor is None
        assert load_model(path, vram="1GiB").executor.governor is None      # placed: the worker's count
        # a draft model runs at the count the target's governor sets: one governor per thread
        target = load_model(path)
        assert load_draft_model(target, path).executor.governor is None
    finally:
        numba.set_num_threads(before)


def test_two_threads_jammed_from_the_start_cost_a_few_slow_steps():
    """Beside two busy processes a 2-thread step can take ~1 s where one thread takes ~10 ms; even
    when the first step is lucky (fast at 2 threads), the run spends at most a few seconds on 2."""
    rng = np.random.default_rng(2)
    gov, spent = ThreadGovernor(2), 0.0
    for step in range(300):
        n = gov.threads()
        t = (0.008 if step == 0 else 1.0) if n == 2 else 0.01 * rng.uniform(0.8, 2.0)
        gov.record(1, t)
        spent += t
    assert spent < 300 * 0.02 + 5, spent


def test_no_probe_for_more_threads_while_the_cores_are_taken():
    """At one thread because others are busy, a probe for two waits until the runnable count says a
    core is free (each failed probe beside busy processes costs ~1 s), then comes within ~0.25 s."""
    step, trace = [0], []
    gov = ThreadGovernor(2, busy=lambda: 1 if step[0] < 300 else 0)
    for step[0] in range(600):
        n = gov.threads()
        machine = "busy" if step[0] < 300 else "idle"
        gov.record(1, STEP[n, machine])
        trace.append(n)
    assert trace[:300] == [1] * 300
    assert trace[300:360].count(2) >= 30 and trace[400:].count(1) <= 6
