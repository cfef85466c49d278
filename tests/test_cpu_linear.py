"""`PackedCpuLinear`: float32 matmuls through oneDNN or an MKL pack (padded up to the
pack's row count) equal `F.linear` up to float32 rounding, other dtypes and autograd are
`F.linear` exactly, calls of every row count (one included: plain decoding) take the
path measured fastest for their row count
(`choose_row_paths`, `plan_paths`: at most the allowed MKL packs, each where it saves
enough), and the engine uses it on CPU float32 only (its float64 engines, which the
exact-equality tests use, stay on `F.linear`)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from specdec.models import cpu_linear
from specdec.models.cpu_linear import (COPY_MARGIN, ROW_LADDER, PackedCpuLinear, RowRouting, choose_row_paths,
                                       mkl_packs_allowed, onednn_available, packed_layers, plan_paths,
                                       use_packed_cpu_linears)
from specdec.models.layers import MLP, Attention, LlamaShape

from engine_helpers import make_engine

INF = float("inf")

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


def packed_copy(lin: nn.Linear) -> nn.Linear:
    other = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None)
    other.load_state_dict(lin.state_dict())
    assert use_packed_cpu_linears(other) == 1
    return other


@pytest.mark.parametrize("prepacked", [True, False], ids=["laid-out-for-rows", "to_mkldnn"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (1, 1, 64), (2, 64), (1, 7, 64), (3, 5, 64), (4, 1, 64), (16, 64)])
def test_calls_equal_f_linear(shape, bias, prepacked, monkeypatch):
    """Both oneDNN paths: the weight laid out for `ONEDNN_PACK_ROWS` rows and called on
    dense inputs, and the older `to_mkldnn()` one that builds without those ops take."""
    if prepacked and not cpu_linear._ONEDNN_PREPACKED:
        pytest.skip("this torch build lacks mkldnn._reorder_linear_weight")
    monkeypatch.setattr(cpu_linear, "_ONEDNN_PREPACKED", prepacked)
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=bias)
    packed = packed_copy(lin)
    for call in range(2):  # the second call reuses the packed weight, on a strided input
        x = torch.randn(*shape) if call == 0 else torch.randn(*shape[:-1], 128)[..., ::2]
        with torch.inference_mode():
            got, want = packed(x), F.linear(x, lin.weight, lin.bias)
        assert got.shape == want.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert packed._packed is not None


def test_one_row_calls_follow_the_routing_and_other_dtypes_are_f_linear_exactly():
    """A one-row call is routed as any other (on AMD EPYC oneDNN took 18.7 ms for the
    target's linears where MKL's gemv took 33.0); a routing that leaves one row to
    `F.linear` keeps it there exactly, and packs nothing."""
    torch.manual_seed(1)
    lin = nn.Linear(64, 96)
    packed = packed_copy(lin)
    packed.routing = RowRouting(frozenset(r for r in ROW_LADDER if r > 1))
    with torch.inference_mode():
        x = torch.randn(1, 1, 64)
        assert torch.equal(packed(x), F.linear(x, lin.weight, lin.bias))
        assert packed._packed is None  # nothing packed until a call routed to oneDNN
        packed.routing = RowRouting(frozenset(ROW_LADDER))
        torch.testing.assert_close(packed(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        assert packed._packed is not None
    lin64 = nn.Linear(64, 96).double()
    assert use_packed_cpu_linears(lin64) == 0  # only float32 modules are turned
    packed = packed_copy(lin)
    x = torch.randn(4, 64, requires_grad=True)
    out = packed(x)  # with autograd on, the module stays differentiable
    out.sum().backward()
    assert x.grad is not None and packed._packed is None


def test_shared_weights_stay_shared():
    emb = nn.Embedding(96, 64)
    head = nn.Linear(64, 96, bias=False)
    head.weight = emb.weight  # tied, as SmolLM2's LM head
    model = nn.ModuleDict({"emb": emb, "head": head})
    assert use_packed_cpu_linears(model) == 1
    assert model["head"].weight is emb.weight
    assert set(model.state_dict()) == {"emb.weight", "head.weight"}


def fake_timings(monkeypatch, onednn_from: int) -> list[int]:
    """oneDNN measures twice as fast from `onednn_from` rows on, 5 % faster below (inside
    the margin); MKL packs never pay. Returns the layer counts each timing was given."""
    counts = []

    def time_paths(layers, rows, repeats, mkl=True, streamed=None):
        counts.append(len(layers))
        return (10.0, 5.0, 10.0, INF) if rows >= onednn_from else (10.0, 9.5, 10.0, INF)
    monkeypatch.setattr(cpu_linear, "_time_paths", time_paths)
    return counts


@pytest.mark.parametrize("onednn_from", [2, 8, 1000])
def test_calls_take_the_path_measured_faster_for_their_row_count(monkeypatch, onednn_from):
    torch.manual_seed(2)
    lin = nn.Linear(64, 96)
    packed = packed_copy(lin)
    fake_timings(monkeypatch, onednn_from)
    routing = choose_row_paths([packed])
    assert routing.onednn_rows == frozenset(r for r in ROW_LADDER if r >= onednn_from)
    assert packed.routing is routing
    with torch.inference_mode():
        for rows in (1, 2, 3, 5, 7, 8, 9, 40, 100):
            step = next((r for r in ROW_LADDER if r >= rows), ROW_LADDER[-1])
            x = torch.randn(rows, 64)
            want = F.linear(x, lin.weight, lin.bias)
            got = packed(x)
            if step >= onednn_from:  # oneDNN: equal up to rounding, and the weight is packed
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                assert packed._packed is not None
            else:  # F.linear itself
                assert torch.equal(got, want)
    if onednn_from > ROW_LADDER[-1]:
        assert packed._packed is None  # no path uses the packed copy: it is not kept


def test_routing_times_the_called_layers_and_routes_the_fused_parts_too(monkeypatch):
    mlp = MLP(64, 128)
    mlp.fuse()  # gate_proj and up_proj become slices of gate_up: a forward calls gate_up, down_proj
    assert use_packed_cpu_linears(mlp) == 4
    counts = fake_timings(monkeypatch, 4)
    routing = choose_row_paths(packed_layers(mlp), max_rows=8)
    assert set(counts) == {2}  # gate_up and down_proj
    assert all(m.routing is routing for m in packed_layers(mlp))
    assert routing.onednn_rows == frozenset(r for r in ROW_LADDER if r >= 4)  # past 8: 8's path
    assert [rows for rows, *_ in routing.timings_ms] == [r for r in ROW_LADDER if r <= 8]


def test_measuring_is_skipped_when_the_environment_asks_for_onednn(monkeypatch):
    monkeypatch.setenv("SPECDEC_CPU_ONEDNN", "1")
    packed = packed_copy(nn.Linear(8, 8))
    assert choose_row_paths([packed]) is None
    assert packed.routing.onednn(1) and packed.routing.onednn(2) and packed.routing.onednn(500)


def test_the_catch_up_queries_call_no_bare_f_linear(monkeypatch):
    """The `queries` path (an EAGLE head catching up) projects k/v over every token and q
    at one position per row: both through modules the routing turns (`kv`, a view of
    the fused weight's k/v rows, and q_proj), not F.linear on slices (MKL's sgemm), and
    its output equals the unrouted forward's."""
    torch.manual_seed(5)
    shape = LlamaShape.from_config(dict(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, attention_bias=True))
    attn = Attention(shape)
    attn.fuse()
    assert attn.kv.weight.untyped_storage().data_ptr() == attn.qkv.weight.untyped_storage().data_ptr()
    x = torch.randn(2, 5, 64)
    cos, sin = torch.ones(2, 1, 5, 16), torch.zeros(2, 1, 5, 16)
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    queries = torch.tensor([4, 2])
    with torch.inference_mode():
        want = attn(x, cos, sin, mask, queries=queries)
    use_packed_cpu_linears(attn)
    fake_timings(monkeypatch, 1)  # oneDNN at every row count
    choose_row_paths(packed_layers(attn), max_rows=8)
    bare = []
    real_linear = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: bare.append(tuple(w.shape)) or real_linear(x, w, b))
    with torch.inference_mode():
        got = attn(x, cos, sin, mask, queries=queries)  # [2, 1, 64]
    assert bare == []
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_routing_describes_itself():
    assert RowRouting(frozenset()).describe() == "F.linear at every row count"
    assert RowRouting(frozenset(ROW_LADDER)).describe() == "oneDNN at every row count"
    assert RowRouting(frozenset({16, 32, 64})).describe() == "oneDNN at 16,32,64 rows, F.linear at the others"
    assert (RowRouting(frozenset({64}), packs=((4, 4), (6, 8), (8, 8))).describe()
            == "MKL packed at 4,8 rows (6 to 8 padded), oneDNN at 64 rows, F.linear at the others")
    assert (RowRouting(frozenset({64}), streamed_rows=frozenset({1, 2, 3})).describe()
            == "oneDNN at 64 rows, streamed at 1,2,3 rows, F.linear at the others")
    assert RowRouting(frozenset(), streamed_rows=frozenset(ROW_LADDER)).describe() == "streamed at every row count"


