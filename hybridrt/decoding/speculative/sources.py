"""`--spec-type` names to draft sources (llama.cpp's names). A comma-separated list mixes a lookup
with a model source (draft_chain.py), tried in llama.cpp's order of preference: lookup first."""
from __future__ import annotations

from ...errors import UserError
from ...models.base import Model
from ..sampling import SamplerConfig, make_generator
from ...runtime.session import Session
from .draft import DraftPicker, DraftSource
from .draft_chain import DraftChain
from .draft_model import DraftModelSource, check_same_vocab
from .draft_mtp import MTPSource
from .draft_ngram import NgramSource
from .loop import SpecConfig
from .spec_types import spec_type_parts


def default_spec_type(model: Model) -> str:
    return "draft-mtp" if model.mtp is not None else "none"


def build_source(spec_type: str, session: Session, sampler: SamplerConfig, spec: SpecConfig,
                 draft_model: Model | None = None, ngram_n_max: int = 4, ngram_n_min: int = 2,
                 cache_type: str = "f32", draft_vocab: int = 0) -> DraftSource | None:
    """A fresh source for one generation on `session` (None for "none"). draft_vocab: the number
    of tokens the built-in MTP head drafts among (0: all of them; draft_vocab.py)."""
    parts = spec_type_parts(spec_type)
    if draft_vocab and "draft-mtp" not in parts:
        raise UserError(f"--spec-draft-vocab drafts with the model's MTP head: it needs --spec-type draft-mtp, "
                        f"not {spec_type}")
    if len(parts) > 1:
        if draft_model is not None and "draft-simple" not in parts:
            raise UserError(f"-md/--model-draft needs draft-simple in --spec-type, not {spec_type}")
        return DraftChain([build_source(p, session, sampler, spec, draft_model if p == "draft-simple" else None,
                                        ngram_n_max, ngram_n_min, cache_type, draft_vocab if p == "draft-mtp" else 0)
                           for p in parts])
    if spec_type != "draft-simple" and draft_model is not None:
        raise UserError(f"-md/--model-draft needs --spec-type draft-simple, not {spec_type}")
    if spec_type == "none":
        return None
    if spec_type == "ngram-simple":
        return NgramSource(ngram_n_max, ngram_n_min)
    # drafts are sampled with their own stream so the target's draws do not depend on the source
    picker = DraftPicker(sampler, make_generator(sampler.seed + 1 if sampler.seed >= 0 else -1), spec.p_min)
    if spec_type == "draft-mtp":
        return MTPSource(session, picker, draft_vocab)
    if draft_model is None:
        raise UserError("--spec-type draft-simple needs a draft model: -md DRAFT.gguf")
    check_same_vocab(session.model, draft_model)
    return DraftModelSource(draft_model, session.n_ctx, picker, spec.k_max, cache_type)
