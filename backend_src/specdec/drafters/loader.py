"""Loading every drafter the config names, and the default static trees.

All drafters whose checkpoints the config gives are loaded, not only the default
method's, so a request can pick any of them (`speculative_method` per request).
"""
from __future__ import annotations

from dataclasses import dataclass, field

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
            drafter = EagleDrafter(head, target, slots, max_len, _score_temperature(config, config.eagle_dir))
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
            heads = MedusaHeads.from_pretrained(config.medusa_dir, target.shape.hidden_size,
                                                target.shape.vocab_size, dtype, device)
            out.drafters["medusa"] = MedusaDrafter(heads)
            out.medusa_heads = len(heads)
            out.trees["medusa"] = _tree(config.medusa_choices, "medusa_choices", len(heads))
        if config.draft_model_dir:
            if read_config(config.draft_model_dir).get("vocab_size") != target.shape.vocab_size:
                raise ConfigError("draft_model_dir: the draft model's vocabulary differs from the base model's")
            model = LlamaModel.from_pretrained(config.draft_model_dir, dtype, device)
            out.drafters["draft_model"] = DraftModelDrafter(model, slots, max_len)
    except (KeyError, ValueError, OSError) as e:
        raise ConfigError(f"cannot load a drafter: {type(e).__name__}: {e}") from None
    return out


def _tree(spec: str, name: str, max_depth: int):
    try:
        return static_tree(spec, top_k=16, max_depth=max_depth)
    except InputError as e:
        raise ConfigError(f"parameter {name!r}: {e}") from None


def _score_temperature(config: EngineConfig, head_dir: str) -> float:
    """The config's EAGLE-2/3 ranking temperature, else the head checkpoint's own
    recommendation (`specdec_score_temperature`, not an upstream key), else 1."""
    if config.eagle_score_temperature is not None:
        return config.eagle_score_temperature
    return float(read_config(head_dir).get("specdec_score_temperature", 1.0))
