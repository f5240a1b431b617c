#!/usr/bin/env bash
# The GPU check: run this first on any machine with a CUDA GPU, and record what it prints in
# BENCHMARKS.md ("GPU check" section) with the date and the card.
#
#   bash scripts/gpu_check.sh [OUTDIR]          # default OUTDIR: $OUT if set, else .out/gpu_check
#
# GPU_CHECK_STEPS="cuda_tests plan_gemma3" runs only the steps named (a rerun after a fix);
# GPU_CHECK_STEP_TIMEOUT (seconds, default 300) ends a step that hangs, so the next one still runs.
# GPU_CHECK_DRY_RUN=1 runs the same steps on this machine's CPU (the plan with the CPU standing in for
# the card, the 27B cut to 2 layers, the CUDA-only steps left out): the script's plumbing checked
# before a lent GPU's minutes are spent on it.
#
# It runs, each step on its own (a failing step is reported and the next one still runs):
#   1. the card: nvidia-smi, torch/triton versions, device-to-device copy bandwidth;
#   2. the `cuda` tests (Triton kernels compiled for the card: exactness, bit identity across k);
#   3. the plan path end to end (`hybridrt bench --device cuda --vram ...`): SmolLM2 and Gemma 3
#      (the real files if pulled, else random-weight files of their exact shapes and types), and a
#      qwen35 + MTP file, each at budgets that put everything / about half / nothing of the FFN on
#      the GPU; measured vs predicted t/s from --json; SmolLM2 all on the GPU again with
#      HYBRIDRT_DIRECT_LAUNCH=0 (the direct launcher's A/B); then one traced run of SmolLM2 at half;
#   4. the mission's case: a full-size Qwen3.6-27B-MTP Q4_K_M written here (scripts/make_model.py, in the
#      background from the start) and run at --vram 12GiB -c 32768: `bench` plain and speculative
#      (forced acceptance) measured vs predicted with pp512, bench_mission's t(k) and alpha-0.8
#      speculation, and one traced run summarized (device busy, CPU FFN, copies, host gaps);
#   5. the kernel benches (the matvec sweep last: it writes the card's launch table): the host time per call of each device piece (scripts/bench_gpu_launch.py:
#      what bounds a decode step today; again with HYBRIDRT_DIRECT_LAUNCH=0), fused dequantize-dot vs torch dequantize+matmul at the 27B
#      FFN shapes (scripts/bench_gpu_kernels.py), the Gated DeltaNet step (scripts/bench_gpu_delta_net.py).
# The plan path comes before the kernel benches: on a short lease it is the part that matters most.
#
# On the lent machines (see the device tool's README): nothing can be downloaded there, so carry
# the gguf wheel (and starlette, uvicorn: the server's extras, for test files that import it):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#   --platform manylinux_2_17_x86_64 -d .whl gguf starlette uvicorn   (pure Python: any platform)
# and run, with carry [".whl"] and a timeout that leaves room for one rerun (the lease is 15 minutes,
# its start included; at most 8 files come back from $OUT, and the 27B must not be among them):
#   timeout 540 bash scripts/gpu_check.sh /tmp/gc; tar czf $OUT/gpu_check.tgz -C /tmp/gc --exclude=models .
# The script installs .whl/*.whl into /tmp/site when present and puts the checkout on PYTHONPATH
# (no pip install of hybridrt needed).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUTDIR=${1:-${OUT:-.out/gpu_check}}
mkdir -p "$OUTDIR"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$ROOT:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
export OUTDIR
FAILED=()
# the mission's case: the 27B's layers, context, prompt and generated tokens (a dry run: a sliver of it)
export DEVICE=cuda MISSION_LAYERS="" MISSION_CTX=32768 MISSION_PP=512 MISSION_N=32
if [ -n "${GPU_CHECK_DRY_RUN:-}" ]; then
  DEVICE=cpu MISSION_LAYERS="--layers 2" MISSION_CTX=1024 MISSION_PP=16 MISSION_N=4
  echo "gpu_check: dry run on the CPU (no card): the steps' plumbing only"
fi
MISSION="$OUTDIR/models/qwen3.6-27b-mtp.gguf"
export MISSION

hybridrt_cli() { python3 -c "from hybridrt.cli import main; main()" "$@"; }

