"""gpu_kernels.triton_matvec: the fused dequantize-and-dot kernel, exact and bit-stable across k.

Without a GPU the kernel runs under TRITON_INTERPRET=1 (conftest sets it) on CPU tensors, so every
type and every k is checked here; the `cuda` tests repeat the checks on a real GPU, where the
compiled code is what must not depend on k, and add the Qwen3.6-27B FFN shapes.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from cpu_kernels.quantize import quantize
from gpu_kernels import triton_support
from gpu_kernels.qlinear import QuantLinear
from gpu_kernels.quant import dequantize_torch, row_bytes
from gpu_kernels.matvec_table import DEFAULT, MatvecParams
from gpu_kernels.triton_matvec import K_MAX, TRITON_MATVEC_TYPES, device_rows, matvec_triton, tail_slack
from gpu_kernels.triton_support import TritonMissing, have_triton, interpreting, require_triton
from tests.sm90_compile import run_in_subprocess as compile_for_sm90
from tests.test_gpu_quant import random_bytes

TYPES = [T(q) for q in sorted(TRITON_MATVEC_TYPES)]
N_IN = 512                  # two 256-weight chunks per row: the sum runs across chunks
CUDA = pytest.mark.cuda

pytestmark = pytest.mark.usefixtures("single_thread")


def weights(qtype, n_out: int, n_in: int, seed: int = 0) -> np.ndarray:
    """Valid blocks from cpu_kernels' quantizer, row magnitudes spread over six decades."""
    rng = np.random.default_rng([int(qtype), n_out, n_in, seed])
    w = rng.standard_normal((n_out, n_in)) * 10.0 ** rng.uniform(-4, 2, (n_out, 1))
    return quantize(w.astype(np.float32), qtype)


def tokens(k: int, n_in: int, seed: int = 0, device="cpu") -> torch.Tensor:
    return torch.randn(k, n_in, generator=torch.Generator().manual_seed(seed)).to(device)


def assert_close_to_gguf(y: torch.Tensor, raw: np.ndarray, qtype, x: torch.Tensor, what: str = ""):
    """|y - x W^T| <= 1e-5 * |x| |W|^T elementwise, W from gguf-py, the products in float64."""
    w = gguf_dequantize(raw, T(qtype)).reshape(raw.shape[0], -1).astype(np.float64)
    xd = x.cpu().double().numpy()
    err = np.abs(y.cpu().double().numpy() - xd @ w.T)
    bound = np.abs(xd) @ np.abs(w).T
    worst = (err / np.maximum(bound, 1e-300)).max()
    assert worst <= 1e-5, f"{what}: error {worst:.3g} of sum |w||x|"


def k_sweep(raw: torch.Tensor, qtype, x: torch.Tensor) -> list[torch.Tensor]:
    """matvec_triton on the first k tokens, for k = 1 .. K_MAX."""
    n_in = x.shape[1]
    return [matvec_triton(raw, qtype, n_in, x[:k]) for k in range(1, K_MAX + 1)]


def assert_k_independent(batches: list[torch.Tensor], raw: torch.Tensor, qtype, x: torch.Tensor):
    """Every token's row is bitwise the same in every batch that holds it, and alone."""
    full = batches[-1]
    for k, y in enumerate(batches, start=1):
        assert torch.equal(y, full[:k]), f"{T(qtype).name}: k={k} differs from the first k rows of k={K_MAX}"
    for t in (0, 5, K_MAX - 1):
        alone = matvec_triton(raw, qtype, x.shape[1], x[t:t + 1].clone())
        assert torch.equal(alone[0], full[t]), f"{T(qtype).name}: token {t} alone differs"


