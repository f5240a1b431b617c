#!/usr/bin/env python3
"""How well a trained MTP head's confidence predicts acceptance: greedy draft-mtp at N = 1 with every
draft proposed, on bench_mtp's held-out and adversarial prompts; acceptance per tenth of the
draft row's top-1 probability (what the adaptive policy's confidence gate reads, adaptive.py).

    python3 scripts/mtp_calibration.py -m gemma3-270m --head ~/.cache/hybridrt/heads/gemma3-270m.v4.mtp.gguf
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_mtp import GREEDY, prompts  # noqa: E402
from hybridrt.decoding.generate import generate  # noqa: E402
from hybridrt.runtime.loader import load_model  # noqa: E402
from hybridrt.decoding.speculative.loop import SpecConfig  # noqa: E402
from hybridrt.decoding.speculative.sources import build_source  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--head", required=True)
    ap.add_argument("-n", "--n-gen", type=int, default=64)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    m = load_model(args.model, threads=args.threads, mtp_head=args.head)
    hits, trials = [0] * 10, [0] * 10
    for _, ids in prompts(m):
        spec = SpecConfig(n_max=1)
        session = m.session(len(ids) + args.n_gen + 16, k_max=spec.k_max)
        source = build_source("draft-mtp", session, GREEDY, spec)
        confs: list[float] = []
        source.picker.gate = lambda i, top1: confs.append(top1) or True    # records, keeps every draft
        _, stats = generate(m, session, ids, args.n_gen, GREEDY, source, spec, stop_ids=set())
        for top1, kept in zip(confs, stats.spec.accepted):
            b = min(int(top1 * 10), 9)
            hits[b] += kept
            trials[b] += 1
    print("| top-1 probability | drafts | accepted |\n|---|---|---|")
    for b in range(10):
        print(f"| {b / 10:.1f}-{(b + 1) / 10:.1f} | {trials[b]} | {hits[b] / max(trials[b], 1):.1%} |")
    print(f"| all | {sum(trials)} | {sum(hits) / max(sum(trials), 1):.1%} |")


if __name__ == "__main__":
    main()
