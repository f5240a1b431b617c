"""First-run kernel compilation: cold vs warm told apart from Numba's cache index alone, one stderr
line only on a cold cache, and `hybridrt warmup` leaving a cache on which nothing is announced."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from hybridrt.warmup import MESSAGE, announce_and_compile, compile_kernels, kernels_cold
from tests.real_models import SMOLLM2, require


def _python(code: str, cache_dir) -> subprocess.CompletedProcess:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.usefixtures("single_thread")
def test_warm_cache_is_silent_and_cheap(capsys):
    from hybridrt.loader import load_model

    model = load_model(require(SMOLLM2))
    compile_kernels(model)                   # whatever the cache held before, it is warm now
    t0 = time.perf_counter()
    assert not kernels_cold()
    assert time.perf_counter() - t0 < 0.5    # reads three small index files, compiles nothing
    assert announce_and_compile(model) is False
    assert capsys.readouterr().err == ""


def test_fresh_cache_dir_is_cold(tmp_path):
    r = _python("from hybridrt.warmup import kernels_cold; print(kernels_cold())", tmp_path)
    assert r.stdout.strip() == "True", r.stderr


@pytest.mark.slow
def test_warmup_command_compiles_once(tmp_path):
    require(SMOLLM2)
    run = "from hybridrt.cli import main; import sys; sys.argv[1:] = ['warmup', '-m', 'smollm2-135m']; main()"
    cold = _python(run, tmp_path)
    assert cold.returncode == 0 and cold.stderr.startswith(MESSAGE) and "compiled for" in cold.stderr
    warm = _python(run, tmp_path)
    assert warm.returncode == 0 and MESSAGE not in warm.stderr and "already compiled" in warm.stderr
    r = _python("from hybridrt.warmup import announce_and_compile; print(announce_and_compile('smollm2-135m'))",
                tmp_path)
    assert r.stdout.strip() == "False" and r.stderr == ""
