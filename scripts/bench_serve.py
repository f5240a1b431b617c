#!/usr/bin/env python3
"""Serving throughput of `hybridrt serve` with N concurrent streaming clients, next to llama.cpp's
batched decode of the same model and N sequences, in one run.

    python scripts/bench_serve.py [MODEL ...] [-t 2] [-npl 1,2,4,8] [-n 64] [--reps 1] [--spec [FLAGS]]
        [--serve-args FLAGS] [--no-llamacpp] [--json]

MODEL: known names (smollm2-135m, gemma3-270m: the default is both) or GGUF paths. For each model:
  * `hybridrt serve -m MODEL -t T --parallel max(N) --spec-type none` starts on a free loopback
    port (and, with --spec, a second server with those flags instead of `--spec-type none`;
    `--spec` alone is `--spec-type ngram-simple`); the bench waits for /health. -t is serve's:
    the threads of the shared steps (continuous batching, serve's default) and of each session's
    own work; with serve's -nocb (--serve-args -nocb) each session decodes alone with T threads.
  * llama.cpp: scripts/bench_llamacpp_batched.py in the oracle venv (scripts/oracle_setup.sh
    builds it), the model loaded once with max(N) sequences and T threads: per request, the N
    prompts in one llama_decode, then one llama_decode per step for all N sequences.
  * one untimed warm-up round of each engine at max(N) streams, then for each N, --reps rounds in
    which the engines take turns (llama.cpp, hybridrt, hybridrt with --spec), so all see the same load.
A hybridrt round: N clients at once (the `openai` package's AsyncOpenAI, one event loop), each a
streaming /v1/completions request of a distinct prompt (the same N prompts llama.cpp gets), greedy
(temperature 0), max_tokens = -n and ignore_eos (llama-server's extension), so every stream is -n
tokens long; the final chunk's usage gives each stream's token counts (a mismatch is an error).

Reported per model, engine and N (the table; --json: the same rows as one JSON object, with the
machine and the settings; progress goes to stderr):
  decode t/s   aggregate decode throughput: the tokens after each stream's first, summed over the
               N streams, over the wall time from the first token of any stream to the last token
               of any stream (each token's time: its chunk's arrival at the client). llama.cpp:
               N (n - 1) tokens over the summed time of its n - 1 decode steps. Median over --reps.
  x N=1        decode t/s over the same engine's at N = 1 (when -npl has 1).
  vs llama.cpp decode t/s over llama.cpp's at the same N.
  TTFT         time to first token of each stream, from its request's send to its first chunk with
               text; llama.cpp: the N prompts' batch and first tokens (one time for all N). p50, p95.
  token ms     per-token latency: the gaps between consecutive text chunks of a stream (a chunk per
               token; drafted tokens that a verify accepts arrive together, so speculation lowers
               p50 more than p95); llama.cpp: each decode step's time. p50, p95.
Percentiles are nearest-rank over every stream (and rep) of the row. e2e_tps (JSON only): all
completion tokens over the wall time from the first request's send to the last token.
Bad input (a model not pulled, a bad -npl list, no oracle venv without --no-llamacpp, serve refusing
the flags) prints one `error: ...` line and exits 2; a failure while measuring exits 1.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_mission import Parser, check_oracle, gguf_path, host, int_list, log, oracle_python  # noqa: E402
from hybridrt.errors import UserError  # noqa: E402
from hybridrt.files.gguf_file import GGUFError  # noqa: E402

HOST = "127.0.0.1"
DEFAULT_MODELS = ("smollm2-135m", "gemma3-270m")
NGRAM = "--spec-type ngram-simple"
# distinct openings, so that no two streams decode the same text (and n-gram drafts find only
# what each stream's own text repeats)
PROMPTS = (
    "The history of the city of Paris begins",
    "Here is a simple recipe for tomato soup:",
    "The three laws of thermodynamics say that",
    "Once upon a time, in a small fishing village,",
    "To install Python on a new computer, first",
    "The main causes of the First World War were",
    "A good way to learn a new language is",
    "Photosynthesis is the process by which plants",
)
PROMPT_ROOM = 128       # context beyond -n for the prompt (and a verify's drafts)
START_TIMEOUT_S = 600   # a first start may compile the kernels


def prompts(n: int) -> list[str]:
    """n distinct prompts: PROMPTS, then numbered parts of them."""
    return [PROMPTS[i] if i < len(PROMPTS) else f"Part {i // len(PROMPTS) + 1}. {PROMPTS[i % len(PROMPTS)]}"
            for i in range(n)]


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile: the smallest value with at least p % of the values at or below it."""
    ranked = sorted(values)
    return ranked[max(0, math.ceil(p / 100 * len(ranked)) - 1)]


