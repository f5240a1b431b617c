"""gpu_kernels.triton_norms: RMSNorm and the L2 norm in one launch, one program per row.

Interpreted on CPU tensors without a GPU (conftest sets TRITON_INTERPRET=1); the `cuda` test checks
the compiled kernel and that norms.rms_norm takes it there.
"""
from __future__ import annotations

import pytest
import torch

from gpu_kernels import norms
from gpu_kernels.triton_norms import norm_rows_triton
from tests.sm90_compile import run_in_subprocess as compile_for_sm90

pytestmark = pytest.mark.usefixtures("single_thread")


def reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float, mean: bool) -> torch.Tensor:
    xd = x.double()
    ss = (xd * xd).mean(-1, keepdim=True) if mean else (xd * xd).sum(-1, keepdim=True)
    y = xd / torch.sqrt(ss + eps)
    return y * weight.double() if weight is not None else y


@pytest.mark.parametrize("shape", [(1, 576), (5, 640), (3, 4, 128), (2, 5120), (1, 1000)], ids=str)
@pytest.mark.parametrize("mean,weighted", [(True, True), (True, False), (False, False)],
                         ids=["rms", "rms-noweight", "l2"])
def test_close_to_float64_and_each_row_alone(shape, mean, weighted):
    g = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(shape, generator=g) * 10.0 ** (torch.rand(shape[:-1] + (1,), generator=g) * 6 - 3)
    w = torch.randn(shape[-1], generator=g) if weighted else None
    y = norm_rows_triton(x, w, 1e-6, mean)
    ref = reference(x, w, 1e-6, mean)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert ((y.double() - ref).abs() <= 1e-5 * ref.abs().amax(-1, keepdim=True)).all()
    # a row's bits do not depend on the rows beside it (a verify batch vs lone decode steps)
    flat = x.reshape(-1, shape[-1])
    for i in (0, flat.shape[0] - 1):
        alone = norm_rows_triton(flat[i:i + 1].clone(), w, 1e-6, mean)
        assert torch.equal(alone[0], y.reshape(-1, shape[-1])[i])


def test_zero_row_and_strided_input():
    x = torch.randn(4, 256)
    x[1] = 0.0
    y = norm_rows_triton(x[:, :128], None, 1e-6, True)          # a strided view is read as a copy
    assert torch.equal(y[1], torch.zeros(128))
    assert torch.allclose(y, reference(x[:, :128], None, 1e-6, True).float(), rtol=1e-5, atol=0)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="weight must hold 8 values"):
        norm_rows_triton(torch.ones(2, 8), torch.ones(4), 1e-6, True)


@pytest.mark.cuda
def test_cuda_rms_norm_takes_it_and_keeps_rows_independent():
    x = torch.randn(6, 5120, device="cuda") * 30
    w = torch.randn(5120, device="cuda")
    y = norms.rms_norm(x, w, 1e-6)
    assert torch.equal(y, norm_rows_triton(x, w, 1e-6, True))
    ref = reference(x.cpu(), w.cpu(), 1e-6, True)
    assert ((y.cpu().double() - ref).abs() <= 1e-5 * ref.abs().amax(-1, keepdim=True)).all()
    for i in range(6):
        assert torch.equal(norms.rms_norm(x[i:i + 1], w, 1e-6)[0], y[i])
    q = torch.randn(3, 16, 128, device="cuda")
    assert torch.equal(norms.l2_norm(q, 1e-6), norm_rows_triton(q, None, 1e-6, False))


def test_kernel_compiles_for_a_gpu_without_one():
    compile_for_sm90("norms")
