"""Medusa heads, in Medusa's own checkpoint layout.

Layout (as `FasterDecoding/medusa-vicuna-7b-v1.3`): `config.json` with
`medusa_num_heads` and `medusa_num_layers`; weights in `medusa_lm_head.safetensors`
(or `medusa_lm_head.pt`) keyed `{head}.{j}.linear.weight/bias` for the residual blocks
j < medusa_num_layers and `{head}.{medusa_num_layers}.weight` for the vocabulary
projection. Head k reads the base model's final (post-norm) hidden state at position t
and proposes the token at t + 2 + k (the base lm_head proposes t + 1).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from ..errors import ConfigError
from .checkpoint import load_state_dict, read_config
from .layers import vocabulary_projection

WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "model.safetensors", "pytorch_model.bin")


class ResBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.ModuleList):
    """A ModuleList of heads, so parameter names are Medusa's `{head}.{j}.*`."""

    def __init__(self, hidden: int, vocab: int, num_heads: int, num_layers: int):
        super().__init__(
            nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)], nn.Linear(hidden, vocab, bias=False))
            for _ in range(num_heads)
        )
        self.num_layers = num_layers
        self.rows: Optional[torch.Tensor] = None  # [K] the token ids the projections kept; None: every token

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., H] -> logits [num_heads, ..., V] float32."""
        return torch.stack([head(hidden) for head in self]).float()

    def keep_rows(self, token_ids: torch.Tensor) -> None:
        """Keep only the vocabulary projection rows of `token_ids` [K] (a drafting
        vocabulary): each head then outputs [..., K] logits, column i for token_ids[i],
        and the full [V, H] projections are freed (on SmolLM2 four heads of 113 MB in
        float32)."""
        for head in self:
            head[-1] = vocabulary_projection(head[-1].weight, token_ids)[1]
        self.rows = token_ids.to(dtype=torch.long)

    @staticmethod
    def from_pretrained(directory: str | Path, hidden: int, vocab: int, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", rows: Optional[torch.Tensor] = None) -> "MedusaHeads":
        """The heads in `directory`; with `rows` ([K] token ids, a drafting vocabulary)
        cut by `keep_rows(rows)` while they still hold the file's tensors, so the full
        [V, H] projections never exist in `dtype` (on SmolLM2, 4 x 113 MB in float32)."""
        cfg = read_config(directory)
        if "medusa_num_heads" not in cfg:
            raise ConfigError(f"{str(directory)!r}: config.json has no 'medusa_num_heads'")
        with torch.device("meta"):  # shapes only: every parameter is then assigned from the file
            heads = MedusaHeads(hidden, vocab, cfg["medusa_num_heads"], cfg.get("medusa_num_layers", 1))
        state = load_state_dict(directory, names=WEIGHT_FILES)
        missing, unexpected = heads.load_state_dict(state, strict=False, assign=True)  # the file's own tensors
        if missing or unexpected:
            raise ConfigError(f"{str(directory)!r} is not a Medusa checkpoint for hidden {hidden}, vocab {vocab} "
                              f"(missing {missing[:4]}, unexpected {unexpected[:4]})")
        del state
        if rows is not None:  # cut in the file's dtype, before any conversion
            heads.keep_rows(rows)
        return heads.to(device=device, dtype=dtype).eval()

    def save_pretrained(self, directory: str | Path, config: dict, dtype=torch.float16) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(directory / "medusa_lm_head.safetensors"), metadata={"format": "pt"})
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
