"""`hybridrt train-mtp`: an MTP head for a target that has none, by self-distillation on the CPU.

1. The frozen target writes its own training text: the built-in training prompts continued at a
   mix of temperatures (batched in torch for llama / qwen3 / gemma3, with the teacher's
   final-normed hidden at every position; hybridrt's own decoding for qwen35), and hybridrt's own
   greedy continuations of the held-out prompts for evaluation.
2. hybridrt runs the target over the text that has no hiddens yet (teacher forcing) and keeps its
   final-normed hidden at every position: exactly the hidden `draft_mtp` feeds the head at run time.
3. The head learns p(t_(j+1) | h_(j-1), t_j) against the target's own distribution at j (KL to
   the target's logits restricted to the draft vocabulary, or cross-entropy to their argmax),
   evaluated by held-out greedy acceptance (head argmax == target argmax) per position, as a run at
   --spec-draft-n-max 1 meets the same hits, and behind prompt lookup (the lookup's draft where it
   has a match); the best evaluation is what gets written (--for-lookup: the best behind the lookup,
   the loss leaving out the positions the lookup covers).
Everything is a function of --seed; the text and hiddens are cached next to the output
(`HEAD.gguf.data.pt`) and the optimizer state checkpointed (`HEAD.gguf.ckpt`) at every
evaluation, so an interrupted run resumes where it stopped.
"""
from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..errors import UserError
from ..models.mtp_head import head_attention_spec, head_target, target_fingerprint, write_head
from ..decoding.sampling import SamplerConfig
from ..decoding.speculative.draft_ngram import NgramIndex
from .config import TrainConfig
from .prompts import HELDOUT_PROMPTS, TRAIN_PROMPTS, Prompt
from .torch_model import MTPHeadModule, TorchTeacher, initial_head_tensors, output_rows

# bfloat16 matmuls (teacher text, training steps) where the CPU has them natively (AVX-512 BF16 /
# AMX); emulated they would be slower than float32
BF16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
# 1: temperatures cycled per continuation; 2: text_plan (sampled prefix, then greedy); 3: the held-out
# continuations written by hybridrt's own greedy decoding; 4: the teacher's batches sized by its KV
# cache (256 sequences for the small models), which changes the sampled streams of a seed; 5: each
# distinct prompt of a batch prefilled once (its bfloat16 rounding differs from a full batch's); 6:
# decode steps' attention in cpu_kernels.attention_batch (float32 sums in its own order) over a
# float32 KV cache on every machine (the AMX Xeon's was bfloat16); 7: sampling by one uniform draw per
# sequence and step (inverse CDF), and finished sequences leaving the teacher's batch; 8: a float16 KV
# cache (as `hybridrt run`'s), decode attention in kv_attention's steps; 9: hybridrt's prompt batches
# attend in kv_attention too (the held-out text and every teacher-forced hidden); 10: the teacher's
# top-k by cpu_kernels.top_k (equal logits: lower id first, where torch.topk's order was its own); 11:
# after the first batch's first 64 steps the teacher's logits cover only the ids those ranked in a
# top-k (TorchTeacher.restrict_output; --full-teacher-vocab keeps all)
TEXT_VERSION = 11
RESTRICT_AFTER = 64
MAX_SEQ = 512                               # prompt + continuation (one hybridrt prefill chunk)


@dataclass
class Sequence:
    tokens: torch.Tensor       # [L] int64: prompt + continuation
    hidden: torch.Tensor       # [L, n_embd] the target's final-normed hidden at each position
    n_prompt: int
    argmax: torch.Tensor | None = None     # held-out: the target's argmax at each position


@dataclass(frozen=True)
class Acceptance:
    """Held-out greedy acceptance of a head's drafts (head argmax == target argmax)."""
    per_position: float        # at every generated position: what training selects on (most samples)
    n_max_1: float             # the same hits met as `run --spec-draft-n-max 1` meets them (below)
    lookup_first: float = 0.0  # per position behind prompt lookup (`--spec-type ngram-simple,draft-mtp`):
                               # the lookup's draft where it has a match, the head's elsewhere (--for-lookup selects on it)


