#!/usr/bin/env python3
"""Benchmarks of the mission's size: hybridrt next to llama.cpp on one big GGUF, in one run.

    python scripts/bench_mission.py MODEL [-t 2] [-n 16] [--reps 3] [--sections decode,tk,pp,start,spec]
        [--k-max 8] [--depth 0] [--pp 512] [--cold] [--spec-n 1,2,3] [--spec-accept 0.6,0.8]
        [--spec-draft-vocab 0,4096] [--no-llamacpp]

MODEL: the 16.8 GB Qwen3.6-27B Q4_K_M file (`scripts/make_model.py --preset qwen3.6-27b-mtp`), or any
GGUF both engines load. Both engines run at -t threads and alternate rep by rep, so that both see the
same machine load; llama.cpp is scripts/bench_llamacpp.py in the oracle venv (scripts/oracle_setup.sh
builds it; --no-llamacpp measures hybridrt alone). Progress goes to stderr; stdout gets one JSON
object per section, the first ("machine") with the command line, CPU, cores, memory and date.

Sections (--sections, comma-separated; default decode,tk,pp,start). Each stdout line is
{"section": NAME, ..., "seconds": its wall time}; ENGINE is hybridrt or llamacpp, and a ratio is
hybridrt / llama.cpp.
  decode  greedy plain decoding of -n tokens after a short prompt (bench_vs_llamacpp's), median and
          best of --reps; the bytes one decode step reads (Model.weight_bytes_per_token: every matrix
          once, as `hybridrt bench` counts) times t/s against the machine's read bandwidth, measured
          with `hybridrt bench`'s probe (placement.measure_cpu_bandwidth, --bw-mib, -t threads).
          Fields: n_gen, reps, weight_bytes_per_token, file_bytes, read_bw_gbps, bw_probe_mib,
          ENGINE_tps, ENGINE_tps_best, ENGINE_ms_per_token, ENGINE_gbps, ENGINE_bw_fraction, ratio.
  tk      t(k), k = 1 .. --k-max: one forward of a k-token batch with logits for every token at the
          end of a short prompt (or of a --depth-token one), rolled back to its first token as a
          verify whose drafts are all rejected; one round of every k per rep, after an untimed
          warm-up. hybridrt: warmup.verify_costs (the snapshot ring restores the recurrent state).
          llama.cpp: bench_llamacpp.py --batches: llama_decode, then llama_memory_seq_rm with
          n_rs_seq = k_max - 1 recurrent-state snapshots (what its server keeps for draft-mtp); a
          build that refuses the partial removal re-evaluates the prompt instead, untimed
          (llamacpp_rollback: seq_rm or reprompt). Each timing leaves one more token in the context.
          Fields: k, n_prompt, reps, ENGINE_ms (median per k), ENGINE_rel (t(k) / t(1)), ratio (per
          k), llamacpp_rollback, llamacpp_n_rs_seq.
  pp      prompt processing of a --pp-token prompt, bench_vs_llamacpp's code paths.
          Fields: pp, reps, ENGINE_tps, ENGINE_tps_best, ratio.
  start   a fresh `hybridrt run -n 1 -t T --no-display-prompt` process, twice: seconds from its spawn
          to the model loaded (loader.load_model returned) and to its first byte on stdout (the first
          token: run's default warm-up and speculative mode included; --run-args adds flags), to its
          exit, and its peak RSS (its own rusage: mmap'd weight pages it touched count). --cold gives
          the first process an empty NUMBA_CACHE_DIR (every kernel it calls compiles), the second
          reuses it (warm); without --cold both use the usual cache. llama.cpp: one
          bench_llamacpp.py -n 1 -r 1 process (Llama() construction as its load).
          Fields: hybridrt: [{run: cold|first|warm, load_s, first_token_s, exit_s, peak_rss_mib,
          compiled, numba_cache}], llamacpp: {load_s, first_token_s, exit_s, peak_rss_mib}, run_args.
  spec    draft-mtp speculative decoding of -n tokens at fixed draft lengths N (--spec-n), drafts
          forced to a per-token acceptance probability alpha (--spec-accept). `hybridrt bench
          --spec-force` takes only accept (every draft kept) or reject (none), so these rows run its
          loop in this process with its ForcedSource at a corruption probability of 1 - alpha: each
          draft token is the target's own greedy token with probability alpha, and a step keeps the
          drafts up to the first wrong one; the MTP head still drafts, for its cost, over each
          --spec-draft-vocab V (0: the full output head; V: build_source's reduced vocabulary).
          Fields: n_gen, reps, hybridrt_plain_tps, llamacpp_plain_tps (the decode section's medians,
          or measured here when it did not run), rows: [{n_max, alpha, draft_vocab, accept_rate (accepted /
          drafted, as `run` reports it: below alpha for N > 1), tokens_per_step, tps, tps_best,
          identical (the output equals plain decoding's), vs_hybridrt_plain, vs_llamacpp_plain}].
Bad input (a missing file, an unknown section, no oracle venv) prints one `error: ...` line, exit 2.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import bench_vs_llamacpp as vs  # noqa: E402
from hybridrt.errors import UserError  # noqa: E402
from hybridrt.files.gguf_file import GGUFError, GGUFFile  # noqa: E402
from hybridrt.files.registry import cache_dir, resolve_model  # noqa: E402

SECTIONS = ("decode", "tk", "pp", "start", "spec")
DEFAULT_SECTIONS = "decode,tk,pp,start"
LOAD_MARK = "@bench_mission loaded"
# `hybridrt run` with load_model wrapped: one stderr line with the epoch seconds it returned at
RUN_DRIVER = f"""
import sys, time
import hybridrt.runtime.loader as loader
load = loader.load_model
def timed_load(*args, **kwargs):
    loader.load_model = load        # the model's load only, not a draft model's
    model = load(*args, **kwargs)
    print("{LOAD_MARK}", time.time(), file=sys.stderr, flush=True)
    return model
