"""The command-line options that several commands take, each declared once.

A flag is one `typer.Option` here (its names, default and help), used as the default of the
parameter that receives it in every command that takes it (`threads: Optional[int] = THREADS`);
typer reads the declaration from there. Flags that go together are a frozen dataclass whose fields
are such options (`KVFlags`: -ctk/-ctv; `SpecFlags`: the speculative decoding flags of run and
serve; `PlacementFlags`: where run's, bench's and serve's weights go and on what numerics;
`LoadFlags`: those and --trace, for run and bench; `GrammarFlags`: a constraint on the output). A
command names a group as one parameter (`spec: SpecFlags = GROUP`) and `@flag_groups` spreads the
group's fields into the signature typer reads, then calls the command with one instance, whose
methods hold the checks and conversions the commands share. A flag one command alone takes is
declared in it.

No torch at import: `info` and `plan` start without it.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from placement.constants import CACHE_TYPES

from ..errors import UserError

if TYPE_CHECKING:
    from ..decoding.constraint import Grammar
    from ..models.base import Model
    from ..decoding.speculative.loop import SpecConfig

MODEL_HELP = "GGUF path or a known name (gemma3-270m, smollm2-135m); default gemma3-270m"
# A verify batch is the certain token and the drafts: up to 32 tokens it runs on the batch-stable
# small-batch kernels (gpu_kernels ROWWISE_MAX, the fused layer halves) with the second int8 pass
# (quantize_act.RESIDUAL_MAX_TOKENS) that plain steps take; a 33rd would leave them and part from
# plain decoding (tests/test_spec_loop.py checks the three agree)
MAX_DRAFTS = 31
NGRAM_N_MIN = 2     # ngram-simple's shortest n-gram (a 1-gram match predicts little)
# the KV cache types -ctk/-ctv take, the default first
KV_TYPES = ", ".join(sorted(CACHE_TYPES, key=lambda t: t != "f16"))

MODEL = typer.Option(None, "-m", "--model", help=MODEL_HELP)
MODEL_ARG = typer.Argument(None, help=MODEL_HELP, show_default=False)     # `info X`, `plan X`: -m's value
CTX_SIZE = typer.Option(None, "-c", "--ctx-size", show_default=False,
                        help="Context size in tokens (default: 4096 or the model's, if smaller; 0: the model's).")
THREADS = typer.Option(None, "-t", "--threads", help="CPU threads (torch and Numba).")
JSON = typer.Option(False, "--json", help="Print the result as JSON, alone on stdout (anything else goes to stderr).")
CPU_BW = typer.Option(None, "--cpu-bw", help="CPU memory bandwidth in GB/s for the speed prediction (default: measured).")

SPEC_TYPE = typer.Option(None, "--spec-type", help="Speculative drafts: none, draft-mtp, draft-simple, ngram-simple, or "
                         "a lookup and a model source together (ngram-simple,draft-mtp: the lookup drafts where the "
                         "text repeats, the model elsewhere) (default: draft-mtp when the model has an MTP head, "
                         "draft-simple with -md, else none).")
MODEL_DRAFT = typer.Option(None, "-md", "--model-draft", help="Draft model for --spec-type draft-simple (same vocabulary).")
DRAFT_N_MAX = typer.Option(3, "--spec-draft-n-max", "--draft-max", help=f"Most draft tokens per step (1..{MAX_DRAFTS}).")
DRAFT_N_MIN = typer.Option(0, "--spec-draft-n-min", "--draft-min", help="Drop proposals shorter than this.")
DRAFT_P_MIN = typer.Option(0.0, "--spec-draft-p-min", "--draft-p-min",
                           help="Stop model drafting below this top-1 probability.")
NGRAM_N = typer.Option(4, "--spec-ngram-size-n",
                       help=f"ngram-simple: longest n-gram to match (tried down to {NGRAM_N_MIN}).")
DRAFT_VOCAB = typer.Option(0, "--spec-draft-vocab", help="draft-mtp: the built-in MTP head drafts among this many tokens (chosen from the model's tokenizer) and the prompt's and output's own; 0: the whole vocabulary. Verification stays full, so outputs do not change.")
ADAPTIVE = typer.Option(None, "--adaptive/--no-adaptive", help="Choose each step's draft count within "
                        "--spec-draft-n-max from the live acceptance and measured verify cost (default: on for "
                        "draft-mtp and draft-simple).")
MTP_HEAD = typer.Option(None, "--mtp-head", help="MTP head from `hybridrt train-mtp` for --spec-type draft-mtp "
                        "(replaces a built-in head).")
WARMUP = typer.Option(True, "--warmup/--no-warmup", help="Before the run (serve: before listening), generate a few "
                      "tokens through the steps it takes, so that first calls (kernels loaded or compiled) are not "
                      "timed or paid by the first request, and adaptive length starts from timed verify sizes, as "
                      "llama.cpp does.")

GRAMMAR = typer.Option(None, "--grammar", "--grammar-file", help="Constrain the output to a grammar file: Lark "
                       "(llguidance's syntax) or llama.cpp's GBNF. Needs llguidance (pip install 'hybridrt[grammar]').")
JSON_SCHEMA = typer.Option(None, "-j", "--json-schema", "--json-schema-file", help="Constrain the output to JSON "
                           "valid against a JSON schema: a file, or the schema itself ({...}, as llama.cpp's -j). "
                           "Needs llguidance.")
REGEX = typer.Option(None, "--regex", help="Constrain the whole output to match a regular expression (Rust regex "
                     "syntax). Needs llguidance.")

PARALLEL = typer.Option(1, "-np", "--parallel", help="Sessions at once (serve's), each with its own KV cache, "
                        "recurrent state and draft state; a plan reserves those once per session.")

CACHE_TYPE_K = typer.Option("f16", "-ctk", "--cache-type-k", help=f"KV cache type for K: {KV_TYPES}.")
CACHE_TYPE_V = typer.Option("f16", "-ctv", "--cache-type-v", help=f"KV cache type for V: {KV_TYPES}.")

DEVICE = typer.Option("cpu", "--device", help="Trunk device: cpu or cuda. With cuda (or --vram) the plan is executed: "
                      "trunk and the FFN layers that fit on the device, the rest from the mmap on the CPU.")
VRAM = typer.Option(None, "--vram", help="VRAM budget to plan for (12GiB, 700MiB, auto = free memory of the GPU). "
                    "With --device cpu the CPU stands in for the GPU.")
GPU_LAYERS = typer.Option(None, "-ngl", "--n-gpu-layers", "--gpu-layers", show_default=False, help=(
    "llama.cpp's offload flag: 0 runs everything on the CPU; any other count runs the plan on the GPU (--device "
    "cuda, the free VRAM as budget; without a GPU it is ignored, as in llama.cpp). hybridrt places by memory, not "
    "by layer count: as many whole FFN layers as fit (--vram SIZE sets a smaller budget)."))
MARGIN = typer.Option("512MiB", "--margin", help="Planned fixed overhead: CUDA context, allocator slack, safety.")
NO_OP_OFFLOAD = typer.Option(False, "--no-op-offload", help="With a plan: prompt batches run the CPU FFN layers on the "
                             "CPU instead of copying their weights to the device (frees one layer's VRAM for decoding).")
NO_CUDA_GRAPHS = typer.Option(False, "--no-cuda-graphs", help="With a plan on CUDA: launch every step's kernels "
                              "eagerly instead of replaying captured CUDA graphs (HYBRIDRT_CUDA_GRAPHS=0).")
TRACE = typer.Option(None, "--trace", help="Write a Chrome/Perfetto trace (device work, CPU FFN, transfers, draft, "
                     "verify) to this file.")
EXACT_ACTIVATIONS = typer.Option(False, "--exact-activations", help="Run the mmap'd matrices on float32 activations "
                                 "(exact; slower) instead of int8 activations with integer dot products (llama.cpp's "
                                 "numerics).")
ACT_RESIDUAL = typer.Option(None, "--act-residual/--no-act-residual", help="On int8 activations, a second int8 pass on "
                            "the rounding of the attention and FFN-down inputs of decode and verify steps (near-float32 "
                            "accuracy, ~8 % a step; default on, HYBRIDRT_ACT_RESIDUAL); --no-act-residual is "
                            "llama.cpp's numerics exactly.")


# ------------------------------------------------------------------------------------------ groups
GROUP = None    # a group parameter's default in a command's own signature (`@flag_groups` replaces it)


def flag_groups(command):
    """The command as typer should see it: each parameter annotated with a flag group (a dataclass
    of this module) replaced, where it stands, by the group's fields; called with one instance per
    group built from them."""
    hints = typing.get_type_hints(command)
    params, groups = [], {}
    for p in inspect.signature(command).parameters.values():
        kind = hints[p.name]
        if dataclasses.is_dataclass(kind):
            groups[p.name] = kind
            field_hints = typing.get_type_hints(kind)
            params += [inspect.Parameter(f.name, p.POSITIONAL_OR_KEYWORD, default=f.default,
                                         annotation=field_hints[f.name]) for f in dataclasses.fields(kind)]
        else:
            params.append(p.replace(annotation=kind))

    @functools.wraps(command)
    def with_groups(**kwargs):
        for name, kind in groups.items():
            kwargs[name] = kind(**{f.name: kwargs.pop(f.name) for f in dataclasses.fields(kind)})
        return command(**kwargs)

    with_groups.__signature__ = inspect.Signature(params)
    with_groups.__annotations__ = {p.name: p.annotation for p in params}
    return with_groups


@dataclass(frozen=True)
class KVFlags:
    """-ctk / -ctv: the KV cache's types (run, bench, serve, plan)."""
    cache_type_k: str = CACHE_TYPE_K
    cache_type_v: str = CACHE_TYPE_V

    @property
    def cache_type(self) -> str:
        """The one cache type the runtime takes for both (an error for a pair it does not run)."""
        from ..runtime.kv_cache import kv_cache_type

        return kv_cache_type(self.cache_type_k, self.cache_type_v)


