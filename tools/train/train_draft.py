"""Trains the draft model: a small Llama that shares the target's tokenizer and embeddings.

The draft model is the target's first `--layers` decoder layers, its final norm and its
(tied) embeddings, then trained to match the target's next-token distribution on the
self-distilled conversations (soft cross-entropy over the full vocabulary, on answer
positions; the target's distribution comes from the cached features, `features.py`).
The embeddings stay frozen: they are the target's, so setup can write them back
(`tools/setup_model.py`) and the committed checkpoint holds only the layers and norm,
with a drafting vocabulary (`--draft-vocab`, the most frequent answer tokens) whose rows
of the LM head serving's drafting scores alone.

Starting from the target's own layers rather than from random weights means the draft
begins as an early exit of the target, which a few hundred thousand tokens on two CPU
cores can sharpen; a model trained from scratch could not learn English on that budget.

Seeded and resumable like `train_heads.py`. Before and after training, the draft's top-1
agreement with the target on the held-out conversations (every `HOLDOUT_EVERY`-th, never
trained on) is printed and saved in `training.json`, over the full vocabulary and over
the drafting vocabulary (what serving's greedy drafting picks from). The target's own
forward gives its argmax there, so scoring needs no feature cache: `--score-only` scores
the draft model saved in `--out` and records the scores in its `training.json`.

    python tools/train/train_draft.py --base .cache/smollm2/base --data .cache/data/self_distill.jsonl \
        --out checkpoints/smollm2-135m-instruct/draft --work .cache/train/heads
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "backend_src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import (Dataset, batches, epoch_schedule, frequent_tokens, learning_rate, load_dataset,  # noqa: E402
                  load_state, run_key, save_draft_vocab)
from features import build_features  # noqa: E402
from specdec.drafters.loader import DRAFT_VOCAB_FILE, draft_vocab  # noqa: E402
from specdec.kv_cache import AttentionBatch  # noqa: E402
from specdec.models.layers import LlamaShape, causal_mask  # noqa: E402
from specdec.models.llama import LlamaModel  # noqa: E402


def draft_from_target(base: LlamaModel, base_cfg: dict, layers: int) -> tuple[LlamaModel, dict]:
    cfg = dict(base_cfg, num_hidden_layers=layers, tie_word_embeddings=True, torch_dtype="float16")
    draft = LlamaModel(LlamaShape.from_config(cfg))
    state = {k: v for k, v in base.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    draft.load_state_dict({k: v for k, v in state.items() if k in draft.state_dict()}, strict=False)
    draft.model.embed_tokens.weight.requires_grad_(False)
    return draft, cfg


def save_draft(draft: LlamaModel, cfg: dict, out: Path, meta: dict) -> None:
    """Hugging Face layout without the tied embeddings (setup adds the target's)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    keep = {k: v for k, v in draft.state_dict().items()
            if k.startswith(("model.layers.", "model.norm.")) and k.endswith((".weight", ".bias"))}
    state = {}
    for k, v in keep.items():
        parts = k.split(".")  # the engine also holds fused copies (qkv, kv, gate_up): keep the HF-named weights
        if parts[-2] in ("qkv", "kv", "gate_up"):
            continue
        state[k] = v.detach().to(torch.float16).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {k: v for k, v in cfg.items() if k != "torch_dtype"}
    config.update(architectures=["LlamaForCausalLM"], torch_dtype="float16")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")


def conversation_batch(ds: Dataset, group: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, T] of conversations `group` (padded on the right) and a mask [B, T] of
    the positions whose next token is an answer token."""
    T, B = max(len(ds.conversations[c]) for c in group), len(group)
    ids = torch.zeros(B, T, dtype=torch.long)
    answer = torch.zeros(B, T, dtype=torch.bool)
    for row, c in enumerate(group):
        n = len(ds.conversations[c])
        ids[row, :n] = torch.tensor(ds.conversations[c])
        answer[row, ds.prompt_lens[c] - 1: n - 1] = True
    return ids, answer


def hidden_states(model: LlamaModel, ids: torch.Tensor) -> torch.Tensor:
    """The model's final hidden states [B, T, H] over ids [B, T]. No KV cache (its in-place
    writes would break autograd): each layer attends over the forward's own tokens with the
    batch's causal mask."""
    B, T = ids.shape
    batch = AttentionBatch.build(torch.arange(B), torch.zeros(B, dtype=torch.long), causal_mask(B, T, "cpu"))
    hidden, _ = model(ids, torch.arange(T)[None].expand(B, T), None, batch)
    return hidden