loader.load_model = timed_load
from hybridrt.cli.commands import main
main()
"""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def emit(section: str, row: dict) -> None:
    print(json.dumps({"section": section, **row}), flush=True)


def int_list(text: str, what: str, minimum: int = 1) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{what} {text!r}: expected comma-separated integers") from None
    if not values or min(values) < minimum:
        raise UserError(f"{what} {text!r}: expected integers >= {minimum}")
    return values


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """A usage error is one `error: ...` line and exit 2, as any other bad input."""
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="GGUF path (or a known name)")
    ap.add_argument("-t", "--threads", type=int, default=2, help="threads of both engines")
    ap.add_argument("-n", "--n-gen", type=int, default=16, help="decode / spec tokens per rep")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per engine (alternating)")
    ap.add_argument("--sections", default=DEFAULT_SECTIONS, help=f"any of {','.join(SECTIONS)}")
    ap.add_argument("--k-max", type=int, default=8, help="tk: batches of 1 .. k-max tokens")
    ap.add_argument("--depth", type=int, default=0, help="tk: batches after a prompt of this many tokens "
                    "(0: the short prompt)")
    ap.add_argument("--pp", type=int, default=512, help="pp: prompt tokens")
    ap.add_argument("--cold", action="store_true", help="start: the first run on an empty kernel cache")
    ap.add_argument("--run-args", default="", help="start: more `hybridrt run` flags, space-separated")
    ap.add_argument("--spec-n", default="1,2,3", help="spec: draft lengths N")
    ap.add_argument("--spec-accept", default="0.6,0.8", help="spec: forced per-token acceptance probabilities (0..1)")
    ap.add_argument("--spec-draft-vocab", default="0", help="spec: draft vocabularies V (0: the full head)")
    ap.add_argument("--bw-mib", type=int, default=512, help="decode: MiB the bandwidth probe reads")
    ap.add_argument("-ctk", "--cache-type", default="f16", help="hybridrt's KV cache (f16: llama.cpp's)")
    ap.add_argument("--no-llamacpp", action="store_true", help="hybridrt only (no oracle venv needed)")
    ap.add_argument("--device", default="cpu", help="hybridrt's trunk device (cuda: with --vram, the plan on a GPU)")
    ap.add_argument("--vram", default=None, help="execute a plan for this VRAM budget (e.g. 12GiB), as `run --vram`")
    ap.add_argument("-c", "--ctx-size", type=int, default=None, help="with --vram: the context the plan reserves")
    args = ap.parse_args(argv)
    args.section_list = [s.strip() for s in args.sections.split(",") if s.strip()]
    return args


def oracle_python() -> Path:
    return cache_dir() / "oracle-venv" / "bin" / "python"


def check_args(args: argparse.Namespace) -> Path:
    """Every input checked before anything is measured (UserError: one error line, exit 2)."""
    unknown = [s for s in args.section_list if s not in SECTIONS]
    if unknown or not args.section_list:
        raise UserError(f"--sections {args.sections!r}: choose from {','.join(SECTIONS)}")
    for flag, value in (("-t", args.threads), ("-n", args.n_gen), ("--reps", args.reps), ("--k-max", args.k_max),
                        ("--pp", args.pp), ("--bw-mib", args.bw_mib)):
        if value < 1:
            raise UserError(f"{flag} {value}: must be >= 1")
    if args.depth < 0:
        raise UserError(f"--depth {args.depth}: must be >= 0")
    args.spec_n_list = int_list(args.spec_n, "--spec-n")
    args.draft_vocab_list = int_list(args.spec_draft_vocab, "--spec-draft-vocab", minimum=0)
    try:
        args.accept_list = [float(v) for v in args.spec_accept.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"--spec-accept {args.spec_accept!r}: expected comma-separated rates") from None
    if not args.accept_list or not all(0.0 <= a <= 1.0 for a in args.accept_list):
        raise UserError(f"--spec-accept {args.spec_accept!r}: rates between 0 and 1")
    path = gguf_path(args.model)
    check_oracle(args.no_llamacpp)
    return path


def gguf_path(model: str) -> Path:
    """A known name's or a path's GGUF file, read far enough to know it is one (else UserError)."""
    path = resolve_model(model, auto_pull=False)
    if not path.is_file():
        raise UserError(f"model file not found: {path}")
    try:
        GGUFFile(path)
    except GGUFError as exc:
        raise UserError(str(exc)) from None
    return path


def check_oracle(no_llamacpp: bool) -> None:
    if not no_llamacpp and not oracle_python().exists():
        raise UserError(f"llama.cpp oracle venv missing ({oracle_python()}): run bash scripts/oracle_setup.sh, "
                        f"or pass --no-llamacpp")


def host(with_llamacpp: bool) -> dict:
    """The machine and checkout a benchmark ran on: CPU, cores, memory, date, load, commit, and the
    oracle's llama-cpp-python version (None without it)."""
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    git = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    oracle = sorted(oracle_python().parents[1].glob("lib/python*/site-packages/llama_cpp_python-*.dist-info"))
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_gib": round(mem / 2**30, 1),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "load_avg": os.getloadavg()[0],
            "commit": git.stdout.strip() or None,
            "llamacpp": None if not with_llamacpp else
            (oracle[-1].name.removesuffix(".dist-info").replace("_", "-") if oracle else "llama-cpp-python")}


