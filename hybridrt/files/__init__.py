"""Reading model files without torch: GGUF (`gguf_file.py`), the tokenizer and chat template the file
carries, `model_info.py` (what `hybridrt info` prints), `model_profile.py` (the shapes the planner
prices) and `registry.py` (known model names and `hybridrt pull`). `hybridrt info` and `plan` import
only this package and placement/."""
