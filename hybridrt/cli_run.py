"""`hybridrt run`: generate text from a prompt, streaming it, with llama.cpp's flag names."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Optional

import typer

from .errors import UserError
from .warmup import compile_notice, warm_up

MODEL_HELP = "GGUF path or a known name (gemma3-270m, smollm2-135m)"


def read_prompt(prompt: Optional[str], file: Optional[Path]) -> str:
    if file is not None:
        if prompt is not None:
            raise UserError("pass the prompt with -p or with -f, not both")
        if file.is_dir():
            raise UserError(f"-f {file}: is a directory, not a prompt file")
        if not file.is_file():
            raise UserError(f"-f {file}: no such prompt file")
        try:
            return file.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"-f {file}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    if prompt is None:
        raise UserError("no prompt: pass -p TEXT or -f FILE")
    return prompt


# A verify batch is the certain token and the drafts: up to 32 tokens it runs on the batch-stable
# small-batch kernels (gpu_kernels ROWWISE_MAX, the fused layer halves) with the second int8 pass
# (quantize_act.RESIDUAL_MAX_TOKENS) that plain steps take; a 33rd would leave them and part from
# plain decoding (tests/test_spec_loop.py checks the three agree)
MAX_DRAFTS = 31
NGRAM_N_MIN = 2     # ngram-simple's shortest n-gram (a 1-gram match predicts little)


GPU_LAYERS_HELP = ("llama.cpp's offload flag: 0 runs everything on the CPU; any other count runs the plan on "
                   "the GPU (--device cuda, the free VRAM as budget; without a GPU it is ignored, as in "
                   "llama.cpp). hybridrt places by memory, not by layer count: as many whole FFN layers as fit "
                   "(--vram SIZE sets a smaller budget).")


def device_for_gpu_layers(gpu_layers: Optional[int], device: str) -> str:
    """--device as -ngl implies it (None: as given)."""
    if gpu_layers is None:
        return device
    if gpu_layers == 0:
        return "cpu"
    import torch

    if not torch.cuda.is_available():       # llama.cpp's CPU builds take scripts' `-ngl 99` the same way
        print(f"warning: no CUDA device is available: -ngl {gpu_layers} is ignored, running on the CPU",
              file=sys.stderr)
        return device
    return device if device.startswith("cuda") else "cuda"


def placement_options(model_path: str, vram: Optional[str], device: str, ctx_size: Optional[int],
                      cache_type_k: str, cache_type_v: str, spec_type: Optional[str], draft_n_max: int,
                      model_draft: Optional[str], margin: str, op_offload: bool = True):
    """The plan request of `run` / `bench`: None (everything in the mmap, the trunk on `device`)
    unless --vram is given or the device is a GPU (then the free VRAM is the budget)."""
    from .place import PlacementRequest, parse_size
    from .registry import resolve_model
    from .speculative.spec_types import model_spec_type

    if vram is None and not device.startswith("cuda"):
        return None
    return PlacementRequest(
        vram_bytes=None if vram in (None, "auto") else parse_size(vram, "--vram"),
        n_ctx=ctx_size or None, cache_type_k=cache_type_k, cache_type_v=cache_type_v,
        spec_type=model_spec_type(spec_type) if spec_type else None,     # a chain: its model source sizes it
        spec_draft_n_max=draft_n_max, draft_path=str(resolve_model(model_draft)) if model_draft else None,
        margin_bytes=parse_size(margin, "--margin"), op_offload=op_offload)


def adaptive_default(spec_type: str) -> bool:
    """Adaptive length pays where a draft costs a forward (model drafts, alone or in a chain); n-gram
    drafts are free."""
    from .speculative.spec_types import MODEL_TYPES, spec_type_parts

    return any(p in MODEL_TYPES for p in spec_type_parts(spec_type))


def check_spec_flags(draft_n_max: int, ngram_n: int = 4) -> None:
    if not 1 <= draft_n_max <= MAX_DRAFTS:
        raise UserError(f"--spec-draft-n-max must be within 1..{MAX_DRAFTS}, got {draft_n_max}")
    if ngram_n < NGRAM_N_MIN:
        raise UserError(f"--spec-ngram-size-n must be >= {NGRAM_N_MIN} (n-grams are tried from it down to "
                        f"{NGRAM_N_MIN}), got {ngram_n}")


def check_ctx_size(ctx_size: Optional[int]) -> None:
    if ctx_size is not None and ctx_size < 0:
        raise UserError(f"-c {ctx_size}: the context size must be >= 1 (0: the model's)")


def context_size(ctx_size: Optional[int], n_ctx_train: int, default: Optional[int] = None) -> int:
    """-c as run, serve and plan read it: none given, `default` (else 4096 or the model's, if
    smaller); 0, the model's training context; above it, an error."""
    check_ctx_size(ctx_size)
    if ctx_size is not None and ctx_size > n_ctx_train:
        raise UserError(f"-c {ctx_size} is larger than the model's training context {n_ctx_train}")
    if ctx_size == 0:
        return n_ctx_train
    return ctx_size or default or min(4096, n_ctx_train)


