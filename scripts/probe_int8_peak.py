#!/usr/bin/env python3
"""The int8 dot-product peak of one core: how many int8 products a core retires per second, from a
loop of independent accumulator chains compiled for this CPU with llvmlite (the intrinsics the
kernels use, simd_int), in the lowering the kernels run (simd_int.ISA): with AVX-512 VNNI each step
is one zmm vpdpbusd (64 u8 x s8 products summed into 16 int32 lanes), with AVX-VNNI (no AVX-512) one
ymm vpdpbusd (32 products into 8 lanes); on the avx2 lowering (no VNNI) it is llama.cpp's and
simd_int's form, a vpmaddubsw (32 products into 16 int16 pairs) summed by a vpmaddwd by ones and
added to 8 int32 lanes.

    python scripts/probe_int8_peak.py [--chains 1,4,8,12,16] [--ops 20000000] [--int16]

`--int16` times the int16 step instead (vpmaddwd into int32 lanes; vpdpwssd with VNNI): what
activations of 16 bits would cost per product. Two int8 passes whose second one has a fixed scale
(the first's / 256) are one int16 pass in disguise (docs/history.md, "AVX2: a sub-block's products
summed in int16"). On Zen 3 a chain of vpmaddwd steps retires ~1.2 a cycle, 50-62 G int16 products
a second against the int8 step's 89-92 G.

With VNNI one chain measures the instruction's latency (each vpdpbusd adds into the last); on
avx2 a chain's steps depend on each other only through the vpaddd. Many chains give the throughput
(on avx2 past ~6 chains the 16 ymm registers spill). HYBRIDRT_INT_ISA=avx2 on a VNNI host probes
the form the kernels would then run. The peak bounds what a k-token
pass can cost per token: the 27B's Q4_K / Q6_K matrices take 4 vpdpbusd per row, super-block and
token, so at the peak the per-token work of a verify batch is 4 / (vpdpbusd per cycle) cycles per
(row, super-block) (BENCHMARKS.md, "Mission size", t(k)); on AVX2 a token of the 27B's weights is
~26 G products (~39 G with the second int8 pass), so k tokens take at least k times that over the
peak ("On AVX2" there). Needs a vector lowering (simd_int.ISA not "portable"): elsewhere it prints
one `error:` line and exits 2.
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import time

import llvmlite.binding as llvm
from llvmlite import ir

from cpu_kernels import simd_int

I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
V16 = ir.VectorType(I32, 16)
# products a chain's step retires, per ISA; the int16 steps (`--int16`) multiply pairs of int16
PRODUCTS = {"avx512vnni": 64, "avxvnni": 32, "avx2": 32}
PRODUCTS_INT16 = {"avx512vnni": 32, "avxvnni": 16, "avx2": 16}
STEP = {"avx512vnni": "zmm vpdpbusd", "avxvnni": "ymm vpdpbusd", "avx2": "vpmaddubsw + vpmaddwd + vpaddd"}
STEP_INT16 = {"avx512vnni": "zmm vpdpwssd", "avxvnni": "ymm vpdpwssd", "avx2": "vpmaddwd + vpaddd"}


def loop_ir(chains: int, isa: str = "avx512vnni", triple: str | None = None, int16: bool = False) -> str:
    """run(n): n iterations, each one step (PRODUCTS[isa] products, PRODUCTS_INT16[isa] with
    `int16`) on every one of `chains` accumulators; for this process's target triple unless
    `triple` names another."""
    m = ir.Module(name="int8_peak")
    m.triple = triple or llvm.get_process_triple()
    fn = ir.Function(m, ir.FunctionType(I32, [I64]), name="run")
    entry, body, done = (fn.append_basic_block(n) for n in ("entry", "body", "done"))
    b = ir.IRBuilder(entry)
    if isa not in PRODUCTS:
        raise ValueError(f"no probe step for the {isa!r} lowering")
    acc_t = V16 if isa == "avx512vnni" else ir.VectorType(I32, 8)
    b.branch(body)
    b.position_at_end(body)
    i = b.phi(I64)
    accs = [b.phi(acc_t) for _ in range(chains)]
    i.add_incoming(ir.Constant(I64, 0), entry)
    for a in accs:
        a.add_incoming(ir.Constant(acc_t, [0] * acc_t.count), entry)
    if isa in ("avx512vnni", "avxvnni"):
        # each step adds into its chain's last result, so constant operands cannot be hoisted
        width = "512" if isa == "avx512vnni" else "256"
        op = "vpdpwssd" if int16 else "vpdpbusd"
        dot = ir.Function(m, ir.FunctionType(acc_t, [acc_t] * 3), name=f"llvm.x86.avx512.{op}.{width}")
        u = ir.Constant(acc_t, [0x01020304 + i for i in range(acc_t.count)])
        s = ir.Constant(acc_t, [0x05060708 + i for i in range(acc_t.count)])
        new = [b.call(dot, [a, u, s]) for a in accs]
    elif int16:
        v16 = ir.VectorType(I16, 16)
        maddwd = ir.Function(m, ir.FunctionType(acc_t, [v16, v16]), name="llvm.x86.avx2.pmadd.wd")
        s = ir.Constant(v16, [(517 * j) % 4001 - 2000 for j in range(16)])
        us = [b.phi(v16) for _ in accs]       # moving operands, as the int8 step's below
        for c, u in enumerate(us):
            u.add_incoming(ir.Constant(v16, [1 + (j + c) % 15 for j in range(16)]), entry)
            u.add_incoming(b.add(u, ir.Constant(v16, [1] * 16)), body)
        new = [b.add(a, b.call(maddwd, [u, s])) for a, u in zip(accs, us)]
    else:
        v8, v16 = ir.VectorType(I8, 32), ir.VectorType(I16, 16)
        maddubs = ir.Function(m, ir.FunctionType(v16, [v8, v8]), name="llvm.x86.avx2.pmadd.ub.sw")
        maddwd = ir.Function(m, ir.FunctionType(acc_t, [v16, v16]), name="llvm.x86.avx2.pmadd.wd")
        s = ir.Constant(v8, [(5 * j) % 31 - 15 for j in range(32)])
        ones = ir.Constant(v16, [1] * 16)
        # each chain's unsigned operand its own, moving every step (a vpaddb, on another port): LLVM
        # would hoist a product of constants out of the loop, and share one product among the chains
        us = [b.phi(v8) for _ in accs]
        for c, u in enumerate(us):
            u.add_incoming(ir.Constant(v8, [1 + (j + c) % 15 for j in range(32)]), entry)
            u.add_incoming(b.add(u, ir.Constant(v8, [1] * 32)), body)
        new = [b.add(a, b.call(maddwd, [b.call(maddubs, [u, s]), ones])) for a, u in zip(accs, us)]
    step = b.add(i, ir.Constant(I64, 1))
    i.add_incoming(step, body)
    for a, n in zip(accs, new):
        a.add_incoming(n, body)
    b.cbranch(b.icmp_unsigned("<", step, fn.args[0]), body, done)
    b.position_at_end(done)
    total = new[0]
    for n in new[1:]:
        total = b.add(total, n)
    b.ret(b.extract_element(total, ir.Constant(I32, 0)))        # every chain's result is used
    return str(m)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chains", default="1,4,8,12,16", help="accumulator chains to try (comma-separated)")
    ap.add_argument("--int16", action="store_true",
                    help="time the int16 step instead (vpmaddwd; vpdpwssd with VNNI): what 16-bit activations would cost")
    ap.add_argument("--ops", type=int, default=20_000_000, help="steps (a vpdpbusd, or avx2's three instructions) per timed run")
    args = ap.parse_args(argv)
    try:
        chains = [int(c) for c in args.chains.split(",")]
        if not chains or min(chains) < 1 or args.ops < 1:
            raise ValueError
    except ValueError:
        print(f"error: --chains takes positive integers, --ops a positive count (got {args.chains!r}, {args.ops})",
              file=sys.stderr)
        return 2
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    cpu, isa = llvm.get_host_cpu_name(), host_isa()
    if isa is None:
        print(f"error: the kernels' integer lowering on {cpu} is {simd_int.ISA!r}: no int8 dot step to probe "
              "(needs AVX2, AVX-VNNI or AVX-512 VNNI)", file=sys.stderr)
        return 2
    keep = []       # an engine's code lives as long as the engine
    step, products = (STEP_INT16[isa], PRODUCTS_INT16[isa]) if args.int16 else (STEP[isa], PRODUCTS[isa])
    kind = "int16" if args.int16 else "int8"
    print(f"{cpu}, one thread, {isa}: {step}, {products} {kind} products a step")
    for n_chains in chains:
        run = compiled_loop(n_chains, isa, keep, args.int16)
        iters = max(1, args.ops // n_chains)
        run(1000)
        best = min(_timed(run, iters) for _ in range(5))
        rate = iters * n_chains / best
        print(f"{n_chains:3d} chains: {rate / 1e9:5.2f} G steps/s, {rate * products / 1e9:4.0f} G {kind} products/s")
    return 0


def host_isa() -> str | None:
    """The probe's step: the lowering the kernels run (simd_int.ISA), None for "portable"."""
    return simd_int.ISA if simd_int.ISA in PRODUCTS else None


def compiled_loop(chains: int, isa: str, keep: list, int16: bool = False):
    """loop_ir(chains, isa, int16=int16) compiled for this CPU: its run(n) as a ctypes function; what must stay
    alive as long as it is called (its engine) is appended to `keep`. Needs the native target
    initialized."""
    target = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=2)
    module = llvm.parse_assembly(loop_ir(chains, isa, int16=int16))
    engine = llvm.create_mcjit_compiler(module, target)
    engine.finalize_object()
    keep.append((target, module, engine))
    return ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_int64)(engine.get_function_address("run"))


def _timed(run, iters: int) -> float:
    t0 = time.perf_counter()
    run(iters)
    return time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main())
