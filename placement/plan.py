"""The VRAM planner: reserve GPU memory in a fixed order, then give whole FFN layers what is left.

Order of reservation, each a line of the report:
  1. fixed overhead: CUDA context, allocator slack, safety margin (`margin_bytes`);
  2. speculation state: the GDN snapshot ring, the draft's KV cache, the draft's weights;
  3. the trunk: embedding (row gather on the CPU), attention / GDN projections, MoE routers and
     shared experts, norms, output head, main KV cache, live recurrent state, activation and logits
     scratch for k_max tokens and a PROMPT_CHUNK-token prompt chunk;
  4. prompt staging (op offload): when some dense FFN layer must stay on the CPU, VRAM for the
     largest one's weights, which each prompt batch of OP_OFFLOAD_MIN_BATCH+ tokens copies up layer
     by layer and runs on the GPU (llama.cpp's op offload: copying a layer over PCIe costs less than
     the CPU's matmuls of a whole prompt batch); decode and verify steps stay on the CPU. Then FFN
     layers, whole, front layers first, while they fit; the rest run on the CPU from the mmap.
     For a MoE model an FFN layer is the layer's routed experts (all of them: which ones a token
     needs is known only after its router ran), and `n_cpu_moe` keeps those of the first N layers
     on the CPU before any is placed (llama.cpp's --n-cpu-moe).
Stages 1-3 must fit or there is no plan (PlanError says the minimum VRAM and what would fit).

Sessions (`n_seq`, serve's --parallel): every session holds its own KV cache, recurrent state,
snapshot ring and draft KV and state, so those lines count n_seq times; the weights, the activation
scratch and the prompt staging count once, because the device runs one step at a time: the
sessions' shared steps (one forward over all their rows, at most ROWWISE_MAX of them: fewer than
the prompt chunk the scratch holds) and their own work between them take the device in turn
(hybridrt/runtime/step_batcher.py; they share the executor's buffers and the dequantization tile). Not reserved by any line: the memory pools of captured steps (CUDA graphs,
runtime/step_graphs.py), one per session and step size.

Snapshot ring: N slots for N drafts. A verify batch is [last token, d1..dN]; after it the state must
be the one after position m, m = accepted drafts in 0..N. m = N is the live state the kernel leaves
behind; m < N needs the state after each of the first N positions: N snapshots, N + 1 copies in all
counting the live state (llama.cpp's n_max + 1). Plain decoding needs no ring.

Embedding: a step needs only k rows of the token embedding, so an untied embedding stays in the
mmap'd file and its rows are gathered on the CPU and copied up (k x n_embd floats): nearly free, and
the 0.7-1.3 GB it would take go to FFN layers instead. A tied embedding is the output head and must
be on the GPU for the logits; rows are gathered from that copy.

FFN order: front layers first. Every FFN layer left on the CPU costs one GPU->CPU->GPU hand-off per
step wherever it sits, because attention and GDN always run on the GPU; llama.cpp offloads from the
back to keep its CPU layers one contiguous prefix with a single hand-off, which does not apply here.
With position free, front-first keeps the rule simple: the GPU holds a run of layers from 0 that
only grows with the budget. When the next layer does not fit, later (smaller, e.g. Q4_K-only vs
Q6_K ffn_down) layers that still fit the remainder are taken too: the bandwidth saved per VRAM byte
is the same for every FFN byte, so the leftover is worth filling.

MoE: routed experts are the natural CPU residents. A token reads only n_used of n_expert experts per
layer, so a CPU expert layer costs the CPU that share of its bytes per step (more for a verify batch:
1 - (1 - used/experts)^k), while the router and shared expert are read in full by every token and
are small: they are trunk (stage 3). Expert layers are not split by units: a split would go by
experts, not intermediate units.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from .constants import CACHE_TYPES, DEQUANT_TILE_ELEMS, OP_OFFLOAD_MIN_BATCH, PROMPT_CHUNK, SPEC_TYPES
from .options import GiB, MiB, PlanOptions
from .profile import F32, ModelProfile
from .speed import FfnSplit, SpeedEstimate, estimate_speed

CTX_STEP = 256          # context suggestions are rounded down to this


class PlanError(ValueError):
    """No plan: bad options, or stages 1-3 do not fit. One line for the user; `min_vram_bytes` is
    set when the configuration is valid but needs more VRAM than the budget."""

    def __init__(self, message: str, min_vram_bytes: int | None = None):
        super().__init__(message)
        self.min_vram_bytes = min_vram_bytes


@dataclass(frozen=True)
class Line:
    stage: int          # 1 overhead, 2 speculation state, 3 trunk, 4 FFN layers
    key: str
    label: str
    gpu_bytes: int = 0
    cpu_bytes: int = 0
    detail: str = ""


@dataclass
class Plan:
    model: str
    arch: str
    options: PlanOptions
    lines: list[Line]
    tensor_device: dict[str, str]       # tensor name -> "gpu" | "cpu" | "unused"
    ffn_gpu_layers: list[int]
    ffn_cpu_layers: list[int]
    not_fitted: list[str]
    speed: SpeedEstimate
    notes: list[str] = field(default_factory=list)
    ffn_split: FfnSplit | None = None   # the boundary layer, part on the GPU (in ffn_cpu_layers too)

    @property
    def gpu_bytes(self) -> int:
        return sum(line.gpu_bytes for line in self.lines)

    @property
    def cpu_bytes(self) -> int:
        return sum(line.cpu_bytes for line in self.lines)

    @property
    def free_bytes(self) -> int:
        return self.options.vram_bytes - self.gpu_bytes

    def line(self, key: str) -> Line:
        return next(line for line in self.lines if line.key == key)

    def to_dict(self) -> dict:
        o = self.options
        opts = {f.name: getattr(o, f.name) for f in fields(o)}
        opts["draft"] = o.draft.name if o.draft is not None else None
        opts["n_draft"], opts["k_max"], opts["decode_depth"] = o.n_draft, o.batch, o.depth
        return {
            "model": self.model,
            "arch": self.arch,
            "options": opts,
            "budget_bytes": self.options.vram_bytes,
            "gpu_bytes": self.gpu_bytes,
            "cpu_bytes": self.cpu_bytes,
            "free_bytes": self.free_bytes,
            "lines": [asdict(line) for line in self.lines],
            "ffn_gpu_layers": self.ffn_gpu_layers,
            "ffn_cpu_layers": self.ffn_cpu_layers,
            "not_fitted": self.not_fitted,
            "speed": asdict(self.speed),
            "ffn_split": asdict(self.ffn_split) if self.ffn_split else None,
            "tensor_device": self.tensor_device,
            "notes": self.notes,
        }


def layer_ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    parts, start = [], None
    for i, n in enumerate(layers):
        if start is None:
            start = n
        if i + 1 == len(layers) or layers[i + 1] != n + 1:
            parts.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(parts)


def _mib(n: int) -> str:
    return f"{n / MiB:,.1f} MiB"




def scratch_bytes(profile: ModelProfile, k: int, n_ctx: int) -> int:
    """Activation and logits buffers for a k-token batch and a PROMPT_CHUNK-token prompt chunk, an
    upper estimate of the torch path: per token of the larger of the two the residual, normed
    input, mixer and FFN outputs (4 x n_embd), two mixer projection outputs, gate/up/product of the
    FFN (3 x n_ff); float32 logits for the k rows (a prompt chunk takes its last row's); and attention's
    working set for one layer: its K and V over the context widened to float32 plus the scores of
    k query rows (the row-by-row kernel widens one row's keys at a time); and the tile that
    GPU-resident quantized weights are dequantized into before their matmul (one shared tile of
    DEQUANT_TILE_ELEMS weights in f16, plus its float32 working copy)."""
    per_token = F32 * (4 * profile.n_embd + 2 * profile.mixer_width + 3 * profile.n_ff)
    logits = F32 * k * profile.n_vocab
    attention = max((n_ctx * (s.kv_f32_bytes_per_token() + F32 * k * s.n_head) for s in profile.attention_shapes),
                    default=0)
    return max(k, PROMPT_CHUNK) * per_token + logits + attention + DEQUANT_TILE_ELEMS * (2 + F32)


def _check(profile: ModelProfile, opt: PlanOptions) -> None:
    if opt.vram_bytes <= 0:
        raise PlanError("the VRAM budget must be positive")
    if opt.margin_bytes < 0:
        raise PlanError("the margin cannot be negative")
    if opt.n_ctx < 1:
        raise PlanError(f"context size must be at least 1, got {opt.n_ctx}")
    for which, ct in (("k", opt.cache_type_k), ("v", opt.cache_type_v)):
        if ct not in CACHE_TYPES:
            raise PlanError(f"unknown --cache-type-{which} '{ct}' (known: {', '.join(CACHE_TYPES)})")
    if opt.spec_type not in SPEC_TYPES:
        raise PlanError(f"unknown --spec-type '{opt.spec_type}' (known: {', '.join(SPEC_TYPES)})")
    if opt.spec_type != "none" and opt.spec_draft_n_max < 1:
        raise PlanError(f"--spec-draft-n-max must be at least 1 for --spec-type {opt.spec_type}")
    if opt.spec_type == "draft-mtp" and not profile.has_mtp:
        raise PlanError(f"{profile.name}: the model has no MTP head (nextn_predict_layers = 0); "
                        "use --spec-type draft-simple -md DRAFT, ngram-simple or none")
    if opt.spec_type == "draft-simple" and opt.draft is None:
        raise PlanError("--spec-type draft-simple needs a draft model (-md DRAFT)")
    if not 0.0 <= opt.accept_rate <= 1.0:
        raise PlanError(f"--accept-rate must be within [0, 1], got {opt.accept_rate}")
    if opt.k_max is not None and opt.k_max < opt.n_draft + 1:
        raise PlanError(f"k_max {opt.k_max} is smaller than a verify batch ({opt.n_draft + 1} tokens)")
    if opt.gpu_bw <= 0 or opt.cpu_bw <= 0:
        raise PlanError("bandwidths must be positive")
    if opt.n_cpu_moe < 0:
        raise PlanError(f"--n-cpu-moe must be at least 0, got {opt.n_cpu_moe}")
    if opt.n_seq < 1:
        raise PlanError(f"--parallel must be at least 1, got {opt.n_seq}")
    for model in (profile, opt.draft if opt.spec_type == "draft-simple" else None):
        try:
            if model is not None:
                model.kv_bytes_per_token(opt.cache_type_k, opt.cache_type_v)
        except ValueError as exc:
            raise PlanError(f"{model.name}: {exc}") from None


def _fixed_lines(profile: ModelProfile, opt: PlanOptions) -> tuple[list[Line], dict[str, str]]:
    """Stages 1-3 and the device of every non-FFN tensor."""
    device: dict[str, str] = {}
    use_mtp = opt.spec_type == "draft-mtp"
    role_gpu: dict[str, int] = {}
    cpu_embedding = mtp_gpu = mtp_cpu = 0
    for t in profile.tensors:
        is_mtp = profile.in_mtp(t)
        if t.role == "ffn" and not is_mtp:
            continue
        if is_mtp and not use_mtp:
            device[t.name] = "unused"
        elif t.role == "embedding":          # untied embeddings (trunk's or MTP's): CPU row gather
            device[t.name] = "cpu"
            if is_mtp:
                mtp_cpu += t.nbytes
            else:
                cpu_embedding += t.nbytes
        elif is_mtp:
            device[t.name] = "gpu"
            mtp_gpu += t.nbytes
        else:
            device[t.name] = "gpu"
            role_gpu[t.role] = role_gpu.get(t.role, 0) + t.nbytes

    n, ctx, k, seqs = opt.n_draft, opt.n_ctx, opt.batch, opt.n_seq
    ctk, ctv = opt.cache_type_k, opt.cache_type_v
    state = profile.recurrent_state_bytes
    spec = opt.spec_type != "none"
    each = f" for each of {seqs} sessions" if seqs > 1 else ""      # ends the detail of a line every session holds
    lines = [Line(1, "overhead", "fixed overhead", opt.margin_bytes,
                  detail="CUDA context, allocator slack and safety margin (--margin)")]

    if not spec:
        ring_detail = "plain decoding: no rollback"
    elif state:
        ring_detail = (f"{n} slots x {_mib(state)} (S + conv of {profile.n_gdn_layers} GDN layers): "
                       f"the state after each of the first {n} verify positions{each}")
    else:
        ring_detail = "no GDN layers: rollback only truncates the KV cache"
    lines.append(Line(2, "gdn_snapshot_ring", "GDN snapshot ring", seqs * n * state if spec else 0, detail=ring_detail))

    draft_kv = draft_weights = draft_state = 0
    draft_kv_detail = draft_w_detail = draft_state_detail = "no draft model"
    if use_mtp:
        per_tok = profile.mtp_kv_bytes_per_token(ctk, ctv)
        draft_kv = seqs * per_tok * ctx
        draft_kv_detail = f"{len(profile.mtp_layers)} MTP layer(s) x {ctx:,} tokens x {per_tok:,} B ({ctk}/{ctv}){each}"
        draft_weights = mtp_gpu
        draft_w_detail = "MTP block(s)" + (f"; its embedding ({_mib(mtp_cpu)}) gathered on the CPU" if mtp_cpu else "")
        draft_state_detail = "MTP steps reuse the trunk's scratch"
    elif opt.spec_type == "draft-simple":
        d = opt.draft
        per_tok = d.kv_bytes_per_token(ctk, ctv)
        draft_kv = seqs * per_tok * ctx
        draft_kv_detail = f"draft {d.name}: {d.n_attention_layers} layers x {ctx:,} tokens x {per_tok:,} B{each}"
        draft_weights = d.total_bytes
        draft_w_detail = f"draft {d.name}, whole on the GPU"
        draft_state = seqs * (n + 1) * d.recurrent_state_bytes + scratch_bytes(d, 1, ctx)
        draft_state_detail = "draft scratch for one token" + (
            f" + live state and {n} snapshots{each}" if d.recurrent_state_bytes else "")
    elif opt.spec_type == "ngram-simple":
        draft_kv_detail = draft_w_detail = draft_state_detail = "n-gram lookup in the token history: no weights"
    lines += [Line(2, "draft_kv", "draft KV cache", draft_kv, detail=draft_kv_detail),
              Line(2, "draft_weights", "draft weights", draft_weights, mtp_cpu, detail=draft_w_detail),
              Line(2, "draft_state", "draft state and scratch", draft_state, detail=draft_state_detail)]

    tied = " (tied: also the token embedding)" if profile.output_tied else ""
    kv_tok = profile.kv_bytes_per_token(ctk, ctv)
    n_moe = len({t.layer for t in profile.tensors if t.role == "moe_shared"})
    lines += [
        Line(3, "embedding", "token embedding", 0, cpu_embedding,
             detail="rows gathered on the CPU, k rows copied up per step" if cpu_embedding
             else "tied: read from the output head's GPU copy"),
        Line(3, "attention_weights", "attention projections", role_gpu.get("attention", 0),
             detail=f"{profile.n_attention_layers} attention layers"),
        Line(3, "gdn_weights", "GDN projections", role_gpu.get("gdn", 0),
             detail=f"{profile.n_gdn_layers} GDN layers"),
        Line(3, "moe_shared", "shared experts, routers", role_gpu.get("moe_shared", 0),
             detail=f"{n_moe} MoE layers: router and shared expert, read by every token" if n_moe
             else "no MoE layers"),
        Line(3, "norms", "norms", role_gpu.get("norm", 0)),
        Line(3, "output_head", "output head", role_gpu.get("output", 0), detail=f"{profile.n_vocab:,} x {profile.n_embd}{tied}"),
        Line(3, "other_weights", "other trunk tensors", role_gpu.get("other", 0)),
        Line(3, "kv_cache", "KV cache", seqs * kv_tok * ctx,
             detail=f"{ctx:,} tokens x {kv_tok:,} B ({ctk}/{ctv}, {profile.n_attention_layers} layers){each}"),
        Line(3, "recurrent_state", "recurrent state", seqs * state,
             detail=f"live S + conv of {profile.n_gdn_layers} GDN layers, float32{each}" if state
             else "no GDN layers"),
        Line(3, "scratch", "activations and logits", scratch_bytes(profile, k, ctx),
             detail=f"batches of up to {k} tokens (k_max), prompt chunks of {PROMPT_CHUNK}, "
                    f"attention over {ctx:,} tokens"),
    ]
    return lines, device


def _fixed_gpu(profile: ModelProfile, opt: PlanOptions) -> int:
    return sum(line.gpu_bytes for line in _fixed_lines(profile, opt)[0])


def _max_ctx(profile: ModelProfile, opt: PlanOptions) -> int | None:
    """The largest context (a multiple of CTX_STEP below n_ctx) whose stages 1-3 fit the budget.
    Every reservation is affine in the context, so two evaluations give the line to solve."""
    at_1 = _fixed_gpu(profile, replace(opt, n_ctx=CTX_STEP))
    slope = (_fixed_gpu(profile, replace(opt, n_ctx=2 * CTX_STEP)) - at_1) / CTX_STEP
    if slope <= 0 or at_1 > opt.vram_bytes:
        return None
    ctx = int(CTX_STEP + (opt.vram_bytes - at_1) // slope) // CTX_STEP * CTX_STEP
    return ctx if CTX_STEP <= ctx < opt.n_ctx else None


def _alternatives(profile: ModelProfile, opt: PlanOptions) -> list[tuple[str, int]]:
    """Cheaper configurations, each with the VRAM its stages 1-3 need."""
    out = []
    ctx = _max_ctx(profile, opt)
    if ctx:
        out.append((f"-c {ctx}", _fixed_gpu(profile, replace(opt, n_ctx=ctx))))
    if (opt.cache_type_k, opt.cache_type_v) != ("q8_0", "q8_0"):
        q8 = replace(opt, cache_type_k="q8_0", cache_type_v="q8_0")
        flags = "--cache-type-k q8_0 --cache-type-v q8_0"
        try:
            out.append((flags, _fixed_gpu(profile, q8)))
            ctx_q8 = _max_ctx(profile, q8)
            if ctx_q8 and ctx_q8 > (ctx or 0):
                out.append((f"-c {ctx_q8} {flags}", _fixed_gpu(profile, replace(q8, n_ctx=ctx_q8))))
        except ValueError:      # head dims that q8_0 cannot block
            pass
    if opt.spec_type != "none":
        out += _fewer(profile, opt, "--spec-draft-n-max", opt.spec_draft_n_max,
                      lambda n: replace(opt, spec_draft_n_max=n, k_max=None))
        out.append(("--spec-type none", _fixed_gpu(profile, replace(opt, spec_type="none", k_max=None))))
    out += _fewer(profile, opt, "--parallel", opt.n_seq, lambda n: replace(opt, n_seq=n))
    return out


def _fewer(profile: ModelProfile, opt: PlanOptions, flag: str, now: int, with_n) -> list[tuple[str, int]]:
    """The largest count below `now` (of drafts, of sessions) whose stages 1-3 fit, else 1, with the
    VRAM it needs; none when `now` is 1. `with_n(n)`: the options at count n."""
    for n in range(now - 1, 0, -1):
        need = _fixed_gpu(profile, with_n(n))
        if need <= opt.vram_bytes or n == 1:
            return [(f"{flag} {n}", need)]
    return []


def _does_not_fit(profile: ModelProfile, opt: PlanOptions, need: int) -> PlanError:
    msg = (f"{profile.name} does not fit: even with every FFN layer on the CPU this configuration needs "
           f"at least {_mib(need)} of VRAM (budget {_mib(opt.vram_bytes)}, margin included)")
    alternatives = _alternatives(profile, opt)
    fits = [text for text, needs in alternatives if needs <= opt.vram_bytes]
    if need - opt.margin_bytes <= opt.vram_bytes - 256 * MiB:
        fits.append(f"--margin {(opt.vram_bytes - (need - opt.margin_bytes)) // MiB}MiB (less safety)")
    short = [f"{text} ({_mib(needs)})" for text, needs in alternatives if needs > opt.vram_bytes]
    if fits:
        msg += f"; it fits with {' | '.join(fits)}"
    else:
        msg += "; a larger --vram is needed"
    if short:
        msg += f"; not enough alone: {', '.join(short)}"
    return PlanError(msg, min_vram_bytes=need)


def split_granule(n_ff: int) -> int:
    """Intermediate units per split step: whole quant blocks of ffn_down's rows (256 for K-quants,
    32 for the legacy types; a row of n_ff not a multiple of 256 cannot be a K-quant)."""
    return 256 if n_ff % 256 == 0 else 32 if n_ff % 32 == 0 else 0


def _split_boundary(profile: ModelProfile, ffn: dict[int, int], on_cpu: list[int], left: int) -> FfnSplit | None:
    """Spend the VRAM left after whole layers on the first CPU layer's leading units. Only a dense
    FFN splits this way (an expert layer would split by experts, not units)."""
    if not on_cpu or profile.n_expert:
        return None
    layer, n_ff = on_cpu[0], profile.n_ff
    granule = split_granule(n_ff)
    if not granule or n_ff <= granule:
        return None
    per_granule = ffn[layer] * granule / n_ff      # every FFN tensor is linear in the unit count
    units = min(int(left // per_granule), n_ff // granule - 1) * granule
    if units <= 0:
        return None
    gpu = int(ffn[layer] * units / n_ff)
    return FfnSplit(layer=layer, n_ff=n_ff, gpu_units=units, gpu_bytes=gpu, cpu_bytes=ffn[layer] - gpu)


def _staging(profile: ModelProfile, opt: PlanOptions, ffn: dict[int, int], left: int) -> tuple[int, str]:
    """(bytes, detail) of the prompt staging buffer: the largest FFN layer's weights, when some layer
    must stay on the CPU and that buffer fits. MoE layers are not staged (a batch's experts are known
    only after its routers ran; llama.cpp's op offload copies all of them)."""
    if not opt.op_offload:
        return 0, "off (--no-op-offload): prompt batches run the CPU FFN layers on the CPU"
    if profile.n_expert:
        return 0, "MoE experts are not staged: prompt batches run them on the CPU"
    if not ffn or sum(ffn.values()) <= left:
        return 0, "every FFN layer fits on the GPU: nothing to stage"
    biggest = max(ffn.values())
    if biggest > left:
        return 0, f"does not fit ({_mib(biggest)}): prompt batches run the CPU FFN layers on the CPU"
    return biggest, (f"one CPU FFN layer's weights, copied up layer by layer for prompt batches of "
                     f"{OP_OFFLOAD_MIN_BATCH}+ tokens (--no-op-offload: none, one more layer's room)")


def plan(profile: ModelProfile, options: PlanOptions) -> Plan:
    _check(profile, options)
    lines, device = _fixed_lines(profile, options)
    fixed = sum(line.gpu_bytes for line in lines)
    if fixed > options.vram_bytes:
        raise _does_not_fit(profile, options, fixed)

    left = options.vram_bytes - fixed
    ffn = profile.ffn_layer_bytes()
    staging, staging_detail = _staging(profile, options, ffn, left)
    lines.append(Line(4, "op_offload", "prompt staging", staging, detail=staging_detail))
    left -= staging
    kept = [layer for layer in ffn if layer < options.n_cpu_moe] if profile.n_expert else []
    on_gpu: list[int] = []
    for layer, nbytes in ffn.items():          # front first, then any later layer that still fits
        if nbytes <= left and layer not in kept:
            on_gpu.append(layer)
            left -= nbytes
    on_cpu = [layer for layer in ffn if layer not in set(on_gpu)]
    gpu_set = set(on_gpu)
    for t in profile.tensors:
        if t.role == "ffn" and t.layer < profile.n_layer:
            device[t.name] = "gpu" if t.layer in gpu_set else "cpu"

    split = _split_boundary(profile, ffn, on_cpu, left) if options.split_ffn else None
    split_gpu = split.gpu_bytes if split else 0
    gpu_ffn = sum(ffn[i] for i in on_gpu) + split_gpu
    cpu_ffn = sum(ffn[i] for i in on_cpu) - split_gpu
    what = "routed experts" if profile.n_expert else "FFN layers"
    which = "routed experts of layers" if profile.n_expert else "FFN layers"
    detail = (f"GPU: {layer_ranges(on_gpu) or 'none'} ({len(on_gpu)} layers), "
              f"CPU: {layer_ranges(on_cpu) or 'none'} ({len(on_cpu)} layers)")
    if split:
        detail += f"; layer {split.layer} split: {split.gpu_units} of {split.n_ff} units on the GPU"
    if profile.n_expert:
        detail += f"; {profile.n_expert} experts per layer, {profile.n_expert_used} used per token"
    lines.append(Line(4, "ffn", what, gpu_ffn, cpu_ffn, detail=detail))
    not_fitted = []
    if kept:
        not_fitted.append(f"{which} {layer_ranges(kept)} ({_mib(sum(ffn[i] for i in kept))}) "
                          f"stay on the CPU: --n-cpu-moe {options.n_cpu_moe}")
    unfit = [layer for layer in on_cpu if layer not in kept]
    if unfit:
        smallest = min(ffn[i] for i in unfit)
        not_fitted.append(
            f"{which} {layer_ranges(unfit)} ({len(unfit)} layers, {_mib(sum(ffn[i] for i in unfit))}) "
            "run on the CPU: "
            f"{_mib(left)} of VRAM was left and the smallest of them needs {_mib(smallest)}"
            + (f"; {_mib(split_gpu)} of it holds the first {split.gpu_units} units of layer {split.layer}, "
               "which runs on both at once" if split else ""))
    speed = estimate_speed(profile, options, device, on_cpu, split)
    return Plan(profile.name, profile.arch, options, lines, device, on_gpu, on_cpu, not_fitted, speed,
                notes=list(profile.notes), ffn_split=split)
