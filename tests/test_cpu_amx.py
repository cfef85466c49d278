"""The AMX linear over 4-bit block weights (kernels/cpu_amx_linear.cpp, `models/cpu_amx.py`)
against its torch twin, and where the streamed path sends calls to it.

On a CPU with AMX-BF16 (its /proc/cpuinfo flags), with a C++ compiler and ninja, the
kernel must build and be usable: its tests fail rather than skip there. Elsewhere they skip.
"""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F

from cpu_kernels import can_build, fail_the_build, int8_rows_weight, q4_1_weight, q8_0_weight
from specdec.models import cpu_amx, cpu_streamed


@pytest.fixture(scope="module")
def kernel():
    built = cpu_amx.amx_kernel()
    if built is None:
        assert not (cpu_amx.cpu_has_amx() and can_build() and cpu_amx.wanted()), "the AMX kernel should be usable here"
        pytest.skip("no AMX kernel on this machine")
    return built


def tiled(w: torch.Tensor) -> cpu_amx.TiledWeight:
    """The AMX layout of a weight as GGUF's Q4_1 blocks (4-bit) or Q8_0 blocks (int8) dequantize to."""
    blocks = cpu_streamed.q4_blocks(w)
    if blocks is not None:
        return cpu_amx.tile_weight(blocks.values, blocks.scales, blocks.offsets)
    blocks = cpu_streamed.int8_blocks(w)
    assert blocks is not None
    return cpu_amx.tile_int8(blocks.values, blocks.scales)


MAKE = {"Q4_1": q4_1_weight, "Q8_0": q8_0_weight, "int8 rows": int8_rows_weight}


