"""gpu_kernels.triton_act_quant: a device linear's int8 activation round trip in one launch, bitwise
the torch version's (which is cpu_kernels.quantize_act's arithmetic, tests/test_qlinear.py).

Runs interpreted on CPU tensors (conftest sets TRITON_INTERPRET=1 without a GPU); the `cuda` test
repeats the check with the compiled kernel, against the torch version computed on the CPU.
"""
from __future__ import annotations

import pytest
import torch

from gpu_kernels.qlinear import QuantLinear, int8_round_trip
from gpu_kernels.triton_act_quant import act_round_trip_triton
from tests.sm90_compile import run_in_subprocess as compile_for_sm90
from tests.test_triton_matvec import N_IN, weights

pytestmark = pytest.mark.usefixtures("single_thread")


def activations(k: int, n: int, seed: int) -> torch.Tensor:
    """Values over twelve decades, some blocks all zero, one block's maximum repeated (a tie), and
    values that land on rint's halfway points after scaling."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(k, n, generator=g) * 10.0 ** (torch.rand(k, n, generator=g) * 12 - 6)
    x[0, :32] = 0.0
    x[-1, 32:64] = 3.0
    x[-1, 64:96] = torch.arange(32) - 15.5          # max 15.5: x * 127 / 15.5 hits .5 exactly for some
    return x


def reference(x: torch.Tensor, block: int, residual: bool) -> torch.Tensor:
    first = int8_round_trip(x, block)
    return first + int8_round_trip(x - first, block) if residual else first


@pytest.mark.parametrize("block", [32, 256])
@pytest.mark.parametrize("residual", [False, True], ids=["one-pass", "two-pass"])
def test_bitwise_the_torch_round_trip(block, residual):
    for seed, (k, n_blocks) in enumerate([(1, 1), (3, 5), (5, 37), (2, 130)]):
        n = block * max(n_blocks, 96 // block + 1)
        x = activations(k, n, seed)
        assert torch.equal(act_round_trip_triton(x, block, residual), reference(x, block, residual)), (k, n)


def test_rows_of_a_wider_tensor():
    """Rows with a stride past their length (a view of a wider buffer) are read in place."""
    wide = activations(4, 1024, seed=9)
    x = wide[:, :512]
    assert x.stride(0) == 1024
    assert torch.equal(act_round_trip_triton(x, 256, True), reference(x.contiguous(), 256, True))


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="block must be 32 or 256"):
        act_round_trip_triton(torch.zeros(1, 64), 64, False)
    with pytest.raises(ValueError, match="multiple of 256"):
        act_round_trip_triton(torch.zeros(1, 96), 256, False)
    with pytest.raises(ValueError, match="float32"):
        act_round_trip_triton(torch.zeros(1, 256, dtype=torch.float16), 256, False)


@pytest.mark.parametrize("residual", [False, True], ids=["one-pass", "two-pass"])
def test_quantlinear_takes_it_with_the_fused_matvec(residual):
    """A device linear on int8 activations runs the round trip in Triton where the fused matvec
    runs, and its output keeps the bits of the torch round trip."""
    from gguf.constants import GGMLQuantizationType as T

    raw = torch.from_numpy(weights(T.Q4_K, 24, N_IN, seed=5))
    fused = QuantLinear(raw, T.Q4_K, N_IN, 24, kernel="triton", int8_activations=True, residual=residual)
    torch_trip = QuantLinear(raw, T.Q4_K, N_IN, 24, kernel="triton", int8_activations=True, residual=residual)
    torch_trip._round_trip = None                   # the torch ops instead
    assert fused.fused_round_trip
    assert not QuantLinear(raw, T.Q4_K, N_IN, 24, kernel="torch", int8_activations=True).fused_round_trip
    x = activations(5, N_IN, seed=6)
    assert torch.equal(fused(x), torch_trip(x))


@pytest.mark.cuda
@pytest.mark.parametrize("block", [32, 256])
def test_cuda_bitwise_the_cpu_round_trip(block):
    """Compiled: a correctly rounded division, rint without a contracted multiply-add, the float16
    scale rounded to nearest; so the bits are the CPU's (torch's CUDA division by a scalar takes a
    reciprocal, so the reference is computed on the CPU)."""
    for residual in (False, True):
        x = activations(7, 17408, seed=block)
        got = act_round_trip_triton(x.cuda(), block, residual).cpu()
        assert torch.equal(got, reference(x, block, residual)), residual


def test_launch_passes_arguments_in_the_kernels_order():
    """RoundTripLaunch's direct launcher takes every argument positionally, constexprs last."""
    from gpu_kernels import triton_act_quant

    assert triton_act_quant._act_round_trip_kernel.arg_names == [
        "x_ptr", "y_ptr", "n_blocks", "stride_x", "stride_y", "BLOCK", "G", "RESIDUAL", "F16_SCALE"]


def test_kernel_compiles_for_a_gpu_without_one():
    compile_for_sm90("act_quant")