def test_support_reports_the_interpreter():
    assert have_triton() and interpreting()
    require_triton("nothing")                       # installed: no error


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_k_matches_gguf_and_no_row_depends_on_k(qtype):
    n_out = 24
    raw_np = weights(qtype, n_out, N_IN)
    raw, x = torch.from_numpy(raw_np), tokens(K_MAX, N_IN, seed=int(qtype))
    batches = k_sweep(raw, qtype, x)
    for k, y in enumerate(batches, start=1):
        assert y.dtype == torch.float32 and y.shape == (k, n_out)
        assert_close_to_gguf(y, raw_np, qtype, x[:k], f"{qtype.name} k={k}")
    assert_k_independent(batches, raw, qtype, x)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_scale_bit_pattern(qtype):
    """Random payload bytes (every 6-bit scale, sign and high bit) with finite f16 scales, and a
    ragged last program (45 rows in programs of 8)."""
    raw_np = random_bytes(np.random.default_rng(200 + int(qtype)), qtype, 45, N_IN)
    x = tokens(3, N_IN, seed=1)
    y = matvec_triton(torch.from_numpy(raw_np), qtype, N_IN, x)
    assert_close_to_gguf(y, raw_np, qtype, x, qtype.name)


def test_out_buffer_and_wide_programs():
    """`out` is filled in place; a 16-row program (the launch shape of tall matrices) and 2 warps
    give the same values up to rounding."""
    raw_np = weights(T.Q4_K, 40, N_IN)
    raw, x = torch.from_numpy(raw_np), tokens(4, N_IN)
    out = torch.full((4, 40), float("nan"))
    assert matvec_triton(raw, T.Q4_K, N_IN, x, out=out) is out
    assert_close_to_gguf(out, raw_np, T.Q4_K, x, "out")
    wide = matvec_triton(raw, T.Q4_K, N_IN, x, params=MatvecParams(16, 4, False))
    assert_close_to_gguf(wide, raw_np, T.Q4_K, x, "block_n=16")
    # the default table's launches are the old launch_config's
    assert DEFAULT.plan(T.Q4_K, 17408, 5120) == (MatvecParams(16, 4, False),) * K_MAX
    assert DEFAULT.plan(T.Q4_K, 5120, 17408) == (MatvecParams(8, 2, False),) * K_MAX
    assert DEFAULT.plan(T.Q6_K, 5120, 17408) == DEFAULT.plan(T.Q6_K, 17408, 5120) == (MatvecParams(16, 2, True),) * K_MAX


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_either_tile_order(qtype):
    """Rows first or in the middle is a layout choice: same values up to rounding, and neither
    lets a row depend on k."""
    raw_np = weights(qtype, 16, N_IN, seed=5)
    raw, x = torch.from_numpy(raw_np), tokens(3, N_IN, seed=6)
    for rows_mid in (False, True):
        params = MatvecParams(16, 2, rows_mid)
        y = matvec_triton(raw, qtype, N_IN, x, params=params)
        assert_close_to_gguf(y, raw_np, qtype, x, f"rows_mid={rows_mid}")
        assert torch.equal(matvec_triton(raw, qtype, N_IN, x[1:2], params=params)[0], y[1])


def test_bad_inputs_are_named():
    raw = torch.zeros(8, row_bytes(T.Q4_K, 256), dtype=torch.uint8)
    x = torch.zeros(1, 256)
    with pytest.raises(ValueError, match="IQ2_XXS"):
        matvec_triton(raw, T.IQ2_XXS, 256, x)
    with pytest.raises(ValueError, match="F16"):
        matvec_triton(raw, T.F16, 256, x)
    with pytest.raises(ValueError, match="uint8"):
        matvec_triton(raw, T.Q4_K, 512, torch.zeros(1, 512))
    with pytest.raises(ValueError, match="k <= 16"):
        matvec_triton(raw, T.Q4_K, 256, torch.zeros(17, 256))
    with pytest.raises(ValueError, match="k <= 16"):
        matvec_triton(raw, T.Q4_K, 256, torch.zeros(0, 256))
    with pytest.raises(ValueError, match="float32"):
        matvec_triton(raw, T.Q4_K, 256, x.double())
    with pytest.raises(ValueError, match="out"):
        matvec_triton(raw, T.Q4_K, 256, x, out=torch.zeros(1, 9))
    with pytest.raises(ValueError, match="multiple of 256"):
        matvec_triton(torch.zeros(8, row_bytes(T.Q4_K, 256), dtype=torch.uint8), T.Q4_K, 96, torch.zeros(1, 96))
    with pytest.raises(ValueError, match="170 readable bytes past the last row"):
        matvec_triton(torch.zeros(8, row_bytes(T.Q8_0, 96), dtype=torch.uint8), T.Q8_0, 96, torch.zeros(1, 96))