def test_the_engine_packs_on_cpu_float32_only():
    e32 = make_engine(dtype="float32")
    assert e32.packed_linears > 0
    assert isinstance(e32.target.lm_head, PackedCpuLinear)
    assert "oneDNN, MKL packs or the streamed kernel" in e32.load_note
    assert "measured at" in e32.load_note  # at this load or an earlier one
    # measured on the target's decoder layers, and on its LM head on its own
    assert all(m.routing is e32.row_routing for m in packed_layers(e32.target.model))
    assert e32.target.lm_head.routing is e32.head_routing and "its LM head: " in e32.load_note
    e64 = make_engine(dtype="float64")
    assert e64.packed_linears == 0 and type(e64.target.lm_head) is nn.Linear


def test_disabled_by_the_environment(monkeypatch):
    monkeypatch.setenv("SPECDEC_CPU_ONEDNN", "0")
    assert use_packed_cpu_linears(nn.Linear(8, 8)) == 0


# -- MKL packs ---------------------------------------------------------------------------------
needs_mkl = pytest.mark.skipif(mkl_packs_allowed() == 0, reason="this torch build has no MKL packed gemm")


@needs_mkl
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows,size", [(2, 2), (3, 4), (4, 4), (5, 8), (1, 8), (16, 16)])
def test_an_mkl_pack_equals_f_linear_with_fewer_rows_padded(rows, size, bias):
    torch.manual_seed(3)
    lin = nn.Linear(64, 96, bias=bias)
    packed = packed_copy(lin)
    for shape in [(rows, 64), (1, rows, 64)]:
        x = torch.randn(*shape)
        with torch.inference_mode():
            got, want = packed._mkl_packed(x, rows, size), F.linear(x, lin.weight, lin.bias)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert set(packed._mkl_packs) == {size}  # made once, for its own row count


