#!/usr/bin/env python3
"""Variants of `train-mtp`'s training steps on a text it already wrote: held-out acceptance per variant.

Reads the text and hiddens a `train-mtp` run cached next to its head (HEAD.gguf.data.pt), builds the
head as train-mtp does (hybridrt.train_mtp.train), and trains it for --steps with one thing changed:
the loss (KL to the target's logits over the draft vocabulary, or cross-entropy to their argmax),
an EAGLE-style regression of the target's next final-normed hidden added to it (--reg, smooth L1),
the draft vocabulary's size, the head's FFN width (--head-ffn-layers), the learning rate, the
batch, noise on the hidden it reads (--noise, EAGLE-1's), weight decay, gradient clipping (--clip,
train-mtp's by default), the target's residuals after some layers as further inputs
(--aux-layers, EAGLE-3's low and middle features), the target layer the block starts from
(--init-layer), a pull toward the starting weights (--anchor, L2-SP) or parameters left at their
start (--freeze). Prints the
held-out acceptance (per position, and as a run at --spec-draft-n-max 1 meets it) every --eval
steps, and how much of the held-out argmax tokens the draft vocabulary covers.
Evaluations do not stop the run early, and the batches are train-mtp's own at --seed 0
(train.step_batch) for every variant, so variants differ only in what was changed.

    python3 scripts/ablate_mtp_head.py -m smollm2-135m --data ~/.cache/hybridrt/heads/smollm2-135m.v4.mtp.gguf.data.pt \\
        --steps 600 --loss argmax
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_kernels.norms import rms_norm  # noqa: E402
from hybridrt.runtime.loader import load_model  # noqa: E402
from hybridrt.models.mtp_head import head_target  # noqa: E402
from hybridrt.train_mtp import train as T  # noqa: E402
from hybridrt.train_mtp.config import LOSSES, TrainConfig  # noqa: E402
from hybridrt.train_mtp.torch_model import MTPHeadModule, TorchTeacher, initial_head_tensors, visible  # noqa: E402


def coverage(heldout, ids: torch.Tensor | None, n_vocab: int) -> float:
    """Share of the held-out positions whose target argmax is in the draft vocabulary."""
    if ids is None:
        return 1.0
    inside = torch.zeros(n_vocab, dtype=torch.bool)
    inside[ids] = True
    hits = sum(int(inside[s.argmax[s.n_prompt:]].sum()) for s in heldout)
    return hits / max(1, sum(len(s.tokens) - s.n_prompt for s in heldout))


@torch.no_grad()
def residuals(teacher: TorchTeacher, tokens: torch.Tensor, layers: list[int]) -> list[torch.Tensor]:
    """The target's residual stream leaving each of `layers` (0-based) at every position of one
    sequence, from the torch teacher (its matrices' dtype, as the training text's hiddens)."""
    ids, n = tokens[None], len(tokens)
    pos, valid = torch.arange(n)[None], torch.ones(1, n, dtype=torch.bool)
    h = F.embedding(ids, teacher.embed_rows) * teacher.embed_scale
    out = {}
    for i, block in enumerate(teacher.blocks[:max(layers) + 1]):
        h = block(h, teacher.rotary[block.spec.rope].rows(pos), visible(pos, pos, valid, block.spec.window))
        out[i] = h[0]
    return [out[i] for i in layers]


class AuxHead(nn.Module):
    """train-mtp's head that also reads the target's residuals after a few layers: each RMS-normed
    with its own weight and projected by aux_proj into the block's input, beside eh_proj's. The
    hidden it is given is [final-normed hidden | residual 1 | ...]; aux_proj starts at zero, so the
    head starts as train-mtp's."""

    def __init__(self, base: MTPHeadModule, n_aux: int, d: int):
        super().__init__()
        self.base, self.d = base, d
        self.head = base.head       # the draft rows, as heldout_acceptance and the loss read them
        self.aux_norm = nn.Parameter(torch.ones(n_aux, d))
        self.aux_proj = nn.Parameter(torch.zeros(d, n_aux * d))

    def features(self, emb, hidden, pos, k_valid):
        b, d = self.base, self.d
        x = torch.cat((rms_norm(emb, b.enorm, b.eps), rms_norm(hidden[..., :d], b.hnorm, b.eps)), -1) @ b.eh_proj.T
        aux = rms_norm(hidden[..., d:].unflatten(-1, (-1, d)), self.aux_norm, b.eps).flatten(-2)
        x = b.block(x + aux @ self.aux_proj.T, b.rotary.rows(pos), visible(pos, pos, k_valid, 0))
        return rms_norm(x, b.head_norm, b.eps)

    def forward(self, emb, hidden, pos, k_valid):
        return self.features(emb, hidden, pos, k_valid) @ self.head.T


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def start_block(model, head: MTPHeadModule, layer: int, tokens: list[int], draft_ids: torch.Tensor | None) -> None:
    """The block's tensors and eh_proj as initial_head_tensors makes them from target layer `layer`
    (at that layer's residual scale) instead of the last full-attention layer; same shapes: a
    target whose layers all have one attention spec."""
    start = initial_head_tensors(model, draft_ids, head_target(model.arch), T.residual_scale(model, tokens, layer),
                                 layer=layer)
    for name in head.block.w:
        head.block.w[name].data.copy_(start[name])
    head.eh_proj.data.copy_(start["eh_proj"])