@dataclass
class HoldoutBatch:
    """A batch of held-out conversations and what the draft is scored against there."""

    ids: torch.Tensor  # [B, T] token ids, right-padded
    answer: torch.Tensor  # [B, T] positions whose next token is an answer token
    own: torch.Tensor  # [n] per answer position: its conversation's answer is the target's own
    expected: torch.Tensor  # [n] the target's argmax at each answer position


@torch.no_grad()
def holdout_reference(target: LlamaModel, ds: Dataset, batch_tokens: int) -> list[HoldoutBatch]:
    """The held-out conversations in batches, with the target's argmax at their answer
    positions: computed once, for every score of a run."""
    own = set(ds.self_distilled(ds.holdout))
    out = []
    for group in batches(ds, ds.holdout, batch_tokens, seed=0):
        ids, answer = conversation_batch(ds, group)
        rows_own = torch.tensor([c in own for c in group])[:, None].expand_as(answer)[answer]
        expected = target.logits(hidden_states(target, ids)[answer]).argmax(-1)
        out.append(HoldoutBatch(ids, answer, rows_own, expected))
    return out


@torch.no_grad()
def holdout_top1(draft: LlamaModel, reference: list[HoldoutBatch], vocab_ids: torch.Tensor) -> dict:
    """The draft's top-1 agreement with the target on the held-out answer tokens
    (`holdout_reference`): all of them and the self-distilled ones (the target's own
    answers, what serving drafts for), each over the full vocabulary and over the drafting
    vocabulary `vocab_ids` [K] (serving's drafting picks the best of those alone)."""
    hits = {"all": torch.zeros(2), "self_distilled": torch.zeros(2)}
    totals = {"all": 0, "self_distilled": 0}
    for batch in reference:
        logits = draft.logits(hidden_states(draft, batch.ids)[batch.answer])  # [n, V]
        right = torch.stack([logits.argmax(-1) == batch.expected,
                             vocab_ids[logits[:, vocab_ids].argmax(-1)] == batch.expected])  # [2, n]
        for split, keep in (("all", slice(None)), ("self_distilled", batch.own)):
            hits[split] += right[:, keep].sum(-1)
            totals[split] += int(right[:, keep].shape[1])
    scores = {}
    for split, total in totals.items():
        full, reduced = (hits[split] / max(total, 1)).tolist()
        scores[split] = {"answer_tokens": total, "full_vocabulary": round(full, 4),
                         "drafting_vocabulary": round(reduced, 4)}
    return scores


def load_saved_draft(draft: LlamaModel, out: Path) -> None:
    """Loads the layers and norm `save_draft` wrote to `out` into `draft` (whose embeddings
    are the target's already)."""
    from safetensors.torch import load_file

    saved = load_file(str(out / "model.safetensors"))
    own = draft.state_dict()
    missing = [k for k in saved if k not in own]
    if missing:
        raise SystemExit(f"{out} does not match a {draft.shape.num_hidden_layers}-layer draft (has {missing[:4]})")
    draft.load_state_dict({k: v.to(own[k].dtype) for k, v in saved.items()}, strict=False)


def score_saved(out: Path, draft: LlamaModel, validate) -> None:
    """--score-only: the holdout scores of the target's first layers (`draft` as built) and of
    the draft model saved in `out`, printed and recorded in its training.json."""
    before = validate()
    print(f"holdout top-1 of the target's first layers: {before}", flush=True)
    load_saved_draft(draft, out)
    after = validate()
    print(f"holdout top-1 of {out}: {after}", flush=True)
    record_scores(out, before, after)


