"""First-run kernel compilation: cold vs warm told apart from Numba's cache index alone, one stderr
line exactly when a kernel compiles (a lazy `run` compiles mid-run when a prompt first reaches the
prompt GEMM, and says so), the same tokens from a cold and a warm cache, and `hybridrt warmup`
leaving a cache on which no run compiles anything."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from hybridrt.runtime.warmup import MESSAGE, announce_and_compile, compile_kernels, compile_notice, kernels_cold
from tests.real_models import SMOLLM2, require


def _python(code: str, cache_dir) -> subprocess.CompletedProcess:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)


def _cli(args: list[str], cache_dir) -> subprocess.CompletedProcess:
    return _python(f"from hybridrt.cli.commands import main; import sys; sys.argv[1:] = {args!r}; main()", cache_dir)


def test_compile_notice_says_so_once_and_only_when_compiling(capsys):
    from numba import njit

    def twice(x):
        return 2 * x

    kernel = njit(twice)                # not cached: compiles in this process, at its first call
    with compile_notice() as notice:
        assert kernel(3) == 6 and kernel(2.5) == 5.0        # two compilations, one line
        kernel(4)                                           # compiled already: nothing
    assert notice.compiled and capsys.readouterr().err == MESSAGE + "\n"
    with compile_notice() as notice:
        kernel(5)
    assert not notice.compiled and capsys.readouterr().err == ""
    with compile_notice() as notice:     # run's echoed prompt left a line open: the notice starts its own
        notice.partial_line = True
        assert kernel(True) == 2
    assert capsys.readouterr().err == "\n" + MESSAGE + "\n"
    kernel(1j)                          # outside: nothing printed
    assert capsys.readouterr().err == ""


@pytest.mark.usefixtures("single_thread")
def test_warm_cache_is_silent_and_cheap(capsys):
    from hybridrt.runtime.loader import load_model

    model = load_model(require(SMOLLM2))
    compile_kernels(model)                   # whatever the cache held before, it is warm now
    t0 = time.perf_counter()
    assert not kernels_cold()
    assert time.perf_counter() - t0 < 0.5    # reads three small index files, compiles nothing
    assert announce_and_compile(model) is False
    assert capsys.readouterr().err == ""


def test_fresh_cache_dir_is_cold(tmp_path):
    r = _python("from hybridrt.runtime.warmup import kernels_cold; print(kernels_cold())", tmp_path)
    assert r.stdout.strip() == "True", r.stderr


@pytest.mark.slow
def test_warmup_command_compiles_once(tmp_path):
    require(SMOLLM2)
    run = "from hybridrt.cli.commands import main; import sys; sys.argv[1:] = ['warmup', '-m', 'smollm2-135m']; main()"
    cold = _python(run, tmp_path)
    assert cold.returncode == 0 and cold.stderr.startswith(MESSAGE) and "compiled for" in cold.stderr
    warm = _python(run, tmp_path)
    assert warm.returncode == 0 and MESSAGE not in warm.stderr and "already compiled" in warm.stderr
    r = _python("from hybridrt.runtime.warmup import announce_and_compile; print(announce_and_compile('smollm2-135m'))",
                tmp_path)
    assert r.stdout.strip() == "False" and r.stderr == ""


SHORT = ["run", "-m", "smollm2-135m", "-p", "The capital of France is", "-n", "6", "--temp", "0", "-t", "1"]
# past ROWWISE_MAX (32) tokens: the torch trunk and the tiled prompt kernels, which a short run never calls
LONG = ["run", "-m", "smollm2-135m", "-p", "one two three four five six seven eight nine ten " * 5, "-n", "4",
        "--temp", "0", "-t", "1"]


FIRST_RUN_TIMES = "(first run: these times include compiling CPU kernels"


@pytest.mark.slow
def test_lazy_run_compiles_what_it_calls_and_says_so(tmp_path):
    """A cold run announces its compilation once; a warm run is silent with the same tokens; a long
    prompt later compiles the prompt kernels the short run left out, and announces that too."""
    require(SMOLLM2)
    cold = _cli(SHORT + ["--no-warmup"], tmp_path)
    assert cold.returncode == 0, cold.stderr
    assert cold.stderr.lstrip("\n").startswith(MESSAGE) and cold.stderr.count(MESSAGE) == 1
    assert FIRST_RUN_TIMES in cold.stderr       # its t/s are not the engine's: it says so
    # with run's warm-up (the default) the compiling is done before the timed run: announced, and
    # the times are the engine's
    warmed = _cli(SHORT, tmp_path / "other")
    assert warmed.returncode == 0 and warmed.stderr.count(MESSAGE) == 1, warmed.stderr
    assert FIRST_RUN_TIMES not in warmed.stderr and warmed.stdout == cold.stdout
    warm = _cli(SHORT, tmp_path)
    assert warm.returncode == 0 and MESSAGE not in warm.stderr and FIRST_RUN_TIMES not in warm.stderr, warm.stderr
    assert warm.stdout == cold.stdout
    assert kernels_cold_in(tmp_path)            # the short run left the prompt GEMM uncompiled
    long_cold = _cli(LONG, tmp_path)
    assert long_cold.returncode == 0 and long_cold.stderr.count(MESSAGE) == 1, long_cold.stderr
    long_warm = _cli(LONG, tmp_path)
    assert MESSAGE not in long_warm.stderr and long_warm.stdout == long_cold.stdout


def kernels_cold_in(cache_dir) -> bool:
    r = _python("from hybridrt.runtime.warmup import kernels_cold; print(kernels_cold())", cache_dir)
    return r.stdout.strip() == "True"


@pytest.mark.slow
def test_after_warmup_no_run_compiles(tmp_path):
    """`hybridrt warmup` compiles everything ahead: a short run, a long prompt and a speculative run
    (verify batches) then load cached code only."""
    require(SMOLLM2)
    assert _cli(["warmup", "-m", "smollm2-135m"], tmp_path).returncode == 0
    # a prompt that repeats itself: n-gram drafts, verify batches of up to 9 tokens
    spec = ["run", "-m", "smollm2-135m", "-p", "one two three four five six seven eight nine ten " * 2 + "one two",
            "-n", "8", "--temp", "0", "-t", "1", "--spec-type", "ngram-simple", "--spec-draft-n-max", "8"]
    for args in (SHORT, LONG, spec):
        r = _cli(args, tmp_path)
        assert r.returncode == 0 and MESSAGE not in r.stderr, (args, r.stderr)


@pytest.mark.slow
def test_warmup_with_a_trained_head_leaves_nothing_for_the_first_draft(tmp_path):
    """A trained head's matrices are Q8_0, which SmolLM2's file has none of: `warmup --mtp-head`
    compiles them too, so a draft-mtp run compiles nothing (before, its first draft stalled ~2.6 s)."""
    import torch

    from hybridrt.runtime.loader import load_model
    from hybridrt.models.mtp_head import head_target, write_head
    from hybridrt.train_mtp.torch_model import initial_head_tensors

    model = load_model(require(SMOLLM2))
    draft_ids = torch.arange(256)
    tensors = {name: t.numpy() for name, t in initial_head_tensors(model, draft_ids, head_target(model.arch)).items()}
    head = write_head(tmp_path / "head.gguf", {f"mtp.{n}.weight": a for n, a in tensors.items()}, model.gguf,
                      model.n_vocab, draft_ids.numpy())
    cache = tmp_path / "cache"
    assert _cli(["warmup", "-m", "smollm2-135m", "--mtp-head", str(head)], cache).returncode == 0
    r = _cli(SHORT + ["--mtp-head", str(head), "--spec-type", "draft-mtp"], cache)
    assert r.returncode == 0 and "draft-mtp" in r.stderr and MESSAGE not in r.stderr, r.stderr


def test_compile_head_runs_a_built_in_head_and_skips_a_model_without_one(tiny_qwen35_mtp, tiny_qwen3):
    """qwen35's own MTP head (its KV in the hybrid state) is stepped as drafting steps it, on a
    session of the cache type asked; a model without a head is left alone."""
    from hybridrt.runtime.loader import load_model
    from hybridrt.runtime.warmup import compile_head

    calls = []
    model = load_model(tiny_qwen35_mtp)
    real_step = model.mtp.step
    model.mtp.step = lambda state, tokens, *a, **kw: calls.append(len(tokens)) or real_step(state, tokens, *a, **kw)
    made, real_session = [], model.session
    model.session = lambda *a, **kw: made.append(kw.get("cache_type")) or real_session(*a, **kw)
    compile_head(model, "f16")
    assert calls == [1, 2, 4]
    assert made == ["f16"]      # the run's cache type: another would compile the attention half for it
    compile_head(load_model(tiny_qwen3), "f16")        # no head: nothing to do, no error


def test_run_warm_up_takes_the_runs_own_steps(tiny_qwen35_mtp, monkeypatch):
    """run's warm-up (llama.cpp's, before the timed run): a speculative one verifies the largest
    batch the run can (drafts at fixed n_max) and steps the MTP head; a plain one decodes. Each on a
    scratch session, not the run's."""
    from hybridrt.runtime.loader import load_model
    from hybridrt.decoding.sampling import SamplerConfig
    from hybridrt.runtime.session import Session
    from hybridrt.decoding.speculative.loop import SpecConfig
    from hybridrt.runtime.warmup import warm_up

    model = load_model(tiny_qwen35_mtp)
    evals, sessions = [], []
    real_eval, real_session = Session.eval, model.session
    monkeypatch.setattr(Session, "eval", lambda self, tokens, *a, **kw:
                        evals.append((len(tokens), kw.get("logits"))) or real_eval(self, tokens, *a, **kw))
    monkeypatch.setattr(model, "session", lambda *a, **kw: sessions.append(kw.get("k_max")) or real_session(*a, **kw))
    steps = []
    real_step = model.mtp.step
    model.mtp.step = lambda state, tokens, *a, **kw: steps.append(len(tokens)) or real_step(state, tokens, *a, **kw)
    policies = warm_up(model, "draft-mtp", SpecConfig(n_max=3, adaptive=True), SamplerConfig(temp=0.0), "f16")
    assert (4, "all") in evals and steps and 4 in sessions
    # an adaptive run's policy starts from the verify sizes timed after the warm-up's steps
    assert set(policies) == {"draft-mtp"} and sorted(policies["draft-mtp"].verify_s) == [1, 2, 3, 4]
    assert all(len(ts) == 3 and min(ts) > 0 for ts in policies["draft-mtp"].verify_recent.values())
    assert warm_up(model, "draft-mtp", SpecConfig(n_max=3), SamplerConfig(temp=0.0), "f16") is None
    evals.clear()
    assert warm_up(model, "none", SpecConfig(), SamplerConfig(temp=0.7, seed=3), "f16") is None
    assert (1, "last") in evals and max(n for n, _ in evals) <= 2


