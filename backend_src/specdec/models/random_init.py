"""Models with seeded random weights, built from a config dict without checkpoint files.

For benchmarks and smoke tests that need a model's shape, not its knowledge (e.g. a
Llama-2-7B-shaped target on a GPU). Owns: building a `LlamaModel` or an EAGLE-1/2
`EagleHead` from a Hugging Face-style config dict, initialised with normal(0, std)
weights (RMSNorm weights 1, biases 0), in serving form (eval, fused projections) as
`from_pretrained` returns it. Does not own: reading or writing checkpoints.

The module is built on the meta device and materialised once on the target device in
the target dtype, so a 7B shape never passes through CPU memory or float32.
"""
from __future__ import annotations

import torch
from torch import nn

from .eagle import EagleHead
from .layers import LlamaShape, RMSNorm, fuse_projections, rope_inv_freq
from .llama import LlamaModel


def random_llama(config: dict, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 seed: int = 0, std: float = 0.02) -> LlamaModel:
    """A `LlamaModel` of `config`'s shape with seeded random weights."""
    shape = LlamaShape.from_config(config)
    with torch.device("meta"):
        model = LlamaModel(shape)
    model = _materialise(model, dtype, device, seed, std)
    if shape.tie_word_embeddings:  # to_empty gives every parameter its own storage
        model.lm_head.weight = model.model.embed_tokens.weight
    return fuse_projections(model.eval())


def random_eagle_head(config: dict, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                      seed: int = 0, std: float = 0.02, fc_bias: bool = True) -> EagleHead:
    """An EAGLE-1/2 head (fc 2H -> H, then `num_hidden_layers` decoder layers, as
    `yuhuili/EAGLE-llama2-chat-7B` with 1) with seeded random weights and embeddings."""
    shape = LlamaShape.from_config({**config, "model_type": "llama"})
    with torch.device("meta"):
        head = EagleHead(shape, fc_bias=fc_bias)
    return fuse_projections(_materialise(head, dtype, device, seed, std).eval())


def _materialise(module: nn.Module, dtype: torch.dtype, device: str | torch.device, seed: int,
                 std: float) -> nn.Module:
    """Meta module -> `device`/`dtype` storage, filled in; RoPE tables recomputed (the
    meta ones hold nothing) and cast to `dtype`, as `from_pretrained`'s final `.to` does."""
    module = module.to(dtype=dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    norm_weights = {id(m.weight) for m in module.modules() if isinstance(m, RMSNorm)}
    with torch.no_grad():
        for name, p in module.named_parameters():  # registration order: same seed, same weights
            if id(p) in norm_weights:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=gen)
    module.inv_freq = rope_inv_freq(module.shape).to(device=device, dtype=dtype)
    return module
