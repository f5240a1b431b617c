"""What `hybridrt train-mtp` trains with: a torch-free module, so the CLI takes its option defaults
from here without importing torch before the command runs."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError

LOSSES = ("kl", "argmax")


@dataclass(frozen=True)
class TrainConfig:
    tokens: int = 393216         # generated training tokens (Gemma 3: ~8 min of bfloat16 teacher on 2 threads)
    steps: int = 1000            # optimizer steps (early stopping may end sooner)
    draft_vocab: int = 4096      # output rows of the head (0: the full vocabulary)
    seed: int = 0
    loss: str = "kl"
    lr: float = 1.5e-3
    batch: int = 8               # sequences per step
    gen_len: int = 256           # tokens per training continuation
    heldout_len: int = 96        # tokens per held-out continuation
    eval_every: int = 50
    clip: float = 1.0            # gradient norm clipping (0: none)
    patience: int = 3            # evaluations without a better acceptance before stopping
    head_type: str = "q8_0"
    head_ffn_layers: int = 1     # the head block's FFN as the target's last N layers' FFNs side by side
    full_teacher_vocab: bool = False   # the teacher's logits over every id in every batch (not only the first)
    for_lookup: bool = False     # a head that drafts behind prompt lookup: learns only where the lookup has no match

    def __post_init__(self):
        from ..models.mtp_head import HEAD_TYPES       # the head writer's storage types (imports torch)

        if min(self.tokens, self.steps, self.batch, self.gen_len, self.eval_every, self.head_ffn_layers) < 1:
            raise UserError("train-mtp: --tokens, --steps, --batch, --gen-len, --eval-every and --head-ffn-layers "
                            "must be positive")
        if self.clip < 0:
            raise UserError("train-mtp: --clip must be >= 0 (0: no gradient clipping)")
        if self.draft_vocab < 0:
            raise UserError("train-mtp: --draft-vocab must be >= 0 (0: the full vocabulary)")
        if self.loss not in LOSSES:
            raise UserError(f"train-mtp: --loss must be one of {', '.join(LOSSES)}")
        if self.head_type not in HEAD_TYPES:
            raise UserError(f"train-mtp: --head-type must be one of {', '.join(HEAD_TYPES)}")
