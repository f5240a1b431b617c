"""The runtime: what turns a GGUF file and a plan into forward passes. `loader.py` opens the file,
resolves the plan and builds the model; `session.py` holds one sequence's caches and its single `eval`
entry point; `executor.py` owns the step (which device runs what, overlap, streams); `backends/` holds
the linear / FFN / fused-layer implementations the binder picks by its rule table; `kv_cache.py` and
`snapshot_ring.py` hold the state a verify batch may roll back; `place.py` maps a plan onto tensors;
`config.py` is the one frozen RuntimeConfig (execution mode and numerics) the loader resolves from
flags and the environment; `thread_governor.py`, `trace.py` and `warmup.py` are the runtime's
services."""