def ladder_timings(sgemm, onednn=None, packed=None, streamed=None) -> list:
    """Timings at every ladder step from functions of the row count (default: no gain;
    no streamed kernel)."""
    return [(r, sgemm(r), (onednn or sgemm)(r), (packed or sgemm)(r), (streamed or (lambda _: INF))(r))
            for r in ROW_LADDER]


def test_plan_takes_packs_where_they_pay_padding_fewer_rows_up():
    # sgemm costs 10 + rows; packs save 30 % at 8 and 16 rows, nothing elsewhere: 6 rows pad
    # to 8 (12.6 against 16), 12 to 16 (18.2 against 22); 4 rows would save less than the margin
    def sgemm(r):
        return 10.0 + r

    def packed_ms(r):
        return 0.7 * sgemm(r) if r in (8, 16) else sgemm(r)
    timings = ladder_timings(sgemm, packed=packed_ms)
    routing = plan_paths(timings, max_packs=3)
    assert dict(routing.packs) == {6: 8, 8: 8, 12: 16, 16: 16} and not routing.onednn_rows
    assert [routing.pack_rows(r) for r in (2, 4, 5, 7, 8, 9, 16, 17, 100)] == [None, None, 8, 8, 8, 16, 16, None, None]
    one = plan_paths(timings, max_packs=1)  # 8's pack saves 0.51 of a step's time, 16's 0.47
    assert one.pack_sizes() == [8] and dict(one.packs) == {6: 8, 8: 8}
    assert not plan_paths(timings, max_packs=0).packs