@dataclass(frozen=True)
class SpecFlags:
    """The speculative decoding flags of run and serve."""
    spec_type: Optional[str] = SPEC_TYPE
    model_draft: Optional[str] = MODEL_DRAFT
    draft_n_max: int = DRAFT_N_MAX
    draft_n_min: int = DRAFT_N_MIN
    draft_p_min: float = DRAFT_P_MIN
    ngram_n: int = NGRAM_N
    draft_vocab: int = DRAFT_VOCAB
    adaptive: Optional[bool] = ADAPTIVE

    def check(self) -> None:
        """The values alone, before anything loads (SpecConfig checks n_min against n_max, p_min;
        the model's vocabulary bounds --spec-draft-vocab from above once it is loaded)."""
        check_spec_flags(self.draft_n_max, self.ngram_n)
        check_draft_vocab_flag(self.draft_vocab)
        self.config("none")

    def source_type(self, model: "Model", planned: str | None = None) -> str:
        """--spec-type as given, else the plan's (`planned`), else draft-simple with -md, draft-mtp
        for a model with an MTP head, none."""
        from ..decoding.speculative.sources import default_spec_type

        return self.spec_type or planned or ("draft-simple" if self.model_draft else default_spec_type(model))

    def config(self, spec_type: str, shared_steps: bool = False) -> "SpecConfig":
        """The limits of `spec_type`'s drafts; adaptive length as asked, else as `adaptive_default`."""
        from ..decoding.speculative.loop import SpecConfig

        adaptive = adaptive_default(spec_type, shared_steps) if self.adaptive is None else self.adaptive
        return SpecConfig(n_max=self.draft_n_max, n_min=self.draft_n_min, p_min=self.draft_p_min, adaptive=adaptive)


