"""Trains the target's heads: an EAGLE-1/2 head, an EAGLE-3 head and Medusa heads.

All three learn from the frozen target's own features on self-distilled conversations
(`features.py` computes them once), each the way its paper trains it:
- EAGLE-1: from the feature at t and the token at t + 1, regress the feature at t + 1
  (smooth L1) + 0.1 x cross-entropy of its logits (through the target's LM head)
  against the target's distribution there; uniform noise on the input features.
- EAGLE-3: training-time test: `--ttt-steps` unrolled steps, each feeding the head its
  own previous output; step k at position t sees the step-0 keys up to t and its own
  earlier steps at t (what a depth-k draft node sees when serving); loss weighted
  0.8^k; target = the target's distribution restricted to the draft vocabulary.
- Medusa (Medusa-1): head k, a residual block in front of the frozen target LM head,
  matches the target's distribution of the token k + 2 ahead.
Losses are taken where the predicted token belongs to the answer. The cross-entropies
of EAGLE-1 and Medusa run over the `--train-vocab` most frequent answer tokens (the
target's distribution renormalised over them): the full 49k-token LM head would cost
more than everything else in the step. Those tokens are saved beside the EAGLE-1 and
Medusa heads (`draft_vocab.safetensors`), and serving's drafting scores them alone.

The heads are the engine's own modules (`specdec.models.*`), saved in the upstream
layouts, less what setup derives from the target (`tools/setup_model.py`): Medusa's
head projections (the target's LM head, frozen here) are not written.

Seeded and resumable: a state file in `--work` is written every `--save-every` steps;
rerunning the same command goes on from it, and a state that another run left there
(other data or settings) is refused rather than resumed. `--medusa-heads 0` trains
and writes the EAGLE heads only, `--medusa-only` the Medusa heads only. `--snapshots` saves the EAGLE heads after
that many answer tokens (comma list), for the learning curve. `--init DIR` starts from
the heads saved in DIR (a later round goes on from an earlier one's heads; EAGLE-3 keeps
their draft vocabulary, which `--widen-draft-vocab N` grows to N tokens; answer tokens are
counted on from theirs, and with `--snapshots` the starting heads are the first snapshot).
Before and after training, the heads' top-1 agreement with the target on the held-out
conversations is printed and saved in `training.json`: a validation score that never
reads the evaluation question sets.

    python tools/train/train_heads.py --base .cache/smollm2/base --data .cache/data/self_distill.jsonl \
        --out checkpoints/smollm2-135m-instruct --work .cache/train/heads
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
from data import (Dataset, batches, coverage, epoch_schedule, frequent_tokens, learning_rate,  # noqa: E402
                  load_dataset, load_state, run_key, save_draft_vocab, widened_vocabulary)  # noqa: E402
from features import FeatureSet, build_features  # noqa: E402
from specdec.drafters.loader import DRAFT_VOCAB_FILE  # noqa: E402
from specdec.models.eagle import EagleHead  # noqa: E402
from specdec.models.eagle3 import Eagle3Head  # noqa: E402
from specdec.models.layers import LlamaShape, causal_mask, rope, rope_tables  # noqa: E402
from specdec.models.llama import LlamaModel  # noqa: E402
from specdec.models.medusa import ResBlock  # noqa: E402

SCORE_TEMPERATURE = 0.5


def head_config(base_cfg: dict, **extra) -> dict:
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling", "max_position_embeddings",
            "vocab_size", "hidden_act")
    cfg = {k: base_cfg[k] for k in keys if k in base_cfg}
    cfg.update(model_type="llama", num_hidden_layers=1, torch_dtype="float16", tie_word_embeddings=False)
    cfg.update(extra)
    return cfg


def soft_ce(logits: torch.Tensor, target_probs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against a target distribution, averaged over positions by `weight` [B, T]."""
    loss = -(target_probs * F.log_softmax(logits.float(), dim=-1)).sum(-1)
    return (loss * weight).sum() / weight.sum().clamp(min=1)


def ttt_attention(attn, inv_freq: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, past: list,
                  causal: torch.Tensor) -> torch.Tensor:
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
        out = out + weights[..., T + j: T + j + 1] * vj
    return attn.o_proj(out.transpose(1, 2).reshape(B, T, -1))


