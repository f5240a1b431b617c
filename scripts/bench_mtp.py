#!/usr/bin/env python3
"""Trained MTP heads on real models: held-out acceptance and draft-mtp speed next to plain decoding.

For each model, trains a head with `hybridrt train-mtp` (or reuses the one cached under
~/.cache/hybridrt/heads/), then on the held-out prompts (never used in training: chat, prose, code,
lists, Q&A) and two adversarial ones decodes greedily with plain decoding, draft-mtp at each fixed
N (--no-adaptive) and adaptive draft-mtp (the default) with n_max = the largest N (--lookup: the
same modes again with prompt lookup drafting first, `--spec-type ngram-simple,draft-mtp`), the runs
of one prompt alternating so that all see the same machine load (best of --reps per prompt and mode).
Every speculative output is checked token for token against plain decoding.

    python3 scripts/bench_mtp.py -m smollm2-135m -m gemma3-270m -t 2 --json out.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
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
from hybridrt.decoding.speculative.bench_prompts import ADVERSARIAL_PROMPT  # noqa: E402
from hybridrt.decoding.speculative.loop import SpecConfig  # noqa: E402
from hybridrt.decoding.speculative.sources import build_source  # noqa: E402
from hybridrt.train_mtp.config import TrainConfig  # noqa: E402
from hybridrt.train_mtp.prompts import HELDOUT_PROMPTS  # noqa: E402
from hybridrt.train_mtp.train import prompt_ids  # noqa: E402
from hybridrt.runtime.warmup import warm_up  # noqa: E402

HEADS = Path.home() / ".cache" / "hybridrt" / "heads"
GREEDY = SamplerConfig(temp=0.0)


def head_for(model: str, args) -> Path:
    path = Path(args.head) if args.head else HEADS / f"{Path(str(model)).stem}.v4.mtp.gguf"
    if path.exists() and not args.retrain:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-c", "from hybridrt.cli.commands import main; main()", "train-mtp", "-m", model, "-o", str(path),
           "--tokens", str(args.tokens), "--steps", str(args.steps), "--draft-vocab", str(args.draft_vocab),
           "--json"] + (["-t", str(args.threads)] if args.threads else [])
    t0, c0 = time.perf_counter(), time.process_time()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"train-mtp failed:\n{r.stderr}")
    info = json.loads(r.stdout)
    print(f"trained {path}: {time.perf_counter() - t0:.0f} s wall, {info['cpu_s']:.0f} s CPU, "
          f"held-out acceptance {info['heldout_acceptance']:.1%}", file=sys.stderr)
    return path


def prompts(m) -> list[tuple[str, list[int]]]:
    out = [(f"{p.domain}/{p.kind}", prompt_ids(m, p)) for p in HELDOUT_PROMPTS]
    out.append(("adversarial/text", m.tokenize(ADVERSARIAL_PROMPT)))
    g = torch.Generator().manual_seed(0)
    out.append(("adversarial/random-tokens", torch.randint(1000, m.n_vocab - 1000, (48,), generator=g).tolist()))
    return out


def run_mode(m, ids: list[int], n_gen: int, n_max: int | None, adaptive: bool, gate: bool = True,
             spec_type: str = "draft-mtp", policies: dict | None = None):
    """(tokens, decode seconds, drafted, accepted); n_max None: plain decoding. policies: adaptive
    length's policies to continue (as a server's session keeps them between requests). New adaptive
    policies start as `run`'s and `serve`'s: from the verify costs a warm-up timed (warmup.warm_up,
    untimed here)."""
    if n_max is None:
        out, stats = generate(m, m.session(len(ids) + n_gen + 16), ids, n_gen, GREEDY, stop_ids=set())
        return out, stats.decode_s, 0, 0
    spec = SpecConfig(n_max=n_max, adaptive=adaptive, gate=gate)
    if adaptive and not policies:       # new policies (kept ones continue as they are)
        seeded = warm_up(m, spec_type, spec, GREEDY, "f32")
        if policies is None:
            policies = seeded
        else:                           # --keep-policies: this mode's first prompt
            policies.update(seeded)
    session = m.session(len(ids) + n_gen + 16, k_max=spec.k_max)
    source = build_source(spec_type, session, GREEDY, spec)
    out, stats = generate(m, session, ids, n_gen, GREEDY, source, spec, stop_ids=set(), policies=policies)
    return out, stats.decode_s, sum(stats.spec.drafted), sum(stats.spec.accepted)


def step_costs(m, reps: int = 30, k_max: int = 4) -> dict:
    """Median ms of a plain step (the decode path, logits of the last row), a k-token verify (every
    row's logits, k = 1..k_max) and one head draft (step + head), alternating in one process so all
    see the same load."""
    s = m.session(512, k_max=k_max)
    ids = m.tokenize("The history of the printing press begins in the fifteenth century, when")
    s.eval(ids)
    h, pos = s.hidden[-1:], len(ids)
    row = torch.empty(1, m.mtp.n_out)
    times = {"plain": [], "draft": [], **{f"verify{k}": [] for k in range(1, k_max + 1)}}
    for _ in range(reps):
        t0 = time.perf_counter()
        s.eval([100], start_pos=pos, logits="last")
        times["plain"].append(time.perf_counter() - t0)
        for k in range(1, k_max + 1):
            t0 = time.perf_counter()
            s.eval(list(range(100, 100 + k)), start_pos=pos, logits="all")
            times[f"verify{k}"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        m.mtp.draft(s.state, torch.tensor([100]), h, pos, out=row)       # as MTPSource drafts
        times["draft"].append(time.perf_counter() - t0)
    ms = {k: 1e3 * sorted(v)[len(v) // 2] for k, v in times.items()}
    return {**ms, "verify2_over_plain": ms["verify2"] / ms["plain"], "draft_over_plain": ms["draft"] / ms["plain"]}


def bench_model(model: str, args) -> dict:
    head = head_for(model, args)
    m = load_model(model, threads=args.threads, mtp_head=head)
    modes = [("plain", None, False, True, "")] + [(f"N={n}", n, False, True, "draft-mtp") for n in args.n_max] + \
        [(f"adaptive<={max(args.n_max)}", max(args.n_max), True, True, "draft-mtp")]
    if args.ungated:
        modes.append((f"adaptive<={max(args.n_max)} ungated", max(args.n_max), True, False, "draft-mtp"))
    if args.lookup:
        chain = "ngram-simple,draft-mtp"
        modes += [(f"lookup+N={n}", n, False, True, chain) for n in args.n_max] + \
            [(f"lookup+adaptive<={max(args.n_max)}", max(args.n_max), True, True, chain)]
    run_mode(m, m.tokenize("Hello"), 8, max(args.n_max), False)        # compile / warm up
    costs = step_costs(m)
    verify = ", ".join(f"{k[len('verify'):]}: {v:.1f}" for k, v in costs.items()
                       if k.startswith("verify") and not k.endswith("plain"))
    print(f"{Path(model).stem} step costs (median ms): plain {costs['plain']:.1f}, verify of k tokens ({verify}), "
          f"verify 2 / plain {costs['verify2_over_plain']:.2f}x, one draft {costs['draft']:.1f} "
          f"({costs['draft_over_plain']:.1%})", file=sys.stderr)
    if args.costs_only:
        return {"model": str(resolve_model(model)), "head": str(head), "costs": costs}
    rows = []
    kept = {label: {} for label, *_ in modes} if args.keep_policies else {}    # per mode, across prompts
    for name, ids in prompts(m)[:args.limit]:
        best = {label: None for label, *_ in modes}
        ref = None
        for _ in range(args.reps):
            for label, n, adaptive, gate, spec_type in modes:   # alternating: every mode sees the same load
                out, secs, drafted, accepted = run_mode(m, ids, args.n_gen, n, adaptive, gate, spec_type,
                                                        kept.get(label))
                if n is None:
                    ref = out
                same = out == ref
                if best[label] is None or secs < best[label]["s"]:
                    best[label] = {"s": secs, "drafted": drafted, "accepted": accepted, "identical": same}
                else:
                    best[label]["identical"] &= same
        rows.append({"prompt": name, "n_prompt": len(ids), **best})
        print(f"{Path(model).stem} {name}: " + ", ".join(
            f"{k} {args.n_gen / v['s']:.1f} t/s" + (f" acc {v['accepted'] / max(1, v['drafted']):.0%}" if v["drafted"] else "")
            for k, v in best.items()), file=sys.stderr)
    return {"model": str(resolve_model(model)), "head": str(head), "costs": costs,
            "modes": [lbl for lbl, *_ in modes], "rows": rows}


def summarize(res: dict, n_gen: int) -> list[str]:
    lines = [f"### {Path(res['model']).name} (head {Path(res['head']).name})", "",
             "| prompt set | " + " | ".join(res["modes"]) + " |", "|---" * (len(res["modes"]) + 1) + "|"]
    groups = {"held-out": [r for r in res["rows"] if not r["prompt"].startswith("adversarial")]}
    for r in res["rows"]:
        if r["prompt"].startswith("adversarial"):
            groups[r["prompt"]] = [r]
    for gname, rows in groups.items():
        cells = []
        plain = sum(r["plain"]["s"] for r in rows)
        for mode in res["modes"]:
            secs = sum(r[mode]["s"] for r in rows)
            tps = n_gen * len(rows) / secs
            drafted = sum(r[mode]["drafted"] for r in rows)
            acc = sum(r[mode]["accepted"] for r in rows) / drafted if drafted else None
            same = all(r[mode]["identical"] for r in rows)
            cell = f"{tps:.1f} t/s"
            if mode != "plain":
                cell += f", {plain / secs:.2f}x, acc {acc:.0%}" if acc is not None else f", {plain / secs:.2f}x"
                cell += "" if same else " (OUTPUT DIFFERS)"
            cells.append(cell)
        lines.append(f"| {gname} ({len(rows)} prompts) | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", action="append", required=True)
    ap.add_argument("--head", help="head file (default: ~/.cache/hybridrt/heads/NAME.mtp.gguf, trained if missing)")
    ap.add_argument("--retrain", action="store_true")
    ap.add_argument("-t", "--threads", type=int)
    ap.add_argument("-n", "--n-gen", type=int, default=64)
    ap.add_argument("--n-max", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=TrainConfig.tokens)
    ap.add_argument("--steps", type=int, default=TrainConfig.steps)
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--limit", type=int, help="only the first LIMIT prompts (a quick check)")
    ap.add_argument("--costs-only", action="store_true", help="only the plain / verify-2 / draft step costs")
    ap.add_argument("--keep-policies", action="store_true",
                    help="adaptive modes continue their length policies from prompt to prompt, as `serve` does "
                         "between a session's requests (default: each run learns afresh, as `run` does)")
    ap.add_argument("--ungated", action="store_true", help="also adaptive without the confidence gate (SpecConfig.gate)")
    ap.add_argument("--lookup", action="store_true",
                    help="also every mode with prompt lookup first (--spec-type ngram-simple,draft-mtp)")
    ap.add_argument("--json", type=Path, help="write the raw results here")
    args = ap.parse_args()
    results = [bench_model(model, args) for model in args.model]
    for res in results:
        if "rows" in res:
            print("\n".join(summarize(res, args.n_gen)))
            print()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