def p50_p95_ms(seconds: list[float]) -> dict | None:
    if not seconds:
        return None
    return {"p50": round(1e3 * percentile(seconds, 50), 2), "p95": round(1e3 * percentile(seconds, 95), 2)}


# --- one hybridrt round ---------------------------------------------------------------------------
@dataclass
class Stream:
    """What one client saw: perf_counter times of its request's send and of each chunk with text."""
    sent: float
    chunks: list[float]
    prompt_tokens: int
    completion_tokens: int
    drafted: int = 0
    accepted: int = 0


async def _stream(client, prompt: str, n_gen: int) -> Stream:
    sent = time.perf_counter()
    response = await client.completions.create(model="bench", prompt=prompt, max_tokens=n_gen, temperature=0.0,
                                               stream=True, extra_body={"ignore_eos": True})
    chunks, usage, timings = [], None, {}
    async for chunk in response:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].text:
            chunks.append(now)
        if chunk.usage is not None:
            usage = chunk.usage
            timings = (chunk.model_extra or {}).get("timings") or {}
    if usage is None:
        raise RuntimeError("a stream ended without usage")
    return Stream(sent, chunks, usage.prompt_tokens, usage.completion_tokens,
                  timings.get("draft_n", 0), timings.get("draft_n_accepted", 0))


async def _streams(url: str, texts: list[str], n_gen: int) -> list[Stream]:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=3600.0) as client:
        return list(await asyncio.gather(*(_stream(client, t, n_gen) for t in texts)))


def hybridrt_round(url: str, n: int, n_gen: int) -> list[Stream]:
    streams = asyncio.run(_streams(url, prompts(n), n_gen))
    wrong = [s.completion_tokens for s in streams if s.completion_tokens != n_gen]
    if wrong:
        raise RuntimeError(f"streams of {wrong} tokens, {n_gen} asked (ignore_eos not honoured?)")
    return streams


def decode_tps(streams: list[Stream]) -> float:
    """Tokens after each stream's first, over the first token of any stream to the last of any."""
    window = max(s.chunks[-1] for s in streams) - min(s.chunks[0] for s in streams)
    return sum(s.completion_tokens - 1 for s in streams) / window


def e2e_tps(streams: list[Stream]) -> float:
    return sum(s.completion_tokens for s in streams) / (max(s.chunks[-1] for s in streams) - min(s.sent for s in streams))


def hybridrt_row(rounds: list[list[Stream]]) -> dict:
    streams = [s for r in rounds for s in r]
    per_round = [decode_tps(r) for r in rounds]
    row = {"decode_tps": round(statistics.median(per_round), 2), "decode_tps_reps": [round(v, 2) for v in per_round],
           "e2e_tps": round(statistics.median(e2e_tps(r) for r in rounds), 2),
           "ttft_ms": p50_p95_ms([s.chunks[0] - s.sent for s in streams]),
           "token_ms": p50_p95_ms([b - a for s in streams for a, b in zip(s.chunks, s.chunks[1:])]),
           "prompt_tokens": [s.prompt_tokens for s in rounds[0]],
           "completion_tokens": [s.completion_tokens for s in streams]}
    drafted = sum(s.drafted for s in streams)
    if drafted:
        row["draft_accept"] = round(sum(s.accepted for s in streams) / drafted, 3)
    return row


