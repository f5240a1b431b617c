"""First run, cold vs warm kernel cache: `hybridrt run` wall time to its first token, `hybridrt warmup`.

    python scripts/bench_first_run.py [--tree DIR ...] [--model NAME ...] [--warm N]

For each model and each source tree (default: this one; pass several, e.g. a `git archive` of an
older commit, to compare them back to back): a `run -n 1` on a fresh NUMBA_CACHE_DIR (cold: its
wall time is the time to the first token plus start-up), then N runs on that cache (warm), then
`warmup` on another fresh cache. Each line gives wall time, CPU time (user + sys of the child) and
the 1-minute load average before it, since the machine may be shared.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "The capital of France is"


def timed(tree: Path, args: list[str], cache: str) -> tuple[float, float, float, str]:
    """(wall s, child CPU s, load average before, stderr) of one CLI command from `tree`."""
    env = {**os.environ, "NUMBA_CACHE_DIR": cache, "PYTHONPATH": str(tree)}
    code = f"from hybridrt.cli.commands import main; import sys; sys.argv[1:] = {args!r}; main()"
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(args)} failed:\n{r.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, load, r.stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path, action="append", help="source tree(s) to compare (default: this one)")
    ap.add_argument("--model", action="append", help="model name(s) (default: smollm2-135m, gemma3-270m)")
    ap.add_argument("--warm", type=int, default=3, help="warm runs per tree and model")
    a = ap.parse_args()
    trees = [t.resolve() for t in (a.tree or [Path(__file__).resolve().parents[1]])]
    run = ["run", "-p", PROMPT, "-n", "1", "--temp", "0"]
    print("| model | tree | measurement | wall s | CPU s | load before |")
    print("|---|---|---|---|---|---|")
    for model in a.model or ["smollm2-135m", "gemma3-270m"]:
        caches = {tree: tempfile.mkdtemp(prefix="numba-cold-") for tree in trees}

        def report(tree: Path, what: str, args: list[str], cache: str) -> None:
            wall, cpu, load, _ = timed(tree, args, cache)
            print(f"| {model} | {tree.name} | {what} | {wall:.1f} | {cpu:.1f} | {load:.2f} |", flush=True)
        for tree in trees:         # cold runs back to back, then warm runs alternating, then warmups
            report(tree, "cold run", run + ["-m", model], caches[tree])
        for i in range(a.warm):
            for tree in trees:
                report(tree, f"warm run {i + 1}", run + ["-m", model], caches[tree])
        for tree in trees:
            caches[("warmup", tree)] = tempfile.mkdtemp(prefix="numba-cold-")
            report(tree, "cold warmup", ["warmup", "-m", model], caches[("warmup", tree)])
        for cache in caches.values():
            shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
