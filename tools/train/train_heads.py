"""Trains the base model's drafters: an EAGLE-1/2 head, an EAGLE-3 head and Medusa heads.

All three learn from the frozen base model's own predictions on the stdlib corpus
(one base forward per batch serves the three), each the way its paper trains it:
- EAGLE-1: regress the next feature (smooth L1) + 0.1 x cross-entropy of its logits
  (through the frozen base lm_head) against the base's next-token distribution, on
  teacher-forced features with uniform noise.
- EAGLE-3: training-time test: `--ttt-steps` unrolled steps, each feeding the head its
  own previous output; step k at position t sees the step-0 keys up to t and its own
  earlier steps at t (exactly what a depth-k draft node sees when serving), loss
  weighted 0.8^k, target = the base's distribution restricted to the draft vocabulary.
- Medusa: head k matches the base's distribution of the token k + 2 ahead.
The heads are the engine's own modules (`specdec.models.*`), saved in the upstream
layouts.

    python tools/train/train_heads.py --base checkpoints/base --out checkpoints --steps 300
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
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "backend_src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import BatchSampler, cached_stream, list_sources  # noqa: E402
from specdec.kv_cache import AttentionBatch  # noqa: E402
from specdec.models.eagle import EagleHead  # noqa: E402
from specdec.models.eagle3 import Eagle3Head, eagle3_feature_layers  # noqa: E402
from specdec.models.layers import LlamaShape, causal_mask, rope, rope_tables  # noqa: E402
from specdec.models.llama import LlamaModel  # noqa: E402
from specdec.models.medusa import MedusaHeads  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

MEDUSA_HEADS = 4
DRAFT_VOCAB = 1024
SCORE_TEMPERATURE = 0.25


def head_config(base_cfg: dict, **extra) -> dict:
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size", "hidden_act")
    cfg = {k: base_cfg[k] for k in keys if k in base_cfg}
    cfg.update(model_type="llama", num_hidden_layers=1, torch_dtype="float16", tie_word_embeddings=False)
    cfg.update(extra)
    return cfg


def base_forward(base: LlamaModel, ids: torch.Tensor, aux_layers):
    B, T = ids.shape
    cache = base.new_cache(B, T)
    batch = AttentionBatch.build(torch.arange(B), torch.zeros(B, dtype=torch.long), causal_mask(B, T, ids.device))
    with torch.no_grad():
        feats, aux = base(ids, torch.arange(T)[None].expand(B, T), cache, batch, aux_layers)
        logits = base.logits(feats)
    return feats, aux, logits


def soft_ce(logits: torch.Tensor, target_probs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against a target distribution, averaged over `valid` positions."""
    loss = -(target_probs * F.log_softmax(logits.float(), dim=-1)).sum(-1)
    return (loss * valid).sum() / valid.sum().clamp(min=1)


