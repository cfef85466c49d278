"""Trains the family's base model and its small draft model (both `LlamaForCausalLM`).

Both see the same seeded batches from the stdlib corpus, so one pass of data loading
serves two models. Checkpoints are saved as float16 safetensors in the Hugging Face
layout (sharded at 16 MB so every file fits the GPU host's transfer limit), with the
tokenizer beside them.

    python tools/train/train_lm.py --tokenizer DIR --base-out checkpoints/base \
        --draft-out checkpoints/draft --steps 600
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import BatchSampler, cached_stream, eval_windows, list_sources  # noqa: E402

# The shipped family's shapes. Base: 12 layers, GQA 4 query / 2 KV heads of 64, ~10 M
# parameters. Draft: 3 layers at width 128 with tied embeddings, ~0.9 M parameters.
BASE_SHAPE = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=12,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
DRAFT_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=3,
                   num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)


def make_config(shape: dict, vocab_size: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size, max_position_embeddings=2048, rms_norm_eps=1e-5,
        rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=None,
        hidden_act="silu", attention_bias=False, mlp_bias=False, **shape,
    )


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def perplexity(model: LlamaForCausalLM, windows: np.ndarray, batch: int = 8) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        x = torch.from_numpy(windows[i : i + batch])
        out = model(input_ids=x[:, :-1], labels=x[:, :-1].clone())
        n = x[:, 1:-1].numel()
        total += out.loss.item() * n
        count += n
    model.train()
    return math.exp(total / count)


def save(model: LlamaForCausalLM, tokenizer, out: Path, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(out, safe_serialization=True, max_shard_size="16MB")
    model.to(torch.float32)
    tokenizer.save_pretrained(out)
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True, type=Path)
    ap.add_argument("--base-out", required=True, type=Path)
    ap.add_argument("--draft-out", required=True, type=Path)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate of the base model")
    ap.add_argument("--draft-lr", type=float, default=2e-3, help="peak learning rate of the draft model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", type=Path, default=Path(".cache/train"))
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    train_files, heldout_files = list_sources()
    train_stream = cached_stream(tokenizer, train_files, args.cache, "train")
    heldout_stream = cached_stream(tokenizer, heldout_files, args.cache, "heldout")
    print(f"corpus: {len(train_stream)} train tokens, {len(heldout_stream)} held-out tokens", flush=True)

    models = {
        "base": LlamaForCausalLM(make_config(BASE_SHAPE, len(tokenizer))),
        "draft": LlamaForCausalLM(make_config(DRAFT_SHAPE, len(tokenizer))),
    }
    peak = {"base": args.lr, "draft": args.draft_lr}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=peak[k], betas=(0.9, 0.95), weight_decay=0.1)
            for k, m in models.items()}
    for k, m in models.items():
        print(f"{k}: {sum(p.numel() for p in m.parameters()) / 1e6:.2f} M parameters", flush=True)

    sampler = BatchSampler(train_stream, args.seq_len, args.batch_size, args.seed)
    warmup = max(1, args.steps // 20)
    t0 = time.time()
    for step in range(args.steps):
        x = torch.from_numpy(sampler.next())
        losses = {}
        for k, m in models.items():
            for g in opts[k].param_groups:
                g["lr"] = lr_at(step, args.steps, peak[k], warmup)
            loss = m(input_ids=x[:, :-1], labels=x[:, :-1].clone()).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opts[k].step()
            opts[k].zero_grad(set_to_none=True)
            losses[k] = loss.item()
        if step % 10 == 0 or step == args.steps - 1:
            el = time.time() - t0
            print(f"step {step}/{args.steps} base {losses['base']:.3f} draft {losses['draft']:.3f} "
                  f"{el:.0f}s ({el / (step + 1):.2f}s/step)", flush=True)

    windows = eval_windows(heldout_stream, args.seq_len, 32)
    for k, m in models.items():
        ppl = perplexity(m, windows)
        print(f"{k}: held-out perplexity {ppl:.3f}", flush=True)
        meta = dict(role=k, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                    lr=peak[k], seed=args.seed, heldout_perplexity=round(ppl, 4),
                    train_tokens=int(args.steps * args.batch_size * args.seq_len),
                    python=sys.version.split()[0])
        save(m, tokenizer, args.base_out if k == "base" else args.draft_out, meta)


if __name__ == "__main__":
    main()
