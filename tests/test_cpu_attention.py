"""The CPU attention kernel (kernels/cpu_tree_attention.cpp, models/cpu_attention.py).

It equals its torch twin (`scaled_dot_product_attention` with `enable_gqa`) up to float32
rounding at every shape it takes, over strided views of a KV cache; a query row's result
is the same bit for bit whatever rows share its call and whatever masked keys sit beside
its keys (what makes a tree node's attention equal a plain step's); the layers take it for
cached float32 attention on the CPU and fall back where it does not apply or is off."""
from __future__ import annotations

import random

import pytest
import torch

from cpu_kernels import built_or_skip, fail_the_build
from specdec.kv_cache import AttentionBatch, KVCache
from specdec.models import cpu_attention, layers
from specdec.models.layers import Attention, LlamaShape


@pytest.fixture(scope="module")
def kernel():
    return built_or_skip(cpu_attention.attention_kernel(), cpu_attention.wanted(), "CPU attention kernel")


def cached(B, H_kv, S, D, gen, slots=5, length=400):
    """k, v [B, H_kv, S, D]: views of a KV cache's slots, as the layers read them."""
    kv = torch.randn(2, slots, H_kv, length, D, generator=gen)
    pick = torch.randperm(slots, generator=gen)[:B].sort().values
    if B == 1:
        return kv[0, pick[0], :, :S][None], kv[1, pick[0], :, :S][None]
    return kv[0, pick, :, :S], kv[1, pick, :, :S]


def random_mask(B, T, S, gen):
    mask = torch.rand(B, 1, T, S, generator=gen) < 0.6
    mask[..., torch.randint(0, S, (1,), generator=gen)] = True  # every query sees a key
    return mask


@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 2), (8, 1), (4, 4), (12, 2)])
@pytest.mark.parametrize("D", [16, 32, 48, 64, 80, 128])
def test_equals_its_twin(kernel, heads, kv_heads, D):
    rng = random.Random(heads * 1000 + kv_heads * 100 + D)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    for _ in range(12):
        B, T, S = rng.randint(1, 4), rng.choice([1, 2, 3, 5, 8, 11, 16, 17, 33]), rng.randint(1, 300)
        q = torch.randn(B, T, heads, D, generator=gen).transpose(1, 2) * rng.choice([0.3, 1.0, 6.0])  # strided
        k, v = cached(B, kv_heads, S, D, gen)
        mask = random_mask(rng.choice([1, B]), T, S, gen)
        got = cpu_attention.attend(kernel, q, k, v, mask)
        want = cpu_attention.twin(q, k, v, mask)
        assert got.shape == (B, T, heads, D)
        assert (got - want).abs().max() < 2e-5 * max(1.0, want.abs().max().item()), (B, T, S)


def test_a_rows_result_is_the_same_alone_beside_other_rows_and_beside_masked_keys(kernel):
    gen = torch.Generator().manual_seed(7)
    H, H_kv, D, S, T = 9, 3, 64, 230, 12
    q = torch.randn(1, H, T, D, generator=gen)
    k, v = cached(1, H_kv, S, D, gen)
    mask = random_mask(1, T, S, gen)
    together = cpu_attention.attend(kernel, q, k, v, mask)  # [1, T, H, D]
    for t in range(T):
        alone = cpu_attention.attend(kernel, q[:, :, t: t + 1], k, v, mask[:, :, t: t + 1])
        assert torch.equal(alone[:, 0], together[:, t])
    # The keys a row sees, packed, alone and with masked keys of any values after them: as a
    # plain step sees its prefix and a tree node its prefix, ancestors and masked siblings.
    t = 3
    seen = mask[0, 0, t].nonzero()[:, 0]
    packed_k, packed_v = k[:, :, seen], v[:, :, seen]
    n = len(seen)
    just_seen = cpu_attention.attend(kernel, q[:, :, t: t + 1], packed_k, packed_v,
                                     torch.ones(1, 1, 1, n, dtype=torch.bool))
    extra = 40
    padded_k = torch.cat((packed_k, torch.randn(1, H_kv, extra, D, generator=gen) * 50), dim=2)
    padded_v = torch.cat((packed_v, torch.randn(1, H_kv, extra, D, generator=gen) * 50), dim=2)
    padded_mask = torch.cat((torch.ones(1, 1, 1, n, dtype=torch.bool), torch.zeros(1, 1, 1, extra, dtype=torch.bool)),
                            dim=-1)
    beside_masked = cpu_attention.attend(kernel, q[:, :, t: t + 1], padded_k, padded_v, padded_mask)
    assert torch.equal(just_seen, beside_masked)
    assert torch.equal(just_seen[:, 0], together[:, t])  # the masked keys between them add exact zeros