def test_plan_keeps_f_linear_inside_the_margin_and_onednn_where_it_beats_both():
    inside = plan_paths(ladder_timings(lambda r: 10.0, packed=lambda r: 10.0 * (1 - COPY_MARGIN / 2)), max_packs=3)
    assert not inside.packs and not inside.onednn_rows  # a copy of the weights must save COPY_MARGIN
    both = plan_paths(ladder_timings(lambda r: 10.0, onednn=lambda r: 4.0 if r >= 32 else 10.0,
                                     packed=lambda r: 7.0), max_packs=3)
    assert both.onednn_rows == {32, 64}
    assert all(step < 32 for step, _ in both.packs)  # oneDNN's steps take no pack


def test_plan_of_a_layer_too_small_to_time_keeps_f_linear():
    """A tiny layer (a tiny model's drafting vocabulary) whose timings round to 0 ms is
    planned without dividing by them: nothing saves anything, F.linear throughout."""
    zero = plan_paths(ladder_timings(lambda r: 0.0, onednn=lambda r: 0.0, packed=lambda r: 0.0), max_packs=3)
    assert not zero.packs and not zero.onednn_rows


@pytest.mark.parametrize("seed", range(20))
def test_plan_never_exceeds_its_packs_or_loses_to_f_linear(seed):
    rng = torch.Generator().manual_seed(seed)
    noise = {r: float(torch.rand(2, generator=rng).mul(1.5).add(0.3)[0]) for r in ROW_LADDER}
    sgemm = {r: 5.0 + r for r in ROW_LADDER}
    timings = ladder_timings(lambda r: sgemm[r], packed=lambda r: sgemm[r] * noise[r])
    saved = []
    for max_packs in range(5):
        routing = plan_paths(timings, max_packs)
        assert len(routing.pack_sizes()) <= max_packs
        for step, size in routing.packs:
            assert size >= step and timings[ROW_LADDER.index(size)][3] < (1 - COPY_MARGIN) * sgemm[step]
        saved.append(sum(1 - timings[ROW_LADDER.index(size)][3] / sgemm[step] for step, size in routing.packs))
    assert saved == sorted(saved)  # more packs allowed never saves less


@needs_mkl
def test_calls_take_their_mkl_pack_and_unused_packs_are_dropped(monkeypatch):
    torch.manual_seed(4)
    lin = nn.Linear(64, 96)
    packed = packed_copy(lin)

    def time_paths(layers, rows, repeats, mkl=True, streamed=None):  # packs save 40 % at 4 and 16 rows
        return (10.0 + rows, 10.0 + rows, (10.0 + rows) * (0.6 if rows in (4, 16) else 1.0), INF)
    monkeypatch.setattr(cpu_linear, "_time_paths", time_paths)
    routing = choose_row_paths([packed])
    assert routing.pack_sizes() == [4, 16]
    assert [routing.pack_rows(r) for r in (2, 3, 5, 6, 7, 12, 17)] == [4, 4, None, None, 16, 16, None]
    with torch.inference_mode():
        for rows in (2, 3, 4, 5, 12, 16, 40):
            x = torch.randn(rows, 64)
            want = F.linear(x, lin.weight, lin.bias)
            got = packed(x)
            if routing.pack_rows(rows) is None:
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert set(packed._mkl_packs) == {4, 16}
    cpu_linear.route([packed], RowRouting(frozenset(), packs=((16, 16),)))
    assert set(packed._mkl_packs) == {16}


def test_the_environment_caps_the_packs(monkeypatch):
    monkeypatch.setenv("SPECDEC_CPU_MKL_PACKS", "0")
    assert mkl_packs_allowed() == 0
    packed = packed_copy(nn.Linear(8, 8))
    seen = []

    def time_paths(layers, rows, repeats, mkl=True, streamed=None):
        seen.append(mkl)
        return (10.0, 10.0, INF, INF)
    monkeypatch.setattr(cpu_linear, "_time_paths", time_paths)
    assert not choose_row_paths([packed]).packs and not any(seen)  # not even timed
    monkeypatch.setenv("SPECDEC_CPU_MKL_PACKS", "many")
    with pytest.raises(ValueError, match="SPECDEC_CPU_MKL_PACKS"):
        mkl_packs_allowed()
