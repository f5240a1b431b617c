"""The Triton GDN kernels (gpu_kernels/triton_delta_net.py): the delta-rule recurrence against a
float64 reference, bitwise batch invariance and snapshots, the causal conv against the torch path,
the kernel="auto"|"triton"|"torch" dispatch, and a tiny qwen35 model run through the Triton path.

Without a GPU the kernels run interpreted on CPU tensors (tests/conftest.py sets TRITON_INTERPRET);
the `cuda` cases run the same checks compiled on a GPU.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from gpu_kernels.delta_net import causal_conv, causal_conv_step, delta_rule
from gpu_kernels.norms import l2_norm
from gpu_kernels.triton_support import interpreting
from tests.sm90_compile import run_in_subprocess as compile_for_sm90

triton_delta_net = pytest.importorskip("gpu_kernels.triton_delta_net")
delta_rule_triton, causal_conv_triton = triton_delta_net.delta_rule_triton, triton_delta_net.causal_conv_triton

INTERPRETED = interpreting()
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="Triton runs CPU tensors only interpreted")),
           pytest.param("cuda", marks=pytest.mark.cuda)]


def gdn_inputs(n: int, H: int, d_k: int, d_v: int, device="cpu", seed=0):
    """What GatedDeltaNet feeds the recurrence: l2-normalised q (scaled) and k, beta in (0, 1),
    g < 0, and a state that is not zero."""
    g = torch.Generator().manual_seed(seed)
    q = l2_norm(torch.randn(n, H, d_k, generator=g), 1e-6) / d_k ** 0.5
    k = l2_norm(torch.randn(n, H, d_k, generator=g), 1e-6)
    v = torch.randn(n, H, d_v, generator=g)
    log_decay = -torch.rand(n, H, generator=g) * 2
    beta = torch.rand(n, H, generator=g)
    state = torch.randn(H, d_k, d_v, generator=g) * 0.5
    return [t.to(device) for t in (q, k, v, log_decay, beta, state)]


def reference(q, k, v, log_decay, beta, state):
    """float64, head by head: (outputs [n, H, d_v], the state after each token [n, H, d_k, d_v])."""
    q, k, v, log_decay, beta, S = (t.double().cpu() for t in (q, k, v, log_decay, beta, state))
    S = S.clone()
    outs, states = [], []
    for t in range(q.shape[0]):
        S = S * torch.exp(log_decay[t])[:, None, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", S, k[t]))
        S = S + k[t][:, :, None] * u[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", S, q[t]))
        states.append(S)
    return torch.stack(outs), torch.stack(states)


def rel_err(got, ref) -> float:
    return float((got.double().cpu() - ref).norm() / ref.norm())


# ------------------------------------------------------------------ delta rule

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", range(1, 9))
def test_delta_rule_matches_float64_reference(device, n):
    q, k, v, g, beta, state = gdn_inputs(n, H=4, d_k=32, d_v=32, device=device, seed=n)
    ref_out, ref_states = reference(q, k, v, g, beta, state)
    snapshots = torch.zeros(max(n - 1, 0), *state.shape, device=device)
    out = delta_rule_triton(q, k, v, g, beta, state, snapshots)
    assert rel_err(out, ref_out) <= 1e-5
    assert rel_err(state, ref_states[-1]) <= 1e-5
    for t in range(n - 1):
        assert rel_err(snapshots[t], ref_states[t]) <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d_k,d_v,block_v", [(24, 40, 16), (16, 16, 8), (32, 48, None)])
def test_delta_rule_masks_odd_head_dims_and_splits_value_columns(device, d_k, d_v, block_v):
    q, k, v, g, beta, state = gdn_inputs(3, H=3, d_k=d_k, d_v=d_v, device=device)
    ref_out, ref_states = reference(q, k, v, g, beta, state)
    out = delta_rule_triton(q, k, v, g, beta, state, block_v=block_v)
    assert rel_err(out, ref_out) <= 1e-5 and rel_err(state, ref_states[-1]) <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_delta_rule_is_bitwise_the_same_whatever_the_batch(device):
    """Tokens as one batch of 8, as 3 + 5, and one at a time: the same outputs, final state and
    per-token states (snapshots of the batch, live state of the lone steps), bit for bit."""
    n = 8
    q, k, v, g, beta, state0 = gdn_inputs(n, H=4, d_k=32, d_v=32, device=device)
    args = q, k, v, g, beta

    batch_state = state0.clone()
    ring = torch.full((n + 2, *state0.shape), 7.0, device=device)        # larger than needed
    batch_out = delta_rule_triton(*args, batch_state, ring)
    assert torch.all(ring[n - 1:] == 7.0)          # only slots 0 .. n-2 are written

    lone_state, lone_out, lone_states = state0.clone(), [], []
    for t in range(n):
        lone_out.append(delta_rule_triton(*(a[t:t + 1] for a in args), lone_state))
        lone_states.append(lone_state.clone())
    assert torch.equal(batch_out, torch.cat(lone_out))
    assert torch.equal(batch_state, lone_state)
    for t in range(n - 1):
        assert torch.equal(ring[t], lone_states[t])

    split_state, split_ring = state0.clone(), torch.empty_like(ring)
    first = delta_rule_triton(*(a[:3] for a in args), split_state, split_ring)
    assert torch.equal(split_ring[:2], ring[:2]) and torch.equal(split_state, lone_states[2])
    rest = delta_rule_triton(*(a[3:] for a in args), split_state, split_ring)
    assert torch.equal(torch.cat([first, rest]), batch_out) and torch.equal(split_ring[:4], ring[3:7])


@pytest.mark.parametrize("device", DEVICES)
def test_delta_rule_takes_strided_views_like_the_model_gives(device):
    """v comes from a split of the conv output: a view with a token stride wider than H x d_v."""
    n, H, d = 3, 4, 16
    q, k, _, g, beta, state = gdn_inputs(n, H, d, d, device=device)
    mixed = torch.randn(n, 3 * H * d, device=device)
    v = mixed[:, 2 * H * d:].reshape(n, H, d)
    assert not v.is_contiguous()
    want_state = state.clone()
    want = delta_rule_triton(q, k, v.contiguous(), g, beta, want_state)
    got = delta_rule_triton(q, k, v, g, beta, state)
    assert torch.equal(got, want) and torch.equal(state, want_state)


# ------------------------------------------------------------------ causal conv

def conv_inputs(n: int, C: int, K: int = 4, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x, conv_state, weight = torch.randn(n, C, generator=g), torch.randn(K - 1, C, generator=g), torch.randn(C, K, generator=g)
    return x.to(device), conv_state.to(device), weight.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("C", [128, 200])         # 200: a partial channel block
def test_causal_conv_matches_torch_path(device, n, C):
    x, conv_state, weight = conv_inputs(n, C, device=device, seed=n)
    want_out, want_history = causal_conv(x, conv_state, weight, kernel="torch")
    history = torch.full_like(want_history, float("nan"))
    new_state = conv_state.clone()
    out = causal_conv_triton(x, new_state, weight, history)
    torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6)
    assert torch.equal(history, want_history)
    assert torch.equal(new_state, want_history[-conv_state.shape[0]:])    # what qwen35 keeps

    kept = conv_state.clone()
    torch.testing.assert_close(causal_conv_triton(x, kept, weight, update_state=False), want_out, rtol=1e-6, atol=1e-6)
    assert torch.equal(kept, conv_state)


@pytest.mark.parametrize("device", DEVICES)
def test_causal_conv_is_bitwise_the_same_whatever_the_batch(device):
    x, conv_state, weight = conv_inputs(6, 128, device=device)
    batch_state = conv_state.clone()
    batch = causal_conv_triton(x, batch_state, weight)
    lone_state = conv_state.clone()
    lone = torch.cat([causal_conv_triton(x[t:t + 1], lone_state, weight) for t in range(6)])
    assert torch.equal(batch, lone) and torch.equal(batch_state, lone_state)


@pytest.mark.parametrize("device", DEVICES)
def test_causal_conv_step_keeps_the_state_the_same_on_both_paths(device):
    """The stateful form: conv state advanced in place and the ring's history slice written, by
    the torch ops and copies or by the one Triton launch."""
    x, conv_state, weight = conv_inputs(3, 128, device=device)
    got = {}
    for kernel in ("torch", "triton"):
        state, ring = conv_state.clone(), torch.zeros(2, conv_state.shape[0] + 4, 128, device=device)
        out = causal_conv_step(x, state, weight, ring[1, :conv_state.shape[0] + 3], kernel=kernel)
        got[kernel] = out, state, ring
    torch.testing.assert_close(got["triton"][0], got["torch"][0], rtol=1e-6, atol=1e-6)
    assert torch.equal(got["triton"][1], got["torch"][1]) and torch.equal(got["triton"][2], got["torch"][2])
    assert torch.equal(got["torch"][1], x)          # 3 new inputs fill all K - 1 = 3 rows


# ------------------------------------------------------------------ dispatch

def test_dispatch_keeps_the_torch_path_for_cpu_tensors_and_forces_either():
    q, k, v, g, beta, state = gdn_inputs(4, H=2, d_k=16, d_v=16)
    results = {}
    for kernel in ("auto", "torch", "triton"):
        S, snaps = state.clone(), torch.zeros(3, *state.shape)
        results[kernel] = delta_rule(q, k, v, g, beta, S, snaps, kernel=kernel), S, snaps
    for a, b in zip(results["auto"], results["torch"]):
        assert torch.equal(a, b)
    if INTERPRETED:
        for a, b in zip(results["triton"], results["torch"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    x, conv_state, weight = conv_inputs(3, 64)
    auto, torch_path = causal_conv(x, conv_state, weight), causal_conv(x, conv_state, weight, kernel="torch")
    assert all(torch.equal(a, b) for a, b in zip(auto, torch_path))
    if INTERPRETED:
        before = conv_state.clone()
        out, history = causal_conv(x, conv_state, weight, kernel="triton")
        torch.testing.assert_close(out, torch_path[0], rtol=1e-6, atol=1e-6)
        assert torch.equal(history, torch_path[1]) and torch.equal(conv_state, before)   # a pure function either way

    with pytest.raises(ValueError, match="kernel must be"):
        delta_rule(q, k, v, g, beta, state, kernel="cuda")


@pytest.mark.cuda
def test_auto_dispatch_takes_triton_on_cuda():
    q, k, v, g, beta, state = gdn_inputs(4, H=4, d_k=32, d_v=32, device="cuda")
    S_auto, S_triton = state.clone(), state.clone()
    assert torch.equal(delta_rule(q, k, v, g, beta, S_auto), delta_rule_triton(q, k, v, g, beta, S_triton))
    assert torch.equal(S_auto, S_triton)


@pytest.mark.cuda
def test_real_model_shape_on_cuda():
    """Qwen3.6-27B's GDN layer: 48 value heads of 128 x 128, a 4-token verify batch with its ring."""
    q, k, v, g, beta, state = gdn_inputs(4, H=48, d_k=128, d_v=128, device="cuda")
    ref_out, ref_states = reference(q, k, v, g, beta, state)
    ring = torch.zeros(3, *state.shape, device="cuda")
    torch_state, torch_ring = state.clone(), ring.clone()
    torch_out = delta_rule(q, k, v, g, beta, torch_state, torch_ring, kernel="torch")
    out = delta_rule(q, k, v, g, beta, state, ring, kernel="triton")
    assert rel_err(out, ref_out) <= 1e-5 and rel_err(state, ref_states[-1]) <= 1e-5
    torch.testing.assert_close(out, torch_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ring, torch_ring, rtol=1e-4, atol=1e-5)


