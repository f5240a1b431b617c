"""`--spec-type` values: llama.cpp's source names, or a comma-separated list that mixes a lookup with
a model source (draft_chain.py). Torch-free, so `plan` reads them without loading the runtime."""
from __future__ import annotations

from placement.constants import MODEL_TYPES, SPEC_TYPES

from ...errors import UserError


def spec_type_parts(spec_type: str) -> tuple[str, ...]:
    """The sources a --spec-type names, in the order a chain asks them (lookups, then the model
    source); a UserError for an unknown name, a repeat, two model sources or "none" in a list."""
    parts = tuple(p.strip() for p in spec_type.split(","))
    for p in parts:
        if p not in SPEC_TYPES:
            raise UserError(f"unknown --spec-type '{p}' (one of: {', '.join(SPEC_TYPES)}; "
                            "or a comma-separated list such as ngram-simple,draft-mtp)")
    if len(parts) > 1:
        if "none" in parts or len(set(parts)) < len(parts) or sum(p in MODEL_TYPES for p in parts) > 1:
            raise UserError(f"--spec-type '{spec_type}': a list names each source once, at most one of "
                            f"{', '.join(MODEL_TYPES)}, and not none")
    return tuple(sorted(parts, key=lambda p: p in MODEL_TYPES))


def model_spec_type(spec_type: str) -> str:
    """The part of a --spec-type that sizes a plan and a session: its model source if it has one
    (that source's KV and verify batches), else the lookup (or none)."""
    parts = spec_type_parts(spec_type)
    return next((p for p in parts if p in MODEL_TYPES), parts[0])
