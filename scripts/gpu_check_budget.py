"""A --vram budget that puts a fraction of a model's FFN bytes on the GPU (after everything the
plan reserves first, and below 1.0 the prompt staging of op offload: the largest FFN layer), for
scripts/gpu_check.sh:  python scripts/gpu_check_budget.py MODEL FRACTION
[--spec-type T --spec-draft-n-max N]. Prints the budget in bytes."""
from __future__ import annotations

import argparse
import dataclasses

from hybridrt.files.model_profile import load_profile
from hybridrt.runtime.place import PlacementRequest, plan_for


def fraction_budget(model: str, fraction: float, request: PlacementRequest) -> int:
    """The budget for `request`'s configuration (its vram_bytes ignored) that puts `fraction` of
    the FFN bytes on the GPU."""
    roomy = plan_for(str(model), dataclasses.replace(request, vram_bytes=1 << 50), "cpu")
    fixed = sum(line.gpu_bytes for line in roomy.lines if line.stage < 4)
    ffn = roomy.line("ffn").gpu_bytes + roomy.line("ffn").cpu_bytes
    profile = load_profile(str(model))       # the staging the planner reserves for dense layers
    staging = max(profile.ffn_layer_bytes().values()) if fraction < 1.0 and not profile.n_expert else 0
    return int(fixed + staging + fraction * ffn) + (1 << 20) * (fraction == 1.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("fraction", type=float)
    ap.add_argument("--spec-type", default="none")
    ap.add_argument("--spec-draft-n-max", type=int, default=3)
    args, _ = ap.parse_known_args()
    request = PlacementRequest(spec_type=args.spec_type, spec_draft_n_max=args.spec_draft_n_max)
    print(fraction_budget(args.model, args.fraction, request))


if __name__ == "__main__":
    main()
