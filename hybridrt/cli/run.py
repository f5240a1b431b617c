"""`hybridrt run`: generate text from a prompt, streaming it, with llama.cpp's flag names."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from .options import (CTX_SIZE, GROUP, MODEL, MTP_HEAD, THREADS, WARMUP, GrammarFlags, KVFlags, LoadFlags,
                      SpecFlags, check_ctx_size, context_size, flag_groups, read_text_file)
from .options import MAX_DRAFTS, adaptive_default  # noqa: F401  (tests read them here, where they were)
from ..errors import UserError
from ..runtime import compile_helper
from ..runtime.warmup import compile_notice, warm_up


def read_prompt(prompt: Optional[str], file: Optional[Path]) -> str:
    if file is not None:
        if prompt is not None:
            raise UserError("pass the prompt with -p or with -f, not both")
        return read_text_file(file, "-f")
    if prompt is None:
        raise UserError("no prompt: pass -p TEXT or -f FILE")
    return prompt


@flag_groups
def run(
    model: Optional[str] = MODEL,
    prompt: Optional[str] = typer.Option(None, "-p", "--prompt", help="Prompt text."),
    file: Optional[Path] = typer.Option(None, "-f", "--file", help="Read the prompt from a file."),
    n_predict: int = typer.Option(256, "-n", "--n-predict", help="Tokens to generate (-1: until end of generation or full context)."),
    ctx_size: Optional[int] = CTX_SIZE,
    temp: float = typer.Option(0.8, "--temp", help="Temperature; 0 is greedy."),
    top_k: int = typer.Option(40, "--top-k", help="Top-k sampling (0: off)."),
    top_p: float = typer.Option(0.95, "--top-p", help="Top-p sampling (1.0: off)."),
    min_p: float = typer.Option(0.05, "--min-p", help="Min-p sampling (0.0: off)."),
    seed: int = typer.Option(-1, "-s", "--seed", help="RNG seed (-1: random)."),
    chat: bool = typer.Option(False, "--chat", "-cnv", help="Wrap the prompt in the model's chat template."),
    threads: Optional[int] = THREADS,
    load: LoadFlags = GROUP,
    kv: KVFlags = GROUP,
    display_prompt: bool = typer.Option(True, "--display-prompt/--no-display-prompt", help="Echo the prompt before the output."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="End-of-generation tokens do not stop generation (-n tokens or a full context do)."),
    drafts: SpecFlags = GROUP,
    constrain: GrammarFlags = GROUP,
    mtp_head: Optional[Path] = MTP_HEAD,
    warmup: bool = WARMUP,
):
    """Generate text from a prompt (streams tokens; timings on stderr like llama.cpp)."""
    from ..decoding.generate import generate
    from ..runtime.loader import load_draft_model
    from ..decoding.sampling import SamplerConfig
    from ..decoding.speculative.sources import build_source

    # Kernels compile lazily, when a step first calls them (a short greedy run never builds the prompt
    # GEMM or the verify kernels); on a cold cache one stderr line says why the first token takes a while
    with compile_notice() as notice:
        text = read_prompt(prompt, file)
        if not text:
            raise UserError("empty prompt: pass some text with -p or -f")
        # the flags' values are checked (the sampling and speculation ones by their configs) before
        # anything loads
        drafts.check()
        grammar = constrain.check()
        check_ctx_size(ctx_size)
        device = load.check()
        sampler = SamplerConfig(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
        cache_type = kv.cache_type
        if device == "cpu" and load.vram is None:
            # a cold cache: another core compiles the kernels this run reaches after its first layer kind
            compile_helper.start(model, cache_type, True if load.exact_activations else None, load.act_residual)
        m = load.load(model, device, threads, ctx_size, kv, drafts.spec_type, drafts.draft_n_max, drafts.model_draft,
                      mtp_head)
        if chat:
            if m.tokenizer.chat_template is None:
                print("note: this GGUF has no chat template: using ChatML, as llama.cpp does", file=sys.stderr)
            text = m.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ids = m.tokenize(text, add_special=True, parse_special=chat)
        n_ctx = context_size(ctx_size, m.n_ctx_train, m.plan.options.n_ctx if m.plan is not None else None)
        if len(ids) >= n_ctx:
            raise UserError(f"prompt is {len(ids)} tokens, the context is {n_ctx} (raise -c or shorten the prompt)")
        spec_type = drafts.source_type(m, m.plan.options.spec_type if m.plan is not None else None)
        spec = drafts.config(spec_type)
        draft_model = load_draft_model(m, drafts.model_draft) if drafts.model_draft else None
        policies = None
        if warmup:
            # an adaptive run's length policies start from the verify costs the warm-up timed
            policies = warm_up(m, spec_type, spec, sampler, cache_type, draft_model, drafts.ngram_n,
                               draft_vocab=drafts.draft_vocab)
            if m.executor.trace is not None:
                m.executor.trace.clear()
            notice.compiled = False         # whether the timed run below compiled anything
        session = m.session(n_ctx, cache_type, k_max=spec.k_max if spec_type != "none" else 1)
        source = build_source(spec_type, session, sampler, spec, draft_model, ngram_n_max=drafts.ngram_n,
                              cache_type=cache_type, draft_vocab=drafts.draft_vocab)
        constraint = None
        if grammar is not None:
            from ..decoding.constraint import Constraint

            constraint = Constraint(grammar, m.tokenizer, m.n_vocab)
        if display_prompt and not chat:
            sys.stdout.write(text)
            notice.partial_line = not text.endswith("\n")
        stream = m.tokenizer.stream()

        def emit(token: int) -> None:
            sys.stdout.write(stream.push(token))
            sys.stdout.flush()

        stop_ids = set() if ignore_eos else None      # None: the tokenizer's end-of-generation ids
        out, stats = generate(m, session, ids, n_predict, sampler, source, spec, on_token=emit, stop_ids=stop_ids,
                              trace=m.executor.trace, policies=policies, constraint=constraint)
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
        if load.trace is not None:
            load.write_trace(m)
            print(f"trace: {load.trace} (open in ui.perfetto.dev)", file=sys.stderr)