@dataclass
class TrainResult:
    path: Path
    acceptance: float          # the best evaluation's per-position held-out acceptance
    acceptance_n_max_1: float  # the same head's acceptance as a run at --spec-draft-n-max 1 counts it
    acceptance_lookup_first: float     # per position behind prompt lookup (Acceptance.lookup_first)
    steps: int
    draft_vocab: int
    n_train_tokens: int
    wall_s: float
    cpu_s: float
    history: list


# --- 1. text ------------------------------------------------------------------------------------
def prompt_ids(model, p: Prompt) -> list[int]:
    if p.kind == "chat" and model.tokenizer.chat_template is not None:
        text = model.tokenizer.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True)
        return model.tokenize(text, add_special=True, parse_special=True)
    return model.tokenize(p.text, add_special=True)


def text_plan(n_cont: int, n_prompts: int, n_new: int, seed: int) -> tuple[list[float], list[int]]:
    """Temperature and greedy switch of each training continuation (continuation i continues
    training prompt i % n_prompts). The first round is greedy, the text drafts are measured on.
    Later rounds sample (temperature 0.6 / 0.8 / 1.0, top-k 40) for their first r tokens, r uniform
    in 1..48, then continue greedily: greedy text from states the prompts alone never lead to, so
    one prompt yields many different greedy passages; one in four samples throughout, for variety."""
    g = torch.Generator().manual_seed(seed * 31 + 7)
    temps, switch = [], []
    for i in range(n_cont):
        if i < n_prompts:
            temps.append(0.0)
            switch.append(0)
            continue
        temps.append((0.6, 0.8, 1.0)[int(torch.randint(3, (1,), generator=g))])
        r = int(torch.randint(1, 49, (1,), generator=g))
        switch.append(n_new if int(torch.randint(4, (1,), generator=g)) == 0 else r)
    return temps, switch


def write_text(model, teacher: TorchTeacher | None, prompts: list[list[int]], temps: list[float],
               greedy_after: list[int], n_new: int, seed: int, progress,
               label: str, restrict: bool = False) -> list[tuple[list[int], torch.Tensor | None]]:
    """Continuations of `prompts`, batched through the torch teacher where the architecture has one
    (with the teacher's final-normed hidden at every position; `restrict`: after the first batch's
    first RESTRICT_AFTER steps, only the logits of the ids those ranked in a top-k); else hybridrt's own
    decoding, one sequence at a time, sampling throughout (greedy_after unused; hiddens come from
    teacher forcing)."""
    stop = set(model.tokenizer.eog_ids)
    gen = torch.Generator().manual_seed(seed)
    task = progress.add_task(label, total=len(prompts), info="")
    out: list[tuple[list[int], torch.Tensor | None]] = []
    if teacher is not None:
        group = teacher.batch_size()
        for lo in range(0, len(prompts), group):
            out += teacher.generate(prompts[lo:lo + group], n_new, temps[lo:lo + group], gen, stop,
                                    greedy_after[lo:lo + group], restrict_after=RESTRICT_AFTER if restrict else None)
            progress.update(task, completed=len(out), info=f"{sum(len(c) for c, _ in out)} tokens")
        return out
    from ..decoding.generate import generate

    session = model.session(n_ctx=MAX_SEQ, k_max=1)
    for i, (ids, temp) in enumerate(zip(prompts, temps)):
        sampler = SamplerConfig(temp=temp, top_k=40, top_p=1.0, min_p=0.0, seed=seed * 7919 + i)
        tokens, stats = generate(model, session, ids, n_new, sampler, stop_ids=set())
        cut = next((j + 1 for j, t in enumerate(tokens) if t in stop), len(tokens))
        out.append((tokens[:cut], None))
        progress.update(task, completed=len(out), info=f"{sum(len(c) for c, _ in out)} tokens")
    return out