selected() { [ -z "${GPU_CHECK_STEPS:-}" ] || [[ " $GPU_CHECK_STEPS " == *" $1 "* ]]; }

step() {   # step NAME COMMAND...: run (under a timeout), log to OUTDIR/NAME.log, remember failures
  local name=$1; shift
  selected "$name" || return 0
  echo "=== $name: $*"
  local t0=$SECONDS
  if timeout --kill-after=10 "${GPU_CHECK_STEP_TIMEOUT:-300}" bash -c '"$@"' _ "$@" 2>&1 | tee "$OUTDIR/$name.log"
  then :; else FAILED+=("$name"); fi
  echo "=== $name: $((SECONDS - t0)) s"
}

card() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.memory --format=csv || true
  python3 - <<'EOF'
import torch, triton
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__}, triton {triton.__version__}, {p.name}, {p.multi_processor_count} SMs, "
      f"{p.total_memory / 2**30:.1f} GiB")
n = 1 << 30
a = torch.empty(n, dtype=torch.uint8, device="cuda"); b = torch.empty_like(a)
for _ in range(3):
    b.copy_(a)
torch.cuda.synchronize()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(10):
    b.copy_(a)
end.record(); torch.cuda.synchronize()
s = start.elapsed_time(end) / 1e3 / 10
print(f"device-to-device copy: {2 * n / s / 1e9:.0f} GB/s (read + write)")
EOF
}

models() {   # real models when pulled, else random-weight stand-ins of the same shapes
  mkdir -p "$OUTDIR/models"
  python3 - "$OUTDIR/models" <<'EOF'
import sys
from pathlib import Path
sys.path.insert(0, "scripts")
import make_model
from hybridrt.files.registry import model_path
out = Path(sys.argv[1])
shapes = {
    "smollm2-135m": ("llama", "q8_0", dict(n_embd=576, n_layer=30, n_ff=1536, n_head=9, n_head_kv=3,
                                            head_dim=64, n_rot=64, n_vocab=49152)),
    "gemma3-270m": ("gemma3", "q4_k_m", dict(n_embd=640, n_layer=18, n_ff=2048, n_head=4, n_head_kv=1,
                                             head_dim=256, n_rot=256, n_vocab=65536)),
}
for name, (arch, mix, dims) in shapes.items():
    real = model_path(name)
    path = real if real.exists() else out / f"{name}-shaped-random.gguf"
    if not path.exists():
        make_model.write_model(path, arch, mix=mix, seed=0, dims=dims)
    (out / f"{name}.path").write_text(str(path))
    print(name, "->", path)
q = out / "qwen35-mtp-1b-q4_k_m.gguf"
if not q.exists():
    make_model.write_model(q, "qwen35", mtp=True, mix="q4_k_m", seed=0,
                           dims=dict(n_embd=2048, n_layer=16, n_ff=6144, n_head=8, n_head_kv=2, head_dim=256,
                                     n_rot=64, ssm_head_dim=128, ssm_k_heads=8, ssm_v_heads=16, n_vocab=32768))
(out / "qwen35-mtp.path").write_text(str(q))
print("qwen35-mtp ->", q)
EOF
}

plan_bench() {   # plan_bench NAME EXTRA...: bench at three budgets, all / about half / none of the FFN
  local name=$1; shift
  local model; model=$(cat "$OUTDIR/models/$name.path")
  for frac in 1.0 0.5 0.0; do
    local vram
    vram=$(python3 scripts/gpu_check_budget.py "$model" "$frac" "$@") || return 1
    echo "--- $name, FFN fraction $frac: --vram $vram"
    hybridrt_cli bench -m "$model" --device "$DEVICE" --vram "$vram" -p 128 -n 64 -r 3 --json "$@" \
      > "$OUTDIR/bench-$name-$frac.json" || return 1
    python3 - "$OUTDIR/bench-$name-$frac.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
p = d.get("placement") or {}
pp = f"pp {d['pp_tps']:.0f} t/s, " if "pp_tps" in d else ""
print(f"  {pp}measured {d['measured_tps']:.1f} t/s, predicted {d['predicted_tps'] or 0:.1f} t/s "
      f"({d['prediction']}); FFN on GPU {len(p.get('ffn_gpu_layers', []))}, on CPU {len(p.get('ffn_cpu_layers', []))}")
EOF
  done
}

