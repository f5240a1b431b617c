"""Command-line options are declared once (hybridrt/cli_options.py) and shared by the commands that
take them; flag groups reach a command as one instance."""
from __future__ import annotations

import inspect
from collections import defaultdict
from pathlib import Path
from typing import Optional

import typer
from typer.testing import CliRunner

from hybridrt.cli import options as cli_options
from hybridrt.cli.commands import app
from hybridrt.cli.options import GROUP, MODEL, KVFlags, SpecFlags, flag_groups

# Flags that mean something else in one command, so are that command's own declaration: (flag, command)
OWN_MEANING = {
    ("-p", "bench"),            # llama-bench's: the number of prompt tokens (run's -p is the prompt's text)
    ("-n", "bench"),            # llama-bench's: tokens generated per repetition (--n-gen, not --n-predict)
    ("-c", "bench"),            # only the context a plan reserves: the bench's sessions are sized by -p and -n
    ("-f", "bench"),            # the speculative bench's prompt file
    ("--spec-type", "bench"),   # what to compare with plain decoding (none or no value: the plain bench)
    ("-t", "serve"),            # threads per session, the cores shared out over --parallel by default
    ("-t", "train-mtp"),        # torch's threads for training
    ("-m", "train-mtp"),        # required: the target the head is trained for
    ("--seed", "train-mtp"),    # training's seed, TrainConfig's default
    ("--vram", "plan"),         # default auto: a plan always has a budget
    ("-m", "warmup"),           # warmup.py's own declaration, word for word MODEL's (not yet moved here)
    ("--mtp-head", "warmup"),   # a head whose kernels to compile too
}


def _declarations() -> dict[str, dict[str, typer.models.OptionInfo]]:
    """flag -> {command: the OptionInfo declaring it, as the command's signature holds it}, every name
    of a declaration (-m and --model) a flag of its own."""
    flags: dict[str, dict] = defaultdict(dict)
    for command in app.registered_commands:
        name = command.name or command.callback.__name__
        for p in inspect.signature(command.callback).parameters.values():
            if isinstance(p.default, typer.models.OptionInfo):
                for flag in (d for part in p.default.param_decls for d in part.split("/")):
                    flags[flag][name] = p.default
    return flags


def test_a_flag_several_commands_take_is_one_declaration():
    flags = _declarations()
    assert {"run", "bench", "serve", "plan"} <= set(flags["--spec-draft-n-max"])
    own = {(c, id(flags[flag][c])) for flag, c in OWN_MEANING}
    declared_here = {id(v) for v in vars(cli_options).values()}
    for flag, by_command in flags.items():
        shared = {c: o for c, o in by_command.items() if (c, id(o)) not in own}
        if len(shared) > 1:
            assert len({id(o) for o in shared.values()}) == 1, (flag, sorted(shared))
            assert id(next(iter(shared.values()))) in declared_here, flag
    for flag, command in OWN_MEANING:      # an exception for a flag no other command takes would hide nothing
        assert len(flags[flag]) > 1, (flag, command)


def test_groups_reach_the_command_as_instances():
    seen = {}

    @flag_groups
    def command(model: Optional[str] = MODEL, kv: KVFlags = GROUP, drafts: SpecFlags = GROUP,
                out: Optional[Path] = typer.Option(None, "-o")):
        seen.update(model=model, kv=kv, drafts=drafts, out=out)

    runner = CliRunner()
    one = typer.Typer()
    one.command()(command)
    r = runner.invoke(one, ["-m", "x.gguf", "-ctv", "q8_0", "--draft-max", "5", "--spec-type", "ngram-simple",
                            "--no-adaptive", "-o", "y"])
    assert r.exit_code == 0, r.output
    assert seen["model"] == "x.gguf" and seen["out"] == Path("y")
    assert seen["kv"] == KVFlags(cache_type_k="f16", cache_type_v="q8_0")
    assert seen["drafts"] == SpecFlags(spec_type="ngram-simple", model_draft=None, draft_n_max=5, draft_n_min=0,
                                       draft_p_min=0.0, ngram_n=4, draft_vocab=0, adaptive=False)
    assert seen["drafts"].config("ngram-simple").k_max == 6 and not seen["drafts"].config("draft-mtp").adaptive
    help_text = runner.invoke(one, ["--help"]).output
    assert help_text.index("--model") < help_text.index("--cache-type-v") < help_text.index("--spec-type")
