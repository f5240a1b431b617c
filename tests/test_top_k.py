"""cpu_kernels.top_k (the train-mtp teacher's top-k of each logits row) against a stable sort of the
float64 values on fresh random rows: bfloat16 and float32, ties, negative values, rows of every
length around the kernel's chunk."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cpu_kernels.top_k import CHUNK
from hybridrt.train_mtp.torch_model import top_k_rows


def _reference_ids(x: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's k largest by value, ties lower index first."""
    v = x.double().numpy()
    return torch.tensor(np.stack([np.lexsort((np.arange(len(r)), -r))[:k] for r in v]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(40, 40), (CHUNK + 7, 1), (5 * CHUNK + 3, 40), (20_000, 40), (3 * CHUNK, 64)])
def test_top_k_rows_matches_a_stable_sort(dtype, n, k):
    g = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 31)))
    rows = [torch.randn(n, generator=g) * 4,                                    # distinct values
            torch.randint(-6, 7, (n,), generator=g).float() / 2,               # heavy ties, zeros, negatives
            torch.linspace(-1, 1, n),                                         # rising: every chunk beats the kept
            -torch.rand(n, generator=g) - 1]                                  # all negative
    x = torch.stack(rows).to(dtype).contiguous()
    values, ids = top_k_rows(x, k)
    want = _reference_ids(x, k)
    assert torch.equal(ids, want)
    assert torch.equal(values, x.gather(1, want))
    assert torch.equal(values, torch.topk(x, k, dim=-1).values)