def shifted(x: torch.Tensor, k: int) -> torch.Tensor:
    """x[:, k:] padded back to x's length with zeros at the end (rows past the end are masked)."""
    if k == 0:
        return x
    return torch.cat([x[:, k:], torch.zeros_like(x[:, :k])], dim=1)


def eagle3_ttt_loss(head: Eagle3Head, ids, aux, draft_target, weight, steps: int):
    """ids: [B, T]; aux: [B, T, 3H]; draft_target: [B, T, draft_V] the target's distribution
    at each position over the draft vocabulary; weight[b, t]: position t's prediction counts.

    Step k's state at row t stands for the draft node k + 1 levels below position t: it
    reads token x[t + 1 + k] and predicts the target's distribution at t + 1 + k."""
    B, T = ids.shape
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    hidden = head.fc(aux)
    layer = head.midlayer
    past: list = []
    total, acc = 0.0, []
    for k in range(steps):
        tok = shifted(ids, 1 + k)
        positions = (torch.arange(T) + k)[None].expand(B, T)
        emb = head.embed_tokens(tok)
        x = torch.cat((layer.input_layernorm(emb), layer.hidden_norm(hidden)), dim=-1)
        h = hidden + ttt_attention(layer.self_attn, head.inv_freq, x, positions, past, causal)
        hidden = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = head.draft_logits(hidden)
        target = shifted(draft_target, 1 + k)
        w = shifted(weight, 1 + k)
        total = total + (0.8 ** k) * soft_ce(logits, target, w)
        with torch.no_grad():
            hit = ((logits.argmax(-1) == target.argmax(-1)).float() * w).sum() / w.sum().clamp(min=1)
        acc.append(hit.item())
    return total, acc


class Heads(torch.nn.Module):
    """The three trained modules, for one optimizer state and one checkpoint file."""

    def __init__(self, base: LlamaModel, base_cfg: dict, draft_ids: torch.Tensor, medusa_heads: int):
        super().__init__()
        shape = LlamaShape.from_config(head_config(base_cfg))
        # EAGLE-1: one Llama layer (no input norm). It starts as "the next feature is this
        # feature": fc passes the feature half through, and the layer (the target's last,
        # for its attention and MLP shapes of the target's features) adds nothing yet, its
        # output projections zeroed. Copied whole, the target's last layer turns fc's output
        # into activations ~30x the features' scale, which the regression spends most of
        # a short training undoing.
        H = shape.hidden_size
        self.eagle = EagleHead(shape, fc_bias=True)
        self.eagle.embed_tokens.weight.data.copy_(base.model.embed_tokens.weight)
        self.eagle.embed_tokens.weight.requires_grad_(False)
        last = base.model.layers[-1]
        layer = self.eagle.layers[0]
        for mine, theirs in ((layer.self_attn, last.self_attn), (layer.mlp, last.mlp)):
            mine.load_state_dict({k: v for k, v in theirs.state_dict().items() if k in mine.state_dict()})
        layer.self_attn.o_proj.weight.data.zero_()
        layer.mlp.down_proj.weight.data.zero_()
        self.eagle.fc.weight.data.zero_()
        self.eagle.fc.weight.data[:, H:] = torch.eye(H)  # fc input: [embedding (H); feature (H)]
        self.eagle.fc.bias.data.zero_()
        # EAGLE-3: the draft vocabulary is the most frequent answer tokens.
        D = len(draft_ids)
        self.eagle3 = Eagle3Head(shape, D)
        self.eagle3.embed_tokens.weight.data.copy_(base.model.embed_tokens.weight)
        self.eagle3.embed_tokens.weight.requires_grad_(False)
        self.eagle3.d2t.copy_(draft_ids - torch.arange(D))
        self.eagle3.t2d.zero_()
        self.eagle3.t2d[draft_ids] = True
        self.eagle3.lm_head.weight.data.copy_(base.lm_head.weight[draft_ids])
        self.eagle3.norm.weight.data.copy_(base.model.norm.weight)
        # Medusa: residual blocks start as identity (each head first proposes the next token).
        self.medusa = torch.nn.ModuleList(ResBlock(shape.hidden_size) for _ in range(medusa_heads))
        for block in self.medusa:
            block.linear.weight.data.zero_()
            block.linear.bias.data.zero_()


