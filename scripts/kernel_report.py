"""Static report of the device Triton kernels, compiled for sm_86, sm_89 and sm_90 without a GPU.

    python scripts/kernel_report.py [--arch 86,89,90] [--kernels matvec,attention,...] [--json]

Each kernel of gpu_kernels/ is compiled the way it runs: its Python wrapper (MatvecLaunch,
attention_rows_triton, norm_rows_triton, rotary_triton, RoundTripLaunch, delta_rule_triton,
causal_conv_triton) is called on "meta" tensors of Qwen3.6-27B's shapes with the kernel's JIT
launch intercepted, and the launch it asked for (arguments, constexprs, num_warps,
enable_fp_fusion) is compiled with Triton's own argument binder (the JIT's specialization: 16-byte
divisibility of integers and pointers, unit strides as constants; meta tensors sit at address 0
plus their view offset, so pointers are as aligned as fresh CUDA allocations) and an explicit
GPUTarget("cuda", arch, 32). Triton's bundled ptxas (-v) and cuobjdump give, per kernel and arch:

  grid        programs the launch asks for (at the case's tokens: one, or a 4-token verify batch)
  regs        registers per thread (ptxas)
  spill       spill store / load bytes (ptxas)
  smem        shared memory per program (Triton's allocation, bytes); "!" marks more than the
              card lets one block use (99 KiB on sm_86 / sm_89): that launch fails
  warps/SM    warps an SM holds at the launch's grid: min(grid programs / SMs, programs resident
              by registers, shared memory and the SM's warp and block limits) x num_warps
  LDG         global loads by width in bits (8:10 = ten LDG.E.U8 or .S8; a128: LDGSTS, the
              asynchronous copies to shared memory of Triton's pipelined loops), in the whole
              kernel and in the main loop; "+" adds those of its nested loops (for the matvec the
              loop's own loads are the weights' bytes and scales, the nested ones the activations)
  loop        the main loop: the longest backward branch in the SASS (to an earlier address);
              instructions between its target and the branch, inclusive, NOPs excluded.
              Loops nested in it (the matvec's token loop) are counted once: the figures are for a
              one-token decode step. A kernel without a loop counts its whole body up to the last
              EXIT (slow-path subroutines placed after it are not counted, a CALL to one counts as
              one instruction). Static counts: an instruction skipped by a forward branch (a
              predicated-off snapshot store) still counts, a stall does not
  nested      instructions of the loops inside the main loop (the matvec's token loop): a k-token
              call runs about loop + (k - 1) x nested instructions per iteration
  B/iter      global bytes a program's loop iteration (or whole run, without a loop) moves, as each
              case builder's docstring says (for the matvec: the weight bytes, BLOCK_N rows x one
              256-weight chunk; the activations are shared by every program, from L1/L2)

Instructions per byte, against what the card's bandwidth allows:

  kernel:   instr/B  = loop instructions x num_warps / B/iter        (warp-instructions per byte)
  allowed:  allowed  = SMs x 4 schedulers x clock / bandwidth         (warp-instructions per byte)

Each SM issues at most one warp-instruction per scheduler per clock, so streaming B bytes at full
bandwidth leaves SMs x 4 x clock / bandwidth warp-instructions per byte. Per thread both sides are
32x larger (a thread issues the loop's instructions for its 1/(32 x num_warps) share of B/iter).
`x bound` = instr/B / allowed: above 1 the kernel cannot reach the card's bandwidth, it is bound by
instruction issue (and below 1 it may still be bound by latency, occupancy, or pipes slower than
one instruction a clock: shuffles, MUFU, conversions). The cards: RTX 3060 (sm_86: 28 SMs,
360 GB/s, 1.78 GHz boost), RTX 4070 (sm_89: 46 SMs, 504 GB/s, 2.48 GHz), H100 SXM (sm_90:
132 SMs, 3350 GB/s, 1.98 GHz).

Output: a table per arch on stdout (progress on stderr), or with --json one object with the
formula, the cards and a row per kernel x arch. Bad arguments: one `error:` line, exit 2.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from unittest import mock

ARCHES = (86, 89, 90)
KERNELS = ("matvec", "attention", "norms", "rotary", "act_quant", "delta_net")

# Qwen3.6-27B: hidden 5120, FFN 17408, 24 query / 4 KV heads of 256 (64 rotated), Gated DeltaNet
# with 16 key / 48 value heads of 128 and a conv of 4 over 10240 channels
N_EMBD, N_FF, N_HEAD, N_KV, HEAD_DIM, N_ROT = 5120, 17408, 24, 4, 256, 64
GDN_K_HEADS, GDN_V_HEADS, GDN_HEAD, CONV_K = 16, 48, 128, 4
N_CTX = 4096            # the KV cache rows and the decode position (p0 = N_CTX - 1)
VERIFY_TOKENS = 4       # a speculative verify batch, for the kernels that write a snapshot ring
# (matrix, n_out, n_in): the FFN both ways and the 6144-wide attention / GDN output projections
MATVEC_SHAPES = (("ffn_gate/up", N_FF, N_EMBD), ("ffn_down", N_EMBD, N_FF),
                 ("attn_out/ssm_out", N_EMBD, GDN_V_HEADS * GDN_HEAD))


@dataclass(frozen=True)
class Card:
    """A card of each arch, for the bandwidth bound and occupancy (CUDA's per-SM limits)."""
    arch: int
    name: str
    sms: int
    clock_ghz: float        # boost clock
    bandwidth_gbs: float    # DRAM bandwidth
    max_warps: int          # resident warps per SM
    max_programs: int       # resident thread blocks per SM
    smem_bytes: int         # shared memory per SM (each block also reserves 1 KiB)
    smem_block: int         # shared memory one block may use (opt-in maximum): more and Triton refuses the launch
    regs: int = 65536       # 32-bit registers per SM

    @property
    def allowed(self) -> float:
        """Warp-instructions per DRAM byte at which issue (4 schedulers x 1 a clock) and bandwidth balance."""
        return self.sms * 4 * self.clock_ghz * 1e9 / (self.bandwidth_gbs * 1e9)


CARDS = {86: Card(86, "RTX 3060", 28, 1.78, 360, 48, 16, 100 * 1024, 99 * 1024),
         89: Card(89, "RTX 4070", 46, 2.48, 504, 48, 24, 100 * 1024, 99 * 1024),
         90: Card(90, "H100 SXM", 132, 1.98, 3350, 64, 32, 228 * 1024, 227 * 1024)}
FORMULA = ("instr/B = loop SASS instructions x num_warps / bytes per loop iteration per program; "
           "allowed = SMs x 4 schedulers x clock / DRAM bandwidth (warp-instructions per byte; "
           "per thread both are 32x); x bound = instr/B / allowed (> 1: issue bound)")


@dataclass
class Launch:
    """One intercepted JIT launch: kernel[grid](*args, **kwargs)."""
    grid: tuple
    args: tuple
    kwargs: dict


@dataclass
class Case:
    """A kernel at one representative shape: what to compile and how to read its loop."""
    kernel: str             # the --kernels family
    label: str
    fn: object              # the JITFunction
    launch: Launch
    loop: str               # what one main-loop iteration is ("whole": no loop, the program)
    bytes_per_iter: int     # global bytes a program moves per iteration (see each builder)


@dataclass
class Sass:
    """What the report reads off one kernel's SASS."""
    instructions: int
    loads: dict                     # load width (load_width) -> count, whole kernel
    loop_found: bool
    loop_instructions: int          # main loop (or the whole body when there is none)
    nested_instructions: int        # instructions of loops nested in the main loop (counted once)
    loop_loads: dict                # in the main loop, outside the loops nested in it
    nested_loads: dict              # in the nested loops (the matvec's activations, per token)
    loop_mix: dict = field(default_factory=dict)    # opcode (first word) -> count in the loop


# ----------------------------------------------------------------------------------- capture

@contextlib.contextmanager
def intercepted(fn):
    """While active, `fn[grid](...)` records a Launch instead of compiling and launching."""
    seen: list[Launch] = []

    def record(*args, grid, warmup, **kwargs):
        seen.append(Launch(tuple(grid), args, kwargs))
        return None           # as a launch that compiled nothing: Launches keeps the JIT path
    fn.run = record           # an instance attribute: JITFunction.__getitem__ calls self.run
    try:
        yield seen
    finally:
        del fn.run


def capture(fn, call, *modules) -> Launch:
    """The launch of `fn` that call() makes. Wrappers that refuse non-CUDA tensors accept the
    meta tensors when their module's `interpreting` says yes (they check `x.is_cuda or
    interpreting()`); nothing runs, the launch is only recorded."""
    with contextlib.ExitStack() as stack:
        for m in modules:
            stack.enter_context(mock.patch.object(m, "interpreting", lambda: True))
        seen = stack.enter_context(intercepted(fn))
        call()
    if len(seen) != 1:
        raise RuntimeError(f"{fn.__name__}: expected one launch, saw {len(seen)}")
    return seen[0]


def meta(*shape, dtype=None):
    import torch
    return torch.empty(*shape, dtype=dtype or torch.float32, device="meta")


# ----------------------------------------------------------------------------------- cases

def matvec_cases() -> list[Case]:
    """Every type with a fused kernel at each 27B shape, through MatvecLaunch (the matvec table's
    launch for one token: BLOCK_N, num_warps, tile order..., fp fusion off). B/iter: BLOCK_N rows x
    one chunk's bytes."""
    import torch
    from cpu_kernels.formats import type_name
    from gpu_kernels import triton_matvec as m
    from gpu_kernels.quant import row_bytes

    cases = []
    for qtype in sorted(m.TRITON_MATVEC_TYPES, key=type_name):
        for matrix, n_out, n_in in MATVEC_SHAPES:
            launch = m.MatvecLaunch(meta(n_out, row_bytes(qtype, n_in), dtype=torch.uint8), qtype, n_in)
            seen = capture(m._matvec_kernel, lambda: launch(meta(1, n_in), meta(1, n_out)))
            c = launch.by_k[1].constexprs
            cases.append(Case("matvec", f"{type_name(qtype)} {n_out}x{n_in} ({matrix})", m._matvec_kernel, seen,
                              "256-weight chunk", c["BLOCK_N"] * c["CHUNK_BYTES"]))
    return cases


def attention_cases() -> list[Case]:
    """One decode row over an f16 cache (the default -ctk/-ctv f16), eager (p0 an int) and as a
    CUDA graph replays it (p0 read from a device tensor). B/iter: one block of BT keys and values
    of one KV head."""
    import torch
    from gpu_kernels import triton_attention as m

    q, cache = meta(1, N_HEAD, HEAD_DIM), meta(N_CTX, N_KV, HEAD_DIM, dtype=torch.float16)
    cases = []
    for how, p0 in (("eager", N_CTX - 1), ("graph", meta(1, dtype=torch.int64))):
        seen = capture(m._attention_rows_kernel,
                       lambda: m.attention_rows_triton(q, cache, cache, p0, HEAD_DIM ** -0.5), m)
        c = seen.kwargs
        cases.append(Case("attention", f"decode row ({how}), {N_HEAD}/{N_KV} heads x {HEAD_DIM}, f16 cache",
                          m._attention_rows_kernel, seen, f"{c['BT']}-key block", c["BT"] * (c["D"] + c["DV"]) * 2))
    return cases


def norm_cases() -> list[Case]:
    """The trunk's RMSNorm, the GDN output norm and the GDN q/k L2 norm. No loop: B/iter is the
    program's row read and written, plus the weight."""
    from gpu_kernels import triton_norms as m

    cases = []
    for label, x, weighted, mean in ((f"rms {N_EMBD} + weight (trunk)", meta(1, N_EMBD), True, True),
                                     (f"rms {GDN_HEAD} + weight (GDN out, {GDN_V_HEADS} rows)",
                                      meta(1, GDN_V_HEADS, GDN_HEAD), True, True),
                                     (f"l2 {GDN_HEAD} (GDN q/k, {GDN_K_HEADS} rows)",
                                      meta(1, GDN_K_HEADS, GDN_HEAD), False, False)):
        n = x.shape[-1]
        w = meta(n) if weighted else None
        seen = capture(m._norm_rows_kernel, lambda: m.norm_rows_triton(x, w, 1e-6, mean), m)
        cases.append(Case("norms", label, m._norm_rows_kernel, seen, "whole", n * 4 * (3 if weighted else 2)))
    return cases


def rotary_cases() -> list[Case]:
    """q's rotation (neox, 64 of 256 dims) at a decode row, cos / sin rows gathered from the
    table as rotary_rows does. No loop: B/iter is one head row read and written plus cos and sin."""
    from gpu_kernels import triton_rotary as m

    x, table = meta(1, N_HEAD, HEAD_DIM), meta(N_CTX, N_ROT // 2)
    rows = table[N_CTX - 1:N_CTX].unsqueeze(1)
    seen = capture(m._rotary_kernel, lambda: m.rotary_triton(x, rows, rows, N_ROT, True))
    return [Case("rotary", f"q {N_HEAD} heads x {HEAD_DIM}, {N_ROT} rotated (neox)", m._rotary_kernel, seen,
                 "whole", HEAD_DIM * 4 * 2 + N_ROT * 4)]


def act_quant_cases() -> list[Case]:
    """The int8 round trip of a linear's input for both activation blocks, one pass (gate/up) and
    two (the FFN-down input). No loop: B/iter is the program's activations read and written."""
    from gpu_kernels import triton_act_quant as m

    cases = []
    for block in (256, 32):
        for residual, n in ((False, N_EMBD), (True, N_FF)):
            launch = m.RoundTripLaunch(n, block)
            seen = capture(m._act_round_trip_kernel, lambda: launch(meta(1, n), residual))
            cases.append(Case("act_quant", f"block {block}, {'two passes' if residual else 'one pass'}, n {n}",
                              m._act_round_trip_kernel, seen, "whole", m.BLOCKS_PER_PROGRAM[block] * block * 4 * 2))
    return cases


def delta_net_cases() -> list[Case]:
    """The GDN recurrence and causal conv at a decode step and at a verify batch that writes the
    snapshot ring. Token loop; B/iter: the recurrence's q, k, v rows, g, beta, its output row and a
    snapshot of its [BK, BV] state slice; the conv's new input row, its output row and (ring) the
    history row (the older rows and the weights are re-read from L1)."""
    from gpu_kernels import triton_delta_net as m

    value_dim, key_dim = GDN_V_HEADS * GDN_HEAD, GDN_K_HEADS * GDN_HEAD
    channels = 2 * key_dim + value_dim
    cases = []
    for n, ring in ((1, False), (VERIFY_TOKENS, True)):
        mixed = meta(n, channels)
        q = k = meta(n, GDN_V_HEADS, GDN_HEAD)          # repeated to the value heads: contiguous
        v = mixed[:, 2 * key_dim:].reshape(n, GDN_V_HEADS, GDN_HEAD)
        g = beta = meta(n, GDN_V_HEADS)
        state = meta(2, GDN_V_HEADS, GDN_HEAD, GDN_HEAD)[1]          # one layer of the stacked states
        snaps = meta(2, VERIFY_TOKENS, GDN_V_HEADS, GDN_HEAD, GDN_HEAD)[1] if ring else None
        seen = capture(m._delta_rule_kernel, lambda: m.delta_rule_triton(q, k, v, g, beta, state, snaps), m)
        c = seen.kwargs
        moved = (2 * c["BK"] + c["BV"]) * 4 + 8 + c["BV"] * 4 + (c["BK"] * c["BV"] * 4 if ring else 0)
        what = f"{n} tokens, snapshot ring" if ring else "decode, no ring"
        cases.append(Case("delta_net", f"delta rule {GDN_V_HEADS} x {GDN_HEAD}x{GDN_HEAD}, {what}",
                          m._delta_rule_kernel, seen, "token", moved))

        conv_state, weight = meta(2, CONV_K - 1, channels)[1], meta(channels, CONV_K)
        history = meta(2, CONV_K - 1 + VERIFY_TOKENS, channels)[1, :CONV_K - 1 + n] if ring else None
        seen = capture(m._causal_conv_kernel, lambda: m.causal_conv_triton(mixed, conv_state, weight, history), m)
        bc = seen.kwargs["BC"]
        cases.append(Case("delta_net", f"causal conv {channels} ch x {CONV_K}, {what}", m._causal_conv_kernel, seen,
                          "token", bc * 4 * (3 if ring else 2)))
    return cases


CASE_BUILDERS = {"matvec": matvec_cases, "attention": attention_cases, "norms": norm_cases,
                 "rotary": rotary_cases, "act_quant": act_quant_cases, "delta_net": delta_net_cases}


# ----------------------------------------------------------------------------------- compile

@dataclass
class Compiled:
    regs: int
    spill_stores: int
    spill_loads: int
    shared: int
    num_warps: int
    sass: Sass
    seconds: float


def compile_case(case: Case, arch: int, memo: dict) -> Compiled:
    """Compile the launch for `arch` as JITFunction.run would on such a card: its binder's
    specialization, its options (num_warps, enable_fp_fusion, debug) parsed by the CUDA backend."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = case.fn
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kwargs = dict(case.launch.kwargs)
    # the three options JITFunction.run adds before binding
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*case.launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    src = ASTSource(fn, signature, constexprs, attrs)
    key = (src.hash(), options.hash(), arch)
    if key in memo:             # another shape that specializes the same way: the same binary
        return memo[key]
    t0 = time.perf_counter()
    log = io.StringIO()
    # ptxas -v's log (registers, spills) is printed to stdout by the backend when asked for
    with mock.patch.object(knobs.nvidia, "dump_ptxas_log", True), contextlib.redirect_stdout(log):
        kernel = triton.compile(src, target=target, options=options.__dict__)
    text = log.getvalue()
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if regs is None or spills is None:
        raise RuntimeError(f"{fn.__name__} sm_{arch}: no register / spill line in the ptxas log:\n{text}")
    memo[key] = Compiled(int(regs.group(1)), int(spills.group(1)), int(spills.group(2)), kernel.metadata.shared,
                         kernel.metadata.num_warps, read_sass(disassemble(kernel.asm["cubin"])),
                         time.perf_counter() - t0)
    return memo[key]


def disassemble(cubin: bytes) -> str:
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", f.name], check=True,
                              capture_output=True, text=True).stdout


# ----------------------------------------------------------------------------------- SASS

SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
PREDICATE = re.compile(r"^@!?U?P(?:\d|T)\s+")
ADDRESS = re.compile(r"0x[0-9a-f]+")


def load_width(opcode: str) -> str | None:
    """A global load's width in bits per thread ("8" for LDG.E.U8, "32" for LDG.E, "128" for
    LDG.E.128.CONSTANT; "a128" for LDGSTS.E.BYPASS.128, an asynchronous copy into shared memory,
    as Triton's pipelined loops load), or None for any other instruction."""
    parts = opcode.split(".")
    if parts[0] not in ("LDG", "LDGSTS"):
        return None
    bits = 32
    for p in parts[1:]:
        if p in ("U8", "S8"):
            bits = 8
        elif p in ("U16", "S16"):
            bits = 16
        elif p in ("64", "128"):
            bits = int(p)
    return ("a" if parts[0] == "LDGSTS" else "") + str(bits)


def read_sass(text: str) -> Sass:
    """Instruction counts, load widths and the main loop of one function's SASS (cuobjdump -sass)."""
    code = []               # (address, opcode, whole instruction) without NOPs
    for line in text.splitlines():
        m = SASS_LINE.search(line)
        if m is None:
            continue
        instr = PREDICATE.sub("", m.group(2).strip())
        opcode = instr.split()[0]
        if opcode != "NOP":
            code.append((int(m.group(1), 16), opcode, instr))
    exits = [a for a, op, _ in code if op == "EXIT"]
    # the kernel's body ends at its last EXIT: after it come the slow-path subroutines that
    # divisions and square roots CALL, and a branch-to-self as padding
    body_end = max(exits) if exits else code[-1][0]
    body = [c for c in code if c[0] <= body_end]
    # a backward branch (`@P0 BRA 0x260`, `@!P1 BRA !P6, 0x1310`: the target is the last
    # operand) closes a loop
    loops = []
    for addr, op, instr in body:
        targets = ADDRESS.findall(instr) if op.split(".")[0] == "BRA" else []
        if targets and int(targets[-1], 16) < addr:
            loops.append((int(targets[-1], 16), addr))
    if loops:
        lo, hi = max(loops, key=lambda span: span[1] - span[0])
        loop = [c for c in body if lo <= c[0] <= hi]
        nested = [s for s in loops if s != (lo, hi) and lo <= s[0] and s[1] <= hi]
        nested_addrs = {c[0] for c in body for s in nested if s[0] <= c[0] <= s[1]}
    else:
        loop, nested_addrs = body, set()

    def widths(instrs):
        counts = Counter(w for _, op, _ in instrs if (w := load_width(op)) is not None)
        return dict(sorted(counts.items(), key=lambda item: (item[0][0] == "a", int(item[0].lstrip("a")))))
    own = [c for c in loop if c[0] not in nested_addrs]
    return Sass(len(body), widths(body), bool(loops), len(loop), len(nested_addrs), widths(own),
                widths([c for c in loop if c[0] in nested_addrs]),
                dict(Counter(op.split(".")[0] for _, op, _ in loop).most_common()))


# ----------------------------------------------------------------------------------- report

def resident_warps(card: Card, c: Compiled, programs: int) -> float:
    """Warps an SM holds on average at this grid: the grid spread over the SMs, capped by what
    registers (allocated per warp in units of 256), shared memory and the SM's limits allow; 0
    when one program needs more shared memory than the card gives a block (it cannot launch)."""
    if c.shared > card.smem_block:
        return 0.0
    per_warp_regs = math.ceil(c.regs * 32 / 256) * 256
    by_regs = card.regs // per_warp_regs // c.num_warps
    by_smem = card.smem_bytes // (c.shared + 1024)
    resident = min(card.max_programs, card.max_warps // c.num_warps, by_regs, by_smem)
    return min(resident, programs / card.sms) * c.num_warps


def report_row(case: Case, arch: int, c: Compiled) -> dict:
    card = CARDS[arch]
    programs = math.prod(case.launch.grid)
    instr_per_byte = c.sass.loop_instructions * c.num_warps / case.bytes_per_iter
    return {"kernel": case.kernel, "case": case.label, "arch": arch, "card": card.name,
            "launch_kwargs": {k: v.fn.__name__ if hasattr(v, "fn") else v for k, v in case.launch.kwargs.items()},
            "num_warps": c.num_warps, "grid": list(case.launch.grid), "regs": c.regs,
            "spill_stores": c.spill_stores, "spill_loads": c.spill_loads, "shared": c.shared,
            "shared_fits": c.shared <= card.smem_block,
            "warps_per_sm": round(resident_warps(card, c, programs), 2),
            "instructions": c.sass.instructions, "loads": c.sass.loads,
            "loop": case.loop if c.sass.loop_found or case.loop == "whole" else f"{case.loop} (no loop found)",
            "loop_instructions": c.sass.loop_instructions, "nested_instructions": c.sass.nested_instructions,
            "loop_loads": c.sass.loop_loads, "nested_loads": c.sass.nested_loads, "loop_mix": c.sass.loop_mix,
            "bytes_per_iter": case.bytes_per_iter,
            "warp_instr_per_byte": round(instr_per_byte, 4), "allowed_warp_instr_per_byte": round(card.allowed, 4),
            "thread_instr_per_byte": round(32 * instr_per_byte, 2),
            "allowed_thread_instr_per_byte": round(32 * card.allowed, 2),
            "x_bound": round(instr_per_byte / card.allowed, 2), "compile_s": round(c.seconds, 2)}


def widths_text(loads: dict) -> str:
    return " ".join(f"{w}:{n}" for w, n in loads.items()) or "-"


def print_table(rows: list[dict], arches: list[int]) -> None:
    head = ("kernel", "case", "grid", "warps", "regs", "spill st/ld", "smem", "warps/SM", "LDG all", "LDG loop",
            "loop instr", "nested", "B/iter", "instr/B", "x bound", "loop mix (top 5)")
    for arch in arches:
        card = CARDS[arch]
        print(f"\nsm_{arch}, {card.name}: {card.sms} SMs x 4 schedulers x {card.clock_ghz} GHz / "
              f"{card.bandwidth_gbs:g} GB/s = {card.allowed:.3f} warp-instructions per byte allowed "
              f"({32 * card.allowed:.1f} per thread)")
        table = [head]
        for r in (r for r in rows if r["arch"] == arch):
            mix = " ".join(f"{op} {n}" for op, n in list(r["loop_mix"].items())[:5])
            loop_loads = widths_text(r["loop_loads"])
            if r["nested_loads"]:
                loop_loads += f" + {widths_text(r['nested_loads'])}"
            table.append((r["kernel"], r["case"], "x".join(map(str, r["grid"])), str(r["num_warps"]), str(r["regs"]),
                          f"{r['spill_stores']}/{r['spill_loads']}", f"{r['shared']}{'' if r['shared_fits'] else '!'}",
                          f"{r['warps_per_sm']:.1f}", widths_text(r["loads"]), loop_loads,
                          f"{r['loop_instructions']} ({r['loop']})", str(r["nested_instructions"]),
                          str(r["bytes_per_iter"]), f"{r['warp_instr_per_byte']:.3f}", f"{r['x_bound']:.2f}", mix))
        widths = [max(len(row[i]) for row in table) for i in range(len(head))]
        for row in table:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    if not all(r["shared_fits"] for r in rows):
        print("\n! more shared memory than one block may use on that card: Triton refuses the launch (OutOfResources)")
    print(f"\n{FORMULA}")


def parse_list(text: str, allowed: tuple, what: str, convert=str) -> list:
    try:
        items = [convert(t.strip()) for t in text.split(",") if t.strip()]
    except ValueError:
        items = None
    bad = [i for i in items or [] if i not in allowed]
    if not items or bad:
        raise ValueError(f"--{what}: {text!r}: expected a comma-separated list of {', '.join(map(str, allowed))}")
    return list(dict.fromkeys(items))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default=",".join(map(str, ARCHES)), help="compute capabilities, e.g. 86,89,90")
    ap.add_argument("--kernels", default=",".join(KERNELS), help=f"kernel families: {','.join(KERNELS)}")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout instead of the tables")
    a = ap.parse_args(argv)
    try:
        arches = parse_list(a.arch, ARCHES, "arch", int)
        kernels = parse_list(a.kernels, KERNELS, "kernels")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    # compiled kernels, not interpreted ones (Triton reads this when a kernel is decorated), and
    # Triton's cache in a directory of this run's own
    os.environ.pop("TRITON_INTERPRET", None)
    cache = tempfile.TemporaryDirectory(prefix="kernel_report_")
    os.environ["TRITON_CACHE_DIR"] = cache.name
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError as e:
        print(f"error: this needs Triton with its CUDA backend ({e})", file=sys.stderr)
        return 1

    t0 = time.perf_counter()
    cases = [case for k in kernels for case in CASE_BUILDERS[k]()]
    rows, memo = [], {}
    with cache:
        for arch in arches:
            for i, case in enumerate(cases):
                compiled = compile_case(case, arch, memo)
                rows.append(report_row(case, arch, compiled))
                print(f"[sm_{arch} {i + 1}/{len(cases)}] {case.kernel}: {case.label}: {compiled.regs} regs, "
                      f"{rows[-1]['loop_instructions']} loop instructions", file=sys.stderr)
    print(f"{len(memo)} compiles for {len(rows)} rows in {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    if a.json:
        import triton
        json.dump({"triton": triton.__version__, "formula": FORMULA,
                   "cards": {arch: {**asdict(CARDS[arch]), "allowed_warp_instr_per_byte": round(CARDS[arch].allowed, 4)}
                             for arch in arches},
                   "rows": rows}, sys.stdout, indent=1)
        print()
    else:
        print_table(rows, arches)
    return 0


if __name__ == "__main__":
    sys.exit(main())