def machine(args: argparse.Namespace, argv: list[str], path: Path) -> dict:
    return {"command": ["scripts/bench_mission.py", *argv], **host(not args.no_llamacpp), "model": str(path),
            "file_bytes": path.stat().st_size, "threads": args.threads, "sections": args.section_list}


def summary(values: list[float], digits: int = 2) -> tuple[float, float]:
    """(median, best) of t/s values."""
    return round(statistics.median(values), digits), round(max(values), digits)


def speeds(prefix: str, values: list[float]) -> dict:
    med, best = summary(values)
    return {f"{prefix}_tps": med, f"{prefix}_tps_best": best, f"{prefix}_ms_per_token": round(1e3 / med, 2)}


def show(result) -> str:
    """A rep's result for the progress log: t/s, or {k: seconds} as milliseconds."""
    if isinstance(result, dict):
        return " ".join(f"{k}:{1e3 * v:.1f}ms" for k, v in result.items())
    return f"{result:.2f} t/s"


def page_in(model) -> None:
    """Touch every page of the model's mapped file (untimed). llama.cpp repacks its weights into
    memory of its own: on a machine whose RAM holds the file about once (the 27B's 16.8 GB in
    24 GiB) its run evicts part of the page cache, and the next hybridrt forward would time disk
    reads (a 27B verify step measured 6.4 s against 1.7 s)."""
    import numpy as np

    pages = np.frombuffer(model.gguf._mmap, dtype=np.uint8)
    int(pages[::4096].sum(dtype=np.uint64))