def freeze(head: MTPHeadModule, names: list[str]) -> None:
    groups = {"attn": ("attn_",), "ffn": ("ffn_",)}
    for name, p in head.named_parameters():
        short = name.rsplit(".", 1)[-1]
        for want in names:
            if (short == want or (want == "norms" and "norm" in short)
                    or any(short.startswith(g) and "norm" not in short for g in groups.get(want, ()))):
                p.requires_grad_(False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--data", required=True, help="a train-mtp text cache (HEAD.gguf.data.pt)")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--loss", choices=LOSSES, default="kl")
    ap.add_argument("--reg", type=float, default=0.0, help="weight of the next-hidden regression (0: none)")
    ap.add_argument("--draft-vocab", type=int, default=TrainConfig.draft_vocab)
    ap.add_argument("--lr", type=float, default=TrainConfig.lr)
    ap.add_argument("--batch", type=int, default=TrainConfig.batch)
    ap.add_argument("--head-ffn-layers", type=int, default=TrainConfig.head_ffn_layers,
                    help="the head's FFN as the target's last N layers' FFNs side by side")
    ap.add_argument("--noise", type=float, default=0.0,
                    help="uniform noise of this share of its RMS on the hidden the head reads while training")
    ap.add_argument("--weight-decay", type=float, default=0.0, help="AdamW's (train-mtp: 0)")
    ap.add_argument("--clip", type=float, default=TrainConfig.clip, help="gradient norm clipping (0: none)")
    ap.add_argument("--aux-layers", default="",
                    help="comma-separated target layers (0-based) whose residual outputs the head also reads")
    ap.add_argument("--init-layer", type=int, help="start the block from this target layer (default: train-mtp's, "
                    "the last full-attention layer), at that layer's residual scale")
    ap.add_argument("--anchor", type=float, default=0.0,
                    help="weight of an L2 pull of every parameter toward its starting value (L2-SP; 0: none)")
    ap.add_argument("--freeze", default="", help="comma-separated parameters left at their start: block tensor "
                    "names (attn_q, ffn_up, ...), or attn / ffn for all of a half, eh_proj, head, norms")
    ap.add_argument("--eval", type=int, default=100, help="steps between held-out evaluations")
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()

    m = load_model(args.model, threads=args.threads)
    torch.set_num_threads(args.threads)         # after loading, which leaves torch one thread beside Numba's
    if args.init_layer is not None and not 0 <= args.init_layer < len(m.layers):
        fail(f"--init-layer must be a layer of the target, 0 .. {len(m.layers) - 1}")
    if not Path(args.data).is_file():
        fail(f"no train-mtp text cache at {args.data}")
    data = torch.load(args.data, weights_only=False)
    train, heldout = data["train"], data["heldout"]
    cfg = TrainConfig(steps=args.steps, draft_vocab=args.draft_vocab, loss=args.loss, lr=args.lr, batch=args.batch,
                      head_ffn_layers=args.head_ffn_layers, clip=args.clip)
    torch.manual_seed(cfg.seed)
    head, ids, w_draft, _ = T.new_head(m, train, cfg)
    if args.init_layer is not None:
        start_block(m, head, args.init_layer, train[0].tokens.tolist(), ids)
    freeze(head, [x for x in args.freeze.split(",") if x])
    aux = [int(x) for x in args.aux_layers.split(",") if x]
    if aux:
        teacher = TorchTeacher(m, head_target(m.arch), T.MAX_SEQ, dtype=torch.bfloat16 if T.BF16 else torch.float32)
        for s in train + heldout:
            s.hidden = torch.cat([s.hidden] + [r.float() for r in residuals(teacher, s.tokens, aux)], -1)
        del teacher
        head = AuxHead(head, len(aux), m.n_embd)
    print(json.dumps({"variant": vars(args), "train_tokens": sum(len(s.tokens) - s.n_prompt for s in train),
                      "heldout_coverage": round(coverage(heldout, ids, m.n_vocab), 4)}), flush=True)
    start = {n: p.detach().clone() for n, p in head.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=cfg.lr,
                            weight_decay=args.weight_decay)
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = T.lr_at(step, cfg)
        emb, h_in, h_tgt, pos, valid = T.step_batch(m, train, cfg, step)
        h_tgt = h_tgt[..., :m.n_embd]          # the target's logits come from its final-normed hidden
        if args.noise:          # on the final-normed hidden only
            h = h_in[..., :m.n_embd]
            h_in = torch.cat((h + (torch.rand_like(h) * 2 - 1) * args.noise * h.pow(2).mean(-1, keepdim=True).sqrt(),
                              h_in[..., m.n_embd:]), -1)
        features, logits, target = T.head_outputs(head, w_draft, (emb, h_in, h_tgt, pos, valid), T.BF16)
        loss = T.distill_loss(logits, target, cfg.loss).mean()      # at the real entries only
        if args.reg:
            loss = loss + args.reg * F.smooth_l1_loss(features.float()[valid], h_tgt[valid])
        if args.anchor:
            loss = loss + args.anchor * sum((p - start[n]).pow(2).sum() for n, p in head.named_parameters()
                                            if p.requires_grad)
        opt.zero_grad()
        loss.backward()
        T.clip_gradient(head, cfg)
        opt.step()
        if (step + 1) % args.eval == 0 or step + 1 == cfg.steps:
            acc = T.heldout_acceptance(m, head, heldout, ids)
            print(json.dumps({"step": step + 1, "loss": round(float(loss.detach()), 4),
                              "acceptance": round(acc.per_position, 4), "acceptance_n_max_1": round(acc.n_max_1, 4),
                              "s": round(time.perf_counter() - t0)}), flush=True)


if __name__ == "__main__":
    main()
