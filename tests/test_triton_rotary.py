"""gpu_kernels.triton_rotary: apply_rotary in one launch, bitwise torch's rotation.

Interpreted on CPU tensors without a GPU (conftest sets TRITON_INTERPRET=1); the `cuda` test checks
the compiled kernel and that apply_rotary takes it there.
"""
from __future__ import annotations

import pytest
import torch

from gpu_kernels.rotary import apply_rotary, rotary_rows, rotary_table
from gpu_kernels.triton_rotary import fits, rotary_triton
from tests.sm90_compile import run_in_subprocess as compile_for_sm90

pytestmark = pytest.mark.usefixtures("single_thread")

# (tokens, heads, head_dim, n_rot): whole heads, partial rotation (a pass-through tail), one token
CASES = [(1, 9, 64, 64), (4, 2, 256, 256), (3, 4, 128, 64), (2, 3, 80, 32)]


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "normal"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_bitwise_apply_rotary(case, neox):
    n_tok, n_heads, head_dim, n_rot = case
    table = rotary_table(64, n_rot, 10000.0, neox)
    rows = rotary_rows(table, 37, n_tok)
    wide = torch.randn(n_tok, n_heads + 2, head_dim) * 20     # x a view with a head stride past its width
    x = wide[:, 1:n_heads + 1]
    ref = apply_rotary(x, rows)                               # CPU tensors: the torch body
    got = rotary_triton(x, rows.cos, rows.sin, n_rot, neox)
    assert fits(x, rows) and got.is_contiguous()
    assert torch.equal(got, ref)


def test_bad_inputs_are_named():
    rows = rotary_rows(rotary_table(8, 64, 10000.0, True), 0, 1)
    with pytest.raises(ValueError, match="n_rot"):
        rotary_triton(torch.zeros(1, 1, 32), rows.cos, rows.sin, 64, True)
    with pytest.raises(ValueError, match="float32"):
        rotary_triton(torch.zeros(1, 1, 64, dtype=torch.float16), rows.cos, rows.sin, 64, True)
    assert not fits(torch.zeros(1, 1, 64, dtype=torch.float16), rows)       # apply_rotary keeps torch's ops


@pytest.mark.cuda
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "normal"])
def test_cuda_apply_rotary_takes_it_bitwise(neox):
    table = rotary_table(4096, 64, 1e6, neox, device="cuda")
    rows = rotary_rows(table, 3000, 5)
    x = torch.randn(5, 16, 128, device="cuda") * 20
    got = apply_rotary(x, rows)
    cpu_rows = rotary_rows(rotary_table(4096, 64, 1e6, neox), 3000, 5)
    assert torch.equal(got.cpu(), apply_rotary(x.cpu(), cpu_rows))
    assert torch.equal(got, rotary_triton(x, rows.cos, rows.sin, 64, neox))


def test_kernel_compiles_for_a_gpu_without_one():
    compile_for_sm90("rotary")
