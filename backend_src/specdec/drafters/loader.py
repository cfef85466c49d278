"""Loading every drafter the config names, and the default static trees.

All drafters whose checkpoints the config gives are loaded, not only the default
method's, so a request can pick any of them (`speculative_method` per request).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from ..config import EngineConfig
from ..errors import ConfigError, InputError
from ..models.checkpoint import read_config, torch_dtype
from ..models.eagle import EagleHead
from ..models.eagle3 import MIN_BASE_LAYERS, Eagle3Head
from ..models.llama import LlamaModel
from ..models.medusa import MedusaHeads
from .choices import static_tree
from .draft_model import DraftModelDrafter
from .eagle import EagleDrafter
from .medusa import MedusaDrafter


# In an EAGLE-1/2 head's, the Medusa heads' or the draft model's folder (not an upstream
# file): the tokens its drafting scores (`token_ids`, [K] int64), the most frequent answer
# tokens of the training data (FR-Spec). Without it a drafter scores the full LM head.
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


@dataclass
class LoadedDrafters:
    drafters: dict = field(default_factory=dict)  # method -> drafter
    trees: dict = field(default_factory=dict)  # "eagle" / "medusa" -> default StaticTree
    medusa_heads: int = 0


def load_drafters(config: EngineConfig, target: LlamaModel, max_len: int, slots: int) -> LoadedDrafters:
    """Drafters with KV caches of `slots` slots (the engine re-sizes them with
    `allocate` once it knows how many fit)."""
    dtype, device = torch_dtype(config.dtype), target.lm_head.weight.device
    out = LoadedDrafters()
    try:
        if config.eagle_dir:
            head = EagleHead.from_pretrained(config.eagle_dir, config.base_model_dir, dtype, device)
            drafter = EagleDrafter(head, target, slots, max_len, _score_temperature(config, config.eagle_dir),
                                   draft_vocab(config.eagle_dir, "eagle_dir", target.shape.vocab_size))
            out.drafters["eagle"] = out.drafters["eagle2"] = drafter
            out.trees["eagle"] = _tree(config.eagle_choices, "eagle_choices", 16)
        if config.eagle3_dir:
            if target.shape.num_hidden_layers < MIN_BASE_LAYERS:
                raise ConfigError(f"eagle3_dir: EAGLE-3 reads the base model's layers 2, n // 2 and n - 3, which needs at "
                                  f"least {MIN_BASE_LAYERS} layers; this base model has "
                                  f"{target.shape.num_hidden_layers}")
            head3 = Eagle3Head.from_pretrained(config.eagle3_dir, config.base_model_dir, dtype, device)
            out.drafters["eagle3"] = EagleDrafter(head3, target, slots, max_len,
                                                   _score_temperature(config, config.eagle3_dir))
        if config.medusa_dir:
            vocabulary = draft_vocab(config.medusa_dir, "medusa_dir", target.shape.vocab_size)
            heads = MedusaHeads.from_pretrained(config.medusa_dir, target.shape.hidden_size,
                                                target.shape.vocab_size, dtype, device, rows=vocabulary)
            out.drafters["medusa"] = MedusaDrafter(heads, vocabulary)
            out.medusa_heads = len(heads)
            out.trees["medusa"] = _tree(config.medusa_choices, "medusa_choices", len(heads))
        if config.draft_model_dir:
            if read_config(config.draft_model_dir).get("vocab_size") != target.shape.vocab_size:
                raise ConfigError("draft_model_dir: the draft model's vocabulary differs from the base model's")
            model = LlamaModel.from_pretrained(config.draft_model_dir, dtype, device)
            out.drafters["draft_model"] = DraftModelDrafter(
                model, slots, max_len, draft_vocab(config.draft_model_dir, "draft_model_dir", target.shape.vocab_size))
    except (KeyError, ValueError, OSError) as e:
        raise ConfigError(f"cannot load a drafter: {type(e).__name__}: {e}") from None
    return out


def _tree(spec: str, name: str, max_depth: int):
    try:
        return static_tree(spec, top_k=16, max_depth=max_depth)
    except InputError as e:
        raise ConfigError(f"parameter {name!r}: {e}") from None


def draft_vocab(head_dir: str, parameter: str, vocab_size: int) -> Optional[torch.Tensor]:
    """The drafter's drafting vocabulary (ascending target ids), or None (the full LM head)
    when its folder (the config's `parameter`) has no DRAFT_VOCAB_FILE."""
    from safetensors.torch import load_file

    path = Path(head_dir) / DRAFT_VOCAB_FILE
    if not path.is_file():
        return None
    where = f"{parameter}: {DRAFT_VOCAB_FILE}"
    try:
        ids = load_file(str(path)).get("token_ids")
    except Exception as e:  # safetensors raises its own error types on a damaged file
        raise ConfigError(f"{where}: cannot read it: {e}") from None
    if ids is None or ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64) or len(ids) == 0:
        raise ConfigError(f"{where}: needs 'token_ids', a non-empty 1-D integer tensor")
    ids = ids.long().sort().values
    if int(ids[0]) < 0 or int(ids[-1]) >= vocab_size or bool((ids[1:] == ids[:-1]).any()):
        raise ConfigError(f"{where}: token_ids must be distinct ids below the vocabulary size {vocab_size}")
    return ids


def _score_temperature(config: EngineConfig, head_dir: str) -> float:
    """The config's EAGLE-2/3 ranking temperature, else the head checkpoint's own
    recommendation (`specdec_score_temperature`, not an upstream key), else 1."""
    if config.eagle_score_temperature is not None:
        return config.eagle_score_temperature
    return float(read_config(head_dir).get("specdec_score_temperature", 1.0))