def test_kernels_compile_for_a_gpu_without_one():
    """Lowered to an sm_90 cubin with Triton's bundled ptxas (tests/sm90_compile.py): a kernel that
    interprets fine but does not compile fails here, GPU or not."""
    compile_for_sm90("delta_net")


# ------------------------------------------------------------------ a tiny qwen35 model

TOKENS = [int(t) for t in np.random.default_rng(7).integers(3, 300, 10)]


@pytest.fixture
def gdn_kernel(monkeypatch):
    """gdn_kernel(name): qwen35's GDN layers call the conv and the recurrence with kernel=name
    (the model itself leaves it at "auto")."""
    import hybridrt.models.qwen35 as qwen35

    def use(kernel: str) -> None:
        monkeypatch.setattr(qwen35, "delta_rule", functools.partial(delta_rule, kernel=kernel))
        monkeypatch.setattr(qwen35, "causal_conv_step", functools.partial(causal_conv_step, kernel=kernel))
    return use


def greedy(model, n: int) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens after TOKENS, decoded one at a time, and the logits of every position."""
    s = model.session(64)
    logits, tokens = [s.eval(TOKENS)], []
    for _ in range(n):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(s.eval(tokens[-1:]))
    return tokens, torch.cat(logits)


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("device", DEVICES)
def test_tiny_qwen35_gives_the_same_tokens_and_logits_through_triton(tiny_qwen35_mtp, gdn_kernel, device):
    from hybridrt.runtime.loader import load_model

    model = load_model(tiny_qwen35_mtp, device=device)
    gdn_kernel("torch")
    torch_tokens, torch_logits = greedy(model, 6)
    gdn_kernel("triton")
    triton_tokens, triton_logits = greedy(model, 6)
    assert triton_tokens == torch_tokens
    # on CUDA the weights are float16 and each linear rounds its input to float16, which turns
    # the paths' last-bit differences into float16 ones downstream
    assert rel_err(triton_logits, torch_logits.double().cpu()) <= (1e-4 if device == "cpu" else 1e-3)


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("device", DEVICES)
def test_tiny_qwen35_rollback_through_triton_is_bitwise(tiny_qwen35_mtp, gdn_kernel, device):
    """Verify 4 tokens, keep 2, go on: the snapshots the kernel wrote restore the state exactly as
    if the rejected tokens had never been seen (test_qwen35's rollback check, through Triton)."""
    from hybridrt.runtime.loader import load_model

    gdn_kernel("triton")
    model = load_model(tiny_qwen35_mtp, device=device)
    prefix, verify, other = TOKENS[:4], TOKENS[4:8], [5, 6]
    s = model.session(64, k_max=4)
    s.eval(prefix, logits="none")
    s.eval(verify, logits="none")
    s.truncate(len(prefix) + 2)
    got = s.eval(other)
    clean = model.session(64, k_max=4)
    clean.eval(prefix + verify[:2], logits="none")
    assert torch.equal(got, clean.eval(other))
