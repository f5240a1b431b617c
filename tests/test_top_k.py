"""cpu_kernels.top_k (each logits row's k largest: sampling's top-k and the train-mtp teacher's)
against a stable sort of the float64 values on fresh random rows: bfloat16 and float32, ties,
negative values, rows of every length around the kernel's chunk; and sampling.top_k_rows, which
takes torch.topk where the kernel is not meant to run."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cpu_kernels.top_k import CHUNK, top_k_bits
from hybridrt.decoding.sampling import TOP_K_KERNEL_MAX, top_k_rows


def _reference_ids(x: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's k largest by value, ties lower index first."""
    v = x.double().numpy()
    return torch.tensor(np.stack([np.lexsort((np.arange(len(r)), -r))[:k] for r in v]))


def _rows(n: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 31)))
    rows = [torch.randn(n, generator=g) * 4,                                    # distinct values
            torch.randint(-6, 7, (n,), generator=g).float() / 2,               # heavy ties, zeros, negatives
            torch.linspace(-1, 1, n),                                         # rising: every chunk beats the kept
            -torch.rand(n, generator=g) - 1]                                  # all negative
    return torch.stack(rows).to(dtype).contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(40, 40), (CHUNK + 7, 1), (5 * CHUNK + 3, 40), (20_000, 40), (3 * CHUNK, 64)])
def test_top_k_kernel_matches_a_stable_sort(dtype, n, k):
    x = _rows(n, dtype)
    ids = np.empty((x.shape[0], k), np.int64)
    if dtype == torch.bfloat16:
        top_k_bits(x.view(torch.int16).numpy().view(np.uint16), 15, ids)
    else:
        top_k_bits(x.view(torch.int32).numpy().view(np.uint32), 31, ids)
    assert torch.equal(torch.from_numpy(ids), _reference_ids(x, k))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(20_000, 40), (100, 40), (3 * TOP_K_KERNEL_MAX, TOP_K_KERNEL_MAX + 1)])
def test_top_k_rows_gives_torch_topk_values(dtype, n, k):
    x = _rows(n, dtype)
    values, ids = top_k_rows(x, k)
    assert torch.equal(values, torch.topk(x, k, dim=-1).values)
    assert torch.equal(values, x.gather(1, ids))
    if 4 * k <= n <= 20_000 and k <= TOP_K_KERNEL_MAX:        # the kernel's rows: its tie order
        assert torch.equal(ids, _reference_ids(x, k))
    view = x[:, ::2]                                          # a strided view is read as its values
    assert torch.equal(top_k_rows(view, 8)[0], torch.topk(view, 8, dim=-1).values)
