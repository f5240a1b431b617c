"""Compile the project's Triton kernels for an H100 (sm_90) without a GPU.

The interpreter (TRITON_INTERPRET=1, how the CPU suite runs the kernels) accepts code that the
real compiler rejects (layouts, shapes, types), so each kernel is also lowered to a cubin here with
the ptxas bundled in Triton's wheel. The launcher's specializations are mimicked: unit strides are
constants, other integers and pointers 16-divisible.

    python -m tests.sm90_compile matvec|delta_net|act_quant|norms|rotary|attention   # exit 0: all compiled, 77: cannot here

Runs as its own process: the suite's TRITON_INTERPRET=1 must not be set when Triton is imported.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

CANNOT = 77      # this Triton has no CUDA backend or no ptxas: the test skips


def compile_for_sm90(fn, constexprs: dict, num_warps: int, fp_fusion: bool, pointer_types: dict | None = None,
                     unit: frozenset = frozenset(), not_divisible: frozenset = frozenset(), num_stages: int = 3,
                     arch: int = 90):
    """Lower fn to a cubin. Arguments not in constexprs: pointers (`pointer_types[name]`, default
    *fp32, for names in pointer_types or ending in _ptr) or i32; names in `unit` become the
    constant 1 (a unit stride), the rest but `not_divisible` are marked 16-divisible."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pointer_types = pointer_types or {}
    constexprs = {**constexprs, **{a: 1 for a in fn.arg_names if a in unit}}

    def arg_type(a):
        if a in constexprs:
            return "constexpr"
        if a in pointer_types:
            return pointer_types[a]
        return "*fp32" if a.endswith("_ptr") else "i32"
    sig = {a: arg_type(a) for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if sig[a] != "constexpr" and a not in not_divisible}
    kernel = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": fp_fusion})
    assert kernel.asm.get("cubin"), f"{fn.__name__}: no cubin"
    return kernel


def delta_net() -> list[str]:
    from gpu_kernels import triton_delta_net as m
    unit = frozenset({"sq_d", "sk_d", "sv_d", "so_d", "ss_v", "sn_v", "sg_h", "sb_h", "sw_k"})
    compile_for_sm90(m._delta_rule_kernel, {"BK": 128, "BV": 32, "SNAPSHOTS": True}, 4, True,
                     unit=unit, not_divisible=frozenset({"n"}))
    compile_for_sm90(m._causal_conv_kernel, {"K": 4, "KP": 4, "BC": 128, "HISTORY": True, "UPDATE": True}, 4, False,
                     unit=unit, not_divisible=frozenset({"n"}))
    return ["_delta_rule_kernel", "_causal_conv_kernel"]


def act_quant() -> list[str]:
    """The activation round trip for both block sizes and both pass counts, fp fusion off."""
    from gpu_kernels import triton_act_quant as m

    done = []
    for block, g in m.BLOCKS_PER_PROGRAM.items():
        for residual in (False, True):
            compile_for_sm90(m._act_round_trip_kernel, {"BLOCK": block, "G": g, "RESIDUAL": residual,
                                                        "F16_SCALE": block == 32}, 4, False,
                             not_divisible=frozenset({"n_blocks"}))
            done.append(f"block {block} residual {residual}")
    return done


def norms() -> list[str]:
    """RMSNorm (weighted or not) and the L2 norm at a 5120-wide row."""
    from gpu_kernels import triton_norms as m

    for mean, has_w in ((True, True), (True, False), (False, False)):
        compile_for_sm90(m._norm_rows_kernel, {"MEAN": mean, "HAS_W": has_w, "BLOCK": 8192}, 8, True,
                         pointer_types={"eps": "fp32"}, not_divisible=frozenset({"n", "eps"}))
    return ["rms weighted", "rms", "l2"]


def rotary() -> list[str]:
    """Both pairings at Qwen3.6's head (256 wide, 64 rotated) and a whole-head rotation."""
    from gpu_kernels import triton_rotary as m

    done = []
    for neox in (True, False):
        for half, bh, bd in ((32, 32, 256), (64, 64, 128)):
            compile_for_sm90(m._rotary_kernel, {"HALF": half, "NEOX": neox, "BH": bh, "BD": bd}, 2, False,
                             not_divisible=frozenset({"n_heads", "head_dim", "sx_t", "sx_h", "sc_t"}))
            done.append(f"neox {neox} half {half}")
    return done


