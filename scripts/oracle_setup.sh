#!/usr/bin/env bash
# Build the llama.cpp oracle (llama-cpp-python from PyPI, compiled from source for this CPU) into
# its own venv, outside the project environment:  ${HYBRIDRT_CACHE:-$HOME/.cache/hybridrt}/oracle-venv
# Oracle tests run its bin/python in a subprocess:  pytest -m oracle
# Idempotent: when the venv already imports llama_cpp nothing is rebuilt. A lock keeps two runs
# from building at once (the second waits, then finds the first one's venv).
# The build takes ~10-20 minutes on 2 cores; its log goes to the venv's build.log.
#
# Build flags: ggml's default (GGML_NATIVE=ON, -march=native) turns on its AMX path on AMX Xeons
# (Sapphire Rapids and later), which crashes (SIGSEGV) on any batch of 2+ tokens. So the build is
# not native: GGML_NATIVE=OFF, the AMX flags OFF, and each x86 SIMD flag ON exactly when this CPU's
# /proc/cpuinfo lists it (forcing AVX-512 on would die with SIGILL on AMD Zen 3, which has none).
# The flags are stamped into the venv; a venv built with other flags (or none recorded) is rebuilt.
# CMAKE_ARGS from the caller's environment come last, so they can override any of these.
set -euo pipefail

cache="${HYBRIDRT_CACHE:-$HOME/.cache/hybridrt}"
venv="$cache/oracle-venv"
python="${PYTHON:-python3}"
mkdir -p "$cache"

# ggml CMake option -> the /proc/cpuinfo flags it needs (all of them)
cpu_cmake_args() {
    local flags
    flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
    local args="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    local opt needs f on
    for spec in "AVX:avx" "AVX2:avx2" "FMA:fma" "F16C:f16c" "BMI2:bmi2" \
                "AVX512:avx512f,avx512cd,avx512vl,avx512dq,avx512bw" "AVX512_VBMI:avx512vbmi" \
                "AVX512_VNNI:avx512_vnni" "AVX512_BF16:avx512_bf16" "AVX_VNNI:avx_vnni"; do
        opt="${spec%%:*}"
        needs="${spec#*:}"
        on=ON
        for f in ${needs//,/ }; do
            [[ "$flags" == *" $f "* ]] || on=OFF
        done
        args="$args -DGGML_$opt=$on"
    done
    echo "$args"
}

cmake_args="$(cpu_cmake_args) ${CMAKE_ARGS:-}"
cmake_args="${cmake_args% }"
stamp="$venv/cmake_args.txt"

oracle_ok() {
    [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import llama_cpp" >/dev/null 2>&1 &&
        [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$cmake_args" ]
}

report() {
    version="$("$venv/bin/python" -c "import llama_cpp; print(llama_cpp.__version__)")"
    echo "llama.cpp oracle ready: llama-cpp-python $version"
    echo "  python: $venv/bin/python"
    echo "  CMAKE_ARGS: $(cat "$stamp")"
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

if [ -d "$venv" ]; then
    echo "rebuilding: $venv was built with other flags (or none recorded)"
    rm -rf "$venv"
fi
echo "building llama-cpp-python into $venv (log: $venv/build.log)"
echo "  CMAKE_ARGS: $cmake_args"
"$python" -m venv "$venv"
# a source build (no cached wheel: it could carry other flags) with the flags above
if ! CMAKE_ARGS="$cmake_args" "$venv/bin/python" -m pip install --disable-pip-version-check --no-cache-dir \
        --no-binary llama-cpp-python llama-cpp-python >"$venv/build.log" 2>&1; then
    tail -n 30 "$venv/build.log" >&2
    echo "error: llama-cpp-python build failed (full log: $venv/build.log)" >&2
    exit 1
fi
echo "$cmake_args" >"$stamp"
oracle_ok || { echo "error: llama_cpp does not import after the build" >&2; exit 1; }
report
