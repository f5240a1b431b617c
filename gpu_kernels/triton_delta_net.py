"""Gated DeltaNet's causal conv and delta-rule recurrence as Triton kernels: one launch per layer call.

The torch versions in `delta_net.py` run about six ops per token; a 48-GDN-layer model then pays
hundreds of tiny launches per decode step on a GPU. Here each kernel walks all k tokens of a
batch itself and writes the snapshot ring (the recurrence's state after each token, the conv's
input history) in the same launch.

Batch invariance: a token runs the same instructions in the same order whatever k is (the token
count is a loop bound, never specialized on), so its output and states are bitwise those of a lone
decode step; speculative rollback depends on that. The math equals the torch path's, not its bits
(the recurrence's reduction order and fused multiply-adds differ; the conv's products and sums are
rounded as torch rounds them, only SiLU may differ in the last bit).

Triton runs these on CPU tensors only interpreted (TRITON_INTERPRET=1 set before this module is
imported); that is how the test suite checks them without a GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_support import interpreting, pow2_at_least


def _check_device(t: torch.Tensor) -> None:
    if not t.is_cuda and not interpreting():
        raise ValueError(f"the Triton kernels need CUDA tensors (got {t.device}); on the CPU use "
                         f"kernel='torch', or set TRITON_INTERPRET=1 before importing gpu_kernels")


def delta_rule_grid(H: int, d_v: int, block_v: int) -> tuple[int, int]:
    """(value heads, value-column blocks): axis 1, limited to 65535 programs on CUDA, holds only
    the few column blocks of one head (4 for d_v 128 at the default 32 columns)."""
    return H, -(-d_v // block_v)


def causal_conv_grid(C: int, block_c: int) -> tuple[int]:
    """One program per block_c channels, on axis 0 (no 65535 limit there)."""
    return (-(-C // block_c),)


# ------------------------------------------------------------------ delta rule

@triton.jit(do_not_specialize=["n"])
def _delta_rule_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, s_ptr, snap_ptr, n, D_K, D_V,
                       sq_t, sq_h, sq_d, sk_t, sk_h, sk_d, sv_t, sv_h, sv_d, sg_t, sg_h, sb_t, sb_h,
                       so_t, so_h, so_d, ss_h, ss_k, ss_v, sn_t, sn_h, sn_k, sn_v,
                       BK: tl.constexpr, BV: tl.constexpr, SNAPSHOTS: tl.constexpr):
    # one program: value head h, value columns [vb * BV, vb * BV + BV); its [d_k, BV] slice of S
    # stays in registers for the whole batch (the columns of S are independent of each other)
    h, vb = tl.program_id(0), tl.program_id(1)
    rk = tl.arange(0, BK)
    rv = vb * BV + tl.arange(0, BV)
    mk, mv = rk < D_K, rv < D_V
    m2 = mk[:, None] & mv[None, :]
    s_off = h * ss_h + rk[:, None] * ss_k + rv[None, :] * ss_v
    S = tl.load(s_ptr + s_off, mask=m2, other=0.0)
    for t in range(n):
        g = tl.load(g_ptr + t * sg_t + h * sg_h).to(tl.float32)
        b = tl.load(beta_ptr + t * sb_t + h * sb_h).to(tl.float32)
        kt = tl.load(k_ptr + t * sk_t + h * sk_h + rk * sk_d, mask=mk, other=0.0).to(tl.float32)
        qt = tl.load(q_ptr + t * sq_t + h * sq_h + rk * sq_d, mask=mk, other=0.0).to(tl.float32)
        vt = tl.load(v_ptr + t * sv_t + h * sv_h + rv * sv_d, mask=mv, other=0.0).to(tl.float32)
        S = S * tl.exp(g)
        u = b * (vt - tl.sum(S * kt[:, None], axis=0))          # beta (v - S^T k)
        S = S + kt[:, None] * u[None, :]                         # + k u^T
        o = tl.sum(S * qt[:, None], axis=0)                      # S^T q
        tl.store(o_ptr + t * so_t + h * so_h + rv * so_d, o.to(o_ptr.dtype.element_ty), mask=mv)
        if SNAPSHOTS:
            if t < n - 1:       # the state after the last token is the live state itself
                tl.store(snap_ptr + t * sn_t + h * sn_h + rk[:, None] * sn_k + rv[None, :] * sn_v, S, mask=m2)
    tl.store(s_ptr + s_off, S, mask=m2)


def delta_rule_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                      beta: torch.Tensor, state: torch.Tensor, snapshots: torch.Tensor | None = None,
                      *, block_v: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """`delta_net.delta_rule` in one launch: per value head h and token t,
        S = exp(g) S;  u = beta (v - S^T k);  S = S + k u^T;  o = S^T q
    q, k: [n, H, d_k]; v: [n, H, d_v]; log_decay g, beta: [n, H]; state [H, d_k, d_v] float32,
    updated in place; `snapshots` [>= n - 1, H, d_k, d_v] float32 receives S after each token but
    the last. Any strides. Returns o [n, H, d_v] (v's dtype).
    block_v: value columns per program (a power of two; default min(32, d_v rounded up)); the grid
    is H x ceil(d_v / block_v). num_warps: default from the tile size."""
    n, H, d_k = q.shape
    d_v = v.shape[2]
    assert k.shape == q.shape and v.shape[:2] == (n, H), (q.shape, k.shape, v.shape)
    assert log_decay.shape == beta.shape == (n, H), (log_decay.shape, beta.shape)
    assert state.shape == (H, d_k, d_v) and state.dtype == torch.float32, (state.shape, state.dtype)
    _check_device(state)
    out = torch.empty_like(v)
    if n == 0:
        return out
    if snapshots is not None:
        assert snapshots.shape[0] >= n - 1 and snapshots.shape[1:] == state.shape, snapshots.shape
        assert snapshots.dtype == torch.float32, snapshots.dtype
    # unused pointer and strides when there are no snapshots
    snap, snap_strides = (snapshots, snapshots.stride()) if snapshots is not None else (state, (0,) * 4)
    BK = pow2_at_least(d_k)
    BV = block_v or min(32, pow2_at_least(d_v))
    assert BV == pow2_at_least(BV), f"block_v must be a power of two, got {BV}"
    # a warp per 256 state values, at most 4: small tiles (the tiny test models) leave no thread idle
    warps = num_warps or max(1, min(4, BK * BV // 256))
    _delta_rule_kernel[delta_rule_grid(H, d_v, BV)](
        q, k, v, log_decay, beta, out, state, snap, n, d_k, d_v,
        *q.stride(), *k.stride(), *v.stride(), *log_decay.stride(), *beta.stride(), *out.stride(),
        *state.stride(), *snap_strides,
        BK=BK, BV=BV, SNAPSHOTS=snapshots is not None, num_warps=warps,
        enable_fp_fusion=True)      # S + k u^T as one FMA: fewer steps in the token loop, one rounding
    return out


# ------------------------------------------------------------------ causal conv

@triton.jit
def _history_row(x_ptr, cs_ptr, r, cols, mask, sx_t, scs_t, KM1: tl.constexpr):
    """Row r (scalar or tensor) of the input history [conv_state; x]: conv_state rows first."""
    old = r < KM1
    a = tl.load(cs_ptr + r * scs_t + cols, mask=mask & old, other=0.0)
    b = tl.load(x_ptr + (r - KM1) * sx_t + cols, mask=mask & (r >= KM1), other=0.0)
    return tl.where(old, a, b).to(tl.float32)


@triton.jit(do_not_specialize=["n"])
def _causal_conv_kernel(x_ptr, cs_ptr, w_ptr, o_ptr, hist_ptr, n, C, sx_t, scs_t, sw_c, sw_k, so_t, sh_t,
                        K: tl.constexpr, KP: tl.constexpr, BC: tl.constexpr,
                        HISTORY: tl.constexpr, UPDATE: tl.constexpr):
    # one program: channels [pid * BC, pid * BC + BC) for every token (a depthwise conv: channels
    # are independent); inputs are contiguous along channels
    cols = tl.program_id(0) * BC + tl.arange(0, BC)
    cm = cols < C
    # the new conv state (the last K-1 inputs) is read before anything is written: conv_state is
    # updated in place at the end
    rows = tl.arange(0, KP)
    sm = (rows[:, None] < K - 1) & cm[None, :]
    new_state = _history_row(x_ptr, cs_ptr, n + rows[:, None], cols[None, :], sm, sx_t, scs_t, K - 1)
    if HISTORY:
        for r in tl.static_range(K - 1):
            tl.store(hist_ptr + r * sh_t + cols, tl.load(cs_ptr + r * scs_t + cols, mask=cm), mask=cm)
    for t in range(n):
        # the torch path's order: xs[t] w[0] + xs[t+1] w[1] + ...
        acc = _history_row(x_ptr, cs_ptr, t, cols, cm, sx_t, scs_t, K - 1) * tl.load(w_ptr + cols * sw_c, mask=cm)
        for j in tl.static_range(1, K):
            w = tl.load(w_ptr + cols * sw_c + j * sw_k, mask=cm)
            acc = acc + _history_row(x_ptr, cs_ptr, t + j, cols, cm, sx_t, scs_t, K - 1) * w
        tl.store(o_ptr + t * so_t + cols, (acc * tl.sigmoid(acc)).to(o_ptr.dtype.element_ty), mask=cm)
        if HISTORY:
            tl.store(hist_ptr + (K - 1 + t) * sh_t + cols, tl.load(x_ptr + t * sx_t + cols, mask=cm), mask=cm)
    if UPDATE:
        tl.debug_barrier()      # every read of the old conv state is done before it is overwritten
        tl.store(cs_ptr + rows[:, None] * scs_t + cols[None, :], new_state, mask=sm)


def causal_conv_triton(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                       history_out: torch.Tensor | None = None, *, update_state: bool = True,
                       block_c: int = 128) -> torch.Tensor:
    """`delta_net.causal_conv` in one launch. x [k, C] new inputs, conv_state [K-1, C] previous
    inputs, weight [C, K] depthwise kernel; out[t, c] = SiLU(sum_j xs[t + j, c] weight[c, j]) over
    xs = [conv_state; x]. conv_state becomes the last K-1 rows of xs (update_state=False leaves it
    alone); history_out [K-1+k, C], when given, receives xs (the snapshot ring's conv history).
    Rows must be contiguous along C. Returns out [k, C] in the promoted dtype of the three inputs
    (the torch path's)."""
    n, C = x.shape
    K = weight.shape[1]
    assert conv_state.shape == (K - 1, C) and weight.shape == (C, K), (x.shape, conv_state.shape, weight.shape)
    assert x.stride(1) == conv_state.stride(1) == 1, "channels must be contiguous"
    if history_out is not None:
        assert history_out.shape == (K - 1 + n, C) and history_out.stride(1) == 1, history_out.shape
    _check_device(x)
    dtype = torch.promote_types(torch.promote_types(x.dtype, conv_state.dtype), weight.dtype)
    out = torch.empty(n, C, dtype=dtype, device=x.device)
    hist = history_out if history_out is not None else out    # a placeholder pointer when unused
    _causal_conv_kernel[causal_conv_grid(C, block_c)](
        x, conv_state, weight, out, hist, n, C, x.stride(0), conv_state.stride(0), *weight.stride(),
        out.stride(0), hist.stride(0),
        K=K, KP=pow2_at_least(max(K - 1, 1)), BC=block_c,
        HISTORY=history_out is not None, UPDATE=update_state, num_warps=max(1, min(4, block_c // 32)),
        enable_fp_fusion=False)     # multiply, then add, rounded apart: the torch path's arithmetic
    return out
