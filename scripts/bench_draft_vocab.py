#!/usr/bin/env python3
"""What a reduced draft vocabulary (`build_source(..., draft_vocab=V)`, speculative/draft_vocab.py)
costs in acceptance and saves per draft, for each V (0: the full vocabulary).

On the held-out prompts (train_mtp.prompts.HELDOUT_PROMPTS, never part of the text the V tokens
are counted on), plain greedy decoding gives the reference, then per V:
  coverage   the share of the target's greedy tokens inside the draft vocabulary: what an oracle
             draft keeps at V. A greedy head's accepted drafts at V are those at full size less the
             ones whose token is outside (about a 1 - coverage share, fewer where rare tokens are the
             head's misses anyway), plus rare lucky ones. `static`: the V chosen tokens alone;
             `sequence`: with the tokens of the prompt and the output before each position (up to V
             more), as a source drafts. Any model, head or not.
  acceptance with an MTP head (qwen35's built-in): draft-mtp at fixed --n-max, greedy, accepted /
             drafted and tokens per step; every output checked token for token against plain.
  draft ms   (--draft-time) the head's draft call, best of --reps, on a held-out prompt's state.

    python3 scripts/bench_draft_vocab.py -m smollm2-135m --vocab 0 32768 8192 4096 -n 64
    python3 scripts/bench_draft_vocab.py -m tiny-qwen35-mtp.gguf --vocab 0 256 128 64 --n-max 3
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridrt.decoding.generate import generate  # noqa: E402
from hybridrt.runtime.loader import load_model  # noqa: E402
from hybridrt.files.registry import resolve_model  # noqa: E402
from hybridrt.decoding.sampling import SamplerConfig  # noqa: E402
from hybridrt.decoding.speculative.draft_vocab import choose_draft_vocab, draft_head  # noqa: E402
from hybridrt.decoding.speculative.loop import SpecConfig  # noqa: E402
from hybridrt.decoding.speculative.sources import build_source  # noqa: E402
from hybridrt.train_mtp.prompts import HELDOUT_PROMPTS  # noqa: E402
from hybridrt.train_mtp.train import prompt_ids  # noqa: E402

GREEDY = SamplerConfig(temp=0.0)


def draft_ms(m, size: int, prompt: list[int], reps: int) -> float:
    """Best time of one draft (block + output rows) after the prompt, in ms."""
    mtp = draft_head(m, size)
    s = m.session(len(prompt) + reps + 8)
    s.eval(prompt, logits="none")
    row, best = torch.empty(1, getattr(mtp, "max_out", mtp.n_out)), float("inf")
    tok, hid = torch.tensor(prompt[-1:]), s.hidden[-1:]
    for i in range(reps):
        t0 = time.perf_counter()
        mtp.draft(s.state, tok, hid, len(prompt) + i, out=row)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def coverage(chosen: set[int], prompts: list[list[int]], refs: list[list[int]], cap: int) -> tuple[float, float]:
    """(static, sequence) shares of the reference tokens inside the draft vocabulary."""
    inside = outside_added = total = 0
    for ids, ref in zip(prompts, refs):
        vocab, added = set(chosen), 0
        for j, t in enumerate(ids + ref):
            if j >= len(ids):
                total += 1
                inside += t in chosen
                outside_added += t in vocab
            if t not in vocab and added < cap:
                vocab.add(t)
                added += 1
    return inside / total, outside_added / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True, help="GGUF path or registry name")
    ap.add_argument("--vocab", type=int, nargs="+", default=[0, 32768, 8192, 4096],
                    help="draft vocabulary sizes (0: full); sizes at or above the model's vocabulary are skipped")
    ap.add_argument("-n", type=int, default=64, help="tokens generated per prompt")
    ap.add_argument("--prompts", type=int, default=len(HELDOUT_PROMPTS), help="the first N held-out prompts")
    ap.add_argument("--n-max", type=int, default=3, help="drafts per step (fixed) where the model has an MTP head")
    ap.add_argument("--draft-time", action="store_true", help="also time one draft per V")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, help="write the figures here too")
    args = ap.parse_args()

    m = load_model(resolve_model(args.model), threads=args.threads)
    sizes = [v for v in args.vocab if v < m.n_vocab]
    prompts = [prompt_ids(m, p) for p in HELDOUT_PROMPTS[:args.prompts]]
    refs = [generate(m, m.session(len(ids) + args.n + 8), ids, args.n, GREEDY, stop_ids=set())[0] for ids in prompts]
    has_head = getattr(m, "mtp", None) is not None
    rows = []
    for v in sizes:
        ids = choose_draft_vocab(m.tokenizer, m.n_vocab, v)
        static, sequence = coverage(set(ids.tolist()), prompts, refs, v) if ids is not None else (1.0, 1.0)
        row = {"vocab": v or m.n_vocab, "static": static, "sequence": sequence}
        if has_head:
            spec, drafted, accepted, steps, identical = SpecConfig(n_max=args.n_max), 0, 0, 0, True
            for ids_p, ref in zip(prompts, refs):
                session = m.session(len(ids_p) + args.n + spec.k_max + 8, k_max=spec.k_max)
                source = build_source("draft-mtp", session, GREEDY, spec, draft_vocab=v)
                out, stats = generate(m, session, ids_p, args.n, GREEDY, source, spec, stop_ids=set())
                identical &= out == ref
                drafted, accepted = drafted + sum(stats.spec.drafted), accepted + sum(stats.spec.accepted)
                steps += stats.spec.steps
            row |= {"acceptance": accepted / max(drafted, 1), "tokens_per_step": (accepted + steps) / max(steps, 1),
                    "identical": identical}
            if args.draft_time:
                row["draft_ms"] = draft_ms(m, v, prompts[0], args.reps)
        rows.append(row)
        print("  ".join(f"{k} {x:.4f}" if isinstance(x, float) else f"{k} {x}" for k, x in row.items()), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model), "n_vocab": m.n_vocab, "n": args.n,
                                         "prompts": len(prompts), "n_max": args.n_max, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
