"""Pure VRAM planning: a model's tensor table and options in, a `Plan` (devices, report, speed) out.
No torch and no hybridrt imports: it can plan a 27B model on a laptop."""
from .bandwidth import DEFAULT_GPU_BW, gpu_peak_bandwidth, measure_cpu_bandwidth
from .constants import CACHE_TYPES, OP_OFFLOAD_MIN_BATCH, PROMPT_CHUNK, SPEC_TYPES
from .options import GiB, MiB, PlanOptions
from .plan import Line, Plan, PlanError, layer_ranges, plan, scratch_bytes, split_granule
from .profile import (ROLES, AttentionShape, GDNShape, LayerProfile, ModelProfile, TensorEntry,
                      cache_row_bytes)
from .speed import FfnSplit, SpeedEstimate, expected_tokens_per_step

__all__ = [
    "AttentionShape", "CACHE_TYPES", "DEFAULT_GPU_BW", "FfnSplit", "GDNShape", "GiB", "LayerProfile", "Line", "MiB",
    "ModelProfile", "OP_OFFLOAD_MIN_BATCH", "PROMPT_CHUNK", "Plan", "PlanError", "PlanOptions", "ROLES", "SPEC_TYPES",
    "SpeedEstimate", "TensorEntry", "cache_row_bytes", "expected_tokens_per_step", "gpu_peak_bandwidth",
    "layer_ranges", "measure_cpu_bandwidth", "plan", "scratch_bytes", "split_granule",
]
