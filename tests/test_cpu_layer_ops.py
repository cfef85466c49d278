"""The CPU layer operations (kernels/cpu_layer_ops.cpp, models/cpu_layer_ops.py).

Each equals its torch twin, the layers' own code: `rope_qkv` and `write_kv` bit for bit,
`rms_norm` and `silu_mul` up to float32 rounding, at row counts of a decode step and of a prompt, over
sizes with and without a tail past the 16 lanes; a row's result is the same bit for bit
alone and beside other rows; the layers take them for float32 on the CPU outside autograd
and keep to the twins elsewhere, or when they are off or fail to build."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpu_kernels import built_or_skip, fail_the_build
from specdec.kv_cache import AttentionBatch, KVCache
from specdec.models import cpu_layer_ops
from specdec.models.layers import (MLP, Attention, LlamaShape, RMSNorm, causal_mask, rope, rope_inv_freq,
                                   rope_tables)


@pytest.fixture(scope="module")
def kernel():
    return built_or_skip(cpu_layer_ops.layer_ops_kernel(), cpu_layer_ops.wanted(), "CPU layer operations")


def norm_twin(x, weight, eps):
    """RMSNorm.forward's torch code."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def within_rounding(got, want, ulps=4):
    """got equals want up to a few float32 roundings of each value's magnitude."""
    return bool(((got - want).abs() <= ulps * 2 ** -23 * want.abs().clamp(min=1e-30)).all())


@pytest.mark.parametrize("H", [576, 64, 1152, 40, 7])
@pytest.mark.parametrize("rows", [1, 3, 8, 33, 300])
def test_rms_norm_equals_its_twin(kernel, H, rows):
    gen = torch.Generator().manual_seed(H * 1000 + rows)
    for scale in (1e-3, 1.0, 40.0):
        x = torch.randn(2, rows, H, generator=gen) * scale
        weight = torch.randn(H, generator=gen)
        got = kernel.rms_norm(x, weight, 1e-5)
        assert got.shape == x.shape
        assert within_rounding(got, norm_twin(x, weight, 1e-5)), (H, rows, scale)
    zeros = torch.zeros(rows, H)
    assert torch.equal(kernel.rms_norm(zeros, weight, 1e-5), zeros)  # eps keeps an all-zero row finite


@pytest.mark.parametrize("I", [1536, 64, 40, 9])
@pytest.mark.parametrize("rows", [1, 4, 17, 200])
def test_silu_mul_equals_its_twin(kernel, I, rows):
    gen = torch.Generator().manual_seed(I * 1000 + rows)
    gate_up = torch.randn(rows, 2 * I, generator=gen) * 6
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -88.5])  # exp's clamps, both ends
    got = kernel.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    assert got.shape == (rows, I)
    assert ((got - want).abs() <= 4 * 2 ** -23 * want.abs() + 1e-30).all()


