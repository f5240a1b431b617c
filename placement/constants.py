"""Facts the planner and the runtime must agree on, stated once. They live in the planner's package
because it imports neither torch nor the runtime (a plan of a 27B model runs on a laptop); the runtime
imports them from here, so a value the plan reserves memory for is the value the runtime runs with.
"""
from __future__ import annotations

# `--spec-type` values (llama.cpp's source names). A comma-separated list mixes a lookup with a model
# source (hybridrt.decoding.speculative.draft_chain); the planner sizes a plan for its model source.
SPEC_TYPES = ("none", "draft-mtp", "draft-simple", "ngram-simple")
MODEL_TYPES = ("draft-mtp", "draft-simple")     # at most one per chain; the others are lookups, tried first

# Prompt tokens per forward (llama.cpp's n_ubatch): bounds the attention scratch of a long prompt,
# and the plan holds one chunk's activations on the device at once.
PROMPT_CHUNK = 512

# The smallest prompt batch that takes CPU FFN layers' weights to the device (op offload): above the
# largest verify batch (32 tokens at --spec-draft-n-max 31), so a verify keeps the CPU kernels' bits,
# which a token's single steps have (llama.cpp takes 32).
OP_OFFLOAD_MIN_BATCH = 64

# KV cache element types: (elements per block, bytes per block). q8_0 is ggml's: 32 int8 + an f16
# scale. The float types are stored as the torch dtype of the same name (hybridrt.runtime.kv_cache).
CACHE_TYPES: dict[str, tuple[int, int]] = {"f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34)}

# Weights a device matrix dequantizes at a time for a prompt GEMM (gpu_kernels.qlinear): 8 MiB in
# float16, ~820 rows of a 5120-wide matrix: enough to keep a GPU busy, small enough that the plan's
# budget, which reserves one tile and its float32 working copy, barely notices it.
DEQUANT_TILE_ELEMS = 1 << 22
