"""Where a decode step's time goes: quantized-kernel time vs everything else (torch ops, Python).

    python scripts/profile_decode.py [MODEL] [-t 2] [-n 40]
Wraps the CPU backends' kernel entry points (matvec, fused FFN) with timers, decodes n tokens
after a warm-up, and prints ms per token per part; the output head is also timed alone.
"""
from __future__ import annotations

import argparse
import time

import torch

import hybridrt.backends as backends
from hybridrt.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--n-steps", type=int, default=40)
    args = ap.parse_args()

    spent = {"matvec": 0.0, "ffn": 0.0}

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t0
        return wrapper

    backends.matvec = timed("matvec", backends.matvec)
    backends.ffn_glu = timed("ffn", backends.ffn_glu)
    m = load_model(args.model, threads=args.threads)
    s = m.session(256)
    s.eval(list(range(100, 120)), logits="last")
    buf = torch.empty(1, m.n_vocab)
    for _ in range(5):
        s.eval([500], logits="last", out=buf)
    spent.update(matvec=0.0, ffn=0.0)
    t0 = time.perf_counter()
    for _ in range(args.n_steps):
        s.eval([500], logits="last", out=buf)
    total = (time.perf_counter() - t0) / args.n_steps * 1e3
    x = torch.randn(1, m.n_embd)
    t0 = time.perf_counter()
    for _ in range(args.n_steps):
        m.output(x, out=buf)
    head = (time.perf_counter() - t0) / args.n_steps * 1e3
    mv, ffn = (spent[k] / args.n_steps * 1e3 for k in ("matvec", "ffn"))
    print(f"{m.gguf.path}: {total:.1f} ms/token = matvec {mv:.1f} (output head alone {head:.1f}) "
          f"+ fused FFN {ffn:.1f} + other {total - mv - ffn:.1f}")


if __name__ == "__main__":
    main()