def load_initial(heads: Heads, init: Path, eagle: bool = True) -> None:
    """Loads the heads that `save_heads` wrote to `init` (the shared embeddings and Medusa's
    projections, which are the target's, stay as `Heads` set them); the EAGLE heads unless
    `eagle` is False. An EAGLE-3 head whose draft vocabulary is a part of this run's is
    widened to it (`widen_eagle3`)."""
    from safetensors.torch import load_file

    for name, module in (("eagle", heads.eagle), ("eagle3", heads.eagle3)) if eagle else ():
        state = load_file(str(init / name / "model.safetensors"))
        own = module.state_dict()
        if name == "eagle3" and state["d2t"].shape != own["d2t"].shape:
            state = widen_eagle3(state, draft_vocabulary(own["d2t"]), own["embed_tokens.weight"])
        missing, unexpected = module.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items() if k in own},
                                                     strict=False)
        if set(missing) != {"embed_tokens.weight"} or unexpected or len(state) != len(own) - 1:
            raise SystemExit(f"{init / name} does not match this run's {name} head (missing {missing[:4]})")
    if len(heads.medusa):
        state = load_file(str(init / "medusa" / "medusa_resblocks.safetensors"))
        for k, block in enumerate(heads.medusa):
            block.load_state_dict({n: state[f"{k}.0.{n}"].float() for n in block.state_dict()})


def widen_eagle3(state: dict, draft_ids: torch.Tensor, embed: torch.Tensor) -> dict:
    """An EAGLE-3 head's weights (`state`, as saved) over a larger draft vocabulary,
    `draft_ids` [D'] (target ids, sorted), that holds all of the head's own D tokens. Their
    LM-head rows are kept. A new token's row starts as the linear map that best takes the
    target's embedding rows of the D tokens to their trained rows (least squares, [H, H]),
    applied to its own embedding row: the trained rows are not the target's (their cosine
    with them is about 0.76 after fourteen rounds), so the target's row alone would rank
    a new token on another scale than the kept ones."""
    own_ids = draft_vocabulary(state["d2t"])  # [D]
    where = torch.searchsorted(draft_ids, own_ids)  # [D]: each own token's place among draft_ids
    if (where >= len(draft_ids)).any() or (draft_ids[where.clamp(max=len(draft_ids) - 1)] != own_ids).any():
        raise SystemExit("the --init EAGLE-3 head's draft vocabulary is not a part of this run's")
    trained = state["lm_head.weight"].double()  # [D, H]
    mapping = torch.linalg.lstsq(embed[own_ids].double(), trained).solution  # [H, H]
    rows = embed[draft_ids].double() @ mapping  # [D', H]
    rows[where] = trained
    t2d = torch.zeros_like(state["t2d"])
    t2d[draft_ids] = True
    return {**state, "lm_head.weight": rows.to(state["lm_head.weight"].dtype),
            "d2t": draft_ids - torch.arange(len(draft_ids)), "t2d": t2d}


def tokens_seen_by(init: Path, name: str = "eagle") -> int:
    """The answer tokens (epochs counted) the heads in `init`/`name` were trained on."""
    return int(json.loads((init / name / "training.json").read_text())["answer_tokens_seen"])


def initial_train_vocabulary(init: Path) -> torch.Tensor:
    """The tokens EAGLE-1's head in `init` was trained and drafts over (its
    `draft_vocab.safetensors`), sorted as written."""
    from safetensors.torch import load_file

    return load_file(str(init / "eagle" / DRAFT_VOCAB_FILE))["token_ids"].long()


def draft_vocabulary(d2t: torch.Tensor) -> torch.Tensor:
    """An EAGLE-3 head's draft vocabulary (target ids) from its `d2t` [D] (target id =
    draft id + d2t[draft id])."""
    return d2t.long() + torch.arange(len(d2t))


def initial_draft_vocabulary(init: Path) -> torch.Tensor:
    """EAGLE-3's draft vocabulary (target ids, sorted) of the head saved in `init`."""
    from safetensors.torch import load_file

    return draft_vocabulary(load_file(str(init / "eagle3" / "model.safetensors"))["d2t"])