# --- 2. teacher forcing ---------------------------------------------------------------------------
def teacher_force(model, seqs: list[list[int]], n_prompt: list[int], progress, label: str,
                  with_argmax: bool = False) -> list[Sequence]:
    if not seqs:        # the torch teacher gave every hidden already: no empty 0/0 line ticking on
        return []
    session = model.session(n_ctx=MAX_SEQ, k_max=1)
    task = progress.add_task(label, total=len(seqs), info="")
    out = []
    for ids, p in zip(seqs, n_prompt):
        logits = session.eval(ids, start_pos=0, logits="all" if with_argmax else "none")
        out.append(Sequence(torch.tensor(ids), session.hidden.clone(), p,
                            torch.argmax(logits, dim=-1) if with_argmax else None))
        progress.advance(task)
    return out


def pick_draft_vocab(train: list[Sequence], n_vocab: int, size: int) -> torch.Tensor | None:
    """The `size` most frequent tokens of the target's own text (ties: lower id first), or None for
    the full vocabulary."""
    if size == 0 or size >= n_vocab:
        return None
    counts = torch.zeros(n_vocab, dtype=torch.int64)
    for s in train:
        counts.index_add_(0, s.tokens, torch.ones_like(s.tokens))
    order = sorted(range(n_vocab), key=lambda t: (-int(counts[t]), t))[:size]
    return torch.tensor(sorted(order), dtype=torch.int64)


# --- 3. training ----------------------------------------------------------------------------------
def batch_inputs(model, seqs: list[Sequence]):
    """Entries j = 1..L-1 of each sequence (token j with the hidden of j - 1), right-padded.
    Returns emb, hidden_in, hidden_target, pos, valid [b, t] (valid: a real entry)."""
    t = max(len(s.tokens) for s in seqs) - 1
    b, d = len(seqs), seqs[0].hidden.shape[1]
    tokens = torch.zeros(b, t, dtype=torch.int64)
    h_in, h_tgt = torch.zeros(b, t, d), torch.zeros(b, t, d)
    valid = torch.zeros(b, t, dtype=torch.bool)
    for i, s in enumerate(seqs):
        n = len(s.tokens) - 1
        tokens[i, :n] = s.tokens[1:]
        h_in[i, :n], h_tgt[i, :n] = s.hidden[:-1], s.hidden[1:]
        valid[i, :n] = True
    emb = model.embed(tokens.reshape(-1)).reshape(b, t, -1)      # n_embd wide (the hidden may carry more)
    pos = torch.arange(1, t + 1)[None, :].expand(b, -1)
    return emb, h_in, h_tgt, pos, valid


def new_head(model, train: list[Sequence], cfg: TrainConfig) -> tuple[MTPHeadModule, torch.Tensor | None, torch.Tensor, float]:
    """The head training starts from (initial_head_tensors), its draft vocabulary (None: the full
    one), the target's output rows of that vocabulary, and the residual scale the block starts at."""
    kind = head_target(model.arch)
    scale = residual_scale(model, train[0].tokens.tolist())
    draft_ids = pick_draft_vocab(train, model.n_vocab, cfg.draft_vocab)
    _, spec = head_attention_spec(model)
    head = MTPHeadModule(initial_head_tensors(model, draft_ids, kind, scale, cfg.head_ffn_layers), spec, kind,
                         model.eps, MAX_SEQ + 1)
    return head, draft_ids, output_rows(model, draft_ids), scale


def lookup_proposals(tokens: list[int], start: int, n_max: int = 4, n_min: int = 2) -> list[int | None]:
    """What prompt lookup (`ngram-simple`, by default as `run` sets it up) drafts after each position
    j >= start of a committed sequence: the token it proposes for j + 1, or None where it has no match."""
    index = NgramIndex(n_max, n_min)
    index.extend(tokens[:start])
    out = []
    for token in tokens[start:]:
        proposal = index.lookup(token, 1)
        out.append(proposal[0] if proposal else None)
        index.append(token)
    return out


