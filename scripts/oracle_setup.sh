#!/usr/bin/env bash
# Build the llama.cpp oracle (llama-cpp-python from PyPI, compiled from source for this CPU) into
# its own venv, outside the project environment:  ${HYBRIDRT_CACHE:-$HOME/.cache/hybridrt}/oracle-venv
# Oracle tests run its bin/python in a subprocess:  pytest -m oracle
# Idempotent: when the venv already imports llama_cpp nothing is rebuilt. A lock keeps two runs
# from building at once (the second waits, then finds the first one's venv).
# The build takes ~10-20 minutes on 2 cores; its log goes to the venv's build.log.
set -euo pipefail

cache="${HYBRIDRT_CACHE:-$HOME/.cache/hybridrt}"
venv="$cache/oracle-venv"
python="${PYTHON:-python3}"
mkdir -p "$cache"

oracle_ok() {
    [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import llama_cpp" >/dev/null 2>&1
}

report() {
    version="$("$venv/bin/python" -c "import llama_cpp; print(llama_cpp.__version__)")"
    echo "llama.cpp oracle ready: llama-cpp-python $version"
    echo "  python: $venv/bin/python"
}

if oracle_ok; then
    report
    exit 0
fi

exec 9>"$cache/oracle-venv.lock"
if ! flock -n 9; then
    echo "another oracle build holds $cache/oracle-venv.lock; waiting for it..."
    flock 9
fi
if oracle_ok; then     # built by the run we waited for
    report
    exit 0
fi

echo "building llama-cpp-python into $venv (log: $venv/build.log)"
"$python" -m venv "$venv"
# a source build for the host CPU; CMAKE_ARGS from the caller's environment are passed through
if ! CMAKE_ARGS="${CMAKE_ARGS:-}" "$venv/bin/python" -m pip install --disable-pip-version-check \
        llama-cpp-python >"$venv/build.log" 2>&1; then
    tail -n 30 "$venv/build.log" >&2
    echo "error: llama-cpp-python build failed (full log: $venv/build.log)" >&2
    exit 1
fi
oracle_ok || { echo "error: llama_cpp does not import after the build" >&2; exit 1; }
report