def record_scores(out: Path, before: dict, after: dict) -> None:
    meta_path = out / "training.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    meta.update(holdout_top1_before=before, holdout_top1_after=after)
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, type=Path)
    ap.add_argument("--data", required=True, type=Path, nargs="+")
    ap.add_argument("--out", required=True, type=Path, help="the draft model's directory")
    ap.add_argument("--work", type=Path, default=Path(".cache/train/heads"),
                    help="the training state; its features/ is the default feature cache")
    ap.add_argument("--features", type=Path, help="the feature cache train_heads.py filled for the same data "
                    "(default: WORK/features)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--save-every", type=int, default=20)
    ap.add_argument("--draft-vocab", type=int, default=8192,
                    help="write the N most frequent answer tokens as the drafting vocabulary serving scores "
                    "(draft_vocab.safetensors; 0: none, drafting scores the full LM head)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--score-only", action="store_true",
                    help="score the draft model saved in --out on the holdout (and the target's first --layers "
                    "layers, where it started), record the scores in its training.json and stop")
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    ds = load_dataset(args.data, args.max_len)
    base = LlamaModel.from_pretrained(args.base)
    base_cfg = json.loads((args.base / "config.json").read_text())
    lm_head = base.lm_head.weight.detach()
    draft, cfg = draft_from_target(base, base_cfg, args.layers)
    vocab = frequent_tokens(ds, ds.train, args.draft_vocab or 8192)
    if args.score_only and (args.out / DRAFT_VOCAB_FILE).is_file():  # what serving drafts over
        vocab = draft_vocab(str(args.out), "--out", base.shape.vocab_size)
    reference: list[HoldoutBatch] = []  # the target's side of every score, once

    def validate() -> dict:
        if not reference:
            reference.extend(holdout_reference(base, ds, args.batch_tokens))
        return holdout_top1(draft, reference, vocab)
    if args.score_only:
        score_saved(args.out, draft, validate)
        return
    args.work.mkdir(parents=True, exist_ok=True)
    fs = build_features(ds.conversations, ds.prompt_lens, args.base, args.features or args.work / "features",
                        log=lambda m: print(m, flush=True))
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = epoch_schedule(ds, args.batch_tokens, args.epochs, args.seed + 100)
    total = len(schedule)
    # where and what beside: not what is trained
    unkeyed = ("save_every", "features", "work", "draft_vocab", "score_only")
    key = run_key(ds, schedule, {k: v for k, v in vars(args).items() if k not in unkeyed})
    state_path = args.work / "draft_state.pt"
    step, seen = 0, 0
    state = load_state(state_path, key)
    if state is not None:
        draft.load_state_dict(state["draft"])
        opt.load_state_dict(state["opt"])
        step, seen = state["step"], state["seen"]
        print(f"resumed at step {step}/{total}", flush=True)
    initial = validate() if state is None else state.get("initial_holdout", {})
    print(f"holdout top-1 before training: {initial}", flush=True)
    t0 = time.time()
    while step < total:
        for g in opt.param_groups:
            g["lr"] = learning_rate(step, total, args.lr)
        group = schedule[step]
        ids, answer = conversation_batch(ds, group)
        B, T = ids.shape
        hidden = hidden_states(draft, ids)
        rows = answer.nonzero(as_tuple=True)
        logits = draft.logits(hidden[rows])  # [n, V]
        target_hidden = torch.cat([torch.from_numpy(np.asarray(fs.hidden[fs.conversation(c)], dtype=np.float32))
                                   [: len(ds.conversations[c])] for c in group])
        flat = torch.cat([torch.arange(len(ds.conversations[c])) + row * T for row, c in enumerate(group)])
        lookup = torch.full((B * T,), -1, dtype=torch.long)
        lookup[flat] = torch.arange(len(flat))
        target = torch.softmax(target_hidden[lookup[rows[0] * T + rows[1]]] @ lm_head.T, dim=-1)
        loss = -(target * F.log_softmax(logits, dim=-1)).sum(-1).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        seen += len(rows[0])
        step += 1
        if step % 5 == 0 or step == total:
            acc = (logits.argmax(-1) == target.argmax(-1)).float().mean().item()
            print(f"step {step}/{total} tokens {seen} loss {loss.item():.3f} top1 {acc:.2f} | "
                  f"{(time.time() - t0) / 60:.1f} min", flush=True)
        if step % args.save_every == 0 or step == total:
            torch.save({"draft": draft.state_dict(), "opt": opt.state_dict(), "step": step, "seen": seen,
                        "run_key": key, "initial_holdout": initial}, state_path)
    save_draft(draft, cfg, args.out, dict(layers=args.layers, answer_tokens_seen=seen, conversations=len(ds.train),
                                          epochs=args.epochs, steps=total, lr=args.lr, seed=args.seed,
                                          initialised_from="the target's first layers, norm and embeddings"))
    if args.draft_vocab:
        save_draft_vocab(args.out, vocab)
    load_saved_draft(draft, args.out)  # scored as saved (float16), as serving and --score-only read it
    final = validate()
    print(f"holdout top-1 after training: {final}", flush=True)
    record_scores(args.out, initial, final)
    print(f"saved to {args.out}", flush=True)


if __name__ == "__main__":
    main()