def check_output_path(path: Optional[Path], flag: str) -> None:
    """An output file's place, checked before any work: a run should not end in a traceback."""
    if path is None:
        return
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a directory")
    if not path.absolute().parent.is_dir():
        raise UserError(f"{flag} {path}: no such directory {path.absolute().parent}")


def run(
    model: Optional[str] = typer.Option(None, "-m", "--model", help=MODEL_HELP + "; default gemma3-270m"),
    prompt: Optional[str] = typer.Option(None, "-p", "--prompt", help="Prompt text."),
    file: Optional[Path] = typer.Option(None, "-f", "--file", help="Read the prompt from a file."),
    n_predict: int = typer.Option(256, "-n", "--n-predict", help="Tokens to generate (-1: until end of generation or full context)."),
    ctx_size: Optional[int] = typer.Option(None, "-c", "--ctx-size", show_default=False,
                                           help="Context size (default: 4096 or the model's, if smaller; 0: the model's)."),
    temp: float = typer.Option(0.8, "--temp", help="Temperature; 0 is greedy."),
    top_k: int = typer.Option(40, "--top-k", help="Top-k sampling (0: off)."),
    top_p: float = typer.Option(0.95, "--top-p", help="Top-p sampling (1.0: off)."),
    min_p: float = typer.Option(0.05, "--min-p", help="Min-p sampling (0.0: off)."),
    seed: int = typer.Option(-1, "-s", "--seed", help="RNG seed (-1: random)."),
    chat: bool = typer.Option(False, "--chat", "-cnv", help="Wrap the prompt in the model's chat template."),
    threads: Optional[int] = typer.Option(None, "-t", "--threads", help="CPU threads (torch and Numba)."),
    device: str = typer.Option("cpu", "--device", help="Trunk device: cpu or cuda. With cuda (or --vram) the plan is executed: trunk and the FFN layers that fit on the device, the rest from the mmap on the CPU."),
    vram: Optional[str] = typer.Option(None, "--vram", help="VRAM budget to plan for (12GiB, 700MiB, auto = free memory of the GPU). With --device cpu the CPU stands in for the GPU."),
    gpu_layers: Optional[int] = typer.Option(None, "-ngl", "--n-gpu-layers", "--gpu-layers", show_default=False, help=GPU_LAYERS_HELP),
    margin: str = typer.Option("512MiB", "--margin", help="Planned fixed overhead: CUDA context, allocator slack, safety."),
    no_op_offload: bool = typer.Option(False, "--no-op-offload", help="With a plan: prompt batches run the CPU FFN layers on the CPU instead of copying their weights to the device (frees one layer's VRAM for decoding)."),
    cache_type_k: str = typer.Option("f16", "-ctk", "--cache-type-k", help="KV cache type for K: f16, f32, bf16, q8_0."),
    cache_type_v: str = typer.Option("f16", "-ctv", "--cache-type-v", help="KV cache type for V: f16, f32, bf16, q8_0."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="Write a Chrome/Perfetto trace (device work, CPU FFN, transfers, draft, verify) to this file."),
    display_prompt: bool = typer.Option(True, "--display-prompt/--no-display-prompt", help="Echo the prompt before the output."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="End-of-generation tokens do not stop generation (-n tokens or a full context do)."),
    spec_type: Optional[str] = typer.Option(None, "--spec-type", help="Speculative drafts: none, draft-mtp, draft-simple, ngram-simple, or a lookup and a model source together (ngram-simple,draft-mtp: the lookup drafts where the text repeats, the model elsewhere) (default: draft-mtp when the model has an MTP head, else none)."),
    model_draft: Optional[str] = typer.Option(None, "-md", "--model-draft", help="Draft model for --spec-type draft-simple (same vocabulary)."),
    draft_n_max: int = typer.Option(3, "--spec-draft-n-max", "--draft-max", help=f"Most draft tokens per step (1..{MAX_DRAFTS})."),
    draft_n_min: int = typer.Option(0, "--spec-draft-n-min", "--draft-min", help="Drop proposals shorter than this."),
    draft_p_min: float = typer.Option(0.0, "--spec-draft-p-min", "--draft-p-min", help="Stop model drafting below this top-1 probability."),
    ngram_n: int = typer.Option(4, "--spec-ngram-size-n", help=f"ngram-simple: longest n-gram to match (tried down to {NGRAM_N_MIN})."),
    exact_activations: bool = typer.Option(False, "--exact-activations", help="Run the mmap'd matrices on float32 activations (exact; slower) instead of int8 activations with integer dot products (llama.cpp's numerics)."),
    act_residual: Optional[bool] = typer.Option(None, "--act-residual/--no-act-residual", help="On int8 activations, a second int8 pass on the rounding of the attention and FFN-down inputs of decode and verify steps (near-float32 accuracy, ~8 % a step; default on, HYBRIDRT_ACT_RESIDUAL); --no-act-residual is llama.cpp's numerics exactly."),
    adaptive: Optional[bool] = typer.Option(None, "--adaptive/--no-adaptive", help="Choose each step's draft count within --spec-draft-n-max from the live acceptance and measured verify cost (default: on for draft-mtp and draft-simple)."),
    mtp_head: Optional[Path] = typer.Option(None, "--mtp-head", help="MTP head from `hybridrt train-mtp` for --spec-type draft-mtp (replaces a built-in head)."),
    warmup: bool = typer.Option(True, "--warmup/--no-warmup", help="Generate a few tokens through the run's own steps before the timed run, so first calls (kernels loaded or compiled) are not timed, as llama.cpp does."),
):
    """Generate text from a prompt (streams tokens; timings on stderr like llama.cpp)."""
    from .generate import generate
    from .kv_cache import kv_cache_type
    from .loader import load_draft_model, load_model
    from .place import placement_line
    from .sampling import SamplerConfig
    from .speculative.loop import SpecConfig
    from .speculative.sources import build_source, default_spec_type

    # Kernels compile lazily, when a step first calls them (a short greedy run never builds the prompt
    # GEMM or the verify kernels); on a cold cache one stderr line says why the first token takes a while
    with compile_notice() as notice:
        text = read_prompt(prompt, file)
        if not text:
            raise UserError("empty prompt: pass some text with -p or -f")
        check_spec_flags(draft_n_max, ngram_n)
        check_ctx_size(ctx_size)
        check_output_path(trace, "--trace")
        # the sampling and speculation values are checked (by their configs) before anything loads
        sampler = SamplerConfig(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
        spec = SpecConfig(n_max=draft_n_max, n_min=draft_n_min, p_min=draft_p_min)
        device = device_for_gpu_layers(gpu_layers, device)
        _check_device(device)
        cache_type = kv_cache_type(cache_type_k, cache_type_v)
        request = placement_options(model, vram, device, ctx_size, cache_type_k, cache_type_v, spec_type,
                                    draft_n_max, model_draft, margin, op_offload=not no_op_offload)
        m = load_model(model, device=device, threads=threads, placement=request, trace=trace is not None,
                       exact_activations=True if exact_activations else None, mtp_head=mtp_head,
                       act_residual=act_residual)
        if m.plan is not None:
            print(placement_line(m.plan, device), file=sys.stderr)
        if chat:
            if m.tokenizer.chat_template is None:
                print("note: this GGUF has no chat template: using ChatML, as llama.cpp does", file=sys.stderr)
            text = m.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ids = m.tokenize(text, add_special=True, parse_special=chat)
        n_ctx = context_size(ctx_size, m.n_ctx_train, m.plan.options.n_ctx if m.plan is not None else None)
        if len(ids) >= n_ctx:
            raise UserError(f"prompt is {len(ids)} tokens, the context is {n_ctx} (raise -c or shorten the prompt)")
        if m.plan is not None and spec_type is None:
            spec_type = m.plan.options.spec_type
        spec_type = spec_type or ("draft-simple" if model_draft else default_spec_type(m))
        spec = dataclasses.replace(spec, adaptive=adaptive_default(spec_type) if adaptive is None else adaptive)
        draft_model = load_draft_model(m, model_draft) if model_draft else None
        policies = None
        if warmup:
            # an adaptive run's length policies start from the verify costs the warm-up timed
            policies = warm_up(m, spec_type, spec, sampler, cache_type, draft_model, ngram_n)
            if m.executor.trace is not None:
                m.executor.trace.clear()
            notice.compiled = False         # whether the timed run below compiled anything
        session = m.session(n_ctx, cache_type, k_max=spec.k_max if spec_type != "none" else 1)
        source = build_source(spec_type, session, sampler, spec, draft_model, ngram_n_max=ngram_n,
                              cache_type=cache_type)
        if display_prompt and not chat:
            sys.stdout.write(text)
            notice.partial_line = not text.endswith("\n")
        stream = m.tokenizer.stream()

        def emit(token: int) -> None:
            sys.stdout.write(stream.push(token))
            sys.stdout.flush()

        stop_ids = set() if ignore_eos else None      # None: the tokenizer's end-of-generation ids
        out, stats = generate(m, session, ids, n_predict, sampler, source, spec, on_token=emit, stop_ids=stop_ids,
                              trace=m.executor.trace, policies=policies)
        sys.stdout.write(stream.flush() + "\n")
        sys.stdout.flush()
        if stats.stopped_by == "context":
            hint = "raise -c" if session.n_ctx < m.n_ctx_train else "the model's training context"
            wanted = f" ({len(out)} of the {n_predict} tokens asked for; {hint})" if n_predict > 0 else ""
            print(f"stopped: the context of {session.n_ctx} tokens is full{wanted}", file=sys.stderr)
        if stats.spec is not None:
            print(stats.spec.summary(), file=sys.stderr)
        threads_line = m.executor.governor.summary() if m.executor.governor is not None else None
        if threads_line:
            print(threads_line, file=sys.stderr)
        print(f"prompt eval: {stats.n_prompt} tokens in {stats.prompt_s * 1e3:.0f} ms ({stats.prompt_tps:.1f} t/s) | "
              f"decode: {stats.n_decode} tokens in {stats.decode_s * 1e3:.0f} ms ({stats.decode_tps:.1f} t/s)",
              file=sys.stderr)
        if notice.compiled:
            print("(first run: these times include compiling CPU kernels; the next run shows the real speed)",
                  file=sys.stderr)
        if trace is not None:
            m.executor.trace.write(trace)
            print(f"trace: {trace} (open in ui.perfetto.dev)", file=sys.stderr)


def _check_device(device: str) -> None:
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available (use --device cpu)")
    if not (device == "cpu" or device.startswith("cuda")):
        raise UserError(f"unknown device '{device}' (use cpu or cuda)")
