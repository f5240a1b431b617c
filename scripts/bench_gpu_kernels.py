"""Time the fused Triton quantized matvec at Qwen3.6-27B's shapes, and sweep its launches into a table.

    python scripts/bench_gpu_kernels.py [--ks 1,2,4,8,16] [--json]
    python scripts/bench_gpu_kernels.py --sweep [--ks 1,4,16] [--write-table PATH] [--max-seconds 80]
    python scripts/bench_gpu_kernels.py --dry-run [--sweep ...]     # no GPU: tiny shapes, interpreted

Without --sweep: for each matrix (ffn_gate/ffn_up 17408 x 5120 and ffn_down 5120 x 17408 in the
types a Q4_K_M file uses, plus Q8_0, Q5_K and Q4_0) and each batch of k tokens: the kernel at the
launch the card's matvec table picks, the weight bytes it reads per second and that as a share of
the card's bandwidth (a 1 GiB device-to-device copy, read + write), the torch tile path
(QuantLinear(kernel="torch"), float16 as the runtime binds it on a GPU) and a dense float16 matmul
of the same shape.

--sweep: for each type (Q4_K, Q6_K, Q8_0, Q5_K, Q4_0, IQ4_XS) and shape class (tall: ffn_gate
17408 x 5120; long: ffn_down 5120 x 17408; small: the attention / GDN output projection 5120 x 6144)
every launch variant of `sweep_variants` (tile shapes, the other tile order, two chunks a step, no
software pipelining, split-K 2 (and 4 on the long and small shapes), the tl.dot modes) at each k. Each
variant's rows are checked against the float64 product of the gguf-py weights (|error| <= 1e-5 of
sum |w||x|, as tests/test_triton_matvec.py) and for every k against its rows at the largest k
(bitwise); variants that pass are grouped by their bits. A (type, shape class) then takes the bits
group whose best times, summed over k relative to the best of any variant, are least, and within
it the fastest variant per k class (matvec_table.K_CLASSES; a class without a measured k takes the
nearest one's). That plan is checked once more end to end (k = 1..16 bitwise the first rows of
k = 16, tokens alone bitwise their batch rows) before `--write-table` writes it as a matvec table
(gpu_kernels/matvec_tables/<card>.json is where a committed one is read from).

Bounds (the GPU check gives the sweep ~90 s): a matrix's variants compile in parallel threads
(Triton's AsyncCompileMode) before any is timed; each timing is do_bench's median over ~20 ms
(5 ms warm-up); no new matrix starts after --max-seconds (its type and shape keep the default rows,
and the report names it).

Times are medians of triton.testing.do_bench, which flushes the L2 cache between calls (an H100's
50 MB L2 would otherwise hold a whole Q4_K matrix; in a model every matrix is read cold). Payloads
are random bytes with finite float16 scales (speed does not depend on the values). A launch is
written as matvec_table.MatvecParams.label(): rows x warps, "m" rows in the middle, s<stages>,
k<split>, u<unroll>, the dot mode. Without a CUDA GPU it prints one line and exits 0; --dry-run runs
the same code interpreted on tiny shapes (a stand-in for each shape class) to test the plumbing.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

N_FF, N_EMBD, N_V = 17408, 5120, 6144       # Qwen3.6-27B: FFN width, model width, GDN value width
# (tensor, rows, columns, type name): Q4_K_M's ffn_gate/up and ffn_down, then other common types
MATRICES = (("ffn_gate", N_FF, N_EMBD, "Q4_K"), ("ffn_down", N_EMBD, N_FF, "Q6_K"),
            ("ffn_down", N_EMBD, N_FF, "Q4_K"), ("ffn_gate", N_FF, N_EMBD, "Q8_0"),
            ("ffn_gate", N_FF, N_EMBD, "Q5_K"), ("ffn_gate", N_FF, N_EMBD, "Q4_0"))
DRY_MATRICES = (("dry", 32, 512, "Q4_K"), ("dry", 32, 512, "Q6_K"), ("dry", 32, 512, "Q8_0"))
# the sweep, most used first (a Q4_K_M file: Q4_K and Q6_K): (tensor, rows, columns, type, shape class)
SWEEP_TYPES = ("Q4_K", "Q6_K", "Q8_0", "Q5_K", "Q4_0", "IQ4_XS")
SWEEP_SHAPES = (("ffn_gate", N_FF, N_EMBD, "tall"), ("ffn_down", N_EMBD, N_FF, "long"),
                ("ssm_out", N_EMBD, N_V, "small"))
SWEEP_MATRICES = tuple((tensor, n_out, n_in, t, shape) for t in SWEEP_TYPES for tensor, n_out, n_in, shape in SWEEP_SHAPES)
# the dry run's stand-ins: tiny matrices timed as if they were of the class named
DRY_SWEEP_MATRICES = (("dry", 16, 512, "Q4_K", "tall"), ("dry", 16, 1024, "Q6_K", "long"))
TOLERANCE = 1e-5        # of sum |w||x|, as tests/test_triton_matvec.assert_close_to_gguf


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default=None, help="batch sizes (tokens per call, 1..16; default 1,2,4,8,16, "
                                               "with --sweep 1,4,16)")
    ap.add_argument("--sweep", action="store_true", help="time every launch variant and choose a table")
    ap.add_argument("--write-table", metavar="PATH", help="with --sweep: write the chosen table as JSON "
                                                         "(PATH a directory: <card>.json in it)")
    ap.add_argument("--table-match", metavar="PATTERN",
                    help="the written table's card name pattern (fnmatch; default: this card's exact name)")
    ap.add_argument("--types", help="with --sweep: only these types (comma-separated, e.g. Q4_K,Q6_K)")
    ap.add_argument("--max-seconds", type=float, default=80.0,
                    help="with --sweep: start no new matrix after this many seconds (default 80)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU needed: tiny shapes on the CPU under TRITON_INTERPRET=1, to test the script")
    return ap.parse_args(argv)


def parse_ks(text: str) -> list[int]:
    try:
        ks = sorted({int(k) for k in text.split(",")})
    except ValueError:
        ks = []
    if not ks or not all(1 <= k <= 16 for k in ks):
        raise ValueError(f"--ks: batch sizes must be 1..16, comma-separated, got {text!r}")
    return ks


def random_blocks(qtype: int, n_rows: int, n_cols: int, device: torch.device) -> torch.Tensor:
    """Random GGUF rows with finite float16 scales around 1e-3 (the type's f16 fields, formats.QUANT_TYPES)."""
    from cpu_kernels.formats import format_of
    from gpu_kernels.quant import block_shape, row_bytes

    g = torch.Generator(device=device).manual_seed(n_rows * 7 + qtype)
    raw = torch.randint(0, 256, (n_rows, row_bytes(qtype, n_cols)), dtype=torch.uint8, device=device, generator=g)
    blocks = raw.view(-1, block_shape(qtype)[1])
    for off in format_of(qtype).f16_fields:
        scales = torch.rand(blocks.shape[0], 1, device=device, generator=g) * 2e-3
        blocks[:, off:off + 2] = scales.half().view(torch.uint8)
    return raw


def make_timer(device: torch.device, sweep: bool):
    """ms per call: do_bench's median with L2 flushes on a GPU (shorter windows in a sweep), one
    wall-clock call otherwise (interpreted: the figure only shows the plumbing works)."""
    if device.type == "cuda":
        from triton.testing import do_bench
        warmup, rep = (5, 20) if sweep else (25, 200)
        return lambda fn: do_bench(fn, warmup=warmup, rep=rep, return_mode="median")

    def wall(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return wall


def copy_bandwidth(device: torch.device, timer, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy, counting the read and the write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (timer(lambda: dst.copy_(src)) / 1e3)


def card_slug(card: str) -> str:
    """A file name for a card's table: "NVIDIA H200" -> "nvidia-h200"."""
    return re.sub(r"[^a-z0-9]+", "-", card.lower()).strip("-")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (TRITON_INTERPRET=1)"


# ---------------------------------------------------------------- the plain benchmark

def bench(ks: list[int], dry: bool, device: torch.device) -> dict:
    from gguf.constants import GGMLQuantizationType as T

    from gpu_kernels.qlinear import QuantLinear
    from gpu_kernels.triton_matvec import MatvecLaunch

    timer = make_timer(device, sweep=False)
    copy_bps = copy_bandwidth(device, timer, (1 << 30) if device.type == "cuda" else (1 << 20))
    rows = []
    for tensor, n_out, n_in, tname in DRY_MATRICES if dry else MATRICES:
        qtype = int(T[tname])
        raw = random_blocks(qtype, n_out, n_in, device)
        fused = MatvecLaunch(raw, qtype, n_in)          # the card's table's launches
        torch_path = QuantLinear(raw, qtype, n_in, n_out, torch.float16, kernel="torch")
        exact = QuantLinear(raw, qtype, n_in, n_out, torch.float32, kernel="torch")     # the check, untimed
        dense = torch.randn(n_out, n_in, dtype=torch.float16, device=device)
        x_all = torch.randn(max(ks), n_in, device=device)
        for k in ks:
            x = x_all[:k].contiguous()
            x16 = x.half()
            y = torch.empty(k, n_out, device=device)
            ref = exact(x)
            torch_ms = timer(lambda: torch_path(x))
            dense_ms = timer(lambda: torch.matmul(x16, dense.t()))
            ms = timer(lambda: fused(x, y))
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            gbps = raw.numel() / (ms / 1e3) / 1e9
            rows.append({"tensor": tensor, "type": tname, "n_out": n_out, "n_in": n_in, "k": k,
                         "launch": fused.plan[k - 1].label(), "weight_bytes": raw.numel(), "triton_ms": ms,
                         "weight_gbps": gbps, "bandwidth_share": gbps * 1e9 / copy_bps, "torch_ms": torch_ms,
                         "dense_f16_ms": dense_ms, "speedup_vs_torch": torch_ms / ms,
                         "speedup_vs_dense_f16": dense_ms / ms, "max_rel_diff_vs_torch_f32": err})
        del raw, fused, torch_path, exact, dense
    return {"device": device_name(device), "copy_gbps": copy_bps / 1e9, "ks": ks, "rows": rows}


def print_table(result: dict) -> None:
    print(f"{result['device']}: device-to-device copy {result['copy_gbps']:.0f} GB/s (read + write)")
    print(f"{'tensor':9} {'type':5} {'shape':>12} {'MiB':>6} {'k':>3} {'launch':>12} {'ms':>8} {'GB/s':>7} "
          f"{'% bw':>5} {'torch ms':>9} {'x torch':>8} {'f16 ms':>8} {'x f16':>6} {'diff':>8}")
    for r in result["rows"]:
        print(f"{r['tensor']:9} {r['type']:5} {r['n_out']:>6}x{r['n_in']:<5} {r['weight_bytes'] / 2**20:6.1f} "
              f"{r['k']:3} {r['launch']:>12} {r['triton_ms']:8.3f} {r['weight_gbps']:7.0f} "
              f"{100 * r['bandwidth_share']:5.1f} {r['torch_ms']:9.3f} {r['speedup_vs_torch']:8.1f} "
              f"{r['dense_f16_ms']:8.3f} {r['speedup_vs_dense_f16']:6.2f} {r['max_rel_diff_vs_torch_f32']:8.1e}")


# ---------------------------------------------------------------- the sweep

def sweep_variants(qtype: int, shape: str, dry: bool) -> list:
    """The launches tried for a (type, shape class), the default first. Each changes one thing from
    the default (or a pair that work together): 11-14 compiles a matrix."""
    from gpu_kernels.matvec_table import default_params

    base = default_params(qtype, shape)
    change = dataclasses.replace
    if dry:
        variants = [base, change(base, block_n=8, num_warps=1, num_stages=2), change(base, unroll=2),
                    change(base, split_k=2), change(base, block_n=16, dot="tf32x3")]
    else:
        variants = [base]
        # tile shapes: rows per program x warps (bits may differ on the GPU: the sweep groups them)
        variants += [change(base, block_n=b, num_warps=w) for b, w in ((8, 2), (16, 4), (32, 4), (16, 8), (32, 8))]
        variants += [change(base, rows_mid=not base.rows_mid), change(base, unroll=2), change(base, num_stages=1),
                     change(base, split_k=2)]
        if shape != "tall":         # few rows: more programs by splitting each row's chunks
            variants += [change(base, split_k=4), change(base, split_k=4, unroll=2)]
        # one of each dot mode: statically (scripts/kernel_report.py's counts for sm_90) they take
        # 2.7-5.5x the loop's instructions per chunk at k = 1 and tf32x3 spills; no token loop
        variants += [change(base, block_n=16, num_warps=4, dot=d) for d in ("ieee", "tf32x3")]
    return list(dict.fromkeys(variants))


def reference(raw: torch.Tensor, qtype: int, n_in: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x W^T in float64 with W bitwise gguf-py's, and sum |x||W|^T (the error's scale)."""
    from gpu_kernels.quant import dequantize_torch

    w = dequantize_torch(raw, qtype, n_in).double()
    xd = x.double()
    return xd @ w.t(), xd.abs() @ w.abs().t()


def compile_all(launches: list, x: torch.Tensor, y: torch.Tensor) -> None:
    """Compile the launches' kernels in parallel threads before timing (Triton releases the GIL in
    much of its compile). Where this Triton has no AsyncCompileMode (or another one), or a compile
    fails, the first timing call compiles, and reports the failure."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode

        with ThreadPoolExecutor(max(2, min(16, os.cpu_count() or 2))) as pool, \
                AsyncCompileMode(pool, ignore_errors=True):
            for launch in launches:
                launch.compile(x, y)
    except Exception:       # noqa: BLE001 -- compiling ahead is an optimization only
        pass


def measure_matrix(tensor: str, n_out: int, n_in: int, tname: str, shape: str, ks: list[int], dry: bool,
                   device: torch.device, timer, copy_bps: float) -> tuple[list[dict], dict]:
    """Every variant at every k: timing and checks; then the chosen plan, checked end to end.
    Returns the variant rows and the (type, shape class) summary with its plan."""
    from gguf.constants import GGMLQuantizationType as T

    from gpu_kernels.matvec_table import K_MAX, bits_key
    from gpu_kernels.triton_matvec import MatvecLaunch

    qtype = int(T[tname])
    raw = random_blocks(qtype, n_out, n_in, device)
    x_all = torch.randn(K_MAX, n_in, generator=torch.Generator().manual_seed(n_in)).to(device)
    ref, scale = reference(raw, qtype, n_in, x_all)
    variants = sweep_variants(qtype, shape, dry)
    launches = [MatvecLaunch(raw, qtype, n_in, plan=v) for v in variants]
    y_full = torch.empty(K_MAX, n_out, device=device)
    if device.type == "cuda":
        compile_all(launches, x_all, y_full)
    rows, outputs, groups = [], {}, []          # groups: [(representative output, [variants])]
    for params, launch in zip(variants, launches):
        row = {"tensor": tensor, "type": tname, "shape": shape, "n_out": n_out, "n_in": n_in,
               "launch": params.label(), "params": dataclasses.asdict(params), "ms": {}, "status": "ok"}
        try:
            outs = {}
            for k in sorted(set(ks) | {K_MAX}):
                x, y = x_all[:k].contiguous(), torch.empty(k, n_out, device=device)
                if k in ks:
                    row["ms"][k] = timer(lambda: launch(x, y))
                else:
                    launch(x, y)
                outs[k] = y
        except Exception as e:     # noqa: BLE001 -- a variant that fails to compile or launch is reported, not fatal
            row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
            rows.append(row)
            continue
        full = outs[K_MAX]
        worst = ((full.double() - ref).abs() / scale.clamp_min(1e-300)).max().item()
        row["max_error"] = worst
        if not worst <= TOLERANCE:
            row["status"] = f"inexact: error {worst:.3g} of sum |w||x|"
        elif not all(torch.equal(y, full[:k]) for k, y in outs.items()):
            row["status"] = "bits depend on k"
        else:
            for rep, members in groups:
                if torch.equal(rep, full):
                    members.append(params)
                    break
            else:
                groups.append((full, [params]))
            row["group"] = next(i for i, (_, members) in enumerate(groups) if params in members)
            outputs[params] = row
        for k, ms in row["ms"].items():
            row.setdefault("gbps", {})[k] = raw.numel() / (ms / 1e3) / 1e9
            row.setdefault("bandwidth_share", {})[k] = raw.numel() / (ms / 1e3) / copy_bps
        rows.append(row)
    summary = {"tensor": tensor, "type": tname, "shape": shape, "n_out": n_out, "n_in": n_in,
               "weight_bytes": raw.numel()}
    if variants[0] in outputs:
        summary["default_ms"] = outputs[variants[0]]["ms"]
    plan = choose_plan([(members, outputs) for _, members in groups], ks)
    if plan is None:
        summary["status"] = "no variant passed the checks: default rows kept"
        return rows, summary
    plan_by_k = tuple(plan[k] for k in range(1, K_MAX + 1))
    if not plan_keeps_bits(raw, qtype, n_in, x_all, plan_by_k, ks if dry else range(1, K_MAX + 1)):
        # cannot happen when the group's bits were equal; then no mixing: its k = 1 choice for every k
        plan_by_k = (plan[1],) * K_MAX
        summary["note"] = "the mixed plan failed the end-to-end bits check; one launch for every k"
        if not plan_keeps_bits(raw, qtype, n_in, x_all, plan_by_k, ks if dry else range(1, K_MAX + 1)):
            summary["status"] = "the chosen launch failed the end-to-end bits check: default rows kept"
            return rows, summary
    assert len({bits_key(p) for p in plan_by_k}) == 1
    summary["status"] = "ok"
    summary["plan"] = plan_by_k
    summary["ms"] = {k: outputs[plan_by_k[k - 1]]["ms"][k] for k in ks}
    summary["bandwidth_share"] = {k: raw.numel() / (ms / 1e3) / copy_bps for k, ms in summary["ms"].items()}
    del raw
    return rows, summary


def choose_plan(groups: list[tuple[list, dict]], ks: list[int]) -> dict | None:
    """{k: MatvecParams} for k = 1..16 from the best bits group, or None when no variant passed.
    A group's score: the sum over the measured k of its best time there over the best of all."""
    from gpu_kernels.matvec_table import K_CLASSES, K_MAX

    if not groups:
        return None

    def ms(outputs, params, k):
        return outputs[params]["ms"][k]
    best = {k: min(ms(o, p, k) for members, o in groups for p in members) for k in ks}
    scores = [sum(min(ms(o, p, k) for p in members) / best[k] for k in ks) for members, o in groups]
    members, outputs = groups[scores.index(min(scores))]    # ties: the first group, the default's
    plan = {}
    for lo, hi in K_CLASSES:
        inside = [k for k in ks if lo <= k <= hi]
        if not inside:          # the measured k nearest the class
            inside = [min(ks, key=lambda k: (max(lo - k, k - hi), k))]
        choice = min(members, key=lambda p: sum(ms(outputs, p, k) for k in inside))
        for k in range(lo, min(hi, K_MAX) + 1):
            plan[k] = choice
    return plan


def plan_keeps_bits(raw: torch.Tensor, qtype: int, n_in: int, x_all: torch.Tensor, plan: tuple, ks) -> bool:
    """Through one MatvecLaunch with the plan: each k's rows bitwise the first rows of k = 16, and
    the first and last token alone bitwise their rows there."""
    from gpu_kernels.triton_matvec import MatvecLaunch

    launch = MatvecLaunch(raw, qtype, n_in, plan=plan)

    def run(x):
        y = torch.empty(x.shape[0], raw.shape[0], device=raw.device)
        launch(x.contiguous(), y)
        return y
    full = run(x_all)
    return all(torch.equal(run(x_all[:k]), full[:k]) for k in ks) and \
        all(torch.equal(run(x_all[t:t + 1])[0], full[t]) for t in (0, x_all.shape[0] - 1))


def sweep(ks: list[int], dry: bool, device: torch.device, types: set[str] | None, max_seconds: float) -> dict:
    start = time.monotonic()
    timer = make_timer(device, sweep=True)
    copy_bps = copy_bandwidth(device, timer, (1 << 30) if device.type == "cuda" else (1 << 20))
    rows, summaries, skipped = [], [], []
    for tensor, n_out, n_in, tname, shape in DRY_SWEEP_MATRICES if dry else SWEEP_MATRICES:
        if types and tname not in types:
            continue
        if time.monotonic() - start > max_seconds:
            skipped.append(f"{tname} {shape} {n_out}x{n_in}")
            continue
        variant_rows, summary = measure_matrix(tensor, n_out, n_in, tname, shape, ks, dry, device, timer, copy_bps)
        rows += variant_rows
        summaries.append(summary)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"device": device_name(device), "copy_gbps": copy_bps / 1e9, "ks": ks, "rows": rows,
            "summaries": summaries, "skipped": skipped, "seconds": time.monotonic() - start}


def sweep_table(result: dict, device: torch.device, match: str | None):
    """The MatvecTable of the sweep's plans (the (type, shape classes) it chose for)."""
    from gpu_kernels.matvec_table import MatvecTable, k_class

    rows, measured = {}, {}
    for s in result["summaries"]:
        if s["status"] != "ok":
            continue
        for k, params in enumerate(s["plan"], start=1):
            key = (s["type"], s["shape"], k_class(k))
            rows[key] = params
            if k in s["ms"]:
                measured[key] = {"k": k, "n_out": s["n_out"], "n_in": s["n_in"], "ms": s["ms"][k],
                                 "bandwidth_share": s["bandwidth_share"][k],
                                 "default_ms": s.get("default_ms", {}).get(k)}
    card = result["device"]
    capability = tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None
    return MatvecTable(card, rows, match or card, capability, measured)


def print_sweep(result: dict) -> None:
    ks = result["ks"]
    print(f"{result['device']}: device-to-device copy {result['copy_gbps']:.0f} GB/s (read + write); "
          f"sweep {result['seconds']:.0f} s")
    print(f"{'type':6} {'shape':5} {'launch':>22} {'grp':>3} " + " ".join(f"{'k=' + str(k) + ' ms':>9}" for k in ks)
          + f" {'% bw k=' + str(ks[0]):>9} status")
    for r in result["rows"]:
        times = " ".join(f"{r['ms'][k]:9.4f}" if k in r["ms"] else f"{'-':>9}" for k in ks)
        share = f"{100 * r['bandwidth_share'][ks[0]]:9.1f}" if r.get("bandwidth_share") else f"{'-':>9}"
        print(f"{r['type']:6} {r['shape']:5} {r['launch']:>22} {r.get('group', '-'):>3} {times} {share} {r['status']}")
    print("\nchosen plans (targets: k=1 >= 70 % of the copy bandwidth, k=4 <= 1.3x k=1, k=16 <= 2.5x k=1)")
    for s in result["summaries"]:
        head = f"{s['type']:6} {s['shape']:5} {s['n_out']}x{s['n_in']}"
        if s["status"] != "ok":
            print(f"{head}: {s['status']}")
            continue
        by_class = " ".join(f"k{k}:{s['plan'][k - 1].label()}" for k in (1, 2, 5, 9))
        times = " ".join(f"k={k} {ms:.4f} ms ({100 * s['bandwidth_share'][k]:.0f} %)" for k, ms in s["ms"].items())
        k1 = s["ms"].get(1)
        ratios = " ".join(f"k{k}/k1 {s['ms'][k] / k1:.2f}" for k in ks if k1 and k != 1)
        default = s.get("default_ms", {})
        gain = f"; default k=1 {default[1]:.4f} ms" if 1 in default else ""
        print(f"{head}: {by_class}\n    {times}; {ratios}{gain}" + (f" [{s['note']}]" if "note" in s else ""))
    if result["skipped"]:
        print(f"not swept (past --max-seconds): {', '.join(result['skipped'])}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        ks = parse_ks(args.ks or ("1,4,16" if args.sweep else "1,2,4,8,16"))
        if args.write_table and not args.sweep:
            raise ValueError("--write-table needs --sweep")
        types = {t.strip() for t in args.types.split(",")} if args.types else None
        if types and not types <= set(SWEEP_TYPES):
            raise ValueError(f"--types: sweep types are {','.join(SWEEP_TYPES)}, got {args.types}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        # Triton reads this when the kernels are decorated: before gpu_kernels is imported
        os.environ["TRITON_INTERPRET"] = "1"
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print("bench_gpu_kernels: needs a CUDA GPU (none found); --dry-run runs tiny shapes on the CPU")
        return 0
    from gpu_kernels.triton_support import require_triton
    require_triton("bench_gpu_kernels.py")
    if not args.sweep:
        result = bench(ks, args.dry_run, device)
        if args.json:
            print(json.dumps(result, indent=1))
        else:
            print_table(result)
        return 0
    result = sweep(ks, args.dry_run, device, types, args.max_seconds)
    table = sweep_table(result, device, args.table_match)
    if args.write_table:
        path = Path(args.write_table)
        if path.is_dir():           # named after the card, as gpu_kernels/matvec_tables/ holds them
            path = path / f"{card_slug(table.card)}.json"
        table.save(path)
    if args.json:
        for s in result["summaries"]:
            if "plan" in s:
                s["plan"] = [p.label() for p in s["plan"]]
        print(json.dumps({**result, "table": table.to_json()}, indent=1))
    else:
        print_sweep(result)
        if args.write_table:
            print(f"table written to {path} ({len(table.rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