def step_batch(model, train: list[Sequence], cfg: TrainConfig, step: int):
    """Step `step`'s batch_inputs: cfg.batch sequences drawn by (seed, step), so a resumed run
    draws what an uninterrupted one would. cfg.for_lookup: the entries where prompt lookup has a
    match are not `valid` (the loss leaves them out; attention still sees them): behind the lookup
    the head only drafts where it has none. SmolLM2 (1000 steps, the default text): 49.8-50.4 %
    per position behind the lookup in the last three evaluations against 47.7-48.7 %, the head alone
    no worse (docs/history.md, "Prompt lookup ahead of the trained heads")."""
    g = torch.Generator().manual_seed(cfg.seed * 100_003 + step)
    pick = torch.randperm(len(train), generator=g)[:cfg.batch].tolist()
    seqs = [train[i] for i in pick]
    emb, h_in, h_tgt, pos, valid = batch_inputs(model, seqs)
    if cfg.for_lookup:
        for row, s in enumerate(seqs):          # entry j - 1 drafts after position j
            matched = [p is not None for p in lookup_proposals(s.tokens.tolist(), 1)]
            valid[row, :len(matched)] &= ~torch.tensor(matched, dtype=torch.bool)
    return emb, h_in, h_tgt, pos, valid


def head_outputs(head: MTPHeadModule, w_draft: torch.Tensor, batch, bf16: bool = False):
    """(the head's final-normed features [b, t, n_embd], its draft logits and the target's logits
    over the draft vocabulary at the batch's real entries [n_valid, V]) for a batch_inputs batch.
    The output products (about a third of a step's work with the backward pass) skip the
    padding: a quarter of SmolLM2's entries, whose continuations end at different lengths. bf16: the head's matmuls
    under bfloat16 autocast (AMX / AVX-512 BF16: ~1.7x the float32 steps per minute here); the
    parameters, the loss and the optimizer stay float32."""
    emb, h_in, h_tgt, pos, valid = batch
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        features = head.features(emb, h_in, pos, torch.ones_like(valid))
        logits = features[valid] @ head.head.T
        with torch.no_grad():
            target = (h_tgt[valid] @ w_draft.T).float()
    return features, logits, target


def clip_gradient(head: torch.nn.Module, cfg: TrainConfig) -> float:
    """Scale the head's gradient to norm cfg.clip at most (0: leave it); returns its norm before."""
    return float(torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.clip or math.inf))


def loss_of(head: MTPHeadModule, w_draft: torch.Tensor, batch, loss: str, bf16: bool = False) -> torch.Tensor:
    _, logits, target = head_outputs(head, w_draft, batch, bf16)
    return distill_loss(logits, target, loss).mean()


class _KLToTarget(torch.autograd.Function):
    """KL(softmax(target) || softmax(logits)) per row, with its gradient softmax(logits) - p written
    by hand: autograd's graph of the same expression made ~10 passes over [entries x V] tensors
    (Gemma 3: 2,400 x 4,096 a step), 102 ms of a ~540 ms step against 68 here."""

    @staticmethod
    def forward(ctx, logits, target):
        logq = torch.log_softmax(logits, dim=-1)
        logp = torch.log_softmax(target, dim=-1)
        p = logp.exp()
        ctx.save_for_backward(logq, p)
        return logp.sub_(logq).mul_(p).sum(-1)

    @staticmethod
    def backward(ctx, grad):
        logq, p = ctx.saved_tensors
        return logq.exp().sub_(p).mul_(grad.unsqueeze(-1)), None


def distill_loss(logits: torch.Tensor, target: torch.Tensor, loss: str) -> torch.Tensor:
    """Per entry: KL(target || head) over the draft vocabulary ("kl"), or the head's cross-entropy
    to the target's argmax ("argmax"); both float32 [..., V] logits."""
    if loss == "kl":
        return _KLToTarget.apply(logits.float(), target.float())
    logq = torch.log_softmax(logits.float(), dim=-1)
    return -logq.gather(-1, target.argmax(-1, keepdim=True))[..., 0]