@dataclass(frozen=True)
class GrammarFlags:
    """--grammar / --json-schema / --regex: what the output must match (at most one)."""
    grammar: Optional[Path] = GRAMMAR
    json_schema: Optional[str] = JSON_SCHEMA
    regex: Optional[str] = REGEX

    def check(self) -> "Grammar | None":
        """The grammar, read and compiled before anything loads, so a bad one fails first (None:
        unconstrained). --json-schema's value is the schema itself when it starts with "{", as
        llama.cpp's -j takes it, else a file."""
        given = [(kind, value) for kind, value in (("grammar", self.grammar), ("json_schema", self.json_schema),
                                                   ("regex", self.regex)) if value is not None]
        if not given:
            return None
        from ..decoding.constraint import KINDS, compile_grammar

        if len(given) > 1:
            raise UserError(f"pass one of {', '.join(KINDS[kind] for kind, _ in given)}, not several")
        kind, value = given[0]
        inline = kind == "regex" or (kind == "json_schema" and value.lstrip().startswith("{"))
        return compile_grammar(kind, value if inline else read_text_file(Path(value), KINDS[kind]))


@dataclass(frozen=True)
class PlacementFlags:
    """Where the weights go and on what numerics (run, bench, serve): a plan when --vram or a GPU
    asks for one, and the mmap'd matrices' activations."""
    device: str = DEVICE
    vram: Optional[str] = VRAM
    gpu_layers: Optional[int] = GPU_LAYERS
    margin: str = MARGIN
    no_op_offload: bool = NO_OP_OFFLOAD
    no_cuda_graphs: bool = NO_CUDA_GRAPHS
    exact_activations: bool = EXACT_ACTIVATIONS
    act_residual: Optional[bool] = ACT_RESIDUAL

    traced = False      # whether the executor records a trace (LoadFlags: --trace)

    def check(self) -> str:
        """The trunk's device (as -ngl implies it), and the sizes read, before anything loads."""
        from ..runtime.place import parse_size

        if self.vram not in (None, "auto"):
            parse_size(self.vram, "--vram")
        parse_size(self.margin, "--margin")
        device = device_for_gpu_layers(self.gpu_layers, self.device)
        check_device(device)
        return device

    def load(self, model: Optional[str], device: str, threads: Optional[int], ctx_size: Optional[int], kv: KVFlags,
             spec_type: Optional[str], draft_n_max: int, model_draft: Optional[str], mtp_head: Optional[Path],
             cpu_bw: float | None = None, n_seq: int = 1) -> "Model":
        """The target, placed by a plan when --vram is given or the device is a GPU (its line on
        stderr); `cpu_bw` (bytes/s) the plan's CPU bandwidth where measured already; `n_seq` the
        sessions the plan holds at once (serve's --parallel)."""
        from ..runtime.loader import load_model
        from ..runtime.place import placement_line

        request = placement_request(model, self.vram, device, ctx_size, kv, spec_type, draft_n_max, model_draft,
                                    self.margin, op_offload=not self.no_op_offload)
        if request is not None:
            request = dataclasses.replace(request, n_seq=n_seq, **({"cpu_bw": cpu_bw} if cpu_bw is not None else {}))
        m = load_model(model, device=device, threads=threads, placement=request, trace=self.traced,
                       exact_activations=True if self.exact_activations else None, mtp_head=mtp_head,
                       act_residual=self.act_residual, cuda_graphs=False if self.no_cuda_graphs else None)
        if m.plan is not None:
            print(placement_line(m.plan, device), file=sys.stderr)
        return m


