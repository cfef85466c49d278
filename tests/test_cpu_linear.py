"""`PackedCpuLinear`: multi-row float32 matmuls through oneDNN equal `F.linear` up to
float32 rounding, one-row calls and other dtypes are `F.linear` exactly, and the engine
uses it on CPU float32 only (its float64 engines, which the exact-equality tests use,
stay on `F.linear`)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from specdec.models.cpu_linear import PackedCpuLinear, onednn_available, use_packed_cpu_linears

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


def test_the_engine_packs_on_cpu_float32_only():
    e32 = make_engine(dtype="float32")
    assert e32.packed_linears > 0
    assert isinstance(e32.target.lm_head, PackedCpuLinear)
    assert "oneDNN" in e32.load_note
    e64 = make_engine(dtype="float64")
    assert e64.packed_linears == 0 and type(e64.target.lm_head) is nn.Linear


def test_disabled_by_the_environment(monkeypatch):
    monkeypatch.setenv("SPECDEC_CPU_ONEDNN", "0")
    assert use_packed_cpu_linears(nn.Linear(8, 8)) == 0
