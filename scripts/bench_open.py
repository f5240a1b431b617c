"""Time to open a GGUF and read all its metadata and tensor table: hybridrt's reader vs gguf-py's.

    python scripts/bench_open.py [MODEL ...] [--reps 5] [--skip-gguf-py]
MODEL is a path or a known name (default: both real models). Prints a table and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from hybridrt.files.gguf_file import GGUFFile
from hybridrt.files.registry import resolve_model


def time_open(path, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f = GGUFFile(path)
        _ = (f.metadata, f.tensors)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=["gemma3-270m", "smollm2-135m"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--skip-gguf-py", action="store_true", help="do not time gguf.GGUFReader (slow)")
    args = ap.parse_args()
    rows = []
    for spec in args.models:
        path = resolve_model(spec)
        ours = time_open(path, args.reps)
        ref = None
        if not args.skip_gguf_py:
            from gguf import GGUFReader
            t0 = time.perf_counter()
            GGUFReader(path)
            ref = time.perf_counter() - t0
        rows.append({"model": str(path), "hybridrt_s": round(ours, 4), "gguf_py_s": ref and round(ref, 2)})
        print(f"{path.name:40s} hybridrt {ours * 1e3:8.1f} ms   gguf-py {'-' if ref is None else f'{ref:.1f} s'}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
