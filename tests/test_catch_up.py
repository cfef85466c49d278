"""A catch-up's output at one position per request (`queries`) equals the full forward's.

An EAGLE catch-up feeds the head every pending pair but drafts only from the last one,
so the head's last layer computes keys and values for all pairs (its KV cache needs
them) and its attention output and MLP at one position per row (`Attention` and
`DecoderLayer` with `queries`). Checked in float64 for the test family's EAGLE-1/2
and EAGLE-3 heads, a random two-layer head with q/k/v biases, and unfused projections:
the outputs at the chosen positions and the KV caches equal the full forward's, with
padded rows and cached prefixes of different lengths.
"""
from __future__ import annotations

import pytest
import torch

from engine_helpers import FAMILY
from specdec.kv_cache import AttentionBatch
from specdec.models.eagle import EagleHead
from specdec.models.eagle3 import Eagle3Head
from specdec.models.layers import Attention, MLP, causal_mask
from specdec.models.random_init import random_eagle_head


def _head(kind: str):
    if kind == "eagle3":
        return Eagle3Head.from_pretrained(FAMILY / "eagle3", FAMILY / "base", torch.float64)
    if kind == "two-layers-bias":
        config = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attention_bias=True, max_position_embeddings=512)
        head = random_eagle_head(config, torch.float64, std=0.2, seed=3)
        for m in head.modules():
            if isinstance(m, Attention) and m.q_proj.bias is not None:
                with torch.no_grad():
                    m.qkv.bias.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(4))
        return head
    head = EagleHead.from_pretrained(FAMILY / "eagle", FAMILY / "base", torch.float64)
    if kind == "unfused":
        for m in head.modules():
            if isinstance(m, Attention):
                m.qkv = m.kv = None
            if isinstance(m, MLP):
                m.gate_up = None
    return head


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "two-layers-bias", "unfused"])
def test_output_at_one_position_equals_the_full_forward(kind):
    head = _head(kind)
    gen = torch.Generator().manual_seed(0)
    B, T, slots = 3, 37, torch.tensor([0, 2, 3])
    lens = torch.tensor([37, 20, 5])  # real pairs per row; the rest of a row is padding
    head_len = torch.tensor([0, 11, 60])  # pairs already cached
    vocab = head.embed_tokens.weight.shape[0]
    ids = torch.randint(0, vocab, (B, T), generator=gen)
    width = head.fc.weight.shape[1] if kind == "eagle3" else head.fc.weight.shape[0]
    features = torch.randn(B, T, width, generator=gen, dtype=torch.float64)
    x = head.fc(features) if kind == "eagle3" else features
    positions = head_len[:, None] + torch.arange(T)[None]
    caches = [head.new_cache(4, 128) for _ in range(2)]
    prior = torch.randn(caches[0].kv.shape, generator=gen, dtype=torch.float64)  # cached prefixes
    for cache in caches:
        cache.kv.copy_(prior)
    with torch.inference_mode():
        batch = AttentionBatch.build(slots, head_len, causal_mask(B, T, "cpu"), host_slots=[0, 2, 3])
        full = head(ids, x, positions, batch.mask, caches[0], batch)  # [B, T, H]
        one = head(ids, x, positions, batch.mask, caches[1], batch, queries=lens - 1)  # [B, 1, H]
    assert one.shape == (B, 1, full.shape[-1])
    torch.testing.assert_close(one[:, 0], full[torch.arange(B), lens - 1], rtol=1e-12, atol=1e-12)
    # Keys and values come from a slice of the fused q/k/v weight instead of the whole
    # one: the same products, summed in another order (equal to float64 rounding).
    torch.testing.assert_close(caches[1].kv, caches[0].kv, rtol=1e-12, atol=1e-12)
    assert not torch.equal(caches[0].kv, prior)  # the forward did write