def alternate(reps: int, ours, theirs, with_llamacpp: bool, model=None) -> tuple[list, list]:
    """reps results of each engine, llama.cpp's first in each rep (as bench_vs_llamacpp); after
    each llama.cpp run the model's pages are read back in (page_in) before hybridrt's is timed."""
    a, b = [], []
    for i in range(reps):
        if with_llamacpp:
            b.append(theirs())
            if model is not None:
                page_in(model)
        a.append(ours())
        log(f"  rep {i + 1}/{reps}: hybridrt {show(a[-1])}" + (f"; llama.cpp {show(b[-1])}" if with_llamacpp else ""))
    return a, b


# --- decode -------------------------------------------------------------------------------------
def plain_decode(args, model, path: Path) -> tuple[list[float], list[float]]:
    """Greedy decode t/s of -n tokens, --reps of each engine (bench_vs_llamacpp's runs)."""
    vs.hybridrt_tps(model, 4, args.cache_type)       # warm-up: kernels loaded, weights paged in
    return alternate(args.reps, lambda: vs.hybridrt_tps(model, args.n_gen, args.cache_type),
                     lambda: vs.llamacpp_run(path, args.n_gen, args.threads)["tg_tps"], not args.no_llamacpp, model)


def section_decode(args, model, path: Path, results: dict) -> dict:
    from placement import measure_cpu_bandwidth

    bw = measure_cpu_bandwidth(args.bw_mib << 20, threads=args.threads) / 1e9
    log(f"decode: read bandwidth {bw:.1f} GB/s ({args.bw_mib} MiB, {args.threads} threads); {args.n_gen} tokens")
    ours, theirs = plain_decode(args, model, path)
    per_token = model.weight_bytes_per_token
    row = {"n_gen": args.n_gen, "reps": args.reps, "weight_bytes_per_token": per_token,
           "file_bytes": path.stat().st_size, "read_bw_gbps": round(bw, 2), "bw_probe_mib": args.bw_mib}
    for name, values in (("hybridrt", ours), ("llamacpp", theirs)):
        if values:
            row.update(speeds(name, values))
            gbps = per_token * row[f"{name}_tps"] / 1e9
            row.update({f"{name}_gbps": round(gbps, 2), f"{name}_bw_fraction": round(gbps / bw, 3)})
            results[name] = row[f"{name}_tps"]
    if theirs:
        row["ratio"] = round(row["hybridrt_tps"] / row["llamacpp_tps"], 3)
    return row