@dataclass(frozen=True)
class LoadFlags(PlacementFlags):
    """PlacementFlags and --trace: run's and bench's."""
    trace: Optional[Path] = TRACE

    @property
    def traced(self) -> bool:
        return self.trace is not None

    def check(self) -> str:
        check_output_path(self.trace, "--trace")
        return super().check()

    def write_trace(self, m: "Model") -> None:
        if self.trace is not None:
            m.executor.trace.write(self.trace)


# ------------------------------------------------------------------------------------------ checks
def check_spec_flags(draft_n_max: int, ngram_n: int = 4) -> None:
    if not 1 <= draft_n_max <= MAX_DRAFTS:
        raise UserError(f"--spec-draft-n-max must be within 1..{MAX_DRAFTS}, got {draft_n_max}")
    if ngram_n < NGRAM_N_MIN:
        raise UserError(f"--spec-ngram-size-n must be >= {NGRAM_N_MIN} (n-grams are tried from it down to "
                        f"{NGRAM_N_MIN}), got {ngram_n}")


def check_draft_vocab_flag(draft_vocab: int) -> None:
    """--spec-draft-vocab alone, before anything loads (the vocabulary bounds it once loaded)."""
    if draft_vocab < 0:
        raise UserError(f"--spec-draft-vocab must be >= 0 (0: the whole vocabulary), got {draft_vocab}")