jit_bench() {   # jit_bench NAME: all of the FFN on the GPU, HYBRIDRT_DIRECT_LAUNCH=0
  local model; model=$(cat "$OUTDIR/models/$1.path")
  local vram; vram=$(python3 scripts/gpu_check_budget.py "$model" 1.0) || return 1
  HYBRIDRT_DIRECT_LAUNCH=0 hybridrt_cli bench -m "$model" --device "$DEVICE" --vram "$vram" -p 128 -n 64 -r 3 --json \
    > "$OUTDIR/bench-$1-1.0-jit.json" || return 1
  python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print(f\"  JIT launches only: pp {d['pp_tps']:.0f} t/s, decode {d['measured_tps']:.1f} t/s\")" \
    "$OUTDIR/bench-$1-1.0-jit.json"
}

traced_run() {   # SmolLM2 with half its FFN on the GPU, one traced run
  local model; model=$(cat "$OUTDIR/models/smollm2-135m.path")
  local vram; vram=$(python3 scripts/gpu_check_budget.py "$model" 0.5) || return 1
  hybridrt_cli run -m "$model" --device "$DEVICE" --vram "$vram" -p "The capital of France is" -n 32 --temp 0 \
    --trace "$OUTDIR/trace-smollm2.json"
}

eager_bench() {   # eager_bench NAME FRACTION: the plan with CUDA graphs off (the graphs' A/B)
  local model; model=$(cat "$OUTDIR/models/$1.path")
  local vram; vram=$(python3 scripts/gpu_check_budget.py "$model" "$2") || return 1
  HYBRIDRT_CUDA_GRAPHS=0 hybridrt_cli bench -m "$model" --device "$DEVICE" --vram "$vram" -p 128 -n 64 -r 3 --json \
    > "$OUTDIR/bench-$1-$2-eager.json" || return 1
  python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print(f\"  graphs off: pp {d['pp_tps']:.0f} t/s, decode {d['measured_tps']:.1f} t/s (predicted {d['predicted_tps'] or 0:.1f})\")" \
    "$OUTDIR/bench-$1-$2-eager.json"
}

mission_file() {   # the full-size 27B, written on this machine (nothing of its size can travel)
  mkdir -p "$OUTDIR/models"
  [ -s "$MISSION" ] || python3 scripts/make_model.py --preset qwen3.6-27b-mtp $MISSION_LAYERS --out "$MISSION"
  ls -l "$MISSION"
}

mission_bench() {   # the 27B at --vram 12GiB: pp and decode measured vs predicted, then speculative (forced accept)
  local common=(-m "$MISSION" --device "$DEVICE" --vram 12GiB -c "$MISSION_CTX" -n "$MISSION_N" -r 1 --json)
  hybridrt_cli bench "${common[@]}" -p "$MISSION_PP" > "$OUTDIR/bench-27b.json" || return 1
  hybridrt_cli bench "${common[@]}" --spec-type draft-mtp --spec-draft-n-max 3 --spec-force accept --no-adaptive \
    > "$OUTDIR/bench-27b-spec.json" || return 1
  python3 - "$OUTDIR/bench-27b.json" "$OUTDIR/bench-27b-spec.json" <<'EOF'
import json, sys
plain, spec = (json.load(open(p)) for p in sys.argv[1:])
p = plain.get("placement") or {}
print(f"  27B: pp {plain['pp_tps']:.1f} t/s, decode {plain['measured_tps']:.2f} t/s, predicted {plain['predicted_tps'] or 0:.2f} "
      f"({plain['prediction']}); FFN on GPU {len(p.get('ffn_gpu_layers', []))}, on CPU {len(p.get('ffn_cpu_layers', []))}")
print(f"  27B speculative, N = 3, drafts forced right: {spec['spec_tps']:.2f} t/s against plain {spec['plain_tps']:.2f}, "
      f"predicted {spec['predicted_tps'] or 0:.2f} ({spec['prediction']})")
EOF
}

mission_tk() {   # t(k) for k = 1..8 and speculation at forced acceptance 0.8 (bench_mission's)
  python3 scripts/bench_mission.py "$MISSION" --no-llamacpp --device "$DEVICE" --vram 12GiB -c "$MISSION_CTX" \
    --sections tk,spec --k-max 8 --spec-n 3 --spec-accept 0.8 --reps 1 -n "$MISSION_N"
}

mission_trace() {   # one traced 27B run: where a step's time goes
  hybridrt_cli run -m "$MISSION" --device "$DEVICE" --vram 12GiB -c "$MISSION_CTX" -p "The capital of France is" -n 8 \
    --temp 0 --trace "$OUTDIR/trace-27b.json" && python3 scripts/trace_summary.py "$OUTDIR/trace-27b.json"
}

export -f hybridrt_cli card models plan_bench jit_bench traced_run eager_bench mission_file mission_bench mission_tk \
  mission_trace

# the 27B takes a minute or two of disk: written from the start, while everything before it runs
MISSION_PID=
if selected mission_bench || selected mission_tk || selected mission_trace; then
  mission_file > "$OUTDIR/mission_file.log" 2>&1 &
  MISSION_PID=$!
fi
# the stand-in files take about a minute of CPU: written while the card and the tests run
MODELS_PID=
if selected models || selected plan_smollm2 || selected plan_gemma3 || selected plan_qwen35_mtp \
    || selected plan_smollm2_jit || selected trace; then
  models > "$OUTDIR/models.log" 2>&1 &
  MODELS_PID=$!
fi
if [ "$DEVICE" = cuda ]; then
  step card card
  # the files that hold cuda tests (collecting every test file would need the server's extras too)
  step cuda_tests python3 -m pytest -q -p no:cacheprovider -m cuda $(grep -l "mark.cuda" tests/test_*.py)
fi
if [ -n "$MODELS_PID" ]; then
  echo "=== models"
  wait "$MODELS_PID" || FAILED+=("models")
  cat "$OUTDIR/models.log"
fi
step plan_smollm2 plan_bench smollm2-135m
step plan_smollm2_eager eager_bench smollm2-135m 1.0
step plan_smollm2_half_eager eager_bench smollm2-135m 0.5
if [ -n "$MISSION_PID" ]; then
  echo "=== mission_file"
  wait "$MISSION_PID" || FAILED+=("mission_file")
  cat "$OUTDIR/mission_file.log"
fi
step mission_bench mission_bench
step mission_tk mission_tk
step mission_trace mission_trace
step plan_gemma3 plan_bench gemma3-270m
step plan_qwen35_mtp plan_bench qwen35-mtp --spec-type draft-mtp --spec-draft-n-max 3
# SmolLM2 all on the GPU again with the direct launcher off: its share of a decode step
step plan_smollm2_jit jit_bench smollm2-135m
step trace traced_run
step trace_summary python3 scripts/trace_summary.py "$OUTDIR/trace-smollm2.json"
if [ "$DEVICE" != cuda ]; then
  step bench_gpu_kernels_sweep_dry python3 scripts/bench_gpu_kernels.py --dry-run --sweep --ks 1,4 --write-table "$OUTDIR"
  if [ ${#FAILED[@]} -eq 0 ]; then echo "gpu_check (dry run): every step passed"; exit 0; fi
  echo "gpu_check (dry run): FAILED steps: ${FAILED[*]}"; exit 1
fi
step bench_gpu_launch python3 scripts/bench_gpu_launch.py
# the same with every launch through Triton's JIT (the direct launcher off), for its A/B
step bench_gpu_launch_jit env HYBRIDRT_DIRECT_LAUNCH=0 python3 scripts/bench_gpu_launch.py
step bench_gpu_kernels python3 scripts/bench_gpu_kernels.py
step bench_gpu_delta_net python3 scripts/bench_gpu_delta_net.py
# every launch variant per (type, shape class, k), checked against float64 and across k; the winners
# as $OUTDIR/<card>.json, to commit into gpu_kernels/matvec_tables/ once reviewed (no new matrix
# after 75 s; the timeout is the hard stop)
step bench_gpu_kernels_sweep timeout --kill-after=10 150 python3 scripts/bench_gpu_kernels.py --sweep --ks 1,4,16 \
  --max-seconds 75 --write-table "$OUTDIR"

if [ ${#FAILED[@]} -eq 0 ]; then
  echo "gpu_check: every step passed; logs in $OUTDIR"
else
  echo "gpu_check: FAILED steps: ${FAILED[*]}; logs in $OUTDIR"
  exit 1
fi