@pytest.mark.parametrize("heads, kv_heads, D", [(9, 3, 64), (4, 2, 16), (8, 8, 32), (2, 1, 6)])
@pytest.mark.parametrize("B, T", [(1, 1), (1, 8), (3, 5), (2, 70)])
def test_rope_qkv_equals_its_twin_bit_for_bit(kernel, heads, kv_heads, D, B, T):
    gen = torch.Generator().manual_seed(heads * 100 + D + B * 7 + T)
    qkv = torch.randn(B, T, (heads + 2 * kv_heads) * D, generator=gen) * 3
    positions = torch.randint(0, 5000, (B, T), generator=gen)
    shape = LlamaShape(vocab_size=8, hidden_size=heads * D, intermediate_size=8, num_hidden_layers=1,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=D, rms_norm_eps=1e-5,
                       rope_theta=10000.0, rope_scaling=None, max_position_embeddings=8192, attention_bias=False,
                       tie_word_embeddings=False)
    cos, sin = rope_tables(rope_inv_freq(shape), positions, torch.float32)
    q, k, v = kernel.rope_qkv(qkv, cos, sin, heads, kv_heads, D)
    tq, tk, tv = qkv.split((heads * D, kv_heads * D, kv_heads * D), dim=-1)
    want_q = rope(tq.reshape(B, T, heads, D).transpose(1, 2), cos, sin)
    want_k = rope(tk.reshape(B, T, kv_heads, D).transpose(1, 2), cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(v, tv.reshape(B, T, kv_heads, D).transpose(1, 2))
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()


@pytest.mark.parametrize("T", [1, 8, 40])
def test_write_kv_equals_its_twin_bit_for_bit(kernel, T):
    gen = torch.Generator().manual_seed(T)
    kv = torch.randn(3, 2, 4, 2, 64, 16, generator=gen)  # [L, 2, S, H_kv, P, D]
    k, v = torch.randn(2, 2, T, 16, generator=gen)
    for layer, slot, start in ((0, 0, 0), (2, 3, 64 - T), (1, 2, 11 if T < 50 else 0)):
        want = kv.clone()
        want[layer, 0, slot, :, start: start + T] = k
        want[layer, 1, slot, :, start: start + T] = v
        kernel.write_kv(kv, layer, slot, start, k, v)
        assert torch.equal(kv, want)


@pytest.mark.parametrize("V", [49152, 8192, 100, 17, 16, 5, 1])
@pytest.mark.parametrize("rows", [1, 9, 40])
def test_greedy_tokens_equal_its_twin(kernel, V, rows):
    """The first largest value's index, as `max(dim).indices`: on random rows, rows whose
    largest value repeats (in one lane and across lanes), constant rows, -inf rows and rows
    with NaNs (the first NaN's index), before, inside and after the 16-lane blocks."""
    from specdec.sampling import greedy_tokens

    gen = torch.Generator().manual_seed(V * 100 + rows)
    x = torch.randn(rows, V, generator=gen)
    picks = torch.randint(0, V, (rows, 3), generator=gen)
    for r in range(rows):
        kind = r % 5
        if kind == 1:  # the largest value at three places, the lowest index first wins
            x[r, picks[r]] = 9.0
        elif kind == 2:
            x[r] = 0.25
        elif kind == 3:
            x[r] = float("-inf")
        elif kind == 4 and V > 1:
            x[r, picks[r, :2]] = float("nan")
            x[r, picks[r, 2]] = float("inf")
    assert torch.equal(kernel.greedy_tokens(x), x.max(dim=-1).indices)
    assert torch.equal(greedy_tokens(x.view(1, rows, V)), x.max(dim=-1).indices.view(1, rows))


@pytest.mark.parametrize("V", [8192, 49152, 100, 16, 5])
@pytest.mark.parametrize("k", [1, 4, 10])
def test_top_log_probs_are_the_twins(kernel, V, k):
    """A drafter's candidates (drafters/eagle.top_log_probs): the k largest of logits / t,
    best first and the lowest index first among equal values, and their log-probabilities,
    as `log_softmax(logits / t).topk(k)` gives them up to float32 rounding; with distinct
    values, the twin's very indices."""
    from specdec.drafters.eagle import top_log_probs

    k = min(k, V)
    gen = torch.Generator().manual_seed(V + k)
    for temperature in (1.0, 0.7):
        x = torch.randn(3, 5, V, generator=gen) * 4
        x[0, 1] = x[0, 1].round()  # many equal values, some of them among the k largest
        x[1, 2, : V // 2] = float("-inf")
        values, ids = top_log_probs(x, k, temperature)
        assert values.shape == ids.shape == (3, 5, k) and ids.dtype == torch.int64
        y = x / temperature
        picked = y.gather(-1, ids)
        assert (picked[..., 1:] <= picked[..., :-1]).all()  # best first
        assert (y.topk(k, dim=-1).values == picked).all()  # the k largest values
        ties = picked[..., 1:] == picked[..., :-1]
        assert (ids[..., 1:][ties] > ids[..., :-1][ties]).all()  # equal values: the lower index first
        twin = torch.log_softmax(y, dim=-1).gather(-1, ids)
        finite = twin.isfinite()  # -inf logits: -inf log-probs in both
        assert torch.equal(values.isfinite(), finite) and (values[~finite] == twin[~finite]).all()
        assert (values[finite] - twin[finite]).abs().max() < 1e-5 * max(1.0, twin[finite].abs().max().item())
        want_ids = torch.log_softmax(y, dim=-1).topk(k, dim=-1).indices
        distinct = (x != x.round()).all(-1)  # rows without repeated values
        assert torch.equal(ids[distinct], want_ids[distinct])
    with torch.no_grad():
        wide = torch.randn(2, V, dtype=torch.float64, generator=gen)
        got_values, got_ids = top_log_probs(wide, k)
        want_values, want_ids = torch.log_softmax(wide, -1).topk(k)
        assert got_values.dtype == torch.float64 and torch.equal(got_values, want_values)  # float64: the twin


def test_drafting_takes_top_log_probs_for_float32(kernel, monkeypatch):
    from specdec.drafters import eagle

    counted = Counted(kernel)
    monkeypatch.setattr(cpu_layer_ops, "layer_ops_kernel", lambda: counted)
    eagle.top_log_probs(torch.randn(2, 64), 3)
    assert counted.calls == ["top_log_probs"]


def test_a_rows_result_is_the_same_alone_and_beside_other_rows(kernel):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, 576, generator=gen)
    weight = torch.randn(576, generator=gen)
    gate_up = torch.randn(40, 3072, generator=gen)
    together, together_mlp = kernel.rms_norm(x, weight, 1e-5), kernel.silu_mul(gate_up)
    for r in (0, 7, 39):
        assert torch.equal(kernel.rms_norm(x[r: r + 1], weight, 1e-5), together[r: r + 1])
        assert torch.equal(kernel.silu_mul(gate_up[r: r + 1]), together_mlp[r: r + 1])


def test_refuses_what_it_does_not_take(kernel):
    with pytest.raises(RuntimeError, match="float32"):
        kernel.rms_norm(torch.randn(2, 16, dtype=torch.float64), torch.randn(16, dtype=torch.float64), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel.silu_mul(torch.randn(32, 4).t())
    with pytest.raises(RuntimeError, match="even"):
        kernel.silu_mul(torch.randn(2, 5))
    with pytest.raises(RuntimeError, match="last dimension"):
        kernel.rope_qkv(torch.randn(1, 2, 100), torch.randn(1, 1, 2, 16), torch.randn(1, 1, 2, 16), 2, 1, 16)
    kv = torch.zeros(1, 2, 2, 1, 8, 4)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel.write_kv(kv, 0, 1, 6, torch.ones(1, 3, 4), torch.ones(1, 3, 4))  # positions 6-8 of 8
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel.write_kv(kv, 0, 2, 0, torch.ones(1, 3, 4), torch.ones(1, 3, 4))  # slot 2 of 2
    assert not kv.any()


SHAPE = LlamaShape(vocab_size=64, hidden_size=96, intermediate_size=80, num_hidden_layers=1, num_attention_heads=6,
                   num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                   max_position_embeddings=512, attention_bias=False, tie_word_embeddings=False)


def layer_outputs(dtype=torch.float32, T=5, grad=False):
    """A fused attention's, MLP's and norm's outputs over T tokens after a 20-token cached
    prefix, on fixed random weights: (attention, mlp, norm)."""
    torch.manual_seed(0)
    attn, mlp, norm = Attention(SHAPE), MLP(SHAPE.hidden_size, SHAPE.intermediate_size), RMSNorm(96, 1e-5)
    norm.weight.data = torch.randn(96)
    for m in (attn, mlp):
        m.fuse()
    attn, mlp, norm = attn.to(dtype), mlp.to(dtype), norm.to(dtype)
    cache = KVCache(1, 2, SHAPE.num_key_value_heads, 64, SHAPE.head_dim, dtype, "cpu")
    cache.kv.normal_()
    batch = AttentionBatch.build(torch.tensor([1]), torch.tensor([20]), causal_mask(1, T, "cpu"), host_slots=[1],
                                 max_prefix=20)
    cos, sin = rope_tables(rope_inv_freq(SHAPE), torch.arange(20, 20 + T)[None], dtype)
    x = torch.randn(1, T, 96, dtype=dtype, requires_grad=grad)
    with torch.set_grad_enabled(grad):
        return attn(x, cos, sin, batch.mask, cache, 0, batch), mlp(x), norm(x)


class Counted:
    """A kernel module whose calls are recorded by name."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getattr__(self, name):
        run = getattr(self.kernel, name)
        return lambda *args: self.calls.append(name) or run(*args)


def test_the_layers_take_them_for_float32_on_the_cpu(kernel, monkeypatch):
    counted = Counted(kernel)
    monkeypatch.setattr(cpu_layer_ops, "layer_ops_kernel", lambda: counted)
    with torch.inference_mode():
        got = layer_outputs()
    assert sorted(set(counted.calls)) == ["rms_norm", "rope_qkv", "silu_mul", "write_kv"]
    monkeypatch.undo()
    monkeypatch.setenv("SPECDEC_CPU_LAYER_OPS", "0")  # the twins, as the layers ran before
    with torch.inference_mode():
        want = layer_outputs()
    for g, w in zip(got, want):
        assert (g - w).abs().max() < 1e-5 * max(1.0, w.abs().max().item())


def test_a_norm_of_an_expanded_view_takes_the_kernel(kernel, monkeypatch):
    """An EAGLE drafting depth's features are the catch-up output expanded over its top-k nodes."""
    counted = Counted(kernel)
    monkeypatch.setattr(cpu_layer_ops, "layer_ops_kernel", lambda: counted)
    norm = RMSNorm(64, 1e-5)
    norm.weight.data = torch.randn(64)
    x = torch.randn(2, 1, 64).expand(2, 4, 64)
    with torch.inference_mode():
        got = norm(x)
    assert counted.calls == ["rms_norm"]
    assert within_rounding(got, norm_twin(x, norm.weight, 1e-5))


def test_float64_and_autograd_keep_to_the_twins(kernel, monkeypatch):
    took = []
    monkeypatch.setattr(cpu_layer_ops, "layer_ops_kernel", lambda: took.append(1) or kernel)
    with torch.inference_mode():
        layer_outputs(torch.float64)  # the exact-equality tests' engines
    outputs = layer_outputs(grad=True)  # training
    assert not took
    sum(o.sum() for o in outputs).backward()


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("SPECDEC_CPU_LAYER_OPS", "0")
    assert cpu_layer_ops.layer_ops_kernel() is None
    assert cpu_layer_ops.kernel_for(torch.randn(2, 16)) is None


def test_a_failed_build_is_logged_once_and_leaves_the_layers_on_torch(monkeypatch, tmp_path, caplog):
    fail_the_build(cpu_layer_ops, monkeypatch, tmp_path)
    with caplog.at_level("WARNING", logger="specdec"):
        assert cpu_layer_ops.layer_ops_kernel() is None
        assert cpu_layer_ops.layer_ops_kernel() is None
        with torch.inference_mode():
            outputs = layer_outputs()
    assert all(torch.isfinite(o).all() for o in outputs)
    assert caplog.text.count("CPU layer operations unavailable") == 1
