"""A mixture-of-experts FFN half (qwen35moe, qwen3next) in one Numba call:

    h + sum_e w_e SwiGLU_e(x) + sigmoid(g . x) SwiGLU_shared(x),   x = rms_norm(h),

the n_used experts e of a token those of its largest router logits, w_e their softmax
probabilities renormalised over the n_used (the same as exp(l_e - max) / sum over the chosen).

Why one call: a 35B-A3B decode step runs 40 such layers, each 8 routed experts of 512 x 2048 plus a
shared one, ~0.6 MB per matrix; as separate calls (router, 8 x ffn_glu, shared ffn_glu, shared gate,
torch softmax / top-k / index_add) a layer crossed into Numba ~25 times and woke the threads for
each small matrix. Here the router and the shared gate are one projection, every chosen expert's
gate and up rows and the shared expert's are one parallel region (units of 16 rows), their downs
another.

A batch's tokens are grouped by expert (each touched expert's weights read once for all the tokens
routed to it), and everything a token's row gets is computed from that row alone with kernels that
are bit-stable across the batch (block_dots, tile_products, row-by-row quantization), so a token's
result does not depend on which other tokens share the batch or how many threads run. A token adds
its experts' outputs in ascending expert order from zero, then the shared expert's, as
hybridrt.runtime.backends.RoutedExperts and models.qwen35.MoEFFN do.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .ffn import _act_times, _sigmoid
from .layer_fused import (GROUPS_PER_THREAD, NONE, ROWS_PER_UNIT, _float_rows, _project, _residual, quant_buffers,
                          quantize_into, rms_norm_rows)
from .matvec_int import block_dots
from .matvec_simd import TILE_ROWS
from .quantize_act import QK_K, RESIDUAL_MAX_TOKENS
from .simd_int import CACHE

SILU = 0    # cpu_kernels.ffn.ACTIVATIONS["silu"]: every MoE expert here is a SwiGLU


@njit(cache=CACHE, nogil=True)
def _route(logits, n_expert, n_used):
    """(experts (k, n_used) ascending, weights (k, n_used) float32) from router logits (k, n_expert+):
    the n_used largest logits (ties: the lower id), each weighted exp(l - max) / sum over the chosen,
    summed in float64 (the renormalised softmax probabilities)."""
    k = logits.shape[0]
    ids = np.empty((k, n_used), np.intp)
    wts = np.empty((k, n_used), np.float32)
    taken = np.zeros(n_expert, np.bool_)
    for t in range(k):
        taken[:] = False
        for j in range(n_used):
            best = -1
            for e in range(n_expert):
                if not taken[e] and (best < 0 or logits[t, e] > logits[t, best]):
                    best = e
            taken[best] = True
        j = 0
        for e in range(n_expert):       # ascending: the order a token adds its experts in
            if taken[e]:
                ids[t, j] = e
                j += 1
        top = -np.inf
        for j in range(n_used):
            top = max(top, np.float64(logits[t, ids[t, j]]))
        total = 0.0
        for j in range(n_used):
            total += np.exp(np.float64(logits[t, ids[t, j]]) - top)
        for j in range(n_used):
            wts[t, j] = np.float32(np.exp(np.float64(logits[t, ids[t, j]]) - top) / total)
    return ids, wts


@njit(cache=CACHE, nogil=True)
def _quantized_runs(x, block, mult, off, cnt):
    """x's rows quantized run by run: run j (rows off[j] .. off[j] + cnt[j]) at rows mult * off[j] of
    the result, its residual rows right after it where mult == 2, so each run is one contiguous
    (mult * cnt[j])-row operand, as block_dots takes a matrix's rows and their residuals."""
    q, d, s = quant_buffers(mult * x.shape[0], x.shape[1], block)
    for j in range(off.shape[0]):
        lo, hi = off[j], off[j] + cnt[j]
        if hi > lo:
            quantize_into(x[lo:hi], block, mult == 2, q[mult * lo:mult * hi], d[mult * lo:mult * hi],
                        s[mult * lo:mult * hi])
    return q, d, s


@njit(cache=CACHE, nogil=True, inline="always")
def _unit(int_types, float_path, w, qt, be, is_int, r_lo, r_hi, out_off, x, q, d, s, out, cold, buf, part, acc):
    """out[:, out_off + r - r_lo'] for rows r_lo .. r_hi - 1 of w (out_off: the column of row 0)."""
    if is_int:
        block_dots((qt,) + int_types, w, r_lo, r_hi - r_lo, q, d, s, out, out_off + r_lo, cold)
    else:
        _float_rows(float_path, w, qt, be, r_lo, r_hi, x, buf, part, acc, out, out_off)


@njit(cache=CACHE, nogil=True)
def _n_units(runs):
    """Units of ROWS_PER_UNIT rows over the runs (a run's last unit may be shorter)."""
    n = 0
    for j in range(runs.shape[0]):
        n += (runs[j, 1] + ROWS_PER_UNIT - 1) // ROWS_PER_UNIT
    return n