def holdout_scores(heads: Heads, fs: FeatureSet, ds: Dataset, lm_head, train_rows, draft_rows, batch_tokens: int,
                   ttt_steps: int, eagle: bool = True) -> dict:
    """Top-1 agreement with the target on the held-out conversations: all of them, and the
    self-distilled ones alone (the target's own answers, what serving drafts for)."""
    own = ds.self_distilled(ds.holdout)
    scores = lambda indexes: _top1(heads, fs, ds, indexes, lm_head, train_rows, draft_rows,  # noqa: E731
                                   batch_tokens, ttt_steps, eagle)
    return {"all": scores(ds.holdout), "self_distilled": scores(own)}


@torch.no_grad()
def _top1(heads: Heads, fs: FeatureSet, ds: Dataset, indexes: list[int], lm_head, train_rows, draft_rows,
          batch_tokens: int, ttt_steps: int, eagle: bool) -> dict:
    """Top-1 agreement with the target on conversations `indexes`, weighted by their answer
    tokens: EAGLE-1 and EAGLE-3 per unrolled step (unless `eagle` is False), Medusa per head."""
    sums, total = None, 0.0
    gen = torch.Generator().manual_seed(0)
    for group in batches(ds, indexes, batch_tokens, seed=0):
        ids, hidden, aux, weight = batch_tensors(fs, ds, group)
        _, (acc_e, acc_3, acc_m) = losses(heads, lm_head, train_rows, draft_rows, ids, hidden, aux, weight,
                                          ttt_steps, gen, noise=0.0, eagle=eagle)
        scores = [acc_e] + acc_3 + acc_m
        n = float(weight.sum())
        sums = [n * a for a in scores] if sums is None else [t + n * a for t, a in zip(sums, scores)]
        total += n
    if not total:
        return {}
    mean = [round(t / total, 4) for t in sums]
    steps = ttt_steps if eagle else 0
    out = {"eagle": mean[0], "eagle3_per_step": mean[1: 1 + steps]} if eagle else {}
    return dict(out, medusa_per_head=mean[1 + steps:], answer_tokens=int(total))


def train_vocab_target(hidden: torch.Tensor, lm_rows: torch.Tensor) -> torch.Tensor:
    """The target's distribution renormalised over the rows' tokens: hidden [B, T, H] -> [B, T, V']."""
    return torch.softmax(hidden @ lm_rows.T, dim=-1)


def batch_tensors(fs: FeatureSet, ds: Dataset, group: list[int]):
    """Right-padded ids [B, T], hidden [B, T, H], aux [B, T, 3H] (float32) and the answer
    weight [B, T]: 1 where the position's *next* token belongs to the answer."""
    T = max(len(ds.conversations[c]) for c in group)
    B = len(group)
    H = fs.hidden.shape[1]
    ids = torch.zeros(B, T, dtype=torch.long)
    hidden = torch.zeros(B, T, H)
    aux = torch.zeros(B, T, 3 * H)
    weight = torch.zeros(B, T)
    for row, c in enumerate(group):
        sl = fs.conversation(c)
        n = sl.stop - sl.start
        ids[row, :n] = torch.from_numpy(fs.ids[sl].astype(np.int64))
        hidden[row, :n] = torch.from_numpy(np.asarray(fs.hidden[sl], dtype=np.float32))
        aux[row, :n] = torch.from_numpy(np.asarray(fs.aux[sl], dtype=np.float32))
        weight[row, ds.prompt_lens[c] - 1: n - 1] = 1.0
    return ids, hidden, aux, weight


def losses(heads: Heads, lm_head: torch.Tensor, train_rows: torch.Tensor, draft_rows: torch.Tensor,
           ids, hidden, aux, weight, ttt_steps: int, gen: torch.Generator, noise: float, eagle: bool = True):
    """The three losses of one batch, and top-1 agreement with the target per head. With
    `eagle` False only Medusa's: the EAGLE losses are zero and their agreements 0 and []."""
    B, T = ids.shape
    rows = lm_head[train_rows]  # [V', H]: the LM head over the training vocabulary
    target = train_vocab_target(hidden, rows)  # [B, T, V']
    loss_m, acc_m = medusa_loss(heads, target, hidden, weight, rows)
    if not eagle:
        return (torch.zeros(()), torch.zeros(()), loss_m), (0.0, [], acc_m)
    # EAGLE-1: row t reads (feature t, token t + 1) and predicts feature t + 1.
    n = T - 1
    noisy = hidden[:, :n] + (torch.rand(hidden[:, :n].shape, generator=gen) - 0.5) * (2 * noise)
    pred = heads.eagle(ids[:, 1:], noisy, torch.arange(n)[None].expand(B, n), causal_mask(B, n, "cpu")[:, None])
    w1 = weight[:, 1:]
    reg = (F.smooth_l1_loss(pred, hidden[:, 1:], reduction="none").mean(-1) * w1).sum() / w1.sum().clamp(min=1)
    e_logits = pred @ rows.T
    loss_e = reg + 0.1 * soft_ce(e_logits, target[:, 1:], w1)
    acc_e = ((e_logits.argmax(-1) == target[:, 1:].argmax(-1)).float() * w1).sum() / w1.sum().clamp(min=1)
    # EAGLE-3
    draft_target = torch.softmax(hidden @ draft_rows.T, dim=-1)
    loss_3, acc_3 = eagle3_ttt_loss(heads.eagle3, ids, aux, draft_target, weight, ttt_steps)
    return (loss_e, loss_3, loss_m), (acc_e.item(), acc_3, acc_m)


