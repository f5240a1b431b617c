"""Pure VRAM planning: a model's tensor table and options in, a `Plan` (devices, report, speed) out.
No torch and no hybridrt imports: it can plan a 27B model on a laptop."""
from .bandwidth import DEFAULT_GPU_BW, gpu_peak_bandwidth, measure_cpu_bandwidth
from .plan import GiB, MiB, SPEC_TYPES, Line, Plan, PlanError, PlanOptions, layer_ranges, plan, scratch_bytes
from .profile import (CACHE_TYPES, ROLES, AttentionShape, GDNShape, LayerProfile, ModelProfile, TensorEntry,
                      cache_row_bytes)
from .speed import SpeedEstimate, expected_tokens_per_step

__all__ = [
    "AttentionShape", "CACHE_TYPES", "DEFAULT_GPU_BW", "GDNShape", "GiB", "LayerProfile", "Line", "MiB",
    "ModelProfile", "Plan", "PlanError", "PlanOptions", "ROLES", "SPEC_TYPES", "SpeedEstimate", "TensorEntry",
    "cache_row_bytes", "expected_tokens_per_step", "gpu_peak_bandwidth", "layer_ranges",
    "measure_cpu_bandwidth", "plan", "scratch_bytes",
]