@njit(cache=CACHE, nogil=True, parallel=True)
def _experts_pass(n_groups, int_types, float_path, w0, t0, e0, i0, w1, t1, e1, i1, runs, x_r, q_r, d_r, s_r, out_r,
                  x_s, q_s, d_s, s_s, out_s):
    """One parallel region over the units of the routed runs and the shared expert.

    (w0, t0, e0, i0): the routed experts' matrix this pass reads (layer_fused.matrix_operands), (w1,
    t1, e1, i1) the shared expert's (separate arguments: a parallel region takes no tuples of
    arrays). runs: int64 rows (first weight row, n_rows, first out column, token row, token rows,
    is_shared): one matrix's rows for one expert's tokens; the routed operands (x_r / q_r ...) hold
    every run's token rows, the shared ones every token."""
    k_max = max(out_r.shape[0], out_s.shape[0])
    n_units = _n_units(runs)
    for g in prange(n_groups):
        buf = np.empty((TILE_ROWS, 1024), np.float32)
        part = np.empty(4 * TILE_ROWS, np.float32)
        acc = np.empty((k_max, TILE_ROWS), np.float32)
        u_first, u_end = g * n_units // n_groups, (g + 1) * n_units // n_groups
        u = 0
        for j in range(runs.shape[0]):
            n_u = (runs[j, 1] + ROWS_PER_UNIT - 1) // ROWS_PER_UNIT
            if u + n_u <= u_first or u >= u_end:
                u += n_u
                continue
            row0, rows, col0, t_lo, t_n, shared = runs[j, 0], runs[j, 1], runs[j, 2], runs[j, 3], runs[j, 4], runs[j, 5]
            for uu in range(max(u, u_first), min(u + n_u, u_end)):
                r_lo = row0 + (uu - u) * ROWS_PER_UNIT
                r_hi = min(row0 + rows, r_lo + ROWS_PER_UNIT)
                cold = uu == u_first or uu == u
                if shared:
                    _unit(int_types, float_path, w1, t1, e1, i1, r_lo, r_hi, col0 - row0, x_s[t_lo:t_lo + t_n],
                          q_s[t_lo:t_lo + t_n], d_s[t_lo:t_lo + t_n], s_s[t_lo:t_lo + t_n],
                          out_s[t_lo:t_lo + t_n], cold, buf, part, acc)
                else:
                    _unit(int_types, float_path, w0, t0, e0, i0, r_lo, r_hi, col0 - row0, x_r[t_lo:t_lo + t_n],
                          q_r[t_lo:t_lo + t_n], d_r[t_lo:t_lo + t_n], s_r[t_lo:t_lo + t_n],
                          out_r[t_lo:t_lo + t_n], cold, buf, part, acc)
            u += n_u


@njit(cache=CACHE, nogil=True)
def _operands(x, mat, mult, off, cnt):
    """(q, d, s) of x's runs for matrix mat's integer path (empty on the float path)."""
    _, _, be, is_int = mat
    if is_int:
        return _quantized_runs(x, be, mult, off, cnt)
    return quant_buffers(0, 0, QK_K)


@njit(cache=CACHE, nogil=True, inline="always")
def _set_run(runs, j, row0, n_rows, col0, tok0, n_tok, shared):
    """runs[j] = (...), one element at a time: a row assigned from a tuple compiles Numba's
    formatted shape-mismatch message (seconds of a cold start)."""
    runs[j, 0], runs[j, 1], runs[j, 2] = row0, n_rows, col0
    runs[j, 3], runs[j, 4], runs[j, 5] = tok0, n_tok, shared