@pytest.mark.parametrize("form", ["Q4_1", "Q8_0", "int8 rows"])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 8, 15, 16, 17, 33])
@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (32, 16), (64, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_its_twin(kernel, form, rows, shape, bias):
    """Within float32 rounding of the float64 product, as F.linear is (17 and 33 rows take
    two and three tiles of rows; 16 and 48 outputs one and three feature tiles)."""
    in_features, out_features = shape
    w = MAKE[form](out_features, in_features, seed=rows)
    b = torch.randn(out_features) if bias else None
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    got = cpu_amx.amx_linear(kernel, x, tiled(w), b)
    want = cpu_amx.twin(x, w, b)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    scale = exact.abs().max().item() * in_features ** 0.5
    assert (got.double() - exact).abs().max().item() <= 1e-6 * scale
    assert (want.double() - exact).abs().max().item() <= 1e-6 * scale
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("form", ["Q4_1", "Q8_0"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kernel, form):
    """Bit for bit: each row alone, all 21 together (two tiles of rows), shuffled, and
    beside a row of huge values."""
    w = tiled(MAKE[form](64, 96, seed=3))
    rows = torch.randn(21, 96, generator=torch.Generator().manual_seed(4))
    together = kernel.amx_linear(rows, w.q, w.scales, w.offsets)
    alone = torch.cat([kernel.amx_linear(rows[i:i + 1].contiguous(), w.q, w.scales, w.offsets) for i in range(21)])
    assert torch.equal(alone, together)
    shuffled = torch.randperm(21, generator=torch.Generator().manual_seed(5))
    assert torch.equal(kernel.amx_linear(rows[shuffled].contiguous(), w.q, w.scales, w.offsets), together[shuffled])
    beside = torch.cat([rows[:4], torch.full((1, 96), 3e30), rows[4:]])
    assert torch.equal(kernel.amx_linear(beside, w.q, w.scales, w.offsets)[5], together[4])


def test_each_input_is_taken_whole(kernel):
    """x's three bfloat16 parts carry all 24 of a float32's significant bits: an input of
    1 + 2^-23, one of 1 + 2^-15 + 2^-23 and a tiny one each meet weights of 1 and come back
    exact."""
    q = torch.ones(16, 32)  # every weight 1: q = 1, scale 1, offset 0
    ones = cpu_amx.tile_weight((q[:, :16] + q[:, 16:] * 16).to(torch.uint8), torch.ones(16, 1), torch.zeros(16, 1))
    values = torch.tensor([1 + 2.0 ** -23, 1 + 2.0 ** -15 + 2.0 ** -23, -(2.0 ** -30) * (1 + 2.0 ** -20)])
    x = torch.zeros(3, 32)
    x[0, 5], x[1, 30], x[2, 0] = values
    got = kernel.amx_linear(x, ones.q, ones.scales, ones.offsets)  # [3, 16]
    assert torch.equal(got[0], torch.full((16,), values[0].item()))
    assert torch.equal(got[1], torch.full((16,), values[1].item()))
    assert torch.equal(got[2], torch.full((16,), values[2].item()))


@pytest.mark.parametrize("form", ["Q4_1", "Q8_0"])
def test_the_tile_layout_puts_every_weight_where_it_belongs(kernel, form):
    """One-hot inputs read each weight back on its own, bit for bit: q * scale is exact and
    a 4-bit block's offset is added once, as the weight's float32 value is made (GGUF's Q4_1
    and Q8_0), so the layout's every value, feature tile and block is checked."""
    w = MAKE[form](48, 96, seed=7)
    got = kernel.amx_linear(torch.eye(96), *dataclasses.astuple(tiled(w)))  # [inputs, outputs]
    assert torch.equal(got, w.T)


def test_a_cpu_without_amx_builds_nothing(monkeypatch):
    monkeypatch.setattr(cpu_amx.KERNEL, "cache", {})
    monkeypatch.setattr(cpu_amx, "cpu_has_amx", lambda: False)
    monkeypatch.setattr(cpu_amx.cpu_extensions, "load", lambda *a: pytest.fail("built on a CPU without AMX"))
    assert cpu_amx.amx_kernel() is None and cpu_amx.build_id() is None


def test_shapes_it_refuses(kernel):
    w = tiled(q4_1_weight(32, 64))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.amx_linear(torch.randn(2, 48), w.q, w.scales, w.offsets)
    with pytest.raises(RuntimeError, match="tile_weight"):
        kernel.amx_linear(torch.randn(2, 96), w.q, w.scales, w.offsets)
    with pytest.raises(RuntimeError, match="scales and offsets"):
        kernel.amx_linear(torch.randn(2, 64), w.q, w.scales[:, :1].contiguous(), w.offsets)
    with pytest.raises(RuntimeError, match="float32"):
        kernel.amx_linear(torch.randn(2, 64).double(), w.q, w.scales, w.offsets)
    with pytest.raises(RuntimeError, match="need offsets"):
        kernel.amx_linear(torch.randn(2, 64), w.q, w.scales)
    int8 = tiled(q8_0_weight(32, 64))
    with pytest.raises(RuntimeError, match="only they take them"):
        kernel.amx_linear(torch.randn(2, 64), int8.q, int8.scales, int8.scales)


def test_the_streamed_path_sends_calls_of_enough_rows_to_it(kernel, monkeypatch):
    """4-bit and int8 weights of shapes it takes get its layout; calls of MIN_ROWS rows or
    more take it, fewer keep to the streamed kernel (each bit for bit). Other forms, other
    shapes and SPECDEC_CPU_AMX=0 keep to the streamed kernel."""
    streamed = cpu_streamed.streamed_kernel()
    if streamed is None:
        pytest.skip("no streamed kernel")
    w = q4_1_weight(64, 96, seed=1)
    compact = cpu_streamed.compact_weight(w)
    assert compact.tiles is not None and torch.equal(compact.tiles.q, tiled(w).q)
    plain = dataclasses.replace(compact, tiles=None)
    for rows in (1, cpu_amx.MIN_ROWS - 1, cpu_amx.MIN_ROWS, 9):
        x = torch.randn(rows, 96)
        got = cpu_streamed.streamed_linear(streamed, x, compact, None)
        taken = (cpu_amx.amx_linear(kernel, x, compact.tiles, None) if rows >= cpu_amx.MIN_ROWS
                 else cpu_streamed.streamed_linear(streamed, x, plain, None))
        assert torch.equal(got, taken)
    assert cpu_streamed.compact_weight(q4_1_weight(8, 96)).tiles is None  # 8 outputs: no feature tile
    int8 = cpu_streamed.compact_weight(q8_0_weight(64, 96))
    assert int8.values.dtype == torch.int8 and int8.tiles is not None and int8.tiles.offsets is None
    x = torch.randn(cpu_amx.MIN_ROWS, 96)
    assert torch.equal(cpu_streamed.streamed_linear(streamed, x, int8, None),
                       cpu_amx.amx_linear(kernel, x, int8.tiles, None))
    assert cpu_streamed.compact_weight(torch.randn(64, 96).half().float()).tiles is None  # a 16-bit form
    monkeypatch.setenv("SPECDEC_CPU_AMX", "0")
    assert cpu_amx.amx_kernel() is None and cpu_amx.build_id() is None
    assert cpu_streamed.compact_weight(w).tiles is None


def test_a_failed_build_is_logged_and_4bit_weights_keep_to_the_streamed_kernel(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu_amx, "cpu_has_amx", lambda: True)  # a build is tried on any CPU then
    fail_the_build(cpu_amx, monkeypatch, tmp_path)
    with caplog.at_level(logging.WARNING, logger="specdec"):
        assert cpu_amx.amx_kernel() is None
        assert cpu_amx.amx_kernel() is None
    assert sum("AMX linear unavailable" in r.getMessage() for r in caplog.records) == 1
    assert cpu_streamed.compact_weight(q4_1_weight(64, 96)).tiles is None
