"""QuantLinear: GGUF bytes on the device, tile-by-tile dequantized matmul, bit-stable small batches."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

import gpu_kernels.qlinear as qlinear
from cpu_kernels.quantize import quantize
from gpu_kernels.attention import ROWWISE_MAX
from gpu_kernels.qlinear import TILE_ELEMS, QuantLinear, TileScratch
from gpu_kernels.quant import QUANTIZED_TYPES, dequantize_torch
from hybridrt.runtime.backends import DeviceLinear, WeightBinder
from hybridrt.files.gguf_file import GGUFFile
from hybridrt.runtime.loader import load_model
from tests.real_models import SMOLLM2, require

QTYPES = [T(q) for q in QUANTIZED_TYPES]
N_IN, N_OUT = 512, 300          # 300 rows in tiles of 64: four full tiles and a ragged one


pytestmark = pytest.mark.usefixtures("single_thread")


def make(qtype, seed=0, n_in=N_IN, n_out=N_OUT, **kw):
    rng = np.random.default_rng([int(qtype), seed])
    raw = torch.from_numpy(quantize(rng.standard_normal((n_out, n_in)).astype(np.float32), qtype))
    return QuantLinear(raw, qtype, n_in, n_out, **kw), raw


def reference(raw, qtype, x):
    w = dequantize_torch(raw, qtype, x.shape[1]).double()
    return x.double() @ w.t()


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_tok", [1, 7, ROWWISE_MAX + 8], ids=lambda n: f"k{n}")
def test_matches_float64_dequantize_then_matmul(qtype, n_tok):
    lin, raw = make(qtype, tile_rows=64)
    x = torch.randn(n_tok, N_IN, generator=torch.Generator().manual_seed(n_tok))
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (n_tok, N_OUT)
    ref = reference(raw, qtype, x)
    rel = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    assert rel <= 1e-5, rel


@pytest.mark.parametrize("tile_rows", [1, 37, N_OUT, None])
def test_any_tiling_is_accurate(tile_rows):
    lin, raw = make(T.Q5_K, tile_rows=tile_rows)
    assert lin.tile_rows == (tile_rows or N_OUT)      # the default tile holds this whole matrix
    x = torch.randn(3, N_IN, generator=torch.Generator().manual_seed(1))
    ref = reference(raw, T.Q5_K, x)
    assert ((lin(x).double() - ref).abs().max() / ref.abs().max()).item() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_rows_bitwise_the_same_alone_or_batched(qtype, dtype):
    """Decode (k = 1) and every verify batch up to ROWWISE_MAX give each row the same bits."""
    lin, _ = make(qtype, compute_dtype=dtype, n_in=256, n_out=150, tile_rows=64)
    x = torch.randn(ROWWISE_MAX, 256, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([lin(x[i:i + 1]) for i in range(ROWWISE_MAX)])
    for k in range(1, ROWWISE_MAX + 1):
        batch = lin(x[:k])
        assert torch.equal(batch, alone[:k]), f"k={k}"
        assert torch.equal(lin(x[ROWWISE_MAX - k:]), alone[ROWWISE_MAX - k:]), f"last {k}"


def test_lower_precision_compute_is_close():
    lin, raw = make(T.Q4_K, compute_dtype=torch.bfloat16)
    x = torch.randn(4, N_IN, generator=torch.Generator().manual_seed(3))
    ref = reference(raw, T.Q4_K, x)
    assert ((lin(x).double() - ref).abs().max() / ref.abs().max()).item() < 2e-2


def test_tiles_reuse_one_scratch_buffer(monkeypatch):
    """Every tile is decoded into the shared scratch; nothing dequantizes a whole matrix per call."""
    scratch = TileScratch("cpu", torch.float32)
    a, _ = make(T.Q4_K, seed=1, scratch=scratch, tile_rows=64)
    b, _ = make(T.Q6_K, seed=2, n_in=256, n_out=100, scratch=scratch, tile_rows=100)
    assert scratch.elems == 64 * N_IN and scratch.nbytes == 64 * N_IN * 4
    assert a.scratch_bytes == 64 * N_IN * 4 and b.scratch_bytes == 100 * 256 * 4
    decoded = []
    real = qlinear.dequantize_torch

    def spy(raw, qtype, n_cols, dtype=torch.float32, out=None):
        assert out is not None and raw.shape[0] <= 64 * N_IN // n_cols
        decoded.append((out.data_ptr(), raw.shape[0]))
        return real(raw, qtype, n_cols, dtype, out=out)

    monkeypatch.setattr(qlinear, "dequantize_torch", spy)
    for n_tok in (1, 4, ROWWISE_MAX + 1):
        a(torch.randn(n_tok, N_IN))
        b(torch.randn(n_tok, 256))
    assert len({ptr for ptr, _ in decoded}) == 1                       # one buffer, every tile, both linears
    assert [rows for _, rows in decoded[:6]] == [64, 64, 64, 64, 44, 100]


def test_out_buffer_and_sizes():
    lin, raw = make(T.Q4_0)
    assert lin.nbytes == raw.numel() == N_OUT * N_IN // 32 * 18
    assert lin.scratch_bytes == N_OUT * N_IN * 4 and lin.tile_rows == N_OUT
    x = torch.randn(5, N_IN)
    out = torch.full((5, N_OUT), float("nan"))
    assert lin(x, out=out) is out and torch.equal(out, lin(x))
    out64 = torch.zeros(5, N_OUT, dtype=torch.float64)
    assert lin(x, out=out64) is out64 and torch.equal(out64, lin(x).double())


def test_default_tile_bounds_the_scratch():
    lin, _ = make(T.Q8_0, n_in=256, n_out=(TILE_ELEMS // 256) + 64)
    assert lin.tile_rows == TILE_ELEMS // 256 and lin.scratch_bytes == TILE_ELEMS * 4
    assert lin.nbytes == lin.n_out * 256 // 32 * 34


def test_bad_construction_is_named():
    raw = torch.zeros(4, 144, dtype=torch.uint8)
    with pytest.raises(ValueError, match="w_bad"):
        QuantLinear(raw, T.Q4_K, 256, 5, name="w_bad")
    with pytest.raises(ValueError, match="F16"):
        QuantLinear(torch.zeros(4, 512, dtype=torch.uint8), T.F16, 256, 4)
    with pytest.raises(ValueError, match="scratch"):
        QuantLinear(raw, T.Q4_K, 256, 4, scratch=TileScratch("cpu", torch.float16))


def test_binder_puts_gguf_bytes_on_the_device():
    gguf = GGUFFile(require(SMOLLM2))
    names = [n for n, t in gguf.tensors.items() if len(t.shape) == 2]
    binder = WeightBinder(gguf, torch.device("cpu"), {n: "device" for n in names})
    for name in names[:12]:
        lin = binder.linear(name)
        assert isinstance(lin, QuantLinear) and lin.nbytes == gguf.tensors[name].nbytes, name
        assert lin.scratch is binder.scratch
    f32 = WeightBinder(gguf, torch.device("cpu"), {"blk.0.attn_norm.weight": "device"}).linear("blk.0.attn_norm.weight")
    assert isinstance(f32, DeviceLinear)


def greedy(model, prompt, n_steps):
    session = model.session(n_ctx=128)
    logits = session.eval(prompt)
    first, tokens = logits, []
    tok = int(logits[-1].argmax())
    for _ in range(n_steps):
        tokens.append(tok)
        tok = int(session.eval([tok])[-1].argmax())
    return first, tokens, session


@pytest.mark.slow
def test_smollm2_on_the_device_matches_the_mmap_path():
    path = require(SMOLLM2)
    torch.manual_seed(0)
    # float32 activations on both sides: int8 activations turn 1e-7 differences into rounding flips
    mmap_model = load_model(path, threads=1, exact_activations=True)
    names = [n for n, t in mmap_model.gguf.tensors.items() if len(t.shape) == 2]
    dev_model = load_model(path, tensor_devices={n: "device" for n in names}, threads=1, exact_activations=True)
    prompt = mmap_model.tokenize("The capital of France is")
    ref_logits, ref_tokens, _ = greedy(mmap_model, prompt, 16)
    logits, tokens, session = greedy(dev_model, prompt, 16)
    rel = ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
    assert rel < 1e-3, rel
    assert tokens == ref_tokens
    # a verify batch gives every token the bits it gets when decoded alone
    start = session.n_past - 4
    batch = session.eval(tokens[-4:], start_pos=start)
    alone = torch.cat([session.eval([t], start_pos=start + i) for i, t in enumerate(tokens[-4:])])
    assert torch.equal(batch, alone)


def test_int8_round_trip_is_the_cpu_activation_quantizer():
    """Device layers of a placed model see the activations the CPU's integer kernels multiply."""
    import numpy as np

    from cpu_kernels.matvec_int import INT_TYPES, act_block
    from cpu_kernels.quantize_act import dequantize_rows, quantize_rows
    from gpu_kernels.qlinear import ACT_BLOCK, int8_round_trip

    assert ACT_BLOCK == {int(t): act_block(t) for t in INT_TYPES}
    rng = np.random.default_rng(7)
    for block in (32, 256):
        x = (rng.standard_normal((5, 512)) * rng.uniform(0.01, 30, (5, 1))).astype(np.float32)
        x[1, :block] = 0.0                      # an all-zero block keeps scale 0
        q, d, _ = quantize_rows(x, block)
        want = dequantize_rows(q, d, 512)
        got = int8_round_trip(torch.from_numpy(x), block).numpy()
        assert np.array_equal(got, want)        # same values (a -0.0 from rounding small negatives equals 0.0)
        # a row's values do not depend on the other rows
        assert torch.equal(int8_round_trip(torch.from_numpy(x[2:3]), block)[0], torch.from_numpy(got[2]))


