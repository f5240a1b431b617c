"""Predicted decode speed from a per-step bandwidth model.

Decoding is memory bound: a step reads every weight it uses once, whatever the batch size k, because
both the GPU matmul and the CPU k-input matvec stream a weight row once for all k inputs. So

    t_step(k) = bytes_gpu(k) / gpu_bw + bytes_cpu(k) / cpu_bw + overheads

with bytes_gpu = GPU weights + KV read (k query rows, each over the context at the decode depth; the
bit-stable attention runs row by row) + recurrent state read and written once, plus one write per
snapshot; bytes_cpu = CPU FFN weights once per step (+ k embedding rows). Routed-expert tensors are
read in the share k tokens touch: 1 - (1 - used/experts)^k, for independent routing (the MTP block's
experts too: one token per draft, the verify batch's tokens in its KV rewrite).
GPU and CPU work is serial (each CPU FFN layer waits for its layer's attention), so times add, except
in the split boundary layer, whose GPU and CPU halves run at the same time.

Speculative step: one verify of k = N + 1 tokens writing N snapshots, plus N draft steps, plus (MTP)
one pass of the MTP block over the accepted tokens to rewrite its KV from trunk hidden states.
Tokens per step = 1 + a + a^2 + ... + a^N for a per-draft acceptance a.
"""
from __future__ import annotations

from dataclasses import dataclass

from .options import PlanOptions
from .profile import ModelProfile


@dataclass(frozen=True)
class FfnSplit:
    """The boundary FFN layer split by intermediate units: units [0, gpu_units) run on the GPU,
    [gpu_units, n_ff) on the CPU, both halves at the same time; the layer's output is the sum of the
    two halves' down projections (each half is a complete SwiGLU over its own units)."""
    layer: int
    n_ff: int
    gpu_units: int          # a multiple of the granule (the quant block of ffn_down's rows)
    gpu_bytes: int
    cpu_bytes: int


@dataclass(frozen=True)
class SpeedEstimate:
    gpu_bw: float                       # bytes/s used
    cpu_bw: float
    depth: int                          # context depth the step is priced at
    plain_step_s: float
    plain_tok_s: float
    plain_gpu_bytes: int                # bytes read per plain step
    plain_cpu_bytes: int
    n_draft: int
    accept_rate: float
    verify_step_s: float | None = None
    verify_gpu_bytes: int | None = None
    verify_cpu_bytes: int | None = None
    draft_step_s: float | None = None   # one draft token
    spec_step_s: float | None = None    # verify + N drafts (+ MTP KV rewrite)
    tokens_per_step: float | None = None
    spec_tok_s: float | None = None
    assumptions: tuple[str, ...] = ()


def expected_tokens_per_step(accept_rate: float, n_draft: int) -> float:
    """1 + a + ... + a^N: draft i is kept only if drafts 1..i all are; the verify adds one token."""
    return sum(accept_rate ** i for i in range(n_draft + 1))


def _read_fraction(profile: ModelProfile, expert: bool, k: int) -> float:
    if not expert or not profile.n_expert:
        return 1.0
    return 1.0 - (1.0 - profile.n_expert_used / profile.n_expert) ** k


def _trunk_step(profile: ModelProfile, opt: PlanOptions, device: dict[str, str], n_cpu_ffn: int,
                k: int, snapshots: int, split: FfnSplit | None = None) -> tuple[float, int, int]:
    gpu = cpu = 0.0
    for t in profile.tensors:
        if profile.in_mtp(t):
            continue
        if t.role == "embedding":
            cpu += k * t.nbytes / profile.n_vocab
            continue
        share = t.nbytes * _read_fraction(profile, t.expert, k)
        if device[t.name] == "gpu":
            gpu += share
        else:
            cpu += share
    gpu += k * opt.depth * profile.kv_bytes_per_token(opt.cache_type_k, opt.cache_type_v)
    gpu += (2 + snapshots) * profile.recurrent_state_bytes
    overlap = 0.0
    if split is not None:       # its tensors are "cpu" above; move the GPU half and credit the overlap
        gpu += split.gpu_bytes
        cpu -= split.gpu_bytes
        overlap = min(split.gpu_bytes / opt.gpu_bw, split.cpu_bytes / opt.cpu_bw)
    seconds = (gpu / opt.gpu_bw + cpu / opt.cpu_bw - overlap
               + profile.n_layer * opt.layer_overhead_s + n_cpu_ffn * opt.handoff_overhead_s)
    return seconds, int(gpu), int(cpu)


