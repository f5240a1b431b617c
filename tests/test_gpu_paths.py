"""What the device path does differently on a GPU, checked without one: launch grids at real model
shapes, the norms' token-by-token reductions off the CPU (meta tensors stand in for CUDA ones),
the prompt attention's bounded working set, and the choice of the current CUDA device."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpu_kernels import attention
from gpu_kernels.attention import ROWWISE_MAX, attend
from gpu_kernels.norms import l2_norm, rms_norm
from gpu_kernels.matvec_table import DEFAULT, committed_tables
from gpu_kernels.triton_matvec import TRITON_MATVEC_TYPES, matvec_grid
from kv_helpers import random_kv_caches

CUDA_GRID_MAX = (2**31 - 1, 65535, 65535)      # programs per launch axis on CUDA


class CountOps(TorchDispatchMode):
    """The aten ops run inside the `with` block, by name."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    def count(self, name: str) -> int:
        return sum(op.startswith(name) for op in self.ops)


def fits_cuda(grid: tuple) -> bool:
    return len(grid) <= 3 and all(1 <= g <= m for g, m in zip(grid, CUDA_GRID_MAX))


# Qwen3.6-27B (n_embd 5120, FFN 17408, vocab 248320), Gemma 3 (vocab 262144), a one-row matrix
@pytest.mark.parametrize("n_out", [1, 5120, 17408, 248320, 262144, 10240 * 3])
def test_matvec_grid_fits_cuda_at_real_shapes(n_out):
    for qtype in TRITON_MATVEC_TYPES:
        for n_in in (640, 5120, 17408):
            for params in {p for table in (DEFAULT, *committed_tables()) for p in table.plan(qtype, n_out, n_in)}:
                grid = matvec_grid(n_out, params.block_n, params.split_k)
                blocks = grid[0] // params.split_k
                assert fits_cuda(grid) and grid[0] % params.split_k == 0
                assert blocks * params.block_n >= n_out > (blocks - 1) * params.block_n


def test_delta_net_grids_fit_cuda_at_real_shapes():
    tdn = pytest.importorskip("gpu_kernels.triton_delta_net")
    for H, d_v in ((48, 128), (64, 128), (32, 256)):            # value heads x head size (27B, 397B, ...)
        for block_v in (16, 32, 64):
            grid = tdn.delta_rule_grid(H, d_v, block_v)
            assert fits_cuda(grid) and grid[1] * block_v >= d_v
    for C in (10240, 12288, 16384, 262144):                     # conv channels
        assert fits_cuda(tdn.causal_conv_grid(C, 128))


@pytest.mark.parametrize("shape", [(4, 5120), (3, 4, 256), (16, 16, 128)])
def test_norms_reduce_token_by_token_off_the_cpu(shape):
    """On a GPU torch sizes a reduction's thread block from the number of rows, so a verify batch's
    rows would not carry a lone step's bits: off the CPU (a meta tensor stands in for a CUDA one)
    small batches reduce one token at a time, prompts and the CPU in one call."""
    k = shape[0]
    for device, batch, calls in (("meta", shape, k), ("meta", (1, *shape[1:]), 1),
                                 ("meta", (ROWWISE_MAX + 1, *shape[1:]), 1), ("cpu", shape, 1)):
        x = torch.randn(batch, device=device)
        w = torch.ones(batch[-1], device=device)
        with CountOps() as c:
            y = rms_norm(x, w, 1e-6)
        assert y.shape == batch and c.count("aten.mean") == calls, (device, batch, c.ops)
        with CountOps() as c:
            y = l2_norm(x, 1e-6)
        assert y.shape == batch and c.count("aten.sum") == calls, (device, batch, c.ops)


def test_norm_rows_whose_bytes_are_not_16_aligned_are_copied_first():
    with CountOps() as c:
        rms_norm(torch.empty(3, 5, device="meta"), None, 1e-6)         # 20-byte rows
    assert c.count("aten.mean") == 3 and c.count("aten.clone") == 3
    with CountOps() as c:
        rms_norm(torch.empty(3, 8, device="meta"), None, 1e-6)
    assert c.count("aten.mean") == 3 and c.count("aten.clone") == 0