def test_residual_pass_on_the_device_is_the_cpus():
    """A QuantLinear with the second int8 pass multiplies the activations the CPU's residual rows
    stand for (up to the float32 order of the sum), for batches up to the same size."""
    import numpy as np

    from cpu_kernels import quantize_act
    from cpu_kernels.matvec import matvec
    from cpu_kernels.matvec_testdata import random_weights
    from gpu_kernels.qlinear import RESIDUAL_MAX_TOKENS, QuantLinear

    assert RESIDUAL_MAX_TOKENS == quantize_act.RESIDUAL_MAX_TOKENS
    rng = np.random.default_rng(8)
    for qtype, n_in in ((T.Q4_K, 512), (T.Q8_0, 96)):
        raw = random_weights(qtype, 24, n_in, rng)
        lin = QuantLinear(torch.from_numpy(raw), qtype, n_in, 24, int8_activations=True, residual=True, kernel="torch")
        one = QuantLinear(torch.from_numpy(raw), qtype, n_in, 24, int8_activations=True, kernel="torch")
        exact = QuantLinear(torch.from_numpy(raw), qtype, n_in, 24, kernel="torch")
        for k in (3, RESIDUAL_MAX_TOKENS + 1):
            x = (rng.standard_normal((k, n_in)) * 3).astype(np.float32)
            got, ref = lin(torch.from_numpy(x)).numpy(), exact(torch.from_numpy(x)).numpy()
            cpu = matvec(raw, qtype, x, residual=True)
            scale = np.abs(ref).max()
            if k <= RESIDUAL_MAX_TOKENS:
                assert np.abs(got - cpu).max() <= 1e-5 * scale
                assert np.abs(got - ref).max() <= 1e-4 * scale
            else:       # a prompt-sized batch: one pass, on both
                assert np.array_equal(got, one(torch.from_numpy(x)).numpy())
                assert np.array_equal(cpu, matvec(raw, qtype, x))
