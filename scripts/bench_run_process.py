#!/usr/bin/env python3
"""`hybridrt run` as a user runs it: one fresh process per generation (its model load, warm-up and
fresh adaptive policy included), decode t/s as run prints it, plain decoding against draft-mtp at
fixed N and adaptive, on bench_mtp's held-out prompts (chat ones in the model's chat template, raw
where it has none, as bench_mtp). The modes of one prompt alternate so all see
the same machine load; best of --reps per prompt and mode; the sums over prompts give the ratios.
bench_mtp.py measures in one warm process, which a user's `run` never is.

    python3 scripts/bench_run_process.py -m smollm2-135m --head ~/.cache/hybridrt/heads/smollm2-135m.v4.mtp.gguf --limit 12
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridrt.errors import UserError  # noqa: E402
from hybridrt.files.gguf_file import GGUFError, GGUFFile  # noqa: E402
from hybridrt.files.registry import resolve_model  # noqa: E402
from hybridrt.train_mtp.prompts import HELDOUT_PROMPTS  # noqa: E402

DECODE = re.compile(r"decode: (\d+) tokens in (\d+) ms")


def mode_args(mode: str) -> list[str]:
    """plain, nK (fixed N = K) or ad (adaptive, n_max 3: run's default)."""
    if mode == "plain":
        return ["--spec-type", "none"]
    if mode == "ad":
        return ["--spec-type", "draft-mtp"]
    if re.fullmatch(r"n\d+", mode):
        return ["--spec-type", "draft-mtp", "--spec-draft-n-max", mode[1:], "--no-adaptive"]
    raise UserError(f"mode {mode}: use plain, nK or ad")


def run_once(args, prompt, mode: str, chat_template: bool) -> float:
    # chat prompts in the model's template, raw where it has none: the text train-mtp and bench_mtp
    # judge the head on (train.prompt_ids; run -cnv would fall back to ChatML)
    chat = prompt.kind == "chat" and chat_template
    cmd = [sys.executable, "-c", "from hybridrt.cli.commands import main; main()", "run", "-m", args.model,
           "--mtp-head", args.head, "-p", prompt.text, "-n", str(args.n_gen), "--temp", "0", "--ignore-eos",
           "--no-display-prompt", "-t", str(args.threads), *(["-cnv"] if chat else []),
           *mode_args(mode), *args.extra]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    m = DECODE.search(r.stderr)
    if r.returncode or m is None:
        raise SystemExit(f"error: {' '.join(cmd)} failed:\n{r.stderr}")
    return int(m.group(2)) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--head", required=True, help="trained head (train-mtp)")
    ap.add_argument("--modes", nargs="+", default=["plain", "n1", "ad"])
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--limit", type=int, default=len(HELDOUT_PROMPTS), help="the first N held-out prompts")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more run flags (last)")
    args = ap.parse_args()
    try:        # bad input is one error line, exit 2, as the CLI's
        for mode in args.modes:
            mode_args(mode)
        chat_template = GGUFFile(resolve_model(args.model)).get("tokenizer.chat_template") is not None
    except (UserError, GGUFError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    totals = dict.fromkeys(args.modes, 0.0)
    for i, prompt in enumerate(HELDOUT_PROMPTS[:args.limit]):
        best = dict.fromkeys(args.modes, float("inf"))
        for _ in range(args.reps):
            for mode in args.modes:
                best[mode] = min(best[mode], run_once(args, prompt, mode, chat_template))
        for mode in args.modes:
            totals[mode] += best[mode]
        print(f"{i} {prompt.domain}/{prompt.kind}: " + ", ".join(f"{m} {args.n_gen - 1} tokens in {1e3 * s:.0f} ms"
                                                             for m, s in best.items()), file=sys.stderr, flush=True)
    n_tokens = (args.n_gen - 1) * min(args.limit, len(HELDOUT_PROMPTS))
    base = totals.get("plain")
    print(f"{Path(args.model).stem}, {args.limit} prompts, best of {args.reps}, one process per run:")
    for mode, secs in totals.items():
        ratio = f" ({base / secs:.2f}x plain)" if base else ""
        print(f"  {mode}: {n_tokens / secs:.1f} t/s{ratio}")
    fixed = [m for m in totals if m.startswith("n")]
    if "ad" in totals and fixed:
        best_fixed = min(fixed, key=totals.get)
        print(f"  adaptive / best fixed ({best_fixed}): {totals[best_fixed] / totals['ad']:.3f}")


if __name__ == "__main__":
    main()