def adaptive_default(spec_type: str, shared_steps: bool = False) -> bool:
    """Adaptive length pays where a draft costs a forward (model drafts, alone or in a chain), and
    where sessions share their steps (serve's continuous batching): there an n-gram draft, free to
    make, still adds verify rows to every session's step. 8 SmolLM2 sessions in shared steps with
    fixed-length n-gram drafts (35-40 % accepted) made 0.87-0.94x the tokens of plain ones; with
    adaptive length weighing the others' tokens (DraftLengthPolicy.others), about the same as plain
    (BENCHMARKS.md, "Serving: concurrent streams")."""
    from ..decoding.speculative.spec_types import MODEL_TYPES, spec_type_parts

    return shared_steps or any(p in MODEL_TYPES for p in spec_type_parts(spec_type))


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


def read_text_file(path: Path, flag: str) -> str:
    """The UTF-8 text of the file a flag names (-f's prompt, a grammar), or a UserError saying why not."""
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a directory, not a file")
    if not path.is_file():
        raise UserError(f"{flag} {path}: no such file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{flag} {path}: not UTF-8 text (byte {e.start}: {e.reason})") from None


def check_output_path(path: Optional[Path], flag: str) -> None:
    """An output file's place, checked before any work: a run should not end in a traceback."""
    if path is None:
        return
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a directory")
    if not path.absolute().parent.is_dir():
        raise UserError(f"{flag} {path}: no such directory {path.absolute().parent}")


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


def check_device(device: str) -> None:
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available (use --device cpu)")
    if not (device == "cpu" or device.startswith("cuda")):
        raise UserError(f"unknown device '{device}' (use cpu or cuda)")


def placement_request(model_path: Optional[str], vram: Optional[str], device: str, ctx_size: Optional[int],
                      kv: KVFlags, spec_type: Optional[str], draft_n_max: int, model_draft: Optional[str], margin: str,
                      op_offload: bool = True):
    """The plan request of `run`, `bench` and `serve`: None (everything in the mmap, the trunk on `device`)
    unless --vram is given or the device is a GPU (then the free VRAM is the budget)."""
    from ..runtime.place import PlacementRequest, parse_size
    from ..files.registry import resolve_model
    from ..decoding.speculative.spec_types import model_spec_type

    if vram is None and not device.startswith("cuda"):
        return None
    return PlacementRequest(
        vram_bytes=None if vram in (None, "auto") else parse_size(vram, "--vram"),
        n_ctx=ctx_size or None, cache_type_k=kv.cache_type_k, cache_type_v=kv.cache_type_v,
        spec_type=model_spec_type(spec_type) if spec_type else None,     # a chain: its model source sizes it
        spec_draft_n_max=draft_n_max, draft_path=str(resolve_model(model_draft)) if model_draft else None,
        margin_bytes=parse_size(margin, "--margin"), op_offload=op_offload)