def test_far_apart_scores_underflow_to_zero_weights(kernel):
    """Scores 100s apart: the small ones' exp underflow to 0 (no NaN, no inf), as the twin's."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 2, 64, generator=gen) * 40
    k, v = cached(1, 2, 50, 64, gen)
    mask = torch.ones(1, 1, 2, 50, dtype=torch.bool)
    got = cpu_attention.attend(kernel, q, k, v, mask)
    assert torch.isfinite(got).all()
    assert (got - cpu_attention.twin(q, k, v, mask)).abs().max() < 1e-4


SHAPE = LlamaShape(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                   rope_theta=10000.0, rope_scaling=None, max_position_embeddings=128,
                   attention_bias=False, tie_word_embeddings=False)


def layer_forward(n, monkeypatch, dtype=torch.float32):
    """A cached Attention forward of n tokens after a 20-token prefix; returns its output
    and whether the kernel ran."""
    torch.manual_seed(0)
    attn = Attention(SHAPE).to(dtype)
    cache = KVCache(1, 2, 2, 128, 16, dtype, "cpu")
    cache.kv.copy_(torch.randn(cache.kv.shape, dtype=dtype))
    local = torch.ones(1, n, n, dtype=torch.bool).tril()
    batch = AttentionBatch.build(torch.tensor([1]), torch.tensor([20]), local, host_slots=[1])
    x = torch.randn(1, n, 64, dtype=dtype)
    cos, sin = layers.rope_tables(layers.rope_inv_freq(SHAPE), 20 + torch.arange(n)[None], dtype)
    calls = []
    attend = cpu_attention.attend
    monkeypatch.setattr(cpu_attention, "attend", lambda *a: calls.append(1) or attend(*a))
    with torch.inference_mode():
        return attn(x, cos, sin, batch.mask, cache, 0, batch), bool(calls)


def test_the_layers_take_it_for_cached_float32_attention(kernel, monkeypatch):
    for n in (1, 8, cpu_attention.MAX_QUERY_TOKENS):
        out, took = layer_forward(n, monkeypatch)
        assert took, n
        monkeypatch.setenv("SPECDEC_CPU_ATTENTION", "0")  # the twin's way, as the layer ran before
        ref, took = layer_forward(n, monkeypatch)
        monkeypatch.delenv("SPECDEC_CPU_ATTENTION")
        assert not took and (out - ref).abs().max() < 1e-5
    assert not layer_forward(cpu_attention.MAX_QUERY_TOKENS + 1, monkeypatch)[1]  # a prefill: torch's kernel
    assert not layer_forward(4, monkeypatch, torch.float64)[1]  # float64 (exact-equality tests): torch's


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("SPECDEC_CPU_ATTENTION", "0")
    assert cpu_attention.attention_kernel() is None


def test_a_failed_build_is_logged_once_and_leaves_the_layers_on_torch(monkeypatch, tmp_path, caplog):
    fail_the_build(cpu_attention, monkeypatch, tmp_path)
    with caplog.at_level("WARNING", logger="specdec"):
        assert cpu_attention.attention_kernel() is None
        assert cpu_attention.attention_kernel() is None
        assert not layer_forward(8, monkeypatch)[1]
    assert caplog.text.count("CPU attention kernel unavailable") == 1
