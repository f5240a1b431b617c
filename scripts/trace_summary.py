"""Where the time of a traced run went: totals per track, per-step averages, and how much of the
split boundary layer's CPU half ran while its device half did.

    hybridrt run ... --trace t.json && python scripts/trace_summary.py t.json [--json]
"""
from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict


def summarize(events: list[dict]) -> dict:
    spans = [e for e in events if e.get("ph") == "X"]
    steps = [e for e in spans if e["cat"] == "step"]
    per_cat: dict[str, float] = defaultdict(float)
    for e in spans:
        per_cat[e["cat"]] += e["dur"]
    # the split layer: pair each device half with the CPU half that started just before it
    device_halves = sorted((e for e in spans if e["cat"] == "device" and e["name"].endswith("(split half)")),
                           key=lambda e: e["ts"])
    cpu_halves = sorted((e for e in spans if e["cat"] == "cpu_ffn" and re.match(r"cpu ffn blk\.\d+ \[\d+:\]", e["name"])),
                        key=lambda e: e["ts"])
    overlap = busy = 0.0
    for d, c in zip(device_halves, cpu_halves):
        overlap += max(0.0, min(d["ts"] + d["dur"], c["ts"] + c["dur"]) - max(d["ts"], c["ts"]))
        busy += min(d["dur"], c["dur"])
    return {
        "steps": len(steps),
        "step_ms_mean": sum(e["dur"] for e in steps) / len(steps) / 1e3 if steps else 0.0,
        "total_ms": {cat: us / 1e3 for cat, us in sorted(per_cat.items())},
        "split_calls": len(device_halves),
        # 1.0: the shorter half ran entirely inside the longer one (the most overlap can give)
        "split_overlap_of_shorter_half": overlap / busy if busy else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with open(args.trace, encoding="utf-8") as f:
        s = summarize(json.load(f)["traceEvents"])
    if args.json:
        print(json.dumps(s, indent=1))
        return
    print(f"{s['steps']} steps, {s['step_ms_mean']:.2f} ms per step on average")
    for cat, ms in s["total_ms"].items():
        print(f"  {cat:10s} {ms:10.1f} ms")
    if s["split_calls"]:
        print(f"split layer: {s['split_calls']} calls, the shorter half overlapped "
              f"{100 * s['split_overlap_of_shorter_half']:.0f} % of its time with the other")


if __name__ == "__main__":
    main()