def n_max_1_walk(hits: list[bool]) -> tuple[int, int]:
    """(accepted, drafted) of a greedy run at --spec-draft-n-max 1 over a continuation whose drafts
    hit or miss as `hits` (one per generated position). The first generated token comes from the
    prompt's logits, undrafted; a miss commits the target's token and the next position is drafted,
    a hit also commits the verify's bonus token, so the position after a hit is never drafted. Hits
    come in runs, so a run accepts a smaller share than all positions show (Gemma 3 v2 head: 40 %
    walked vs 45 % per position; the run measured 35 % on text that differed, see docs/history.md,
    "Per position against walked acceptance")."""
    accepted = drafted = 0
    p = 1
    while p < len(hits):
        drafted += 1
        accepted += hits[p]
        p += 2 if hits[p] else 1
    return accepted, drafted


@torch.no_grad()
def heldout_acceptance(model, head: MTPHeadModule, heldout: list[Sequence], draft_ids: torch.Tensor | None) -> Acceptance:
    """Greedy acceptance on the held-out continuations (hybridrt's own greedy text): at each
    generated position j the head (fed t_j and h_(j-1)) drafts t_(j+1); it is kept iff it is the
    target's argmax at j."""
    hits = total = accepted = drafted = chain_hits = 0
    for s in heldout:
        emb, h_in, _, pos, valid = batch_inputs(model, [s])
        draft = head(emb, h_in, pos, valid).argmax(-1)[0]          # entry j - 1 is position j
        if draft_ids is not None:
            draft = draft_ids[draft]
        first = max(s.n_prompt, 1)
        j = torch.arange(first, len(s.tokens))
        hit = draft[j - 1] == s.argmax[j]
        hits += int(hit.sum())
        total += len(j)
        a, d = n_max_1_walk(hit.tolist())
        accepted, drafted = accepted + a, drafted + d
        target = s.argmax[first:].tolist()
        chain_hits += sum(h if p is None else p == t
                          for h, p, t in zip(hit.tolist(), lookup_proposals(s.tokens.tolist(), first), target))
    return Acceptance(hits / max(total, 1), accepted / max(drafted, 1), chain_hits / max(total, 1))


def _entry(acc: Acceptance) -> dict:
    return {"acceptance": acc.per_position, "acceptance_n_max_1": acc.n_max_1,
            "acceptance_lookup_first": acc.lookup_first}


def _shown(entry: dict) -> str:
    """A history entry's acceptances, for the progress line."""
    return (f"{entry['acceptance']:.1%} / n_max 1 {entry['acceptance_n_max_1']:.1%} / "
            f"behind lookup {entry['acceptance_lookup_first']:.1%}")


def _score(acc: Acceptance, cfg: TrainConfig) -> float:
    """What early stopping and the written head's choice go by: the head alone, or behind the lookup."""
    return acc.lookup_first if cfg.for_lookup else acc.per_position


def lr_at(step: int, cfg: TrainConfig) -> float:
    warm = min(20, cfg.steps // 10 + 1)
    if step < warm:
        return cfg.lr * (step + 1) / warm
    frac = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def _signature(model, cfg: TrainConfig, what: str, init: float = 0.0) -> str:
    """What the cached text ("data") or the checkpoint ("ckpt": the text too, and the block's
    starting scale) depends on: when any of it changes, that stage starts afresh instead of
    resuming (a checkpoint resumed on other text would be judged on another held-out set)."""
    keys = {k: v for k, v in asdict(cfg).items() if what == "ckpt" or k in ("tokens", "seed", "gen_len", "heldout_len",
                                                                            "full_teacher_vocab")}
    prompts = [(p.kind, p.text) for p in TRAIN_PROMPTS + HELDOUT_PROMPTS]
    # TEXT_VERSION and BF16: how the text is written (the plan of temperatures, the teacher's dtype)
    text = [prompts, TEXT_VERSION, BF16]
    blob = json.dumps([target_fingerprint(model.gguf), keys, text, *([init] if what == "ckpt" else [])],
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _progress():
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    # on stderr: stdout is the result's (`train-mtp --json` prints one JSON object there). Redirected
    # to a file, rich assumes 80 columns and elides every field ("━━ 5… 0:… 0…"): give the log
    # lines room instead
    console = Console(stderr=True) if sys.stderr.isatty() else Console(stderr=True, width=160)
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), TextColumn("{task.fields[info]}"), transient=False, console=console)


