"""Which Numba kernels a CLI command compiles on a fresh cache, and how long each takes.

    python scripts/bench_compile.py run -m smollm2-135m -p "The capital of France is" -n 1 --temp 0
    python scripts/bench_compile.py warmup -m gemma3-270m

Runs the command in this process with NUMBA_CACHE_DIR set to a new empty directory (unless it is
set already) and a numba:compile listener, then prints each compilation: seconds including the
kernels it compiled on the way (callees), seconds of its own, the kernel and its signature.
Numba's internal helpers (`impl`) are summed into one line.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

os.environ.setdefault("NUMBA_CACHE_DIR", tempfile.mkdtemp(prefix="numba-cold-"))

from numba.core import event  # noqa: E402  (after NUMBA_CACHE_DIR)


class CompileTimes(event.Listener):
    def __init__(self):
        self.open: list[list[float]] = []       # [start, seconds of nested compilations]
        self.done: list[tuple[float, float, str, str]] = []

    def on_start(self, ev) -> None:
        self.open.append([time.perf_counter(), 0.0])

    def on_end(self, ev) -> None:
        t0, nested = self.open.pop()
        took = time.perf_counter() - t0
        if self.open:
            self.open[-1][1] += took
        fn = ev.data["dispatcher"].py_func
        self.done.append((took, took - nested, f"{fn.__module__}.{fn.__name__}", str(ev.data["args"])))


def main() -> None:
    from hybridrt.cli.commands import main as cli

    times = CompileTimes()
    t0 = time.perf_counter()
    with event.install_listener("numba:compile", times):
        sys.argv[1:] = sys.argv[1:]
        try:
            cli()
        except SystemExit as e:
            if e.code:
                raise
    wall = time.perf_counter() - t0
    print(f"\n{'incl s':>7} {'own s':>7}  kernel  signature", file=sys.stderr)
    helpers = sum(own for _, own, name, _ in times.done if name.endswith(".impl"))
    for took, own, name, sig in times.done:
        if not name.endswith(".impl"):
            print(f"{took:7.2f} {own:7.2f}  {name}  {sig[:140]}", file=sys.stderr)
    print(f"{'':7} {helpers:7.2f}  Numba's helpers (impl), together", file=sys.stderr)
    print(f"compiling: {sum(own for _, own, _, _ in times.done):.1f} s of {wall:.1f} s wall "
          f"(load average {os.getloadavg()[0]:.2f}; cache {os.environ['NUMBA_CACHE_DIR']})", file=sys.stderr)


if __name__ == "__main__":
    main()