def attention() -> list[str]:
    """The heads of SmolLM2 (64 wide, groups of 3), Gemma 3 and Qwen3.6 (256 wide), f16 caches."""
    from gpu_kernels import triton_attention as m

    done = []
    for group, d, warps in ((3, 64, 4), (4, 256, 8), (6, 256, 8)):
        for in_memory in (False, True):     # p0 an int, or read from a device tensor (a CUDA graph's step)
            kernel = compile_for_sm90(
                m._attention_rows_kernel,
                {"GROUP": group, "G": 16, "D": d, "BD": d, "DV": d, "BDV": d, "BT": m.BLOCK_KEYS,
                 "P0_IN_MEMORY": in_memory}, warps, True,
                pointer_types={"k_ptr": "*fp16", "v_ptr": "*fp16", "scale": "fp32", **({"p0": "*i64"} if in_memory else {})},
                not_divisible=frozenset({"p0", "first", "window", "scale"}), num_stages=1, arch=86)
            # an RTX 30 / 40 block has at most 99 KiB of shared memory (three stages took 116800 B)
            assert kernel.metadata.shared <= 99 * 1024, (group, d, kernel.metadata.shared)
            done.append(f"group {group} d {d}{' p0 in memory' if in_memory else ''}")
    return done


def matvec() -> list[str]:
    """Every type's decoder in every launch the default and committed matvec tables pick (any shape
    class, any k), and each kernel variant the sweep can pick (split-K with two chunks a step, the
    tl.dot modes) for a rows-first type, a rows-in-the-middle type and a 32-weight type with and
    without a partial last chunk; as matvec_triton launches them: fp fusion off, k not specialized."""
    from gguf.constants import GGMLQuantizationType as T
    from gpu_kernels import matvec_table as mt
    from gpu_kernels import triton_matvec as m
    from gpu_kernels.quant import block_shape

    launches = {(int(qtype), params) for table in (mt.DEFAULT, *mt.committed_tables())
                for qtype in m._DECODERS for shape in mt.SHAPE_CLASSES for params in table.plan_for(qtype, shape)}
    for qtype in (T.Q4_K, T.Q6_K, T.Q8_0):
        base = mt.default_params(qtype, "long")
        launches |= {(int(qtype), dataclasses.replace(base, **variant))
                     for variant in ({"split_k": 2, "unroll": 2}, {"block_n": 16, "dot": "tf32x3"})}
    launches.add((int(T.Q4_K), mt.MatvecParams(16, 4, False, dot="ieee")))
    done = []
    for qtype, params in sorted(launches, key=lambda qp: (qp[0], qp[1].label())):
        elems, nbytes = block_shape(qtype)
        # a partial last chunk (rows of 576 or 640) exists for the 32-weight types only
        for tail in (False, True) if elems == 32 else (False,):
            constexprs = {"DECODE": m._DECODERS[qtype], "CHUNK_BYTES": m.CHUNK // elems * nbytes,
                          "BLOCK_N": params.block_n, "KT": m.K_MAX, "ROWS_MID": params.rows_mid, "TAIL": tail,
                          "SPLIT_K": params.split_k, "UNROLL": params.unroll, "DOT": params.dot}
            compile_for_sm90(m._matvec_kernel, constexprs, params.num_warps, False,
                             pointer_types={"raw": "*u8", "x": "*fp32", "y": "*fp32", "sums": "*fp32",
                                            "counts": "*i32"},
                             not_divisible=frozenset({"n_out", "row_bytes", "k"}), num_stages=params.num_stages)
            done.append(f"{T(qtype).name} {params.label()}" + (" tail" if tail else ""))
    return done


def run_in_subprocess(kernels: str) -> None:
    """For a test: compile `kernels` in a fresh interpreter without TRITON_INTERPRET; skip when this
    Triton cannot compile for CUDA, fail with the compiler's message."""
    import pytest
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-m", "tests.sm90_compile", kernels], env=env, cwd=root,
                       capture_output=True, text=True, timeout=600)
    if r.returncode == CANNOT:
        pytest.skip("this Triton cannot compile for CUDA here")
    assert r.returncode == 0, r.stderr[-3000:]


def main(argv: list[str]) -> int:
    kernels = {"matvec": matvec, "delta_net": delta_net, "act_quant": act_quant, "norms": norms, "rotary": rotary, "attention": attention}
    if len(argv) != 1 or argv[0] not in kernels:
        print(f"usage: python -m tests.sm90_compile {'|'.join(kernels)}", file=sys.stderr)
        return 2
    try:
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError:
        return CANNOT
    try:
        done = kernels[argv[0]]()
    except FileNotFoundError:       # no ptxas in this Triton install
        return CANNOT
    print("\n".join(done))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
