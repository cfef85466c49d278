"""The EAGLE-3 draft head, in EAGLE-3's own checkpoint layout.

Layout (as `yuhuili/EAGLE3-LLaMA3.1-Instruct-8B`): `config.json` is a Llama config
with `num_hidden_layers: 1`, `draft_vocab_size` and optionally `target_hidden_size`;
weights `fc.weight` [H, 3 * H_target] (fuses the base model's low/mid/high features),
`midlayer.{hidden_norm, input_layernorm, self_attn.*, post_attention_layernorm, mlp.*}`
(attention projections take 2H: the normed token embedding beside the normed
hidden state), `norm.weight`, `lm_head.weight` [draft_vocab, H], and the vocabulary
maps `d2t` [draft_vocab] (target id = draft id + d2t[draft id]) and `t2d` [vocab]
(bool: the target token is in the draft vocabulary). Embeddings come from the base
model unless the checkpoint carries `embed_tokens.weight`.

Features: the inputs of base layers (2, N // 2, N - 3), concatenated in that order.
Pairing as EAGLE-1: input at position t is (embed(x[t+1]), g[t]); the output hidden
state both proposes x[t+2] (through norm + lm_head) and is the next step's input.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file
from torch import nn

from ..errors import ConfigError
from ..kv_cache import AttentionBatch, KVCache
from .checkpoint import load_state_dict, load_tensor, read_config
from .layers import (MLP, Attention, LlamaShape, RMSNorm, at_positions, fuse_projections, rope_inv_freq,
                     rope_tables)


MIN_BASE_LAYERS = 3  # the fewest base layers that have all three feature layers below


def eagle3_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """The base layers whose inputs EAGLE-3 fuses (low, mid, high), as EAGLE-3's reference
    code picks them. They exist from MIN_BASE_LAYERS layers on, and are distinct from 7."""
    return (2, num_layers // 2, num_layers - 3)


class Eagle3Layer(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        H = shape.hidden_size
        self.hidden_norm = RMSNorm(H, shape.rms_norm_eps)
        self.input_layernorm = RMSNorm(H, shape.rms_norm_eps)
        self.self_attn = Attention(shape, in_features=2 * H)
        self.post_attention_layernorm = RMSNorm(H, shape.rms_norm_eps)
        self.mlp = MLP(H, shape.intermediate_size)

    def forward(self, emb, hidden, cos, sin, mask, cache=None, batch=None, queries=None):
        """emb, hidden: [B, T, H] -> [B, T, H], or [B, 1, H] at `queries` (see Attention)."""
        x = torch.cat((self.input_layernorm(emb), self.hidden_norm(hidden)), dim=-1)
        residual = hidden if queries is None else at_positions(hidden, queries)
        x = residual + self.self_attn(x, cos, sin, mask, cache, 0, batch, queries)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(nn.Module):
    def __init__(self, shape: LlamaShape, draft_vocab_size: int, target_hidden_size: Optional[int] = None):
        super().__init__()
        self.shape = shape
        H = shape.hidden_size
        self.embed_tokens = nn.Embedding(shape.vocab_size, H)
        self.fc = nn.Linear(3 * (target_hidden_size or H), H, bias=False)
        self.midlayer = Eagle3Layer(shape)
        self.norm = RMSNorm(H, shape.rms_norm_eps)
        self.lm_head = nn.Linear(H, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(shape.vocab_size, dtype=torch.bool))
        self.register_buffer("inv_freq", rope_inv_freq(shape), persistent=False)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor, cache: Optional[KVCache] = None,
                batch: Optional[AttentionBatch] = None, queries: Optional[torch.Tensor] = None) -> torch.Tensor:
        """input_ids, positions: [B, T]; hidden: [B, T, H], either `fc(features)` or the
        head's own previous output. Returns the next hidden state [B, T, H], or with
        `queries` ([B] int64) only at those positions, [B, 1, H] (every token's KV is
        still written)."""
        emb = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = rope_tables(self.inv_freq, positions, hidden.dtype)
        return self.midlayer(emb, hidden, cos, sin, mask, cache, batch, queries)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., draft_vocab] float32."""
        return self.lm_head(self.norm(hidden)).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        s, p = self.shape, self.fc.weight
        return KVCache(1, num_slots, s.num_key_value_heads, max_len, s.head_dim, p.dtype, p.device)

    @staticmethod
    def from_pretrained(directory: str | Path, base_dir: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> "Eagle3Head":
        cfg = read_config(directory)
        shape = LlamaShape.from_config({**cfg, "model_type": "llama"})
        draft_vocab = cfg.get("draft_vocab_size") or cfg["vocab_size"]
        head = Eagle3Head(shape, draft_vocab, cfg.get("target_hidden_size"))
        state = load_state_dict(directory)
        if "embed_tokens.weight" not in state:
            state["embed_tokens.weight"] = load_tensor(base_dir, "model.embed_tokens.weight")
        if "d2t" not in state:  # full draft vocabulary: identity maps
            state["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
            state["t2d"] = torch.ones(shape.vocab_size, dtype=torch.bool)
        missing, unexpected = head.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ConfigError(f"{str(directory)!r} is not an EAGLE-3 head checkpoint "
                              f"(missing {missing[:4]}, unexpected {unexpected[:4]})")
        head = head.to(device=device, dtype=dtype).eval()
        head.d2t, head.t2d = head.d2t.long(), head.t2d.bool()
        return fuse_projections(head)

    def save_pretrained(self, directory: str | Path, config: dict, dtype=torch.float16) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {}
        for k, v in self.state_dict().items():
            if k == "embed_tokens.weight":
                continue
            state[k] = v.detach().contiguous() if k in ("d2t", "t2d") else v.detach().to(dtype).contiguous()
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