def test_verify_timing_stops_at_its_budget(tiny_qwen3):
    """The warm-up times every verify size COST_REPS times on a small model, and once where a round
    already took the budget (a large model's verifies: seconds of start-up for each round)."""
    from hybridrt.runtime.loader import load_model
    from hybridrt.runtime.warmup import COST_REPS, verify_costs

    model = load_model(tiny_qwen3)
    session = model.session(64, k_max=4)
    session.eval([5, 6])
    times = verify_costs(model, session, 4, 7)
    assert sorted(times) == [1, 2, 3, 4] and all(len(ts) == COST_REPS for ts in times.values())
    assert session.n_past == 2 + 4 * COST_REPS      # each verify rolled back to its first token
    once = verify_costs(model, session, 4, 7, budget_s=0.0)
    assert all(len(ts) == 1 and ts[0] > 0 for ts in once.values())


# sampled at fixed N: an adaptive run's draft lengths follow timings, and a sampled run's tokens
# (exact in distribution) follow its draft lengths
@pytest.mark.parametrize("sampling", [["--temp", "0"], ["--temp", "0.8", "-s", "7", "--no-adaptive"]],
                         ids=["greedy", "sampled"])
def test_run_warm_up_changes_no_output_and_no_trace(tiny_qwen35_mtp, tmp_path, sampling):
    """The same tokens with and without the warm-up, sampled ones too (the warm-up draws from its
    own generator); a --trace holds the timed run only."""
    import json

    args = ["run", "-m", str(tiny_qwen35_mtp), "-p", "one two three four five", "-n", "12", "-t", "1",
            "--spec-draft-n-max", "2", *sampling]
    from tests.test_cli import cli       # this process's kernel cache (a fresh one compiles for a minute)

    with_warmup = cli(*args, "--trace", str(tmp_path / "t.json"))
    without = cli(*args, "--no-warmup")
    assert with_warmup.returncode == 0 and without.returncode == 0, (with_warmup.stderr, without.stderr)
    assert with_warmup.stdout == without.stdout and "draft-mtp" in with_warmup.stderr
    events = json.loads((tmp_path / "t.json").read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    forwards = [e["name"] for e in events if e["name"].startswith("forward ")]
    assert forwards and not any(name.endswith(" @ 0") and name != forwards[0] for name in forwards)
    assert not any(name == "forward 2 @ 0" for name in forwards)        # the warm-up's two-token prompt