# --- the processes --------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def end(proc: subprocess.Popen, ask) -> None:
    """Ask a process to stop (ask()), killing it if it has not within 20 s."""
    if proc.poll() is None:
        ask()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# the flags Server passes to `hybridrt serve` itself
SERVER_FLAGS = frozenset({"-m", "--model", "--port", "--host", "--parallel", "-np", "-t", "--threads", "-c", "--ctx-size",
                          "--log-level"})


def serve_flags(text: str, what: str, taken: frozenset[str] = SERVER_FLAGS) -> list[str]:
    """More `hybridrt serve` flags from one quoted string; UserError on bad quoting or on a flag in
    `taken` (set by the script itself: a second value would silently win or lose)."""
    try:
        flags = shlex.split(text)
    except ValueError as exc:
        raise UserError(f"{what}: {exc}") from None
    clash = taken & set(flags)
    if clash:
        raise UserError(f"{what}: {' '.join(sorted(clash))}: the script sets these itself")
    return flags


class Server:
    """`hybridrt serve` in a subprocess on a free loopback port, up once /health answers."""

    def __init__(self, path: Path, threads: int, parallel: int, n_ctx: int, flags: list[str]):
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log = tempfile.TemporaryFile(mode="w+")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        cmd = [sys.executable, "-c", "from hybridrt.cli.commands import main; main()", "serve", "-m", str(path),
               "--host", HOST, "--port", str(self.port), "-t", str(threads), "--parallel", str(parallel),
               "-c", str(n_ctx), "--log-level", "warning", *flags]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            self._wait_up()
        except BaseException:
            self.close()
            raise

    def _wait_up(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                lines = self.output().strip().splitlines() or ["no output"]
                error = next((line for line in lines if line.startswith("error: ")), None)
                if self.proc.returncode == 2 and error:        # serve refused its flags: bad input
                    raise UserError(f"hybridrt serve: {error.removeprefix('error: ')}")
                raise RuntimeError(f"hybridrt serve exited with {self.proc.returncode}: {lines[-1]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise RuntimeError(f"hybridrt serve did not answer /health in {START_TIMEOUT_S} s")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def close(self) -> None:
        end(self.proc, self.proc.terminate)
        self.log.close()


class LlamaBatched:
    """scripts/bench_llamacpp_batched.py in the oracle venv: the model loaded once, a request a line."""

    def __init__(self, path: Path, threads: int, n_seq_max: int, n_ctx: int):
        n_batch = max(512, sum(len(p.encode()) + 2 for p in prompts(n_seq_max)))     # every prompt in one batch
        cmd = [str(oracle_python()), str(ROOT / "scripts" / "bench_llamacpp_batched.py"), str(path),
               "-t", str(threads), "--n-seq-max", str(n_seq_max), "--n-ctx", str(n_ctx), "--n-batch", str(n_batch)]
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True)
        self.version = self._answer()["llama_cpp"]

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.err.seek(0)
            tail = (self.err.read().strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"llama.cpp batched decode exited with {self.proc.wait()}: {tail}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"llama.cpp batched decode: {answer['error']}")
        return answer

    def run(self, n: int, n_gen: int) -> dict:
        self.proc.stdin.write(json.dumps({"prompts": prompts(n), "n_gen": n_gen}) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        end(self.proc, self.proc.stdin.close)      # end of input: its loop returns
        self.err.close()


def llamacpp_row(rounds: list[dict]) -> dict:
    per_round = [r["decode_tps"] for r in rounds]
    return {"decode_tps": round(statistics.median(per_round), 2), "decode_tps_reps": [round(v, 2) for v in per_round],
            "ttft_ms": p50_p95_ms([r["prompt_s"] for r in rounds]),
            "token_ms": p50_p95_ms([t for r in rounds for t in r["step_s"]]),
            "prompt_tokens": rounds[0]["n_prompt"], "completion_tokens": [len(t) for r in rounds for t in r["tokens"]]}


# --- the run --------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("models", nargs="*", default=list(DEFAULT_MODELS), metavar="MODEL",
                    help=f"known names or GGUF paths (default: {' '.join(DEFAULT_MODELS)})")
    ap.add_argument("-t", "--threads", type=int, default=2, help="serve's -t and llama.cpp's threads")
    ap.add_argument("-npl", "--streams", dest="n_list", default="1,2,4,8",
                    help="concurrent streams N, comma-separated (llama-batched-bench's -npl)")
    ap.add_argument("-n", "--n-predict", type=int, default=64, help="tokens of every stream (>= 2)")
    ap.add_argument("--reps", type=int, default=1, help="rounds of each engine per N (alternating)")
    ap.add_argument("--spec", nargs="?", const=NGRAM, default=None, metavar="FLAGS",
                    help=f"also serve with these speculation flags (alone: {NGRAM!r}); "
                         "quote them: --spec '--spec-type ngram-simple --spec-draft-n-max 4'")
    ap.add_argument("--serve-args", default="", metavar="FLAGS", help="more `hybridrt serve` flags for every server")
    ap.add_argument("--no-llamacpp", action="store_true", help="hybridrt only (no oracle venv needed)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout instead of the table")
    return ap.parse_args(argv)


def check_args(args: argparse.Namespace) -> list[Path]:
    """Every input checked before any server starts (UserError: one error line, exit 2)."""
    args.ns = int_list(args.n_list, "-npl")
    if max(args.ns) > 64:
        raise UserError(f"-npl {args.n_list!r}: at most 64 streams")
    for flag, value, least in (("-t", args.threads, 1), ("-n", args.n_predict, 2), ("--reps", args.reps, 1)):
        if value < least:
            raise UserError(f"{flag} {value}: must be >= {least}")
    args.spec_flags = serve_flags(args.spec, "--spec") if args.spec is not None else None
    args.serve_flags = serve_flags(args.serve_args, "--serve-args")
    if args.spec_flags == []:
        raise UserError("--spec '': give speculation flags, or --spec alone for n-gram drafts")
    if "--spec-type" in args.serve_flags:
        raise UserError("--serve-args: speculation goes in --spec")
    check_oracle(args.no_llamacpp)
    return [gguf_path(model) for model in args.models]


ENGINES = ("llama.cpp", "hybridrt", "hybridrt spec")


def bench_model(args, path: Path) -> list[dict]:
    """Every row of one model: the engines started, warmed up, then alternating per N."""
    n_max, n_ctx = max(args.ns), args.n_predict + PROMPT_ROOM
    runners, closers = {}, []
    try:
        if not args.no_llamacpp:
            log(f"{path.name}: llama.cpp batched decode, {n_max} sequences, -t {args.threads}")
            anchor = LlamaBatched(path, args.threads, n_max, n_ctx)
            closers.append(anchor.close)
            runners["llama.cpp"] = lambda n, n_gen: anchor.run(n, n_gen)
        for engine, spec in (("hybridrt", ["--spec-type", "none"]), ("hybridrt spec", args.spec_flags)):
            if spec is None:
                continue
            log(f"{path.name}: hybridrt serve --parallel {n_max} -t {args.threads} {' '.join(spec + args.serve_flags)}")
            server = Server(path, args.threads, n_max, n_ctx, spec + args.serve_flags)
            closers.append(server.close)
            runners[engine] = lambda n, n_gen, url=server.url: hybridrt_round(url, n, n_gen)
        order = [e for e in ENGINES if e in runners]
        log(f"  warm-up: {n_max} streams of 4 tokens on each engine")
        for engine in order:
            runners[engine](n_max, 4)
        rounds = {(e, n): [] for e in order for n in args.ns}
        for n in args.ns:
            for rep in range(args.reps):
                for engine in order:
                    got = runners[engine](n, args.n_predict)
                    rounds[engine, n].append(got)
                    tps = got["decode_tps"] if engine == "llama.cpp" else decode_tps(got)
                    log(f"  N={n} rep {rep + 1}/{args.reps} {engine}: {tps:.1f} t/s (load {os.getloadavg()[0]:.2f})")
    finally:
        for close in reversed(closers):
            close()
    rows = []
    for engine in order:
        for n in args.ns:
            got = rounds[engine, n]
            row = {"model": path.name, "engine": engine, "n": n, "n_predict": args.n_predict, "reps": args.reps,
                   **(llamacpp_row(got) if engine == "llama.cpp" else hybridrt_row(got))}
            if engine == "hybridrt spec":
                row["spec_flags"] = args.spec_flags
            rows.append(row)
    add_ratios(rows)
    return rows


def add_ratios(rows: list[dict]) -> None:
    """speedup: over the same engine at N = 1; vs_llamacpp: over llama.cpp at the same N; vs_plain
    (speculation): over hybridrt without it at the same N."""
    tps = {(r["engine"], r["n"]): r["decode_tps"] for r in rows}
    for r in rows:
        engine, n = r["engine"], r["n"]
        if (engine, 1) in tps:
            r["speedup"] = round(r["decode_tps"] / tps[engine, 1], 2)
        if engine != "llama.cpp" and ("llama.cpp", n) in tps:
            r["vs_llamacpp"] = round(r["decode_tps"] / tps["llama.cpp", n], 2)
        if engine == "hybridrt spec" and ("hybridrt", n) in tps:
            r["vs_plain"] = round(r["decode_tps"] / tps["hybridrt", n], 2)


def table(rows: list[dict]) -> str:
    head = ("model", "engine", "N", "decode t/s", "x N=1", "vs llama.cpp", "vs plain", "TTFT ms p50/p95",
            "token ms p50/p95", "accept")

    def ms(pair):
        return f"{pair['p50']:.1f} / {pair['p95']:.1f}" if pair else "-"

    def num(value, fmt):
        return format(value, fmt) if value is not None else "-"

    body = [(r["model"], r["engine"], str(r["n"]), f"{r['decode_tps']:.1f}", num(r.get("speedup"), ".2f"),
             num(r.get("vs_llamacpp"), ".2f"), num(r.get("vs_plain"), ".2f"), ms(r["ttft_ms"]), ms(r["token_ms"]),
             num(r.get("draft_accept"), ".2f")) for r in rows]
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
             for line in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        paths = check_args(args)
        machine = {"command": ["scripts/bench_serve.py", *argv], **host(not args.no_llamacpp)}
        log(f"{machine['cpu']}, {machine['cores']} cores, load {machine['load_avg']:.2f}")
        rows = [row for path in paths for row in bench_model(args, path)]
    except (UserError, GGUFError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    settings = {"threads": args.threads, "n": args.ns, "n_predict": args.n_predict, "reps": args.reps,
                "spec_flags": args.spec_flags, "serve_args": args.serve_flags, "prompts": prompts(max(args.ns)),
                "load_avg_end": os.getloadavg()[0]}
    if args.json:
        print(json.dumps({"machine": machine, "settings": settings, "rows": rows}))
    else:
        print(f"{machine['cpu']} ({machine['cores']} cores), {machine['date']}, load {machine['load_avg']:.2f} "
              f"-> {settings['load_avg_end']:.2f}; -t {args.threads}, {args.n_predict} tokens per stream, "
              f"reps {args.reps}" + (f", spec: {' '.join(args.spec_flags)}" if args.spec_flags else ""))
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