def ttt_attention(attn, inv_freq: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, past: list, causal: torch.Tensor):
    """EAGLE-3 training-time-test attention of one unrolled step.

    x: [B, T, 2H]. `past` holds (k, v) [B, H_kv, T, D] of the earlier steps; step 0's
    keys are seen causally, each later step's only at the same position (the draft
    node's own ancestors). Appends this step's (k, v) to `past`.
    """
    B, T, _ = x.shape
    q = attn.q_proj(x).view(B, T, attn.n_heads, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(B, T, attn.n_kv, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(B, T, attn.n_kv, attn.head_dim).transpose(1, 2)
    cos, sin = rope_tables(inv_freq, positions, x.dtype)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    past.append((k, v))
    rep = attn.n_heads // attn.n_kv
    scale = 1.0 / math.sqrt(attn.head_dim)
    k0, v0 = (t.repeat_interleave(rep, dim=1) for t in past[0])
    scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]  # [B, h, T, T]
    diag_v = []
    for kj, vj in past[1:]:
        kj, vj = kj.repeat_interleave(rep, dim=1), vj.repeat_interleave(rep, dim=1)
        scores.append((q * kj).sum(-1, keepdim=True) * scale)  # [B, h, T, 1]
        diag_v.append(vj)
    weights = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    out = weights[..., :T] @ v0
    for j, vj in enumerate(diag_v):
        out = out + weights[..., T + j : T + j + 1] * vj
    return attn.o_proj(out.transpose(1, 2).reshape(B, T, -1))


def eagle3_ttt_loss(head: Eagle3Head, ids, aux, base_logits, steps: int):
    """ids: [B, T] true tokens; aux: [B, T, 3H]; base_logits: [B, T, V]."""
    B, T = ids.shape
    n = T - 1  # positions t = 0..T-2 take token x[t+1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    target = torch.softmax(base_logits[..., head.t2d], dim=-1)  # [B, T, draft_V]
    hidden = head.fc(aux[:, :n])
    layer = head.midlayer
    past: list = []
    total, acc = 0.0, []
    for k in range(steps):
        tok = ids[:, 1 + k : 1 + k + n]
        if tok.shape[1] < n:  # pad the tail past the sequence end; those positions are masked
            tok = F.pad(tok, (0, n - tok.shape[1]))
        positions = (torch.arange(n) + k)[None].expand(B, n)
        emb = head.embed_tokens(tok)
        x = torch.cat((layer.input_layernorm(emb), layer.hidden_norm(hidden)), dim=-1)
        h = hidden + ttt_attention(layer.self_attn, head.inv_freq, x, positions, past, causal)
        hidden = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = head.draft_logits(hidden)  # predicts x[t + 2 + k], base row t + 1 + k
        valid = torch.zeros(B, n)
        valid[:, : max(0, n - 1 - k)] = 1.0
        tgt = torch.zeros_like(logits)
        rows = max(0, n - 1 - k)
        tgt[:, :rows] = target[:, 1 + k : 1 + k + rows]
        total = total + (0.8 ** k) * soft_ce(logits, tgt, valid)
        with torch.no_grad():
            hit = (logits[:, :rows].argmax(-1) == tgt[:, :rows].argmax(-1)).float().mean().item()
        acc.append(hit)
    return total, acc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path, help="writes eagle/, eagle3/, medusa/ under it")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--ttt-steps", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", type=Path, default=Path(".cache/train"))
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    train_files, _ = list_sources()
    stream = cached_stream(tokenizer, train_files, args.cache, "train")
    base = LlamaModel.from_pretrained(args.base)
    for p in base.parameters():
        p.requires_grad_(False)
    base_cfg = json.loads((args.base / "config.json").read_text())
    shape = base.shape
    aux_layers = eagle3_feature_layers(shape.num_hidden_layers)

    # EAGLE-1: one Llama layer; starts from the base's last layer.
    eagle = EagleHead(LlamaShape.from_config(head_config(base_cfg)), fc_bias=True)
    eagle.embed_tokens.weight.data.copy_(base.model.embed_tokens.weight)
    eagle.embed_tokens.weight.requires_grad_(False)
    last = base.model.layers[-1]
    for mine, theirs in ((eagle.layers[0].self_attn, last.self_attn), (eagle.layers[0].mlp, last.mlp)):
        # the serving model also holds fused copies (qkv, gate_up): take the HF-named weights
        mine.load_state_dict({k: v for k, v in theirs.state_dict().items() if k in mine.state_dict()})

    # EAGLE-3: draft vocabulary = the most frequent training tokens.
    counts = np.bincount(stream.astype(np.int64), minlength=shape.vocab_size)
    draft_ids = torch.from_numpy(np.sort(np.argsort(-counts, kind="stable")[:DRAFT_VOCAB]))
    eagle3 = Eagle3Head(LlamaShape.from_config(head_config(base_cfg)), DRAFT_VOCAB)
    eagle3.embed_tokens.weight.data.copy_(base.model.embed_tokens.weight)
    eagle3.embed_tokens.weight.requires_grad_(False)
    eagle3.d2t.copy_(draft_ids - torch.arange(DRAFT_VOCAB))
    eagle3.t2d.zero_()
    eagle3.t2d[draft_ids] = True
    eagle3.lm_head.weight.data.copy_(base.lm_head.weight[draft_ids])

    # Medusa: residual blocks start as identity, projections as the base lm_head.
    medusa = MedusaHeads(shape.hidden_size, shape.vocab_size, MEDUSA_HEADS, 1)
    for head in medusa:
        head[0].linear.weight.data.zero_()
        head[0].linear.bias.data.zero_()
        head[1].weight.data.copy_(base.lm_head.weight)

    modules = {"eagle": eagle, "eagle3": eagle3, "medusa": medusa}
    opts = {k: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=args.lr,
                                 betas=(0.9, 0.95), weight_decay=0.0) for k, m in modules.items()}
    sampler = BatchSampler(stream, args.seq_len, args.batch_size, args.seed + 1)
    warmup = max(1, args.steps // 20)
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.time()
    B, T = args.batch_size, args.seq_len
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for opt in opts.values():
            for g in opt.param_groups:
                g["lr"] = lr
        ids = torch.from_numpy(sampler.next()[:, :T])
        feats, aux, logits = base_forward(base, ids, aux_layers)
        probs = torch.softmax(logits, dim=-1)
        n = T - 1
        mask = causal_mask(B, n, "cpu")[:, None]

        # EAGLE-1
        noisy = feats[:, :n] + (torch.rand(feats[:, :n].shape, generator=gen) - 0.5) * 0.2
        pred = eagle(ids[:, 1:], noisy, torch.arange(n)[None].expand(B, n), mask)
        e_logits = base.lm_head(pred)
        ones = torch.ones(B, n)
        loss_e = F.smooth_l1_loss(pred, feats[:, 1:]) + 0.1 * soft_ce(e_logits, probs[:, 1:], ones)
        acc_e = (e_logits.argmax(-1) == logits[:, 1:].argmax(-1)).float().mean().item()

        # EAGLE-3
        loss_3, acc_3 = eagle3_ttt_loss(eagle3, ids, aux, logits, args.ttt_steps)

        # Medusa: head k at t predicts the base's distribution at row t + 1 + k.
        m_logits = medusa(feats)  # [K, B, T, V]
        loss_m, acc_m = 0.0, []
        for k in range(MEDUSA_HEADS):
            rows = T - 1 - k
            valid = torch.ones(B, rows)
            loss_m = loss_m + (0.8 ** k) * soft_ce(m_logits[k, :, :rows], probs[:, 1 + k :], valid)
            acc_m.append((m_logits[k, :, :rows].argmax(-1) == logits[:, 1 + k :].argmax(-1)).float().mean().item())

        for key, loss in (("eagle", loss_e), ("eagle3", loss_3), ("medusa", loss_m)):
            loss.backward()
            torch.nn.utils.clip_grad_norm_(modules[key].parameters(), 1.0)
            opts[key].step()
            opts[key].zero_grad(set_to_none=True)
        if step % 10 == 0 or step == args.steps - 1:
            el = time.time() - t0
            print(f"step {step}/{args.steps} eagle {loss_e.item():.3f} top1 {acc_e:.2f} | "
                  f"eagle3 {loss_3.item():.3f} top1/step {[round(a, 2) for a in acc_3]} | "
                  f"medusa {loss_m.item():.3f} top1/head {[round(a, 2) for a in acc_m]} | "
                  f"{el:.0f}s ({el / (step + 1):.2f}s/step)", flush=True)

    meta = dict(steps=args.steps, batch_size=B, seq_len=T, lr=args.lr, seed=args.seed, ttt_steps=args.ttt_steps)
    # specdec_score_temperature (not an upstream key): the EAGLE-2/3 ranking temperature
    # these heads want, measured with tools/bench/eval_family.py (see config.py).
    eagle.save_pretrained(args.out / "eagle", head_config(base_cfg, architectures=["LlamaForCausalLM"], bias=True,
                                                          specdec_score_temperature=SCORE_TEMPERATURE))
    eagle3.save_pretrained(args.out / "eagle3", head_config(
        base_cfg, architectures=["LlamaForCausalLMEagle3"], bias=False, draft_vocab_size=DRAFT_VOCAB,
        target_hidden_size=shape.hidden_size, specdec_score_temperature=SCORE_TEMPERATURE))
    medusa.save_pretrained(args.out / "medusa", dict(
        medusa_num_heads=MEDUSA_HEADS, medusa_num_layers=1, base_model_name_or_path="../base",
        hidden_size=shape.hidden_size, vocab_size=shape.vocab_size))
    for name in modules:
        (args.out / name / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    print("saved", flush=True)


if __name__ == "__main__":
    main()
