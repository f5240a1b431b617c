"""gpu_kernels.triton_attention: decode / verify rows over a float KV cache in one launch.

Interpreted on CPU tensors without a GPU (conftest sets TRITON_INTERPRET=1): close to a float64
softmax attention, every row's bits the same alone or in a batch; the `cuda` test checks the
compiled kernel and that attention.attend takes it there.
"""
from __future__ import annotations

import pytest
import torch

from gpu_kernels.attention import attend
from gpu_kernels.triton_attention import attention_rows_triton, fits
from tests.sm90_compile import run_in_subprocess as compile_for_sm90

pytestmark = pytest.mark.usefixtures("single_thread")


def reference(q, k_cache, v_cache, p0, scale, window, first):
    """float64 softmax attention, row by row."""
    n_tok, n_head, d = q.shape
    group = n_head // k_cache.shape[1]
    out = torch.empty(n_tok, n_head, v_cache.shape[2], dtype=torch.float64)
    for t in range(n_tok):
        pos = p0 + t
        lo = max(first, pos - window + 1) if window > 0 else first
        keys = k_cache[lo:pos + 1].double().repeat_interleave(group, dim=1)      # [T, n_head, d]
        vals = v_cache[lo:pos + 1].double().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,thd->ht", q[t].double(), keys) * scale
        out[t] = torch.einsum("ht,thd->hd", torch.softmax(s, dim=-1), vals)
    return out


def case(n_ctx, n_head, n_kv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(6, n_head, d, generator=g) * 2
    k = (torch.randn(n_ctx, n_kv, d, generator=g) * 2).to(dtype)
    v = torch.randn(n_ctx, n_kv, d, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("n_head,n_kv,d,window,first,p0", [
    (9, 3, 64, 0, 0, 70),        # SmolLM2's heads, several key blocks
    (4, 1, 256, 0, 0, 5),        # Gemma 3's: one KV head, head dim 256, fewer keys than a block
    (4, 1, 256, 16, 0, 40),      # Gemma 3's sliding window
    (8, 2, 128, 0, 1, 33),       # an MTP block's cache (keys from position 1)
    (6, 6, 80, 0, 0, 9),         # no GQA, a head dim that is not a power of two
], ids=str)
def test_close_to_float64_and_rows_independent(dtype, n_head, n_kv, d, window, first, p0):
    q, k, v = case(128, n_head, n_kv, d, dtype, seed=n_head * d + window)
    scale = d ** -0.5
    got = attention_rows_triton(q, k, v, p0, scale, window, first)
    ref = reference(q, k, v, p0, scale, window, first)
    assert got.dtype == torch.float32 and got.shape == (6, n_head, d)
    assert (got.double() - ref).abs().max().item() <= 2e-5 * ref.abs().max().item()
    for t in (0, 3, 5):          # each row alone, as a lone decode step at its position
        alone = attention_rows_triton(q[t:t + 1].clone(), k, v, p0 + t, scale, window, first)
        assert torch.equal(alone[0], got[t]), t


def test_agrees_with_attend_torch_path():
    q, k, v = case(64, 8, 2, 64, torch.float16, seed=3)
    positions = list(range(40, 46))
    ref = attend(q, k, v, positions, 0.125)          # CPU tensors: the torch row path
    got = attention_rows_triton(q, k, v, 40, 0.125)
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


@pytest.mark.parametrize("window,first", [(0, 0), (16, 0), (0, 1)], ids=str)
def test_first_position_read_from_memory_gives_the_same_bits(window, first):
    """A captured step graph passes p0 as a device tensor the kernel loads: the bits of an int p0."""
    q, k, v = case(96, 4, 2, 64, torch.float16, seed=7)
    for p0 in (33, 70):
        want = attention_rows_triton(q, k, v, p0, 0.125, window, first)
        assert torch.equal(attention_rows_triton(q, k, v, torch.tensor([p0]), 0.125, window, first), want)


def test_attend_at_positions_is_close_to_the_sliced_rows():
    """attention.attend with `at` (the step-graph path): on CPU tensors the masked whole-cache rows,
    within float32 rounding of the sliced ones, and each row's bits independent of the batch."""
    q, k, v = case(64, 8, 2, 64, torch.float32, seed=5)
    positions = list(range(40, 46))
    ref = attend(q, k, v, positions, 0.125, 8, 1)
    got = attend(q, k, v, positions, 0.125, 8, 1, at=torch.tensor(positions))
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    alone = attend(q[2:3], k, v, positions[2:3], 0.125, 8, 1, at=torch.tensor(positions[2:3]))
    assert torch.equal(alone[0], got[2])


def test_bad_inputs_are_named():
    q, k, v = case(16, 4, 2, 64, torch.float32, seed=1)
    with pytest.raises(ValueError, match="outside the cache"):
        attention_rows_triton(q, k, v, 12, 0.1)
    assert not fits(q, object(), v)


@pytest.mark.cuda
@pytest.mark.parametrize("window", [0, 512])
def test_cuda_attend_takes_it(window):
    q, k, v = case(4096, 24, 4, 256, torch.float16, seed=window)
    q, k, v = q.cuda(), k.cuda(), v.cuda()
    positions = list(range(3000, 3006))
    got = attend(q, k, v, positions, 0.0625, window)
    assert torch.equal(got, attention_rows_triton(q, k, v, 3000, 0.0625, window))
    ref = reference(q.cpu(), k.cpu(), v.cpu(), 3000, 0.0625, window, 0)
    assert (got.cpu().double() - ref).abs().max().item() <= 2e-5 * ref.abs().max().item()
    for t in range(6):
        assert torch.equal(attend(q[t:t + 1], k, v, [3000 + t], 0.0625, window)[0], got[t])


def test_kernel_compiles_for_a_gpu_without_one():
    compile_for_sm90("attention")
