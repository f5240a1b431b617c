#!/usr/bin/env bash
# The transformers oracle: Hugging Face transformers 5.x (+ accelerate, which its GGUF loader
# requires) in a venv outside the project environment, reusing the system torch, numpy and gguf:
#   ${HYBRIDRT_CACHE:-$HOME/.cache/hybridrt}/transformers-venv
# tests/test_transformers_oracle.py runs its bin/python in a subprocess (pytest -m oracle).
# Idempotent; about 15 MB of wheels, a minute to install.
set -euo pipefail

cache="${HYBRIDRT_CACHE:-$HOME/.cache/hybridrt}"
venv="$cache/transformers-venv"
python="${PYTHON:-python3}"
mkdir -p "$cache"

ok() {
    [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import transformers, accelerate, gguf, torch" >/dev/null 2>&1
}

if ! ok; then
    "$python" -m venv --system-site-packages "$venv"
    "$venv/bin/pip" install --quiet "transformers>=5,<6" accelerate
fi
echo "transformers oracle ready: transformers $("$venv/bin/python" -c "import transformers; print(transformers.__version__)")"
echo "  python: $venv/bin/python"
