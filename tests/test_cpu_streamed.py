"""The streamed float32 CPU linear (kernels/cpu_streamed_linear.cpp, `models/cpu_streamed.py`)
against its torch twin `F.linear`, and the routing that sends row counts to it
(`cpu_linear.plan_paths`, `PackedCpuLinear`).

The kernel is built once per machine (about 35 s on 2 cores, then cached by torch). On an
x86-64 Linux machine with a C++ compiler and ninja, as the test machines are, it must build:
the kernel tests fail rather than skip there, so that they cannot pass by never running.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cpu_kernels import built_or_skip, fail_the_build, int8_rows_weight, q4_1_weight, q8_0_weight
from specdec.models import cpu_linear, cpu_streamed
from specdec.models.cpu_linear import COPY_MARGIN, ROW_LADDER, RowRouting, plan_paths, use_packed_cpu_linears

INF = float("inf")


@pytest.fixture(scope="module")
def kernel():
    return built_or_skip(cpu_streamed.streamed_kernel(), cpu_streamed.wanted(), "streamed kernel")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 33, 64])
@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (64, 33), (16, 1), (48, 200)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_its_twin(kernel, rows, shape, bias):
    """Equal to F.linear up to float32 rounding: both within a few float32 ulps of the
    float64 product (odd output counts take the single-row tail; 1 output is all tail)."""
    in_features, out_features = shape
    torch.manual_seed(rows * 7 + in_features)
    lin = nn.Linear(in_features, out_features, bias=bias)
    x = torch.randn(rows, in_features)
    got = cpu_streamed.streamed_linear(kernel, x, lin.weight.detach(), None if lin.bias is None else lin.bias.detach())
    want = cpu_streamed.twin(x, lin.weight.detach(), None if lin.bias is None else lin.bias.detach())
    exact = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
    assert got.shape == want.shape == (rows, out_features) and got.dtype == torch.float32
    # the error bound of a float32 dot product of length K: K * eps * sum |x_k w_k|
    scale = (x.double().abs() @ lin.weight.double().abs().T) * in_features * torch.finfo(torch.float32).eps
    assert ((got.double() - exact).abs() <= scale + 1e-6).all()
    assert ((want.double() - exact).abs() <= scale + 1e-6).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kernel_keeps_leading_dims(kernel):
    torch.manual_seed(1)
    w, b = torch.randn(80, 64), torch.randn(80)
    x = torch.randn(2, 3, 64)
    got = cpu_streamed.streamed_linear(kernel, x, w, b)
    assert got.shape == (2, 3, 80)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_a_row_does_not_depend_on_the_rows_beside_it(kernel):
    """Bit for bit: a row alone, among 8 (one block), among 13 (blocks of 8, 4 and 1) and
    with other rows around it give the same result."""
    torch.manual_seed(3)
    w = torch.randn(200, 576)
    rows = torch.randn(13, 576)
    alone = torch.cat([kernel.streamed_linear(rows[i:i + 1].contiguous(), w, None) for i in range(13)])
    together = kernel.streamed_linear(rows, w, None)
    assert torch.equal(alone, together)
    shuffled = torch.randperm(13)
    assert torch.equal(kernel.streamed_linear(rows[shuffled].contiguous(), w, None), together[shuffled])
    padded = torch.cat([torch.randn(5, 576), rows[4:5], torch.randn(2, 576)])
    assert torch.equal(kernel.streamed_linear(padded, w, None)[5], together[4])


def test_kernel_refuses_int8_weights_without_their_scales(kernel):
    q, scales = torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 2)
    x = torch.randn(2, 64)
    assert torch.equal(kernel.streamed_linear(x, q, None, scales), torch.zeros(2, 8))
    with pytest.raises(RuntimeError, match="need scales"):
        kernel.streamed_linear(x, q, None)
    with pytest.raises(RuntimeError, match="need scales"):
        kernel.streamed_linear(x, torch.randn(8, 64), None, scales)
    with pytest.raises(RuntimeError, match="scales"):
        kernel.streamed_linear(x, q, None, torch.ones(8, 3))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.streamed_linear(torch.randn(2, 48), torch.zeros(8, 48, dtype=torch.int8), None, torch.ones(8, 1))


def test_kernel_refuses_4bit_weights_without_their_scales_and_offsets(kernel):
    q, blocks = torch.zeros(8, 32, dtype=torch.uint8), torch.ones(8, 2)  # 64 inputs, two blocks a row
    x = torch.randint(-4, 5, (2, 64)).float()  # integers: every sum exact, in any order
    assert torch.equal(kernel.streamed_linear(x, q, None, blocks, blocks), x.sum(1, keepdim=True).expand(2, 8))
    with pytest.raises(RuntimeError, match="need scales"):
        kernel.streamed_linear(x, q, None)
    with pytest.raises(RuntimeError, match="needs offsets"):
        kernel.streamed_linear(x, q, None, blocks)
    with pytest.raises(RuntimeError, match="needs offsets"):
        kernel.streamed_linear(x, torch.zeros(8, 64, dtype=torch.int8), None, blocks, blocks)
    with pytest.raises(RuntimeError, match="offsets"):
        kernel.streamed_linear(x, q, None, blocks, torch.ones(8, 3))
    with pytest.raises(RuntimeError, match="K / 2"):
        kernel.streamed_linear(x, torch.zeros(8, 64, dtype=torch.uint8), None, blocks, blocks)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.streamed_linear(torch.randn(2, 48), torch.zeros(8, 24, dtype=torch.uint8), None, torch.ones(8, 1),
                               torch.ones(8, 1))


def test_kernel_refuses_what_it_cannot_take(kernel):
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernel.streamed_linear(torch.randn(2, 24), torch.randn(8, 24), None)
    with pytest.raises(RuntimeError, match="float32"):
        kernel.streamed_linear(torch.randn(2, 32).double(), torch.randn(8, 32).double(), None)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel.streamed_linear(torch.randn(32, 2).T, torch.randn(8, 32), None)


def exact_in(dtype: torch.dtype, rows: int, cols: int, scale: float = 1.0) -> torch.Tensor:
    """A float32 weight [rows, cols] whose every value is exact in `dtype`."""
    return (torch.randn(rows, cols) * scale).to(dtype).float()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13])
@pytest.mark.parametrize("shape", [(576, 960), (64, 33), (16, 1)])
def test_a_16bit_weight_gives_the_float32_weights_results_bit_for_bit(kernel, dtype, rows, shape):
    """The kernel widens 16-bit weights as it loads them: on a weight exact in 16 bits, the
    16-bit copy's results are the float32 weight's, bit for bit (odd outputs, tails)."""
    in_features, out_features = shape
    torch.manual_seed(rows + out_features)
    w, b = exact_in(dtype, out_features, in_features), torch.randn(out_features)
    x = torch.randn(rows, in_features)
    compact = w.to(dtype)
    assert compact.dtype == dtype and compact.element_size() == 2
    got = cpu_streamed.streamed_linear(kernel, x, compact, b)
    assert torch.equal(got, cpu_streamed.streamed_linear(kernel, x, w, b))
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-4, atol=1e-4)  # another summation order


def test_16bit_weights_take_every_value_their_type_holds(kernel):
    """Subnormals, zeros and the largest values of each 16-bit type come back as
    themselves (the widening is exact, not approximated)."""
    for dtype in (torch.float16, torch.bfloat16):
        info = torch.finfo(dtype)
        special = torch.tensor([0.0, -0.0, info.tiny, info.tiny / 4, -info.tiny / 8, info.max, -info.max,
                                info.eps, 1.0, -1.0, 3.0, 1.5, -0.75, 0.5, -2.0, 65504.0])
        w = torch.stack([special.roll(i) for i in range(32)]).to(dtype)  # [32, 16]
        x = torch.eye(16)  # each output is one weight: the widened value itself
        got = kernel.streamed_linear(x, w.contiguous(), None)
        assert torch.equal(got, w.float().T.contiguous())


def test_compact_weight_only_where_exact(monkeypatch):
    torch.manual_seed(2)
    plain = torch.randn(64, 32)  # float32 values, none of the compact forms exact
    assert cpu_streamed.compact_weight(plain).values is plain and cpu_streamed.compact_weight(plain).scales is None
    half = exact_in(torch.float16, 64, 32)
    assert cpu_streamed.compact_weight(half).values.dtype == torch.float16
    wide = exact_in(torch.bfloat16, 64, 32, scale=1e9)  # past float16's range: bfloat16's
    assert cpu_streamed.compact_weight(wide).values.dtype == torch.bfloat16
    tiny = exact_in(torch.bfloat16, 64, 32, scale=1e-9)  # below float16's subnormals
    assert cpu_streamed.compact_weight(tiny).values.dtype == torch.bfloat16
    blocks = q8_0_weight(64, 64)
    assert cpu_streamed.compact_weight(blocks).values.dtype == torch.int8
    int8_rows = int8_rows_weight(64, 64)
    assert cpu_streamed.compact_weight(int8_rows).values.dtype == torch.int8
    four_bit = q4_1_weight(64, 64)
    assert cpu_streamed.compact_weight(four_bit).values.dtype == torch.uint8
    for exact in (half, wide, blocks, int8_rows, four_bit):
        almost = exact.clone()
        almost[17, 3] = torch.nextafter(almost[17, 3], torch.tensor(1e30))  # one value off, past the probe rows
        assert cpu_streamed.compact_weight(almost).values is almost
        assert torch.equal(widened(cpu_streamed.compact_weight(exact)), exact)
    monkeypatch.setenv("SPECDEC_CPU_STREAMED_COMPACT", "0")
    for exact in (half, blocks, int8_rows, four_bit):
        assert cpu_streamed.compact_weight(exact).values is exact


def widened(weight: cpu_streamed.KernelWeight) -> torch.Tensor:
    """The float32 values a compact weight stands for (written out here, apart from the
    kernel: a 4-bit block's byte j holds value j low and value 16 + j high)."""
    if weight.scales is None:
        return weight.values.float()
    rows = weight.values.shape[0]
    if weight.offsets is not None:
        packed = weight.values.view(rows, -1, cpu_streamed.Q4_BLOCK // 2)  # [rows, blocks, 16]
        q = torch.cat((packed & 15, packed >> 4), dim=-1).float()  # [rows, blocks, 32]
        return (q * weight.scales[..., None] + weight.offsets[..., None]).view(rows, -1)
    blocks = weight.values.float().view(rows, -1, cpu_streamed.INT8_BLOCK) * weight.scales[..., None]
    return blocks.view(rows, -1)


@pytest.mark.parametrize("form", ["Q8_0", "Q4_1", "int8 rows"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13])
@pytest.mark.parametrize("shape", [(576, 960), (64, 33), (32, 1)])
def test_gguf_blocks_give_the_float32_weights_results_bit_for_bit(kernel, form, rows, shape, monkeypatch):
    """A weight as GGUF's Q8_0 or Q4_1 blocks dequantize to, or as the EAGLE-3 head's int8
    rows (tools/packed_rows.py) do, read as int8 or 4-bit blocks: exactly its values, and
    the kernel's results on it equal its results on the float32 weight, bit for bit (13
    rows: two blocks of rows, each widening the weight). The AMX kernel, which would take
    the calls of 8 and 13 rows, is off here (tests/test_cpu_amx.py)."""
    monkeypatch.setenv("SPECDEC_CPU_AMX", "0")
    in_features, out_features = shape
    make, dtype, per_byte = {"Q8_0": (q8_0_weight, torch.int8, 1), "Q4_1": (q4_1_weight, torch.uint8, 2),
                             "int8 rows": (int8_rows_weight, torch.int8, 1)}[form]
    w = make(out_features, in_features, seed=rows)
    compact = cpu_streamed.compact_weight(w)
    assert compact.values.dtype == dtype and compact.values.shape == (out_features, in_features // per_byte)
    assert compact.scales.shape == (out_features, in_features // 32)
    assert (compact.offsets is None) == (form != "Q4_1")
    assert torch.equal(widened(compact), w)
    x, b = torch.randn(rows, in_features), torch.randn(out_features)
    got = cpu_streamed.streamed_linear(kernel, x, compact, b)
    assert torch.equal(got, cpu_streamed.streamed_linear(kernel, x, w, b))
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-4, atol=1e-4)  # another summation order


def test_4bit_blocks_take_each_nibble_where_it_sits(kernel):
    """Each of a block's 32 values alone (the others 0) comes back as itself at its own
    input: the nibble order and the second half's shift, read by the kernel."""
    q = torch.zeros(32, 32, dtype=torch.long)
    q[torch.arange(32), torch.arange(32)] = torch.arange(32) % 15 + 1  # row j: value j only, 1..15
    packed = (q[:, :16] | (q[:, 16:] << 4)).to(torch.uint8)  # [32, 16]
    scales, offsets = torch.full((32, 1), 0.5), torch.zeros(32, 1)
    got = kernel.streamed_linear(torch.eye(32), packed, None, scales, offsets)  # [inputs, rows]
    assert torch.equal(got, (q.float() * 0.5).T)


def test_q4_blocks_refuse_what_they_cannot_hold():
    w = q4_1_weight(8, 64)
    assert cpu_streamed.q4_blocks(w) is not None
    assert cpu_streamed.q4_blocks(q8_0_weight(8, 64)) is None  # 255 levels a block
    assert cpu_streamed.q4_blocks(torch.randn(8, 48)) is None  # K % 32
    scaled = w * 3.0  # each block's step still exact in float16, but the sums round elsewhere
    assert cpu_streamed.q4_blocks(scaled) is None or torch.equal(widened(cpu_streamed.q4_blocks(scaled)), scaled)
    huge = w.clone()
    huge[0, 0], huge[0, 1] = -3e38, 3e38  # a step past float16's range
    assert cpu_streamed.q4_blocks(huge) is None


def test_the_real_weights_are_read_as_4bit_and_int8_blocks():
    """SmolLM2's layers (Q4_1 in the GGUF) have an exact 4-bit form, its LM head (its
    embedding, Q8_0) an exact int8 one."""
    from safetensors import safe_open
    from setup_model import BASE_DIR
    files = sorted(BASE_DIR.glob("*.safetensors"))
    if not files:
        pytest.skip("SmolLM2 not set up (python tools/setup_model.py)")
    with safe_open(str(files[0]), "pt") as f:
        head = f.get_tensor("model.embed_tokens.weight")
        layer = f.get_tensor("model.layers.0.mlp.down_proj.weight")
    compact = cpu_streamed.compact_weight(head)
    assert compact.values.dtype == torch.int8 and torch.equal(widened(compact), head)
    compact = cpu_streamed.compact_weight(layer)
    assert compact.values.dtype == torch.uint8 and torch.equal(widened(compact), layer)


def test_the_eagle3_heads_weights_are_read_as_int8_blocks():
    """The EAGLE-3 head as setup writes it (its int8 rows' products, tools/packed_rows.py):
    each weight matrix an exact int8 form."""
    from safetensors import safe_open
    from setup_model import FAMILY_DIR
    path = FAMILY_DIR / "eagle3" / "model.safetensors"
    if not path.is_file():
        pytest.skip("SmolLM2's family not set up (python tools/setup_model.py)")
    with safe_open(str(path), "pt") as f:
        for name in ("lm_head.weight", "fc.weight", "midlayer.mlp.down_proj.weight"):
            weight = f.get_tensor(name)
            compact = cpu_streamed.compact_weight(weight)
            assert compact.values.dtype == torch.int8 and torch.equal(widened(compact), weight), name


def test_eligible_weights():
    assert cpu_streamed.eligible(torch.randn(8, 32))
    assert not cpu_streamed.eligible(torch.randn(8, 24))  # inputs not a multiple of 16
    assert not cpu_streamed.eligible(torch.randn(32, 8).T)  # not contiguous
    assert not cpu_streamed.eligible(torch.randn(8, 32).double())
    assert cpu_streamed.eligible(torch.randn(16, 32)[4:])  # a fused projection's rows: contiguous


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("SPECDEC_CPU_STREAMED", "0")
    assert cpu_streamed.streamed_kernel() is None
    assert cpu_linear.streamed_kernel_for(cpu_linear.packed_layers(packed(nn.Linear(32, 32)))) is None


def test_build_name_follows_the_source():
    assert cpu_streamed.build_name(b"a") != cpu_streamed.build_name(b"b")
    assert cpu_streamed.build_name(b"a") == cpu_streamed.build_name(b"a")


# -- routing ------------------------------------------------------------------------------


def ladder(sgemm, onednn=None, packed_ms=None, streamed=None) -> list:
    return [(r, sgemm(r), (onednn or sgemm)(r), (packed_ms or sgemm)(r), (streamed or (lambda _: INF))(r))
            for r in ROW_LADDER]


def test_plan_takes_the_streamed_kernel_where_it_is_the_fastest_copy_free_path():
    # sgemm 10 + 2 rows; streamed 12.5 + rows / 2: slower at 1 row, faster from 2 rows on
    routing = plan_paths(ladder(lambda r: 10.0 + 2 * r, streamed=lambda r: 12.5 + r / 2), max_packs=3)
    assert routing.streamed_rows == frozenset(r for r in ROW_LADDER if r >= 2)
    assert not routing.onednn_rows and not routing.packs
    assert [routing.streamed(r) for r in (1, 2, 5, 64)] == [False, True, True, True]


def test_copies_must_beat_the_streamed_kernel_by_the_margin():
    """A path that copies the weights is weighed against the faster copy-free one."""
    streamed = lambda r: 10.0  # noqa: E731
    close = plan_paths(ladder(lambda r: 20.0, onednn=lambda r: 10.0 * (1 - COPY_MARGIN / 2),
                              packed_ms=lambda r: 10.0 * (1 - COPY_MARGIN / 2), streamed=streamed), max_packs=3)
    assert close.streamed_rows == frozenset(ROW_LADDER) and not close.onednn_rows and not close.packs
    far = plan_paths(ladder(lambda r: 20.0, onednn=lambda r: 5.0 if r >= 16 else 20.0,
                            packed_ms=lambda r: 6.0 if r == 8 else 20.0, streamed=streamed), max_packs=3)
    assert far.onednn_rows == {16, 32, 64} and dict(far.packs) == {r: 8 for r in (1, 2, 3, 4, 6, 8)}
    assert far.streamed_rows == {12}  # where neither copy took the step


def packed(lin: nn.Linear) -> nn.Module:
    model = nn.Sequential(lin)
    assert use_packed_cpu_linears(model) == 1
    return model


def test_calls_take_the_streamed_kernel_at_its_row_counts(kernel, monkeypatch):
    torch.manual_seed(5)
    lin = nn.Linear(64, 96)
    model = packed(nn.Linear(64, 96))
    model[0].load_state_dict(lin.state_dict())
    calls = []
    real = cpu_streamed.streamed_linear

    def spy(k, x, w, b):
        calls.append(x.shape[0])
        return real(k, x, w, b)
    monkeypatch.setattr(cpu_streamed, "streamed_linear", spy)
    routing = RowRouting(frozenset(), streamed_rows=frozenset({2, 3, 4, 8, 64}))
    cpu_linear.route(cpu_linear.packed_layers(model), routing)
    with torch.inference_mode():
        for rows in (1, 2, 4, 5, 7, 9, 70):
            x = torch.randn(rows, 64)
            got, want = model(x), F.linear(x, lin.weight, lin.bias)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            if rows not in (2, 4, 7):
                assert torch.equal(got, want)  # F.linear itself
    # 7 rows take 8's step; 5 rows 6's, 9 rows 12's; 70 rows are past the ladder (a prompt's)
    assert calls == [2, 4, 7]


def test_calls_read_a_16bit_copy_of_an_exact_weight(kernel, monkeypatch):
    """A layer whose weight is exact in float16 (a drafter's checkpoint) hands the kernel
    a float16 copy, made once; its outputs are the float32 weight's bit for bit. A layer
    that never takes the kernel keeps no copy."""
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64))
    with torch.no_grad():
        model[0].weight.copy_(exact_in(torch.float16, 96, 64))
    reference = [(m.weight.detach().clone(), m.bias.detach().clone()) for m in model]
    assert use_packed_cpu_linears(model) == 2
    layers = cpu_linear.packed_layers(model)
    read = []
    real = cpu_streamed.streamed_linear

    def spy(k, x, w, b):
        read.append((x.shape[-1], w.values.dtype, w.values.data_ptr()))
        return real(k, x, w, b)
    monkeypatch.setattr(cpu_streamed, "streamed_linear", spy)
    cpu_linear.route(layers, RowRouting(frozenset(), streamed_rows=frozenset({2, 4})))
    with torch.inference_mode():
        for _ in range(2):
            x = torch.randn(4, 64)
            h = real(kernel, x, *reference[0])
            assert torch.equal(model[0](x), h)
            assert torch.equal(model(x), real(kernel, h, *reference[1]))
    assert [(k, d) for k, d, _ in read] == [(64, torch.float16), (64, torch.float16), (96, torch.float32)] * 2
    assert len({p for k, _, p in read if k == 64}) == 1  # one copy, made at the first call
    assert layers[0]._streamed_weight.values.dtype == torch.float16
    assert layers[1]._streamed_weight.values.data_ptr() == layers[1].weight.data_ptr()  # the weight itself, no copy
    cpu_linear.route(layers, RowRouting(frozenset()))  # the kernel at no row count: copies dropped
    assert all(m._streamed_weight is None for m in layers)


def test_an_ineligible_layer_leaves_the_kernel_out_of_the_timing(monkeypatch):
    seen = []

    def time_paths(layers, rows, repeats, mkl=True, streamed=None):
        seen.append(streamed)
        return (10.0, 10.0, INF, INF)
    monkeypatch.setattr(cpu_linear, "_time_paths", time_paths)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(24, 64))
    assert use_packed_cpu_linears(model) == 2
    layers = cpu_linear.packed_layers(model)
    assert [m._streamable for m in layers] == [True, False]
    cpu_linear.choose_row_paths(layers)
    assert seen and all(s is None for s in seen)


def test_a_failed_build_is_logged_once_and_leaves_the_kernel_out(monkeypatch, tmp_path, caplog):
    """A source that cannot be built (here: none where it is looked for) gives no kernel,
    one warning, and no second attempt in the process; the routing then leaves it out."""
    fail_the_build(cpu_streamed, monkeypatch, tmp_path)
    with caplog.at_level("WARNING", logger="specdec"):
        assert cpu_streamed.streamed_kernel() is None
        assert cpu_streamed.streamed_kernel() is None
    assert caplog.text.count("streamed CPU linear unavailable") == 1
    model = packed(nn.Linear(32, 32))
    assert cpu_linear.streamed_kernel_for(cpu_linear.packed_layers(model)) is None
