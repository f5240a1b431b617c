"""hybridrt: GGUF models split across GPU and CPU, with exact speculative decoding.

The Python API:

    from hybridrt import SamplerConfig, SpecConfig, build_source, load_model
    from hybridrt.decoding.generate import generate

    m = load_model("smollm2-135m")                      # a path or a known name
    ids = m.tokenize("The capital of France is")
    greedy = SamplerConfig(temp=0.0)
    tokens, stats = generate(m, m.session(512), ids, 16, greedy)       # plain decoding
    spec = SpecConfig(n_max=3)                          # speculative: the same loop with a draft source
    s = m.session(512, k_max=spec.k_max)                # room for a verify batch of spec.k_max tokens
    tokens, stats = generate(m, s, ids, 16, greedy, build_source("ngram-simple", s, greedy, spec), spec)

Each name is imported on first use, so that `hybridrt info` and `hybridrt plan` start without
loading torch. `generate` is imported from its module: the package's attribute of that name is the
module `hybridrt.decoding.generate` as soon as anything has imported it.
"""
__version__ = "0.1.0"

# name -> the module that defines it
_API = {
    "load_model": ".runtime.loader",
    "SamplerConfig": ".decoding.sampling",
    "SpecConfig": ".decoding.speculative.loop",
    "build_source": ".decoding.speculative.sources",
}
__all__ = list(_API)


def __getattr__(name):
    if name in _API:
        from importlib import import_module

        return getattr(import_module(_API[name], __name__), name)
    raise AttributeError(name)