def _draft_token(profile: ModelProfile, opt: PlanOptions, device: dict[str, str]) -> tuple[float, float]:
    """Seconds per draft token, and seconds of the MTP KV rewrite per step (0 for other drafts)."""
    ctk, ctv, depth = opt.cache_type_k, opt.cache_type_v, opt.depth
    if opt.spec_type == "draft-mtp":
        def block(k: int) -> float:      # a MoE block's experts are read in the share k tokens touch
            return sum(t.nbytes * _read_fraction(profile, t.expert, k) for t in profile.tensors
                       if device[t.name] == "gpu" and profile.in_mtp(t))
        head = 0 if profile.mtp_has_head else profile.role_bytes("output")
        kv = depth * profile.mtp_kv_bytes_per_token(ctk, ctv)
        n_blocks = len(profile.mtp_layers)
        token = (block(1) + head + kv) / opt.gpu_bw + n_blocks * opt.layer_overhead_s + opt.handoff_overhead_s
        # the rewrite passes the verify batch's tokens through the block at once
        rewrite = (block(opt.n_draft + 1) + kv) / opt.gpu_bw + n_blocks * opt.layer_overhead_s
        return token, rewrite
    if opt.spec_type == "draft-simple":
        d = opt.draft
        read = d.total_bytes + depth * d.kv_bytes_per_token(ctk, ctv) + 2 * d.recurrent_state_bytes
        return read / opt.gpu_bw + d.n_layer * opt.layer_overhead_s + opt.handoff_overhead_s, 0.0
    return 0.0, 0.0      # n-gram lookup: a dictionary probe on the CPU


def estimate_speed(profile: ModelProfile, opt: PlanOptions, device: dict[str, str],
                   cpu_ffn_layers: list[int], split: FfnSplit | None = None) -> SpeedEstimate:
    n_cpu = len(cpu_ffn_layers)
    plain_s, plain_gpu, plain_cpu = _trunk_step(profile, opt, device, n_cpu, 1, 0, split)
    assumptions = [
        f"GPU {opt.gpu_bw / 1e9:.0f} GB/s, CPU {opt.cpu_bw / 1e9:.1f} GB/s; every weight read once per step",
        f"KV read at a context depth of {opt.depth:,} tokens",
        f"{opt.layer_overhead_s * 1e6:.0f} us per layer per step (launches, dispatch), "
        f"{opt.handoff_overhead_s * 1e6:.0f} us per CPU FFN layer hand-off",
    ]
    common = dict(gpu_bw=opt.gpu_bw, cpu_bw=opt.cpu_bw, depth=opt.depth, plain_step_s=plain_s,
                  plain_tok_s=1.0 / plain_s, plain_gpu_bytes=plain_gpu, plain_cpu_bytes=plain_cpu,
                  n_draft=opt.n_draft, accept_rate=opt.accept_rate)
    if opt.spec_type == "none":
        return SpeedEstimate(**common, assumptions=tuple(assumptions))
    n = opt.n_draft
    verify_s, verify_gpu, verify_cpu = _trunk_step(profile, opt, device, n_cpu, n + 1, n, split)
    draft_s, rewrite_s = _draft_token(profile, opt, device)
    step_s = verify_s + n * draft_s + rewrite_s
    per_step = expected_tokens_per_step(opt.accept_rate, n)
    assumptions.append(f"per-draft acceptance {opt.accept_rate:g}: {per_step:.2f} tokens per verify step")
    if opt.spec_type == "draft-mtp":
        assumptions.append("MTP: each draft reads the MTP block and the output head; one more block pass "
                           "per step rewrites its KV from the trunk's hidden states")
    return SpeedEstimate(**common, verify_step_s=verify_s, verify_gpu_bytes=verify_gpu,
                         verify_cpu_bytes=verify_cpu, draft_step_s=draft_s, spec_step_s=step_s,
                         tokens_per_step=per_step, spec_tok_s=per_step / step_s,
                         assumptions=tuple(assumptions))
