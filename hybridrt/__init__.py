"""hybridrt: GGUF models split across GPU and CPU, with exact speculative decoding.

`from hybridrt import load_model` — imported lazily so that `hybridrt info` and `hybridrt plan`
start without loading torch.
"""
__version__ = "0.1.0"


def __getattr__(name):
    if name == "load_model":
        from .loader import load_model

        return load_model
    raise AttributeError(name)