def residual_scale(model, tokens: list[int], layer: int | None = None) -> float:
    """The residual RMS the head's block starts at: the target's, for a pre-norm block (llama,
    qwen3; SmolLM2 ~30: held-out acceptance 14 % vs 11.5 % from unit scale, same data). 1.0 for
    gemma3, whose residual (RMS ~1280) is a few huge channels: starting there gave KL ~250 and 6 %
    after 100 steps. 1.0 where there is no torch teacher (qwen35). `layer`: the layer the block
    copies (default: initial_head_tensors')."""
    kind = head_target(model.arch)
    if not kind.torch_teacher or kind.post_norms:
        return 1.0
    layer = head_attention_spec(model)[0] if layer is None else layer
    return TorchTeacher(model, kind, MAX_SEQ).residual_rms(tokens, layer)


def prepare_data(model, cfg: TrainConfig, cache: Path, progress) -> tuple[list[Sequence], list[Sequence]]:
    sig = _signature(model, cfg, "data")
    if cache.exists():
        saved = torch.load(cache, weights_only=False)
        if saved.get("signature") == sig:
            return saved["train"], saved["heldout"]
    threads = torch.get_num_threads()
    n_cont = max(1, math.ceil(cfg.tokens / cfg.gen_len))
    train_ids = [prompt_ids(model, TRAIN_PROMPTS[i % len(TRAIN_PROMPTS)]) for i in range(n_cont)]
    temps, greedy_after = text_plan(n_cont, len(TRAIN_PROMPTS), cfg.gen_len, cfg.seed)
    held_ids = [prompt_ids(model, p) for p in HELDOUT_PROMPTS]
    for ids in train_ids + held_ids:
        if len(ids) + max(cfg.gen_len, cfg.heldout_len) + 1 > MAX_SEQ:
            raise UserError(f"train-mtp: a built-in prompt plus its continuation exceeds {MAX_SEQ} tokens")
    teacher = None
    if model.spec.torch_teacher:
        teacher = TorchTeacher(model, head_target(model.arch), MAX_SEQ, dtype=torch.bfloat16 if BF16 else torch.float32)
    new = write_text(model, teacher, train_ids, temps, greedy_after, cfg.gen_len, cfg.seed, progress,
                     "training text", restrict=not cfg.full_teacher_vocab)
    del teacher
    torch.set_num_threads(1)        # hybridrt's trunk runs torch single-threaded next to Numba's pool
    # held-out text: hybridrt's own greedy continuations, the text a run drafts on. The bfloat16
    # teacher's greedy text leaves it within a few tokens on some prompts (at the first token on
    # two of Gemma 3's eight), and a head trained on the teacher's text scored 5 points higher
    # on the teacher's held-out text than on hybridrt's (45 % vs 40 %, docs/history.md, "Per
    # position against walked acceptance")
    held_new = write_text(model, None, held_ids, [0.0] * len(held_ids), [0] * len(held_ids), cfg.heldout_len,
                          cfg.seed + 1, progress, "held-out text")
    # the teacher's hiddens are the training inputs where it wrote the text (bfloat16 matmuls: cosine
    # ~0.999 to hybridrt's, argmax agreeing at ~96 % of positions); hybridrt teacher-forces the rest
    train = [Sequence(torch.tensor(p + c), h, len(p)) for p, (c, h) in zip(train_ids, new) if h is not None]
    rest = [(p, c) for p, (c, h) in zip(train_ids, new) if h is None]
    train += teacher_force(model, [p + c for p, c in rest], [len(p) for p, _ in rest], progress, "teacher forcing")
    # held-out: hybridrt's own hiddens and argmax, what drafting at run time is judged against
    heldout = teacher_force(model, [p + c for p, (c, _) in zip(held_ids, held_new)], [len(p) for p in held_ids],
                            progress, "held-out targets", with_argmax=True)
    torch.set_num_threads(threads)
    torch.save({"signature": sig, "train": train, "heldout": heldout}, cache)
    return train, heldout


