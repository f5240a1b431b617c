"""Decoding: `generate.py` is the one generation engine (prefill, the decode loop, stop rules, stats;
plain decoding is speculation without a draft source), `sampling.py` turns logits into tokens, and
`speculative/` holds the draft sources (MTP head, draft model, n-gram lookup), the verify/accept rule
and the adaptive draft length."""