LEGACY_TYPES = [t for t in TYPES if t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.IQ4_NL)]


@pytest.mark.parametrize("qtype", LEGACY_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_in", [576, 640, 96], ids=lambda n: f"n_in={n}")
def test_rows_with_a_partial_last_chunk(qtype, n_in):
    """Widths of whole 32-weight blocks but not of 256 (SmolLM2's 576, Gemma 3's 640): the last
    chunk is decoded over the next row's bytes and zeroed past the row. Accurate, every k's rows
    bitwise those of k = 16, and the bytes past the last row never reach a result (0xFF there
    decodes to NaN scales)."""
    raw_np = weights(qtype, 37, n_in, seed=n_in)
    raw = device_rows(torch.from_numpy(raw_np), qtype, n_in, "cpu")
    x = tokens(K_MAX, n_in, seed=n_in)
    batches = k_sweep(raw, qtype, x)
    for k, y in enumerate(batches, start=1):
        assert_close_to_gguf(y, raw_np, qtype, x[:k], f"{qtype.name} k={k}")
    assert_k_independent(batches, raw, qtype, x)
    poisoned = torch.full((raw.numel() + tail_slack(qtype, n_in),), 0xFF, dtype=torch.uint8)
    rows = poisoned[:raw.numel()].view(raw.shape)
    rows.copy_(raw)
    assert torch.equal(matvec_triton(rows, qtype, n_in, x[:3]), batches[2])


def test_quantlinear_partial_chunk_needs_the_bytes_past_the_rows():
    raw_np = weights(T.Q8_0, 16, 576)
    with pytest.raises(ValueError, match="without the bytes past the last row"):
        QuantLinear(torch.from_numpy(raw_np), T.Q8_0, 576, 16, kernel="triton")
    lin = QuantLinear(device_rows(torch.from_numpy(raw_np), T.Q8_0, 576, "cpu"), T.Q8_0, 576, 16, kernel="triton")
    x = tokens(3, 576)
    assert_close_to_gguf(lin(x), raw_np, T.Q8_0, x, "QuantLinear Q8_0 576")


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_quantlinear_triton_kernel(qtype):
    """kernel="triton" runs the fused kernel for every batch (K_MAX tokens per launch), agrees with
    the torch tile path, and keeps a token's bits in batches past K_MAX."""
    raw_np = weights(qtype, 40, N_IN, seed=3)
    raw = torch.from_numpy(raw_np)
    fused = QuantLinear(raw, qtype, N_IN, 40, kernel="triton")
    tiles = QuantLinear(raw, qtype, N_IN, 40, kernel="torch")
    x = tokens(K_MAX + 4, N_IN, seed=4)
    y = fused(x)
    assert_close_to_gguf(y, raw_np, qtype, x, qtype.name)
    ref = tiles(x).double()
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    assert torch.equal(y[:K_MAX], matvec_triton(raw, qtype, N_IN, x[:K_MAX]))
    assert torch.equal(y[K_MAX:], matvec_triton(raw, qtype, N_IN, x[K_MAX:]))
    out64 = torch.zeros(2, 40, dtype=torch.float64)
    assert fused(x[:2], out=out64) is out64 and torch.equal(out64, y[:2].double())


def test_quantlinear_kernel_choice():
    raw = torch.from_numpy(weights(T.Q4_K, 8, 256))
    assert QuantLinear(raw, T.Q4_K, 256, 8).fused_max == 0                # auto on the CPU: tile path
    assert QuantLinear(raw, T.Q4_K, 256, 8, kernel="torch").fused_max == 0
    with pytest.raises(ValueError, match="kernel must be one of"):
        QuantLinear(raw, T.Q4_K, 256, 8, kernel="cuda")
    with pytest.raises(ValueError, match="no fused Triton kernel for Q8_0 rows of 96 without the bytes"):
        QuantLinear(torch.zeros(8, row_bytes(T.Q8_0, 96), dtype=torch.uint8), T.Q8_0, 96, 8, kernel="triton")


@pytest.fixture
def no_triton(monkeypatch):
    """`import triton` fails and find_spec finds nothing (have_triton's cached answer is reset)."""
    monkeypatch.setitem(sys.modules, "triton", None)
    triton_support.have_triton.cache_clear()
    yield
    triton_support.have_triton.cache_clear()


def test_missing_triton_is_one_clean_line(no_triton):
    assert not triton_support.have_triton()
    raw = torch.from_numpy(weights(T.Q4_K, 8, 256))
    for call in (lambda: matvec_triton(raw, T.Q4_K, 256, torch.zeros(1, 256)),
                 lambda: QuantLinear(raw, T.Q4_K, 256, 8, name="blk.0.ffn_up.weight", kernel="triton")):
        with pytest.raises(TritonMissing) as info:
            call()
        message = str(info.value)
        assert "\n" not in message and "pip install 'hybridrt[gpu]'" in message, message
    assert isinstance(info.value, RuntimeError) and "blk.0.ffn_up.weight" in message
    auto = QuantLinear(raw, T.Q4_K, 256, 8)                 # auto never needs Triton
    assert auto.fused_max == 0 and auto(torch.zeros(1, 256)).shape == (1, 8)


def test_gpu_kernels_import_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import gpu_kernels.qlinear, gpu_kernels.triton_matvec as tm, gpu_kernels.triton_support as ts\n"
            "import gpu_kernels.attention, gpu_kernels.norms, gpu_kernels.rotary, gpu_kernels.delta_net\n"
            "assert not ts.have_triton() and len(tm.TRITON_MATVEC_TYPES) == 12\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_bench_script_runs_interpreted(capsys):
    import bench_gpu_kernels

    assert bench_gpu_kernels.main(["--dry-run", "--ks", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["rows"]) == 3 and all(r["max_rel_diff_vs_torch_f32"] < 1e-5 for r in result["rows"])
    assert [r["launch"] for r in result["rows"]] == ["8x2", "16x2m", "16x2m"]      # the default table's
    if not torch.cuda.is_available():
        assert bench_gpu_kernels.main([]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == 1 and "needs a CUDA GPU" in lines[0]


# ---------------------------------------------------------------- on a real GPU

@CUDA
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_cuda_every_k_matches_gguf_and_no_row_depends_on_k(qtype):
    raw_np = weights(qtype, 300, 1024)
    raw, x = torch.from_numpy(raw_np).cuda(), tokens(K_MAX, 1024, seed=int(qtype), device="cuda")
    batches = k_sweep(raw, qtype, x)
    for k, y in enumerate(batches, start=1):
        assert_close_to_gguf(y, raw_np, qtype, x[:k], f"{qtype.name} k={k}")
    assert_k_independent(batches, raw, qtype, x)


@CUDA
@pytest.mark.parametrize("qtype,n_out,n_in", [(T.Q4_K, 17408, 5120), (T.Q4_K, 5120, 17408), (T.Q6_K, 5120, 17408)],
                         ids=["gate_up-Q4_K", "down-Q4_K", "down-Q6_K"])
def test_cuda_27b_ffn_shapes(qtype, n_out, n_in):
    """Qwen3.6-27B's FFN matrices (random payloads, finite scales): accurate against the bitwise
    gguf-py dequantization in float64, every k's rows bitwise those of k = 16, and QuantLinear's
    auto kernel is this one."""
    raw = torch.from_numpy(random_bytes(np.random.default_rng(int(qtype)), qtype, n_out, n_in)).cuda()
    x = tokens(K_MAX, n_in, device="cuda")
    w = dequantize_torch(raw, qtype, n_in).double()
    ref = x.double() @ w.t()
    bound = x.double().abs() @ w.abs().t()
    batches = k_sweep(raw, qtype, x)
    for k, y in enumerate(batches, start=1):
        worst = ((y.double() - ref[:k]).abs() / bound[:k].clamp_min(1e-300)).max().item()
        assert worst <= 1e-5, f"k={k}: {worst:.3g}"
    assert_k_independent(batches, raw, qtype, x)
    lin = QuantLinear(raw, qtype, n_in, n_out)
    assert lin.fused_max > K_MAX and torch.equal(lin(x[:3]), batches[2])


@CUDA
@pytest.mark.parametrize("qtype", LEGACY_TYPES, ids=lambda t: t.name)
def test_cuda_partial_last_chunk(qtype):
    """SmolLM2's 576-wide rows compiled: accurate, k-independent, and QuantLinear's auto kernel
    takes them when the rows come from device_rows."""
    raw_np = weights(qtype, 1536, 576, seed=7)
    raw = device_rows(torch.from_numpy(raw_np), qtype, 576, "cuda")
    x = tokens(K_MAX, 576, seed=8, device="cuda")
    batches = k_sweep(raw, qtype, x)
    for k, y in enumerate(batches, start=1):
        assert_close_to_gguf(y, raw_np, qtype, x[:k], f"{qtype.name} k={k}")
    assert_k_independent(batches, raw, qtype, x)
    lin = QuantLinear(raw, qtype, 576, 1536)
    assert lin.fused_max > K_MAX and torch.equal(lin(x[:2]), batches[1])


def test_kernel_compiles_for_a_gpu_without_one():
    """Every type's decoder in every launch shape, lowered to an sm_90 cubin with Triton's bundled
    ptxas (tests/sm90_compile.py): the interpreter accepts code the real compiler rejects, and no
    GPU has been lent to check it on."""
    compile_for_sm90("matvec")


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0], ids=lambda t: t.name)
def test_stacked_gate_up_ffn_is_bitwise_the_separate_one(qtype):
    """A device FFN with gate's and up's rows in one matrix (the binder stacks them: one round trip
    and one matvec a layer instead of two) gives the bits of the separate matrices, k = 1..4."""
    from hybridrt.runtime.backends import GluFFN

    n_embd = 512
    n_ff = 96 if qtype == T.Q8_0 else 256          # Q8_0: down's rows end inside a chunk
    gate_np, up_np = weights(qtype, n_ff, n_embd, seed=0), weights(qtype, n_ff, n_embd, seed=1)
    down_np = weights(qtype, n_embd, n_ff, seed=2)

    def lin(raw_np, n_in, n_out):
        raw = device_rows(torch.from_numpy(raw_np), qtype, n_in, "cpu")
        return QuantLinear(raw, qtype, n_in, n_out, kernel="triton", int8_activations=True)

    down = lin(down_np, n_ff, n_embd)
    separate = GluFFN(lin(gate_np, n_embd, n_ff), lin(up_np, n_embd, n_ff), down, "silu")
    stacked = GluFFN(None, None, down, "silu", gate_up=(lin(np.concatenate([gate_np, up_np]), n_embd, 2 * n_ff),
                                                       [n_ff, n_ff]))
    x = tokens(4, n_embd, seed=9)
    for k in range(1, 5):
        assert torch.equal(stacked(x[:k]), separate(x[:k])), k