def medusa_loss(heads: Heads, target: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                rows: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
    """Head k at row t proposes the token the target predicts at row t + 1 + k; target
    [B, T, V'] is the target's distribution over the LM head's `rows` [V', H]."""
    loss, acc = torch.zeros(()), []
    for k, block in enumerate(heads.medusa):
        logits = block(hidden) @ rows.T
        tgt, w = shifted(target, 1 + k), shifted(weight, 1 + k)
        loss = loss + (0.8 ** k) * soft_ce(logits, tgt, w)
        acc.append((((logits.argmax(-1) == tgt.argmax(-1)).float() * w).sum() / w.sum().clamp(min=1)).item())
    return loss, acc


def save_heads(heads: Heads, base_cfg: dict, shape, out: Path, meta: dict, train_rows: torch.Tensor) -> None:
    D = heads.eagle3.lm_head.weight.shape[0]
    heads.eagle.save_pretrained(out / "eagle", head_config(
        base_cfg, architectures=["LlamaForCausalLM"], bias=True, specdec_score_temperature=SCORE_TEMPERATURE))
    save_draft_vocab(out / "eagle", train_rows)
    heads.eagle3.save_pretrained(out / "eagle3", head_config(
        base_cfg, architectures=["LlamaForCausalLMEagle3"], bias=False, draft_vocab_size=D,
        target_hidden_size=shape.hidden_size, specdec_score_temperature=SCORE_TEMPERATURE))
    names = ["eagle", "eagle3"]
    if len(heads.medusa):  # --medusa-heads 0: Medusa not trained here, its checkpoint left as it is
        names.append("medusa")
        save_medusa(heads, shape, out / "medusa", train_rows)
    for name in names:
        (out / name / "training.json").write_text(json.dumps(meta, indent=2) + "\n")


def save_medusa(heads: Heads, shape, medusa_dir: Path, train_rows: torch.Tensor) -> None:
    """The residual blocks (setup adds the projections, the target's LM head) and the
    tokens their cross-entropy ranked over, which serving's Medusa drafting scores."""
    from safetensors.torch import save_file

    save_draft_vocab(medusa_dir, train_rows)
    state = {f"{k}.0.{name}": t.detach().to(torch.float16).contiguous()
             for k, block in enumerate(heads.medusa) for name, t in block.state_dict().items()}
    save_file(state, str(medusa_dir / "medusa_resblocks.safetensors"), metadata={"format": "pt"})
    (medusa_dir / "config.json").write_text(json.dumps(dict(
        medusa_num_heads=len(heads.medusa), medusa_num_layers=1, base_model_name_or_path="../base",
        hidden_size=shape.hidden_size, vocab_size=shape.vocab_size), indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, type=Path)
    ap.add_argument("--data", required=True, type=Path, nargs="+", help="self_distill.py JSONL files")
    ap.add_argument("--out", required=True, type=Path, help="writes eagle/, eagle3/, medusa/ under it")
    ap.add_argument("--work", type=Path, default=Path(".cache/train/heads"), help="feature cache, state, snapshots")
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per step")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ttt-steps", type=int, default=4)
    ap.add_argument("--medusa-heads", type=int, default=4, help="0: train and write only the EAGLE heads")
    ap.add_argument("--medusa-only", action="store_true",
                    help="train and write only the Medusa heads (OUT/medusa; --init then reads only its medusa/)")
    ap.add_argument("--draft-vocab", type=int, default=4096, help="EAGLE-3's draft vocabulary (without --init)")
    ap.add_argument("--widen-draft-vocab", type=int, default=0,
                    help="grow --init's EAGLE-3 draft vocabulary to this many tokens with the most frequent answer "
                    "tokens of --data it lacks (their LM-head rows start from its own, see widen_eagle3)")
    ap.add_argument("--train-vocab", type=int, default=8192, help="tokens the EAGLE-1/Medusa losses rank over")
    ap.add_argument("--keep-train-vocab", action="store_true",
                    help=f"rank over --init's eagle/{DRAFT_VOCAB_FILE} instead of this data's most frequent tokens, "
                    "so that the family's drafters (Medusa's and the draft model's hold the same file) keep one")
    ap.add_argument("--noise", type=float, default=0.1, help="EAGLE-1 input-feature noise, uniform in ±noise")
    ap.add_argument("--snapshots", default="", help="answer-token counts at which to save the EAGLE heads")
    ap.add_argument("--save-every", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", type=Path, help="start from the heads saved in this folder (eagle/, eagle3/, medusa/); "
                    "answer tokens are then counted on from theirs")
    ap.add_argument("--score-only", action="store_true",
                    help="print the --init heads' holdout scores and stop (compares rounds on the same data)")
    ap.add_argument("--draft-vocab-only", action="store_true",
                    help=f"write OUT/eagle/{DRAFT_VOCAB_FILE} (the --train-vocab most frequent answer tokens of "
                    "--data) and stop: for heads saved before training wrote it")
    ap.add_argument("--features", type=Path, help="the feature cache (default: WORK/features); one cache serves "
                    "every round whose data appends to the last round's")
    args = ap.parse_args(argv)
    if args.keep_train_vocab and not args.init:
        ap.error("--keep-train-vocab needs --init (the heads whose vocabulary to keep)")
    if args.widen_draft_vocab and (not args.init or args.medusa_only):
        ap.error("--widen-draft-vocab needs --init (the EAGLE-3 head whose vocabulary to grow)")
    if args.medusa_only and (args.medusa_heads < 1 or args.snapshots):
        ap.error("--medusa-only needs --medusa-heads >= 1 and no --snapshots (they save the EAGLE heads)")
    eagle = not args.medusa_only

    torch.manual_seed(args.seed)
    args.work.mkdir(parents=True, exist_ok=True)
    ds = load_dataset(args.data, args.max_len)
    print(ds.overlap.summary(), flush=True)
    if args.draft_vocab_only:
        save_draft_vocab(args.out / "eagle", frequent_tokens(ds, ds.train, args.train_vocab))
        print(f"wrote {args.out / 'eagle' / DRAFT_VOCAB_FILE}", flush=True)
        return
    fs = build_features(ds.conversations, ds.prompt_lens, args.base, args.features or args.work / "features",
                        log=lambda m: print(m, flush=True))
    base = LlamaModel.from_pretrained(args.base)
    for p in base.parameters():
        p.requires_grad_(False)
    base_cfg = json.loads((args.base / "config.json").read_text())
    lm_head = base.lm_head.weight.detach()
    train_rows = (initial_train_vocabulary(args.init) if args.keep_train_vocab
                  else frequent_tokens(ds, ds.train, args.train_vocab))
    draft_ids = (initial_draft_vocabulary(args.init) if args.init and eagle
                 else frequent_tokens(ds, ds.train, args.draft_vocab))
    if args.widen_draft_vocab:
        draft_ids = widened_vocabulary(ds, ds.train, draft_ids, args.widen_draft_vocab)
    # the shares of held-out answer tokens each vocabulary holds: a drafter cannot propose the others
    covered = dict(train_vocab=round(coverage(ds, ds.holdout, train_rows), 4),
                   draft_vocab=round(coverage(ds, ds.holdout, draft_ids), 4),
                   draft_vocab_self_distilled=round(coverage(ds, ds.self_distilled(ds.holdout), draft_ids), 4))
    print(f"train: {len(ds.train)} conversations, {fs.answer_tokens(ds.train)} answer tokens; holdout "
          f"{len(ds.holdout)}; train vocabulary covers {covered['train_vocab']:.3f} and the draft "
          f"vocabulary {covered['draft_vocab']:.3f} of held-out answer tokens (of the self-distilled "
          f"ones {covered['draft_vocab_self_distilled']:.3f})", flush=True)

    heads = Heads(base, base_cfg, draft_ids, args.medusa_heads)
    if args.init:
        load_initial(heads, args.init, eagle)
    draft_rows = lm_head[draft_ids]  # the target's LM head over the draft vocabulary
    trained = (heads.eagle, heads.eagle3, heads.medusa) if eagle else (heads.medusa,)
    params = [p for module in trained for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = epoch_schedule(ds, args.batch_tokens, args.epochs, args.seed)
    total = len(schedule)
    key = run_key(ds, schedule, {k: v for k, v in vars(args).items()
                                 if k not in ("save_every", "snapshots", "features")})
    gen = torch.Generator().manual_seed(args.seed)
    snapshots = sorted(int(s) for s in args.snapshots.split(",") if s)
    state_path = args.work / "state.pt"
    start_tokens = tokens_seen_by(args.init, "eagle" if eagle else "medusa") if args.init else 0
    step, seen = 0, start_tokens
    state = None if args.score_only else load_state(state_path, key)
    if state is not None:
        heads.load_state_dict(state["heads"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        step, seen = state["step"], state["seen"]
        print(f"resumed at step {step}/{total}", flush=True)

    def validate() -> dict:
        return holdout_scores(heads, fs, ds, lm_head, train_rows, draft_rows, args.batch_tokens, args.ttt_steps,
                              eagle)

    initial = validate() if state is None else state.get("initial_holdout", {})
    print(f"holdout top-1 before training: {initial}", flush=True)
    if args.score_only:
        return
    if args.init and snapshots and step == 0:  # the curve of this round starts at the heads it starts from
        save_heads(heads, base_cfg, base.shape, args.work / "snapshots" / str(seen), dict(answer_tokens=seen),
                   train_rows)
    t0 = time.time()
    while step < total:
        for g in opt.param_groups:
            g["lr"] = learning_rate(step, total, args.lr)
        ids, hidden, aux, weight = batch_tensors(fs, ds, schedule[step])
        (loss_e, loss_3, loss_m), (acc_e, acc_3, acc_m) = losses(
            heads, lm_head, train_rows, draft_rows, ids, hidden, aux, weight, args.ttt_steps, gen, args.noise, eagle)
        (loss_e + loss_3 + loss_m).backward()
        for module in trained:
            torch.nn.utils.clip_grad_norm_([p for p in module.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        before, seen = seen, seen + int(weight.sum())
        step += 1
        for s in snapshots:
            if before < s <= seen:
                save_heads(heads, base_cfg, base.shape, args.work / "snapshots" / str(s), dict(answer_tokens=s),
                           train_rows)
        if step % 5 == 0 or step == total:
            el = time.time() - t0
            print(f"step {step}/{total} tokens {seen} | eagle {loss_e.item():.3f} top1 {acc_e:.2f} | eagle3 "
                  f"{loss_3.item():.3f} top1/step {[round(a, 2) for a in acc_3]} | medusa {loss_m.item():.3f} "
                  f"top1/head {[round(a, 2) for a in acc_m]} | {el / 60:.1f} min", flush=True)
        if step % args.save_every == 0 or step == total:
            torch.save({"heads": heads.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                        "step": step, "seen": seen, "run_key": key, "initial_holdout": initial}, state_path)
    final = validate()
    print(f"holdout top-1 after training: {final}", flush=True)
    meta = dict(answer_tokens_seen=seen, conversations=len(ds.train), epochs=args.epochs, steps=total,
                batch_tokens=args.batch_tokens, lr=args.lr, seed=args.seed, ttt_steps=args.ttt_steps,
                draft_vocab=len(draft_ids), train_vocab=args.train_vocab, noise=args.noise,
                overlap=ds.overlap.summary(), init=str(args.init) if args.init else None,
                answer_tokens_this_run=seen - start_tokens,
                holdout_vocabulary_coverage=covered, holdout_top1_before=initial, holdout_top1_after=final)
    if eagle:
        save_heads(heads, base_cfg, base.shape, args.out, meta, train_rows)
    else:
        save_medusa(heads, base.shape, args.out / "medusa", train_rows)
        (args.out / "medusa" / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"saved to {args.out}", flush=True)


if __name__ == "__main__":
    main()
