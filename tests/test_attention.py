"""Attention of one query per row on the CPU (`layers.single_query_attention`): the
query heads that share a KV head run as that head's rows. It equals grouped-query
attention written out (query head h reads KV head h // (H / H_kv)), and the layer
takes that path for single-query forwards with the same result as `enable_gqa`."""
from __future__ import annotations

import random

import pytest
import torch

from specdec.kv_cache import AttentionBatch, KVCache
from specdec.models import layers
from specdec.models.layers import Attention, LlamaShape, single_query_attention


def written_out(q, k, v, mask):
    """q [B, H, 1, D], k/v [B, H_kv, S, D], mask broadcastable to [B, 1, 1, S]: float64."""
    B, H, _, D = q.shape
    group = H // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).double(), v.repeat_interleave(group, dim=1).double()
    scores = q.double() @ k.transpose(-1, -2) / D ** 0.5  # [B, H, 1, S]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 2), (8, 1), (4, 4)])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_equals_grouped_query_attention_written_out(heads, kv_heads, dtype, tol):
    rng = random.Random(heads * 10 + kv_heads)
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    for _ in range(20):
        B, S, D = rng.randint(1, 5), rng.randint(1, 40), rng.choice([4, 8, 64])
        q = torch.randn(B, heads, 1, D, generator=gen, dtype=dtype)
        k, v = (torch.randn(B, kv_heads, S, D, generator=gen, dtype=dtype) for _ in range(2))
        mask = torch.rand(rng.choice([1, B]), 1, 1, S, generator=gen) < 0.7
        mask[..., rng.randrange(S)] = True  # every row sees a key
        for m in (mask, None):
            got = single_query_attention(q, k, v, m)
            assert got.shape == q.shape and got.dtype == dtype
            assert (got.double() - written_out(q, k, v, m)).abs().max() < tol


def test_a_cached_single_query_forward_takes_it_and_matches_enable_gqa(monkeypatch):
    shape = LlamaShape(vocab_size=32, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=6, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                       rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64,
                       attention_bias=False, tie_word_embeddings=False)
    torch.manual_seed(0)
    attn = Attention(shape).double()
    slots, prefix = [4, 1, 2], torch.tensor([5, 9, 0])
    cache = KVCache(1, 6, 2, 32, 8, torch.float64, "cpu")
    cache.kv.copy_(torch.randn_like(cache.kv))
    batch = AttentionBatch.build(torch.tensor(slots), prefix, torch.ones(3, 1, 1, dtype=torch.bool),
                                 host_slots=slots)
    x, positions = torch.randn(3, 1, 48, dtype=torch.float64), prefix[:, None]
    cos, sin = layers.rope_tables(layers.rope_inv_freq(shape), positions, torch.float64)
    calls = []
    monkeypatch.setattr(layers, "single_query_attention",
                        lambda *a: calls.append(1) or single_query_attention(*a))
    with torch.inference_mode():  # (as serving runs)
        grouped = attn(x, cos, sin, batch.mask, cache, 0, batch)
        assert calls == [1]
        monkeypatch.setattr(layers, "GROUP_SINGLE_QUERIES", False)
        kernels_own = attn(x, cos, sin, batch.mask, cache, 0, batch)
    assert calls == [1]
    assert (grouped - kernels_own).abs().max() < 1e-12


@pytest.mark.parametrize("slots, n", [([3], 8), ([4, 1, 2], 5), ([2, 3], 1), ([5], 1)])
def test_a_forwards_mask_is_made_additive_once_with_the_bool_masks_result(monkeypatch, slots, n):
    shape = LlamaShape(vocab_size=32, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=6, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                       rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64,
                       attention_bias=False, tie_word_embeddings=False)
    gen = torch.Generator().manual_seed(n * 10 + len(slots))
    torch.manual_seed(1)
    attn = Attention(shape)
    B = len(slots)
    prefix = torch.randint(0, 20, (B,), generator=gen)
    local = (torch.rand(B, n, n, generator=gen) < 0.5).tril() | torch.eye(n, dtype=torch.bool)  # a tree: self seen
    cache = KVCache(2, 6, 2, 40, 8, torch.float32, "cpu")
    cache.kv[0] = torch.randn(cache.kv[0].shape, generator=gen)
    cache.kv[1] = cache.kv[0]  # layer 1 sees what layer 0 does
    batch = AttentionBatch.build(torch.tensor(slots), prefix, local, host_slots=slots)
    x = torch.randn(B, n, 48, generator=gen)
    cos, sin = layers.rope_tables(layers.rope_inv_freq(shape), prefix[:, None] + torch.arange(n), torch.float32)
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: seen.append(kw["attn_mask"].dtype) or sdpa(*a, **kw))
    with torch.inference_mode():
        first = attn(x, cos, sin, batch.mask, cache, 0, batch)
        made = batch._additive
        second = attn(x, cos, sin, batch.mask, cache, 1, batch)  # the next layer
        assert batch._additive is made  # made once for the forward
        with_bool = attn(x, cos, sin, batch.mask.clone(), cache, 0, batch)  # not the batch's: as given
    assert seen == [torch.float32, torch.float32, torch.bool]
    assert torch.equal(made, torch.zeros(made.shape).masked_fill(~batch.mask, float("-inf")))
    assert torch.equal(first, with_bool) and torch.equal(first, second)
