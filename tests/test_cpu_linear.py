"""`PackedCpuLinear`: multi-row float32 matmuls through oneDNN equal `F.linear` up to
float32 rounding, one-row calls and other dtypes are `F.linear` exactly, calls take the
path measured faster for their row count (`choose_row_paths`), and the engine uses it on
CPU float32 only (its float64 engines, which the exact-equality tests use, stay on
`F.linear`)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from specdec.models import cpu_linear
from specdec.models.cpu_linear import (ROW_LADDER, PackedCpuLinear, RowRouting, choose_row_paths, onednn_available,
                                       packed_layers, use_packed_cpu_linears)
from specdec.models.layers import MLP

from engine_helpers import make_engine

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


def packed_copy(lin: nn.Linear) -> nn.Linear:
    other = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None)
    other.load_state_dict(lin.state_dict())
    assert use_packed_cpu_linears(other) == 1
    return other


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(2, 64), (1, 7, 64), (3, 5, 64), (4, 1, 64), (16, 64)])
def test_multi_row_calls_equal_f_linear(shape, bias):
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=bias)
    packed = packed_copy(lin)
    for _ in range(2):  # the second call reuses the packed weight
        x = torch.randn(*shape)
        with torch.inference_mode():
            got, want = packed(x), F.linear(x, lin.weight, lin.bias)
        assert got.shape == want.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert packed._packed is not None


def test_one_row_and_other_dtypes_are_f_linear_exactly():
    torch.manual_seed(1)
    lin = nn.Linear(64, 96)
    packed = packed_copy(lin)
    with torch.inference_mode():
        x = torch.randn(1, 1, 64)
        assert torch.equal(packed(x), F.linear(x, lin.weight, lin.bias))
        assert packed._packed is None  # nothing packed until a multi-row call
    lin64 = nn.Linear(64, 96).double()
    assert use_packed_cpu_linears(lin64) == 0  # only float32 modules are turned
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
    the margin). Returns the layer counts each timing was given."""
    counts = []

    def time_paths(layers, rows, repeats):
        counts.append(len(layers))
        return (10.0, 5.0) if rows >= onednn_from else (10.0, 9.5)
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
        for rows in (2, 3, 5, 7, 8, 9, 40, 100):
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
    assert [rows for rows, _, _ in routing.timings_ms] == [r for r in ROW_LADDER if r <= 8]


def test_measuring_is_skipped_when_the_environment_asks_for_onednn(monkeypatch):
    monkeypatch.setenv("SPECDEC_CPU_ONEDNN", "1")
    packed = packed_copy(nn.Linear(8, 8))
    assert choose_row_paths([packed]) is None
    assert packed.routing.use_onednn(2) and packed.routing.use_onednn(500)


def test_routing_describes_itself():
    assert RowRouting(frozenset()).describe() == "F.linear at every row count"
    assert RowRouting(frozenset(ROW_LADDER)).describe() == "oneDNN at every row count"
    assert RowRouting(frozenset({16, 32, 64})).describe() == "oneDNN at 16,32,64 rows, F.linear at the others"


def test_the_engine_packs_on_cpu_float32_only():
    e32 = make_engine(dtype="float32")
    assert e32.packed_linears > 0
    assert isinstance(e32.target.lm_head, PackedCpuLinear)
    assert "oneDNN" in e32.load_note and "measured at" in e32.load_note  # at this load or an earlier one
    assert e32.target.lm_head.routing is e32.row_routing  # measured on the target's own linears
    e64 = make_engine(dtype="float64")
    assert e64.packed_linears == 0 and type(e64.target.lm_head) is nn.Linear


def test_disabled_by_the_environment(monkeypatch):
    monkeypatch.setenv("SPECDEC_CPU_ONEDNN", "0")
    assert use_packed_cpu_linears(nn.Linear(8, 8)) == 0
