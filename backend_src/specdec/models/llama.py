"""The target (and draft-model) forward: a Llama-family decoder over a static KV cache.

Loads Hugging Face checkpoints (Llama, Vicuna, Llama-3, Mistral, Qwen2 shapes) from a
local directory. One forward takes any batch of token blocks, each a prompt, a single
decode token, a chain or a tree: the caller gives per-request cache slots, prefix
lengths, positions and the block's local mask, and gets back final (post-norm) hidden
states and, when asked, the inputs of chosen layers (EAGLE-3's low/mid/high features).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from ..errors import ConfigError
from ..kv_cache import AttentionBatch, KVCache
from .checkpoint import load_state_dict, read_config
from .layers import (DecoderLayer, ForwardPart, LlamaShape, RMSNorm, fuse_projections, rope_inv_freq,
                     rope_tables)


class _Body(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_hidden_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


class LlamaModel(nn.Module):
    """`model.*` + `lm_head` with Hugging Face's parameter names."""

    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.shape = shape
        self.model = _Body(shape)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(shape), persistent=False)

    @staticmethod
    def from_pretrained(directory: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> "LlamaModel":
        shape = LlamaShape.from_config(read_config(directory))
        with torch.device("meta"):
            model = LlamaModel(shape)
        state = load_state_dict(directory)
        if shape.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        expected = {k for k in model.state_dict() if not (shape.tie_word_embeddings and k == "lm_head.weight")}
        missing, unexpected = expected - state.keys(), state.keys() - expected
        unexpected = {k for k in unexpected if not k.endswith("rotary_emb.inv_freq")}
        if missing or unexpected:
            raise ConfigError(f"{str(directory)!r}: checkpoint does not match its config "
                              f"(missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]})")
        model.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False, assign=True)
        if shape.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.inv_freq = rope_inv_freq(shape)
        return fuse_projections(model.to(device=device, dtype=dtype).eval())

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        s = self.shape
        p = self.lm_head.weight
        return KVCache(s.num_hidden_layers, num_slots, s.num_key_value_heads, max_len, s.head_dim,
                       p.dtype, p.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                batch: AttentionBatch, aux_layers: Sequence[int] = ()
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """input_ids, positions: [B, T]. Returns (hidden [B, T, H] after the final norm,
        aux [B, T, len(aux_layers) * H] = inputs of those layers, or None)."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_tables(self.inv_freq, positions, x.dtype)
        return self._decoder(x, lambda layer, h, i: layer(h, cos, sin, batch.mask, cache, i, batch), aux_layers)

    def _decoder(self, x: torch.Tensor, run_layer: Callable[[nn.Module, torch.Tensor, int], torch.Tensor],
                 aux_layers: Sequence[int]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x [..., H] through every decoder layer (`run_layer(layer, x, index)`) and the final
        norm. Returns (hidden [..., H], the inputs of `aux_layers` concatenated [..., len * H]
        or None)."""
        aux: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if i in aux_layers:
                aux[i] = x
            x = run_layer(layer, x, i)
        feats = torch.cat([aux[i] for i in aux_layers], dim=-1) if aux_layers else None
        return self.model.norm(x), feats

    def forward_parts(self, parts: Sequence[tuple[torch.Tensor, torch.Tensor, AttentionBatch]], cache: KVCache,
                      aux_layers: Sequence[int] = ()
                      ) -> list[tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """`forward` of several blocks at once: each part (input_ids [B_p, T_p], positions
        [B_p, T_p], its AttentionBatch) gets what `forward` would return for it alone
        (hidden [B_p, T_p, H], aux or None), but every matmul runs once over all parts'
        tokens, so the weights are read once for all of them (a decode step and a prompt
        being prefilled; attention stays per part). On the 2-core CPU a step of 16 decode
        tokens with a 52-126-token prompt riding took 0.81 of its time with the prompt in
        a forward of its own (docs/benchmarks.md 2.9)."""
        H = self.shape.hidden_size
        dtype = self.model.embed_tokens.weight.dtype
        blocks = []
        for ids, positions, batch in parts:
            cos, sin = rope_tables(self.inv_freq, positions, dtype)
            blocks.append(ForwardPart(tuple(ids.shape), cos, sin, batch))
        x = self.model.embed_tokens(torch.cat([ids.reshape(-1) for ids, _, _ in parts]))  # [R, H]
        hidden, feats = self._decoder(x, lambda layer, h, i: layer.forward_parts(h, blocks, cache, i), aux_layers)
        out, start = [], 0
        for block in blocks:
            B, T = block.shape
            rows = slice(start, start + B * T)
            out.append((hidden[rows].view(B, T, H),
                        None if feats is None else feats[rows].view(B, T, feats.shape[-1])))
            start += B * T
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