def test_rowwise_norm_is_the_lone_steps_on_cpu():
    """The rows a GPU batch reduces one at a time are the lone steps' tensors: on the CPU (where
    both are one call) a row of a batch equals that row alone, bit for bit."""
    x = torch.randn(6, 5120, generator=torch.Generator().manual_seed(0))
    w = torch.randn(5120, generator=torch.Generator().manual_seed(1))
    batch = rms_norm(x, w, 1e-6)
    assert all(torch.equal(batch[i], rms_norm(x[i:i + 1], w, 1e-6)[0]) for i in range(6))


@pytest.mark.parametrize("cache", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("n_tok,start,window,first", [(40, 0, 0, 0), (70, 30, 32, 0), (45, 60, 0, 1)])
def test_prompt_attention_in_query_blocks_is_the_one_call(monkeypatch, cache, n_tok, start, window, first):
    """A prompt whose scores would pass SDPA_SCORES_MAX runs in blocks of query rows with each
    query-head group folded onto its KV head (no widened K/V): the same attention within float32
    rounding as one SDPA call with enable_gqa."""
    n_head, n_kv, d = 6, 2, 64
    torch.manual_seed(n_tok + start)
    kc, vc = random_kv_caches(cache, start + n_tok + 4, n_kv, d)
    q = torch.randn(n_tok, n_head, d)
    positions = list(range(start, start + n_tok))
    whole = attend(q, kc, vc, positions, 0.125, window, first)
    n_keys = positions[-1] + 1 - (max(first, start - window + 1) if window else first)
    monkeypatch.setattr(attention, "SDPA_SCORES_MAX", n_head * n_keys * 7)      # blocks of 7 rows
    with CountOps() as c:
        blocked = attend(q, kc, vc, positions, 0.125, window, first)
    assert c.count("aten._scaled_dot_product_flash_attention_for_cpu") == -(-n_tok // 7), c.ops
    torch.testing.assert_close(blocked, whole, atol=2e-5, rtol=1e-4)


def test_use_cuda_device_makes_cuda_n_current(monkeypatch):
    """Triton launches and CUDA events act on the current device: cuda:N becomes it; an index past
    the machine's devices is one UserError line."""
    from hybridrt.runtime import loader
    from hybridrt.errors import UserError

    chosen = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    loader.use_cuda_device(torch.device("cuda"))
    loader.use_cuda_device(torch.device("cuda:1"))
    assert chosen == [torch.device("cuda:1")]
    with pytest.raises(UserError, match="2 CUDA device"):
        loader.use_cuda_device(torch.device("cuda:2"))


def test_bench_loads_the_draft_where_run_does(monkeypatch, tiny_llama):
    """`bench -md` binds the draft model on the trunk's device as `run` does (it was always loaded
    on the CPU: beside a GPU target, a setup other than the planned one)."""
    from hybridrt.cli import bench as cli_bench
    from hybridrt.runtime import loader

    m = loader.load_model(tiny_llama)
    seen = {}

    class Loaded(Exception):
        pass

    def load(model, **kwargs):
        seen.update(kwargs, model=model)
        raise Loaded

    monkeypatch.setattr(loader, "load_model", load)
    with pytest.raises(Loaded):
        cli_bench._bench_spec(m, "draft-simple", 3, str(tiny_llama), None, "random", "none", 8, 4, 1, True, 1e9,
                              None, "f32")
    assert seen["device"] == m.device and seen["tensor_devices"] is None and seen["exact_activations"] == m.binder.config.exact


def test_launch_bench_runs_with_stubbed_launches():
    """scripts/bench_gpu_launch.py --stub (its own process: it replaces the kernels' launches) times
    every piece's wrapper without a GPU, so the script cannot rot between runs on a GPU."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "scripts/bench_gpu_launch.py", "--stub", "-n", "3"], cwd=root,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert "stubbed" in lines[0] and len(lines) == 9, r.stdout
    assert all(float(line.rsplit(None, 1)[1]) > 0 for line in lines[1:8])
    assert ": off (" in lines[8]                # no compiled kernel behind a stubbed launch


def test_pow2_at_least_is_tritons_next_power_of_2():
    triton = pytest.importorskip("triton")
    from gpu_kernels.triton_support import pow2_at_least

    assert all(pow2_at_least(n) == triton.next_power_of_2(n) for n in range(1, 70000))


class FakeCompiled:
    """A stand-in for Triton's CompiledKernel: `compiled[grid](*args)` runs `body` on the args."""

    def __init__(self, body):
        self.body, self.grids = body, []

    def run(self, *args):           # present on a real one; checked_runner only asks that it exists
        raise AssertionError("not called directly")

    def __getitem__(self, grid):
        self.grids.append(grid)
        return lambda *args: self.body(*args)


def test_checked_runner_takes_only_a_launcher_that_reproduces_the_jit_output():
    from gpu_kernels.triton_support import checked_runner

    x = torch.arange(6.0)
    out = x * 2                                  # what "the JIT launch" wrote
    args = (x, out, 6)

    def right(x, y, n, scale):
        y.copy_(x * scale)

    def wrong(x, y, n, scale):
        y.copy_(x * scale + 1)

    def broken(*args):
        raise TypeError("another Triton's launcher signature")

    good = FakeCompiled(right)
    runner = checked_runner(good, (3,), args, (2.0,), 1)
    assert runner is not None and good.grids == [(3, 1, 1)]       # the grid padded to three axes
    assert torch.equal(out, x * 2)                                # the trial wrote elsewhere
    y = torch.empty(6)
    runner(x, y, 6, 2.0)
    assert torch.equal(y, x * 2)
    assert checked_runner(FakeCompiled(wrong), (3,), args, (2.0,), 1) is None
    assert checked_runner(FakeCompiled(broken), (3,), args, (2.0,), 1) is None
    assert checked_runner(None, (3,), args, (2.0,), 1) is None     # the interpreter returns no kernel


def test_matvec_launch_passes_the_constexprs_in_the_kernels_order():
    """The direct launcher takes every argument positionally, constexprs last, as Triton's JIT
    passes them: MatvecLaunch's order must be the kernel's signature."""
    from gguf.constants import GGMLQuantizationType as T

    from gpu_kernels import triton_matvec
    from gpu_kernels.quant import row_bytes

    pytest.importorskip("triton")
    raw = triton_matvec.device_rows(torch.zeros(4, row_bytes(T.Q8_0, 576), dtype=torch.uint8), T.Q8_0, 576, "cpu")
    launch = triton_matvec.MatvecLaunch(raw, T.Q8_0, 576)
    names = triton_matvec._matvec_kernel.arg_names
    assert names[:9] == ["raw", "x", "y", "n_out", "n_in", "row_bytes", "k", "sums", "counts"]
    assert all(list(run.constexprs) == names[9:] for run in launch.by_k[1:])


def test_launches_take_the_checked_runner_after_the_first_jit_launch():
    """Launches (MatvecLaunch's and RoundTripLaunch's dispatch): a key's first launch goes through
    the JIT and checks a runner; later launches with that key take the runner; try_direct=False
    launches through the JIT without keeping anything."""
    from gpu_kernels.triton_support import Launches

    jit_calls = []

    def body(x, y, scale):
        y.copy_(x * scale)

    class FakeKernel:
        def __getitem__(self, grid):
            def jit(*args, **kwargs):
                jit_calls.append(grid)
                body(*args, *kwargs.values())
                return FakeCompiled(body)
            return jit

    launches = Launches(FakeKernel())
    x = torch.arange(4.0)
    for _ in range(3):
        y = torch.empty(4)
        launches(("k",), (1,), (x, y), {"scale": 3.0}, {}, 1)
        assert torch.equal(y, x * 3)
    assert jit_calls == [(1,)] and launches.direct[("k",)] is not None
    launches(("p",), (2,), (x, torch.empty(4)), {"scale": 3.0}, {}, 1, try_direct=False)
    launches(("p",), (2,), (x, torch.empty(4)), {"scale": 3.0}, {}, 1, try_direct=False)
    assert jit_calls == [(1,), (2,), (2,)] and ("p",) not in launches.direct