# --- t(k) ---------------------------------------------------------------------------------------
def tk_token(n_vocab: int) -> int:
    """The token every batch repeats: warmup.verify_costs's (bench_llamacpp.py --batches takes the same)."""
    return min(1000, n_vocab // 4)


def tk_session(model, ids: list[int], k_max: int, rounds: int, cache_type: str = "f16"):
    """A session holding the prompt `ids` with room for `rounds` rounds of tk_round and one untimed
    warm-up round, which runs here (kernels loaded or compiled, the batch shapes' first calls)."""
    session = model.session(len(ids) + (rounds + 2) * k_max + 8, cache_type, k_max=k_max)
    session.eval(ids, logits="none")
    tk_round(model, session, k_max)
    return session


def tk_round(model, session, k_max: int) -> dict[int, float]:
    """Seconds of one verify forward of k = 1 .. k_max tokens (logits for all), each rolled back to
    its first token (warmup.verify_costs, one round): the session ends k_max tokens longer."""
    from hybridrt.runtime.warmup import verify_costs

    times = verify_costs(model, session, k_max, tk_token(model.n_vocab), budget_s=0.0)
    return {k: t[0] for k, t in times.items()}


def llamacpp_batches(path: Path, ks: list[int], threads: int, depth: int, reps: int = 1) -> dict:
    cmd = [str(oracle_python()), str(ROOT / "scripts" / "bench_llamacpp.py"), str(path), "-p", vs.PROMPT,
           "-t", str(threads), "-r", str(reps), "--depth", str(depth), "--batches", ",".join(map(str, ks))]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def section_tk(args, model, path: Path, results: dict) -> dict:
    ks = list(range(1, args.k_max + 1))
    ids = vs.prompt_ids(model, args.depth) if args.depth else model.tokenize(vs.PROMPT)
    log(f"tk: k = 1..{args.k_max} after {len(ids)} prompt tokens")
    session = tk_session(model, ids, args.k_max, args.reps, args.cache_type)
    rollback = n_rs_seq = None

    def theirs() -> dict[int, float]:
        nonlocal rollback, n_rs_seq
        r = llamacpp_batches(path, ks, args.threads, args.depth)
        rollback, n_rs_seq = r["rollback"], r["n_rs_seq"]
        return {int(k): v[0] for k, v in r["batch_s"].items()}

    ours, their = alternate(args.reps, lambda: tk_round(model, session, args.k_max), theirs, not args.no_llamacpp,
                            model)
    row = {"k": ks, "n_prompt": len(ids), "reps": args.reps}
    for name, rounds in (("hybridrt", ours), ("llamacpp", their)):
        if rounds:
            med = [statistics.median(r[k] for r in rounds) for k in ks]
            row[f"{name}_ms"] = [round(1e3 * t, 2) for t in med]
            row[f"{name}_rel"] = [round(t / med[0], 3) for t in med]
    if their:
        row["ratio"] = [round(a / b, 3) for a, b in zip(row["hybridrt_ms"], row["llamacpp_ms"])]
        row.update(llamacpp_rollback=rollback, llamacpp_n_rs_seq=n_rs_seq)
    return row


# --- pp -----------------------------------------------------------------------------------------
def section_pp(args, model, path: Path, results: dict) -> dict:
    ids = vs.prompt_ids(model, args.pp)
    log(f"pp: {args.pp} prompt tokens")
    vs.hybridrt_pp_tps(model, ids[:64], args.cache_type)     # warm-up of the batch kernels
    ours, theirs = alternate(args.reps, lambda: vs.hybridrt_pp_tps(model, ids, args.cache_type),
                             lambda: vs.llamacpp_run(path, 0, args.threads, args.pp)["pp_tps"], not args.no_llamacpp,
                             model)
    row = {"pp": args.pp, "reps": args.reps}
    for name, values in (("hybridrt", ours), ("llamacpp", theirs)):
        if values:
            row[f"{name}_tps"], row[f"{name}_tps_best"] = summary(values)
    if theirs:
        row["ratio"] = round(row["hybridrt_tps"] / row["llamacpp_tps"], 3)
    return row


# --- start --------------------------------------------------------------------------------------
def timed_process(cmd: list[str], env: dict | None = None) -> dict:
    """Run cmd: seconds from its spawn to its first stdout byte and to its exit, its peak RSS, its
    output; a failure is a RuntimeError with the end of its stderr."""
    with tempfile.TemporaryFile() as err:
        spawned = time.time()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env, cwd=ROOT)
        first = proc.stdout.read(1)
        first_at = time.time()
        out = first + proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        exited = time.time()
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    if proc.returncode:
        tail = "\n".join(stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited with {proc.returncode}:\n{tail}")
    return {"spawned": spawned, "first_output_s": round(first_at - spawned, 3) if first else None,
            "exit_s": round(exited - spawned, 3), "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
            "stdout": out.decode(errors="replace"), "stderr": stderr}


def hybridrt_start(path: Path, threads: int, extra: list[str], cache: str | None) -> dict:
    from hybridrt.runtime.warmup import MESSAGE

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if cache is not None:
        env["NUMBA_CACHE_DIR"] = cache
    run = ["run", "-m", str(path), "-p", vs.PROMPT, "-n", "1", "--temp", "0", "-t", str(threads),
           "--no-display-prompt", *extra]
    r = timed_process([sys.executable, "-c", RUN_DRIVER, *run], env)
    loaded = [float(line.split()[-1]) for line in r["stderr"].splitlines() if line.startswith(LOAD_MARK)]
    return {"load_s": round(loaded[0] - r["spawned"], 3) if loaded else None,
            "first_token_s": r["first_output_s"], "exit_s": r["exit_s"], "peak_rss_mib": r["peak_rss_mib"],
            "compiled": MESSAGE in r["stderr"], "numba_cache": cache or "default"}


def llamacpp_start(path: Path, threads: int) -> dict:
    r = timed_process([str(oracle_python()), str(ROOT / "scripts" / "bench_llamacpp.py"), str(path),
                       "-p", vs.PROMPT, "-n", "1", "-r", "1", "-t", str(threads)])
    out = json.loads(r["stdout"].strip().splitlines()[-1])
    offset = out["started_at"] - r["spawned"]        # interpreter start-up before the script's clock
    return {"load_s": round(offset + out["load_s"], 3), "first_token_s": round(offset + out["first_token_s"], 3),
            "exit_s": r["exit_s"], "peak_rss_mib": r["peak_rss_mib"]}


def section_start(args, model, path: Path, results: dict) -> dict:
    extra = args.run_args.split()
    cache = tempfile.mkdtemp(prefix="numba-cold-") if args.cold else None
    runs = []
    try:
        for label in ("cold" if args.cold else "first", "warm"):
            log(f"start: hybridrt run, {label}" + (f" (NUMBA_CACHE_DIR={cache})" if cache else ""))
            runs.append({"run": label, **hybridrt_start(path, args.threads, extra, cache)})
            log(f"  {runs[-1]}")
    finally:
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
    row = {"hybridrt": runs, "run_args": extra}
    if not args.no_llamacpp:
        log("start: llama.cpp")
        row["llamacpp"] = llamacpp_start(path, args.threads)
        log(f"  {row['llamacpp']}")
    return row


# --- spec ---------------------------------------------------------------------------------------
def spec_run(model, ids: list[int], ref: list[int], n_gen: int, n_max: int, alpha: float, seed: int,
             cache_type: str = "f16", draft_vocab: int = 0):
    """One draft-mtp generation at fixed n_max, each draft token replaced by the target's own greedy
    one (`ref`) with probability alpha, by a wrong one otherwise: (tokens, GenerationStats)."""
    from hybridrt.decoding.generate import generate
    from hybridrt.decoding.sampling import SamplerConfig
    from hybridrt.decoding.speculative.draft_forced import ForcedSource
    from hybridrt.decoding.speculative.loop import SpecConfig
    from hybridrt.decoding.speculative.sources import build_source

    greedy, spec = SamplerConfig(temp=0.0), SpecConfig(n_max=n_max)
    session = model.session(len(ids) + n_gen + n_max + 8, cache_type, k_max=spec.k_max)
    source = ForcedSource(build_source("draft-mtp", session, greedy, spec, cache_type=cache_type, draft_vocab=draft_vocab),
                          ref, len(ids),
                          model.n_vocab, corrupt=1.0 - alpha, seed=seed)
    return generate(model, session, ids, n_gen, greedy, source, spec, stop_ids=set())


def section_spec(args, model, path: Path, results: dict) -> dict:
    from hybridrt.decoding.generate import generate
    from hybridrt.decoding.sampling import SamplerConfig
    from hybridrt.decoding.speculative.loop import SpecConfig
    from hybridrt.runtime.warmup import warm_up

    ids = model.tokenize(vs.PROMPT)
    if "hybridrt" not in results:
        log("spec: plain decode for the ratios")
        ours, theirs = plain_decode(args, model, path)
        results["hybridrt"] = summary(ours)[0]
        if theirs:
            results["llamacpp"] = summary(theirs)[0]
    greedy = SamplerConfig(temp=0.0)
    ref, _ = generate(model, model.session(len(ids) + args.n_gen + 8, args.cache_type), ids, args.n_gen, greedy,
                      stop_ids=set())
    rows = []
    for n_max, vocab in [(n, v) for n in args.spec_n_list for v in args.draft_vocab_list]:
        warm_up(model, "draft-mtp", SpecConfig(n_max=n_max), greedy, args.cache_type,     # untimed, as `run`'s
                draft_vocab=vocab)
        for alpha in args.accept_list:
            tps, rates, steps, identical = [], [], [], True
            for rep in range(args.reps):
                out, stats = spec_run(model, ids, ref, args.n_gen, n_max, alpha, rep, args.cache_type, vocab)
                tps.append(stats.decode_tps)
                rates.append(stats.spec.acceptance_rate)
                steps.append(stats.spec.to_dict()["tokens_per_step"])
                identical &= out == ref
            med, best = summary(tps)
            row = {"n_max": n_max, "alpha": alpha, "draft_vocab": vocab, "accept_rate": round(statistics.mean(rates), 3),
                   "tokens_per_step": round(statistics.mean(steps), 2), "tps": med, "tps_best": best,
                   "identical": identical, "vs_hybridrt_plain": round(med / results["hybridrt"], 3)}
            if "llamacpp" in results:
                row["vs_llamacpp_plain"] = round(med / results["llamacpp"], 3)
            log(f"  spec N={n_max} V={vocab} alpha {alpha}: {row}")
            rows.append(row)
    return {"n_gen": args.n_gen, "reps": args.reps, "hybridrt_plain_tps": results["hybridrt"],
            "llamacpp_plain_tps": results.get("llamacpp"), "rows": rows,
            "note": "drafts forced: ForcedSource(corrupt = 1 - alpha); `hybridrt bench --spec-force`: accept/reject"}


RUNNERS = {"decode": section_decode, "tk": section_tk, "pp": section_pp, "start": section_start,
           "spec": section_spec}


def load(args, path: Path):
    """The model the in-process sections measure (None when only `start` runs: it spawns its own)."""
    from hybridrt.runtime.loader import load_model

    if not set(args.section_list) - {"start"}:
        return None
    log(f"loading {path.name} for the in-process sections ({args.threads} threads)")
    t0 = time.perf_counter()
    placement = None
    if args.vram is not None:
        from hybridrt.runtime.loader import _size
        from hybridrt.runtime.place import PlacementRequest, placement_line

        # the plan reserves verify batches for the largest of tk's k and spec's N + 1
        n_max = max([int(n) for n in args.spec_n.split(",")] if "spec" in args.section_list else [1])
        if "tk" in args.section_list:
            n_max = max(n_max, args.k_max - 1)
        placement = PlacementRequest(vram_bytes=_size(args.vram), n_ctx=args.ctx_size,
                                     cache_type_k=args.cache_type, cache_type_v=args.cache_type,
                                     spec_type="draft-mtp" if n_max > 1 else "none", spec_draft_n_max=max(n_max, 1))
    model = load_model(path, threads=args.threads, device=args.device, placement=placement)
    log(f"  loaded in {time.perf_counter() - t0:.1f} s")
    if model.plan is not None:
        log(placement_line(model.plan, args.device))
        speed = model.plan.speed      # the plan's own CPU bandwidth figure (measured at load unless given)
        log(f"  the plan predicts {speed.plain_tok_s:.1f} t/s decode, {speed.spec_tok_s:.1f} t/s speculative "
            f"(GPU {speed.gpu_bw / 1e9:.0f} GB/s, CPU {speed.cpu_bw / 1e9:.1f} GB/s, acceptance {speed.accept_rate:g})")
    if "spec" in args.section_list and getattr(model, "mtp", None) is None:
        raise UserError(f"--sections spec: {path.name} has no MTP head (draft-mtp)")
    return model


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    results: dict = {}      # plain decode t/s per engine, for the spec ratios
    try:
        path = check_args(args)
        emit("machine", machine(args, argv, path))
        model = load(args, path)
        for name in args.section_list:
            t0 = time.perf_counter()
            row = RUNNERS[name](args, model, path, results)
            emit(name, {**row, "seconds": round(time.perf_counter() - t0, 1)})
    except (UserError, GGUFError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (subprocess.CalledProcessError, RuntimeError) as exc:
        detail = getattr(exc, "stderr", None) or str(exc)
        print(f"error: {(detail.strip().splitlines() or ['failed'])[-1]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