def train_mtp(model, out: str | Path, cfg: TrainConfig, quiet: bool = False) -> TrainResult:
    """Train and write a head for `model` (a loaded hybridrt Model) to `out`."""
    out = Path(out)
    t_wall, t_cpu = time.perf_counter(), time.process_time()
    torch.manual_seed(cfg.seed)
    progress = _progress()
    progress.disable = quiet
    with progress:
        train, heldout = prepare_data(model, cfg, Path(f"{out}.data.pt"), progress)
        head, draft_ids, w_draft, scale = new_head(model, train, cfg)
        opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
        start, best_acc, best_state, stale, history = 0, heldout_acceptance(model, head, heldout, draft_ids), None, 0, []
        history.append({"step": 0, **_entry(best_acc)})
        ckpt, sig = Path(f"{out}.ckpt"), _signature(model, cfg, "ckpt", scale)
        if ckpt.exists():
            saved = torch.load(ckpt, weights_only=False)
            if saved.get("signature") == sig:
                head.load_state_dict(saved["head"])
                opt.load_state_dict(saved["opt"])
                start, best_acc, best_state = saved["step"], saved["best_acc"], saved["best"]
                stale, history = saved["stale"], saved["history"]
        best_state = best_state or {k: v.clone() for k, v in head.state_dict().items()}
        task = progress.add_task("training", total=cfg.steps, completed=start,
                                 info=f"held-out acceptance {_shown(history[-1])}")
        loss_avg, grad_max = None, 0.0
        for step in range(start, cfg.steps):
            if stale >= cfg.patience:
                break
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg)
            loss = loss_of(head, w_draft, step_batch(model, train, cfg, step), cfg.loss, BF16)
            opt.zero_grad()
            loss.backward()
            grad_max = max(grad_max, clip_gradient(head, cfg))
            opt.step()
            value = float(loss.detach())
            loss_avg = value if loss_avg is None else 0.9 * loss_avg + 0.1 * value
            done = step + 1
            if done % cfg.eval_every == 0 or done == cfg.steps:
                acc = heldout_acceptance(model, head, heldout, draft_ids)
                history.append({"step": done, "loss": loss_avg, "grad_norm_max": grad_max, **_entry(acc)})
                grad_max = 0.0
                if _score(acc, cfg) > _score(best_acc, cfg):
                    best_acc, stale = acc, 0
                    best_state = {k: v.clone() for k, v in head.state_dict().items()}
                else:
                    stale += 1
                torch.save({"signature": sig, "step": done, "head": head.state_dict(), "opt": opt.state_dict(),
                            "best": best_state, "best_acc": best_acc, "stale": stale, "history": history}, ckpt)
            progress.update(task, completed=done,
                            info=f"loss {loss_avg:.3f}  held-out acceptance {_shown(history[-1])} (best {_shown(_entry(best_acc))})")
    head.load_state_dict(best_state)
    n_tokens = sum(len(s.tokens) - s.n_prompt for s in train)
    wall, cpu = time.perf_counter() - t_wall, time.process_time() - t_cpu
    write_head(out, head.export(), model.gguf, model.n_vocab, draft_ids.numpy() if draft_ids is not None else None,
               cfg.head_type, extra={"heldout_acceptance": float(best_acc.per_position),
                                     "heldout_acceptance_n_max_1": float(best_acc.n_max_1),
                                     "heldout_acceptance_lookup_first": float(best_acc.lookup_first),
                                     "steps": int(history[-1]["step"]), "tokens": n_tokens, "seed": cfg.seed,
                                     "loss": cfg.loss, "for_lookup": int(cfg.for_lookup)})
    return TrainResult(out, best_acc.per_position, best_acc.n_max_1, best_acc.lookup_first, int(history[-1]["step"]),
                       len(draft_ids) if draft_ids is not None else model.n_vocab, n_tokens, wall, cpu, history)