@njit(cache=CACHE, nogil=True)
def moe_block(h, n_threads, int_types, float_path, norm, eps, router, shared_gate, gate_exps, up_exps, down_exps,
              sh_gate, sh_up, sh_down, n_ff, n_ff_shared, n_used):
    """h (k, n_embd) -> h + MoE(rms_norm(h; norm)) as the module docstring says. Matrices are
    layer_fused.matrix_operands tuples; the experts' are the whole [n_expert * rows] tensors (expert
    e's rows e * n_ff .. (e + 1) * n_ff for gate / up, e * n_embd .. for down), shared_gate one row."""
    k, n_embd = h.shape
    x = rms_norm_rows(h, norm, eps)
    n_expert = router[0].shape[0]
    wr, tr, er, ir = router
    wg, tg, eg, ig = shared_gate
    logits = np.empty((k, n_expert + 1), np.float32)
    _project(n_threads, int_types, float_path, wr, tr, er, ir, n_expert, wg, tg, eg, ig, 1, wr, tr, er, ir, NONE,
             x, logits)
    ids, wts = _route(logits, n_expert, n_used)

    # the batch's (token, expert) pairs grouped by expert, ascending: run r is expert used[r]'s tokens
    count = np.zeros(n_expert, np.intp)
    for t in range(k):
        for j in range(n_used):
            count[ids[t, j]] += 1
    n_runs = 0
    for e in range(n_expert):
        n_runs += count[e] > 0
    used = np.empty(n_runs, np.intp)
    off = np.empty(n_runs, np.intp)
    cnt = np.empty(n_runs, np.intp)
    run_of = np.empty(n_expert, np.intp)    # the run of each touched expert
    r, n_sel = 0, 0
    for e in range(n_expert):
        if count[e] > 0:
            used[r], off[r], cnt[r], run_of[e] = e, n_sel, count[e], r
            n_sel += count[e]
            r += 1
    sel_tok = np.empty(n_sel, np.intp)      # row i of the routed operands: token sel_tok[i]
    slot = np.empty((k, n_used), np.intp)   # where token t's j-th expert's row is
    fill = off.copy()
    for t in range(k):
        for j in range(n_used):
            r = run_of[ids[t, j]]
            sel_tok[fill[r]] = t
            slot[t, j] = fill[r]
            fill[r] += 1
    xg = np.empty((n_sel, n_embd), np.float32)
    for i in range(n_sel):
        for c in range(n_embd):
            xg[i, c] = x[sel_tok[i], c]

    # gate and up: the routed runs and the shared expert's rows in one region. The residual pass is
    # the matrices' own flag (gate / up never take it), so each run is its tokens' rows alone.
    all_tok = np.zeros(1, np.intp)
    all_cnt = np.full(1, k, np.intp)
    gate_up = np.empty((n_sel, 2 * n_ff), np.float32)
    gate_up_s = np.empty((k, 2 * n_ff_shared), np.float32)
    q_r, d_r, s_r = _operands(xg, gate_exps, 1, off, cnt)
    q_s, d_s, s_s = _operands(x, sh_gate, 1, all_tok, all_cnt)
    # two passes (gate, then up) over one set of operands: each region's matrices must be one type
    for m in range(2):
        mats = (gate_exps, sh_gate) if m == 0 else (up_exps, sh_up)
        runs = np.empty((n_runs + 1, 6), np.int64)
        for j in range(n_runs):
            _set_run(runs, j, used[j] * n_ff, n_ff, m * n_ff, off[j], cnt[j], 0)
        _set_run(runs, n_runs, 0, n_ff_shared, m * n_ff_shared, 0, k, 1)
        (w0, t0, e0, i0), (w1, t1, e1, i1) = mats
        _experts_pass(max(1, min(_n_units(runs), GROUPS_PER_THREAD * n_threads)), int_types, float_path,
                      w0, t0, e0, i0, w1, t1, e1, i1, runs, xg, q_r, d_r, s_r, gate_up, x, q_s, d_s, s_s, gate_up_s)
    hidden = np.empty((n_sel, n_ff), np.float32)
    for i in range(n_sel):
        for c in range(n_ff):
            hidden[i, c] = _act_times(gate_up[i, c], gate_up[i, n_ff + c], SILU)
    hidden_s = np.empty((k, n_ff_shared), np.float32)
    for t in range(k):
        for c in range(n_ff_shared):
            hidden_s[t, c] = _act_times(gate_up_s[t, c], gate_up_s[t, n_ff_shared + c], SILU)

    # down: with the residual pass a run's rows are its tokens' hidden rows, then their residuals
    wd, td, ed, i_d = down_exps
    wsd, tsd, esd, isd = sh_down
    if k > RESIDUAL_MAX_TOKENS:
        i_d, isd = min(i_d, 1), min(isd, 1)
    mult_r = 2 if i_d == 2 else 1
    mult_s = 2 if isd == 2 else 1
    wide = np.empty((mult_r * n_sel, n_embd), np.float32)
    wide_s = np.empty((mult_s * k, n_embd), np.float32)
    q_r, d_r, s_r = _operands(hidden, (wd, td, ed, i_d), mult_r, off, cnt)
    q_s, d_s, s_s = _operands(hidden_s, (wsd, tsd, esd, isd), mult_s, all_tok, all_cnt)
    runs = np.empty((n_runs + 1, 6), np.int64)
    for j in range(n_runs):
        _set_run(runs, j, used[j] * n_embd, n_embd, 0, mult_r * off[j], mult_r * cnt[j], 0)
    _set_run(runs, n_runs, 0, n_embd, 0, 0, mult_s * k, 1)
    # the float path reads hidden rows, not their residuals: mult is 1 there
    _experts_pass(max(1, min(_n_units(runs), GROUPS_PER_THREAD * n_threads)), int_types, float_path,
                  wd, td, ed, i_d, wsd, tsd, esd, isd, runs, hidden, q_r, d_r, s_r, wide,
                  hidden_s, q_s, d_s, s_s, wide_s)

    f = np.zeros((k, n_embd), np.float32)
    for t in range(k):
        for j in range(n_used):         # ascending expert ids, from zero
            r = run_of[ids[t, j]]
            row = mult_r * off[r] + (slot[t, j] - off[r])   # the run's own row of this token
            for c in range(n_embd):
                y = wide[row, c] + wide[row + cnt[r], c] if mult_r == 2 else wide[row, c]
                f[t, c] = f[t, c] + y * wts[t, j]
        sg = _sigmoid(logits[t, n_expert])
        for c in range(n_embd):
            y = wide_s[t, c] + wide_s[k + t, c] if mult_s == 2 else wide_s[t, c]
            f[t, c] = f[t, c] + y * sg
    return _residual(h, f, norm, False, eps)
