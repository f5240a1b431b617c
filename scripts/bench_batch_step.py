"""One shared decode step of N sessions against N separate steps (issue 57 item 1).

    python scripts/bench_batch_step.py [--models smollm2-135m gemma3-270m] [--threads 2] [--rounds 60]

For each model (a name pulled with `hybridrt pull`, or a .gguf path: e.g. a qwen35 file of
scripts/make_model.py's), N sessions hold prompts of different lengths (f16
KV cache, as `run` and `serve` default to); a round evaluates one token per session (or k tokens:
a verify-like step) either as N Session.eval calls or as one session.eval_batch, logits of the last
row each, then rolls every session back, so every round runs at the same positions (a recurrent
trunk, qwen35, keeps no state from before its last step to roll back to: its sessions run on, their
context sized for every round, each way alternately at the next positions). Rounds of the
two ways alternate; the figures are medians. "x" is the separate steps' time over the shared
step's: how much of the weight reading the sessions share.
Run it on a quiet machine (it prints the load average before and after).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridrt.errors import UserError  # noqa: E402
from hybridrt.files.gguf_file import GGUFError  # noqa: E402
from hybridrt.files.registry import resolve_model  # noqa: E402
from hybridrt.runtime.loader import load_model  # noqa: E402
from hybridrt.runtime.session import eval_batch  # noqa: E402

PROMPT_LENGTHS = (120, 64, 200, 30, 90, 150, 45, 10)      # session i's prompt


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench(model, n: int, k: int, rounds: int) -> tuple[float, float]:
    """Median seconds of (N separate evals, one shared eval_batch) of k tokens per session."""
    runs_on = model.spec.recurrent
    n_ctx = max(PROMPT_LENGTHS) + 2 * (rounds + 3) * k if runs_on else 512
    sessions = [model.session(n_ctx, "f16", k_max=max(k, 4)) for _ in range(n)]
    for i, s in enumerate(sessions):
        s.eval([(7 * i + j) % model.n_vocab for j in range(PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)])], logits="none")
    tokens = [[(31 * i + j) % model.n_vocab for j in range(k)] for i in range(n)]

    def rollback():
        if runs_on:
            return
        for s in sessions:
            s.truncate(s.n_past - k)

    def separate():
        for s, t in zip(sessions, tokens):
            s.eval(t, logits="last")

    def shared():
        eval_batch(sessions, tokens, logits="last")

    alone, together = [], []
    for r in range(rounds + 3):          # the first rounds compile and warm the caches
        a = timed(separate)
        rollback()
        b = timed(shared)
        rollback()
        if r >= 3:
            alone.append(a)
            together.append(b)
    return statistics.median(alone), statistics.median(together)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"],
                    help="registry names or .gguf paths")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--shapes", nargs="+", default=["1x1", "2x1", "4x1", "8x1", "4x4"],
                    help="NxK: N sessions, K tokens each")
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    for name in args.models:
        try:        # a bad name or file: one error line and exit 2, as the other bench scripts
            model = load_model(resolve_model(name, auto_pull=False), threads=args.threads)
        except (UserError, GGUFError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(2)
        for shape in args.shapes:
            n, k = (int(v) for v in shape.split("x"))
            alone, together = bench(model, n, k, args.rounds)
            print(f"{name} {n} sessions x {k} tokens, {args.threads} threads: separate {1e3 * alone:.2f} ms, "
                  f"shared {1e3 * together:.2f} ms ({alone / together:.2f}x), "
                  f"{n * k / together:.0f} tokens/s shared vs {n * k / alone:.0f}", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
