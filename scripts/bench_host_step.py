"""Host time per placed decode step, eager and graph replay: what the code costs before a GPU sees it.

    python scripts/bench_host_step.py [--steps 40] [--json]

A placed decode step on a GPU is bound by the host: each of a layer's ~19 launches costs it ~25 us
(BENCHMARKS.md, "GPU check"). This script measures that host work with no GPU: the stand-ins of
SmolLM2 (llama, 30 layers), Gemma 3 (18 layers) and Qwen3.6-27B (qwen35, 64 layers: 48 GDN, 16
attention, an MTP block) keep their depth and layer structure but have tiny widths (n_embd 256,
n_ff 512, Q4_K_M), so each device operator costs its dispatch and almost no arithmetic. Each runs a
plan with the CPU standing in for the device, about half the FFN layers "on the device" and the rest
crossing to the CPU worker (HostFFN), as the 12 GB case does.

- eager: a decode step as it runs today without graphs (every device operator dispatched from
  Python, each crossing's copies and CPU FFN);
- graph replay: the step as the executor replays captured segments (runtime/step_graphs.py) with
  every segment's launch stubbed (a CUDA graph launch is one driver call per segment, ~5 us, listed
  as a count): what remains is the host's own work: filling the static buffers, the model's
  bookkeeping, the host jobs (the crossings' tiny CPU FFNs and the embedding gather) and their waits.

Torch operators on the CPU dispatch faster than Triton launches on a GPU host, so the eager figure
here is below a GPU host's; the ratio is the point. Run it on a quiet machine: the figures are
tens of microseconds per layer.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_model  # noqa: E402
from gpu_check_budget import fraction_budget  # noqa: E402

STAND_INS = {   # name -> (arch, mtp, layer count): the real models' depth and structure, tiny widths
    "smollm2-135m": ("llama", False, 30),
    "gemma3-270m": ("gemma3", False, 18),
    "qwen3.6-27b": ("qwen35", True, 64),
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def step_times(session, n: int, token: int = 7) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        session.eval([token], logits="none")
        times.append(time.perf_counter() - t0)
    return times


def measure(name: str, path: Path, steps: int) -> dict:
    import dataclasses

    from hybridrt.runtime.loader import load_model
    from hybridrt.runtime.place import PlacementRequest
    from hybridrt.runtime.step_graphs import HostJob, Wait

    base = PlacementRequest(n_ctx=steps * 3 + 64, cache_type_k="f32", cache_type_v="f32", spec_type="none")
    m = load_model(path, threads=1, placement=dataclasses.replace(base, vram_bytes=fraction_budget(path, 0.5, base)))
    plan = m.plan
    row = {"model": name, "layers": m.n_layer, "ffn_device_layers": len(plan.ffn_gpu_layers),
           "ffn_cpu_layers": len(plan.ffn_cpu_layers) + (plan.ffn_split is not None)}
    s = m.session(base.n_ctx, "f32", k_max=1)
    s.eval([1, 2, 3], logits="none")
    step_times(s, 5)                                    # warm every kernel
    row["eager_us"] = statistics.median(step_times(s, steps)) * 1e6

    m.executor.graphs = "record"
    g = m.session(base.n_ctx, "f32", k_max=1)
    g.eval([1, 2, 3], logits="none")
    step_times(g, 2)                                    # the first step of k = 1 eager, the second captured
    graph = m.executor._step_graphs[id(g.state)][1]
    segments = [p for p in graph.pieces if not isinstance(p, (HostJob, Wait))]
    for seg in segments:
        seg.replay = lambda: None                       # the launch stubbed: the host's own work remains
    row["graph_host_us"] = statistics.median(step_times(g, steps)) * 1e6
    row["segments"] = len(segments)
    row["host_jobs"] = sum(isinstance(p, HostJob) for p in graph.pieces)
    row["ratio"] = row["graph_host_us"] / row["eager_us"]
    m.executor.close()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps per path (the median is reported)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON on stdout")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (arch, mtp, layers) in STAND_INS.items():
            path = Path(tmp) / f"{name}.gguf"
            log(f"{name}: writing a {layers}-layer {arch} stand-in")
            make_model.write_model(path, arch, mtp=mtp, mix="q4_k_m", seed=0, dims={"n_layer": layers})
            rows.append(measure(name, path, args.steps))
            r = rows[-1]
            log(f"  eager {r['eager_us']:.0f} us/step, graph replay {r['graph_host_us']:.0f} us/step "
                f"({r['ratio']:.2f}x) + {r['segments']} segment launches; "
                f"FFN {r['ffn_device_layers']} device / {r['ffn_cpu_layers']} CPU")
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'model':14} {'layers':>6} {'eager us':>9} {'graph us':>9} {'ratio':>6} {'segments':>8} {'host jobs':>9}")
        for r in rows:
            print(f"{r['model']:14} {r['layers']:6d} {r['eager_us']:9.0f} {r['graph_host_us']:9.0f} "
                  f"{r['ratio']:6.2f} {r['segments']:8d} {r['host_jobs']:9d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
