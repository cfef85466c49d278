"""The EAGLE-1/2 draft head, in EAGLE's own checkpoint layout.

Layout (as `yuhuili/EAGLE-Vicuna-7B-v1.3`): `config.json` is a Llama config with
`num_hidden_layers: 1` and `bias` (the fc bias); weights `fc.weight` [H, 2H],
`fc.bias` [H], `layers.0.*` (a Llama layer without `input_layernorm`), optionally
`embed_tokens.weight` (else the base model's embeddings are used). No norm, no
lm_head: the head predicts the base model's next *feature* (its final, post-norm
hidden state) and the base `lm_head` turns that into draft logits.

Pairing: the head's input at position t is (embed(x[t+1]), f[t]) and its output
estimates f[t+1], whose logits propose x[t+2].
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
from .layers import DecoderLayer, LlamaShape, fuse_projections, rope_inv_freq, rope_tables


class EagleHead(nn.Module):
    def __init__(self, shape: LlamaShape, fc_bias: bool = True):
        super().__init__()
        self.shape = shape
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.fc = nn.Linear(2 * shape.hidden_size, shape.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(shape, input_norm=i != 0)
                                    for i in range(shape.num_hidden_layers))
        self.register_buffer("inv_freq", rope_inv_freq(shape), persistent=False)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor, cache: Optional[KVCache] = None,
                batch: Optional[AttentionBatch] = None, queries: Optional[torch.Tensor] = None) -> torch.Tensor:
        """input_ids, positions: [B, T]; features: [B, T, H]; mask: [B, 1, T, keys] bool.
        Returns predicted next features [B, T, H], or with `queries` ([B] int64) only
        at those positions, [B, 1, H]: the last layer still writes every token's KV
        (a catch-up needs the head's cache, and its output at one position)."""
        x = self.fc(torch.cat((self.embed_tokens(input_ids).to(features.dtype), features), dim=-1))
        cos, sin = rope_tables(self.inv_freq, positions, x.dtype)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache, i, batch, queries if i == last else None)
        return x

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        s, p = self.shape, self.fc.weight
        return KVCache(s.num_hidden_layers, num_slots, s.num_key_value_heads, max_len, s.head_dim, p.dtype, p.device)

    @staticmethod
    def from_pretrained(directory: str | Path, base_dir: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> "EagleHead":
        cfg = read_config(directory)
        shape = LlamaShape.from_config({**cfg, "model_type": "llama"})
        state = load_state_dict(directory)
        head = EagleHead(shape, fc_bias="fc.bias" in state or bool(cfg.get("bias", True)))
        if "embed_tokens.weight" not in state:
            state["embed_tokens.weight"] = load_tensor(base_dir, "model.embed_tokens.weight")
        missing, unexpected = head.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ConfigError(f"{str(directory)!r} is not an EAGLE-1 head checkpoint "
                              f"(missing {missing[:4]}, unexpected {unexpected[:4]})")
        return fuse_projections(head.to(device=device, dtype=dtype).eval())

    def save_pretrained(self, directory: str | Path, config: dict, dtype=torch.float16) -> None:
        """Writes `config.json` and `model.safetensors` (without the shared embeddings)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()
                 if k != "embed_tokens.weight"}
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
