"""The streamed float32 linear (kernels/cpu_streamed_linear.cpp): built once per machine, or absent.

A decode step's matmuls on a small CPU are bound by memory: a kernel that keeps up reads
the weights once per call whatever the row count. MKL's sgemm re-packs the weight at
every call, and MKL's packs and oneDNN's layout are copies of the weights (540 MB more
each for SmolLM2-135M's target). This kernel loads each pair of weight rows once and
applies every input row to it while it is in L1, on the weight as it is. It is the
fourth path of `cpu_linear`'s routing, timed at load beside the others and taken where it
is the fastest path without a copy, unless a copy beats it by `cpu_linear.COPY_MARGIN`.
On a 2-core Intel Xeon VM (AVX-512), the load-time timings of the target's linears
(docs/bench/row_routing_smollm2_target_streamed.json) put it at 4-16 rows, and 8-node
EAGLE-3 trees went from 1.05x to 1.14x of plain decoding on MT-bench and from 1.52x to
1.85x on HumanEval, plain decoding unchanged (docs/benchmarks.md 1.25). Since it reads the
target's layers as 4-bit blocks (below), it takes 1-32 rows there, and plain decoding
runs about 1.8x as fast (docs/benchmarks.md 1.28).

The source is compiled at the first load on a machine (`cpu_extensions.py`: about 35 s
on 2 cores, then found built). Without a compiler, or when the build fails,
`streamed_kernel()` logs why once and returns None, and the routing keeps to the other
three paths. `SPECDEC_CPU_STREAMED=0` never builds it.

Its torch twin is `F.linear`: results equal it up to float32 rounding (another summation
order). A row's result does not depend on the rows beside it in a call.

Where a weight's float32 values allow it exactly, `compact_weight` gives the kernel a
smaller copy: 4-bit values in blocks of 32 with a float32 scale and offset each (the
target's decoder layers, which GGUF's Q4_1 blocks dequantize to: 0.75 bytes a weight
instead of 4), int8 in blocks of 32 with a float32 scale each (1.125 bytes a weight: the
target's LM head, from GGUF's Q8_0 blocks, and the EAGLE-3 head, served as the int8 rows
it is committed in), or float16 or bfloat16 (drafters' checkpoints hold their weights in
16 bits, which the engine serves as float32 on a CPU). The kernel widens each weight as
it loads it, so its results equal its results on the float32 weight bit for bit, for
fewer bytes read (decode-time calls are bound by memory). A weight with no exact compact
form is used as it is. `SPECDEC_CPU_STREAMED_COMPACT=0` keeps every weight in float32.

On a CPU with AMX, 4-bit and int8 weights also get the AMX kernel's layout, and their
calls of `cpu_amx.MIN_ROWS` rows or more (a tree's verify) go to it (`cpu_amx.py`): the
same path for the routing, timed as one.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F

from ..ops._cupy import kernel_dir
from . import cpu_amx, cpu_extensions

SOURCE_NAME = "cpu_streamed_linear.cpp"
LANES = 16  # the kernel's inner dimension must be a multiple of this
INT8_BLOCK = 32  # int8 weights per scale along the inner dimension (GGUF's Q8_0 blocks)
Q4_BLOCK = 32  # 4-bit weights per scale and offset along the inner dimension (GGUF's Q4_1 blocks)
Q4_LEVELS = 15  # the largest 4-bit value
PROBE_ROWS = 8  # rows `compact_weight` tries before a whole weight
CHUNK_ROWS = 4096  # rows `int8_blocks` and `q4_blocks` check at a time (bounds their temporaries)


def _build() -> Optional[Any]:
    return cpu_extensions.load(kernel_dir() / SOURCE_NAME, "specdec_streamed_linear", "streamed CPU linear",
                               "matmuls keep to MKL and oneDNN")


KERNEL = cpu_extensions.LazyKernel("SPECDEC_CPU_STREAMED", _build)
wanted = KERNEL.wanted  # SPECDEC_CPU_STREAMED=0 never builds nor times it
streamed_kernel = KERNEL.module  # the extension (its `streamed_linear(x, w, bias)`), or None
build_id = KERNEL.build_id


def compact_wanted() -> bool:
    """Compact copies of exact weights may be made (SPECDEC_CPU_STREAMED_COMPACT is not 0)."""
    return os.environ.get("SPECDEC_CPU_STREAMED_COMPACT", "auto") != "0"


@dataclass(frozen=True)
class KernelWeight:
    """What the kernel reads for a float32 weight [N, K]: its values as they are, or an
    exact compact copy (`compact_weight`): float16 or bfloat16 [N, K]; int8 [N, K] with
    `scales` [N, K / INT8_BLOCK] float32 (value = int8 * its block's scale); or 4-bit
    values packed two a byte, uint8 [N, K / 2], with `scales` and `offsets` [N, K /
    Q4_BLOCK] float32 (value = q * scale + offset, q in [0, 15]; `q4_blocks` packs them).
    A 4-bit or int8 weight may also come laid out for the AMX kernel (`tiles`, `cpu_amx.py`),
    which takes its calls of `cpu_amx.MIN_ROWS` rows or more."""

    values: torch.Tensor
    scales: Optional[torch.Tensor] = None
    offsets: Optional[torch.Tensor] = None
    tiles: Optional[cpu_amx.TiledWeight] = None

    @property
    def out_features(self) -> int:
        return self.values.shape[0]

    @property
    def in_features(self) -> int:
        """K: two 4-bit values a byte, one value an element otherwise."""
        return self.values.shape[1] * (2 if self.values.dtype == torch.uint8 else 1)


def compact_weight(weight: torch.Tensor) -> KernelWeight:
    """What the kernel reads for `weight` (float32, `eligible`), the smallest exact form:
    4-bit blocks (`q4_blocks`), else int8 blocks (`int8_blocks`), else a float16 copy,
    else a bfloat16 copy, where every value survives exactly; else `weight` itself (also
    when `compact_wanted()` is false). The same values, so the same results, for fewer
    bytes read. Each form is tried on a few rows first, so that a weight without it costs
    little. 4-bit and int8 blocks also get the AMX kernel's layout where it is available
    (`with_tiles`)."""
    for _, form in _probed_forms(weight):
        found = form(weight)
        if found is not None:
            return with_tiles(found)
    return KernelWeight(weight)


def probed_form(weight: torch.Tensor) -> str:
    """The compact form `compact_weight` finds exact on `weight`'s first rows, the one it
    then tries on the whole weight ("4-bit", "int8", "float16", "bfloat16"), or "float32":
    what timings of the kernel on `weight` depend on besides its shape, found in a few rows."""
    return next((name for name, _ in _probed_forms(weight)), "float32")


def _probed_forms(weight: torch.Tensor) -> Iterator[tuple[str, Callable[[torch.Tensor], Optional[KernelWeight]]]]:
    """`compact_weight`'s forms, smallest first, by name, that are exact on `weight`'s first
    `PROBE_ROWS` rows; none when `compact_wanted()` is false."""
    if not compact_wanted():
        return
    probe = weight[:PROBE_ROWS]
    for name, form in (("4-bit", q4_blocks), ("int8", int8_blocks),
                       ("float16", partial(_in_16_bits, dtype=torch.float16)),
                       ("bfloat16", partial(_in_16_bits, dtype=torch.bfloat16))):
        if form(probe) is not None:
            yield name, form


def with_tiles(weight: KernelWeight) -> KernelWeight:
    """`weight` with its AMX layout (`cpu_amx.tile_weight`, `cpu_amx.tile_int8`) when it is 4-bit
    or int8 blocks whose shape the AMX kernel takes and the kernel is available here; else
    `weight` as it is."""
    if (weight.values.dtype not in (torch.uint8, torch.int8) or weight.scales is None
            or not cpu_amx.tileable(weight.out_features, weight.in_features) or cpu_amx.amx_kernel() is None):
        return weight
    if weight.values.dtype == torch.int8:
        return replace(weight, tiles=cpu_amx.tile_int8(weight.values, weight.scales))
    return replace(weight, tiles=cpu_amx.tile_weight(weight.values, weight.scales, weight.offsets))


def _in_16_bits(weight: torch.Tensor, dtype: torch.dtype) -> Optional[KernelWeight]:
    """A `dtype` copy of `weight` when every value is exact in it (an overflow to inf is
    not equal), else None."""
    copy = weight.to(dtype)
    return KernelWeight(copy.contiguous()) if torch.equal(copy.float(), weight) else None


def int8_blocks(weight: torch.Tensor) -> Optional[KernelWeight]:
    """int8 values [N, K] with float32 scales [N, K / INT8_BLOCK] whose products equal
    `weight` [N, K] bit for bit, or None. Two forms give such weights, and each block's
    scale comes back exactly as the largest magnitude it covers over 127:
    - GGUF's Q8_0 blocks (32 int8 along k times a float16 scale, the form of SmolLM2's
      embedding, which is also its LM head): the block's own largest magnitude;
    - int8 rows with a float32 scale each (`tools/packed_rows.py`, the form the EAGLE-3 head
      is committed in and served as): the row's largest magnitude, the scale of each of
      its blocks.
    Checked over every value, a chunk of rows at a time; a chunk takes the first form that
    is exact."""
    N, K = weight.shape
    if K % INT8_BLOCK:
        return None
    values = torch.empty(N, K, dtype=torch.int8)
    scales = torch.empty(N, K // INT8_BLOCK)
    for start in range(0, N, CHUNK_ROWS):
        w = weight[start: start + CHUNK_ROWS].reshape(-1, K // INT8_BLOCK, INT8_BLOCK)  # [n, blocks, 32]
        block_top = w.abs().amax(dim=-1)  # [n, blocks]
        row_top = block_top.amax(dim=-1, keepdim=True).expand_as(block_top)  # [n, blocks]
        for top in (block_top, row_top):
            found = _int8_at(w, top)
            if found is not None:
                break
        else:
            return None
        values[start: start + CHUNK_ROWS] = found[0].reshape(-1, K)
        scales[start: start + CHUNK_ROWS] = found[1]
    return KernelWeight(values, scales)


def _int8_at(w: torch.Tensor, top: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """w [n, blocks, 32] as int8 values times scales `top / 127` [n, blocks] (an all-zero
    `top`: scale 1, values 0), when every product gives w's value back bit for bit (as the
    kernel widens it: fl(q * scale)); else None. The quotients need not be whole: a float32
    scale's products are rounded."""
    scale = torch.where(top > 0, top / 127, torch.ones_like(top))
    rounded = (w / scale[..., None]).round()  # |q| <= 127 by the scale
    if not torch.equal(rounded * scale[..., None], w):
        return None
    return rounded.to(torch.int8), scale


def q4_blocks(weight: torch.Tensor) -> Optional[KernelWeight]:
    """4-bit values packed two a byte [N, K / 2] with float32 scales and offsets [N, K /
    Q4_BLOCK] whose `q * scale + offset` equals `weight` [N, K] bit for bit in float32, or
    None. GGUF's Q4_1 blocks (32 values q in [0, 15] along k, a float16 scale d and offset
    m; the form of SmolLM2's decoder layers) dequantize to fl(d * q + m), with d * q exact:
    the block's smallest value is m (q = 0) and its largest fl(15 d + m), so d is the
    float16 nearest (largest - smallest) / 15. Every value is checked, with d * q exact, a
    chunk of rows at a time. A block's byte j holds value j in its low nibble and value
    16 + j in its high one (GGUF's order)."""
    N, K = weight.shape
    if K % Q4_BLOCK:
        return None
    half = Q4_BLOCK // 2
    values = torch.empty(N, K // 2, dtype=torch.uint8)
    scales = torch.empty(N, K // Q4_BLOCK)
    offsets = torch.empty(N, K // Q4_BLOCK)
    for start in range(0, N, CHUNK_ROWS):
        w = weight[start: start + CHUNK_ROWS].reshape(-1, K // Q4_BLOCK, Q4_BLOCK)  # [n, blocks, 32]
        low, high = w.amin(dim=-1), w.amax(dim=-1)  # [n, blocks]
        scale = ((high.double() - low.double()) / Q4_LEVELS).to(torch.float16).float()
        if not torch.isfinite(scale).all():
            return None
        step = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant block: q = 0
        q = ((w - low[..., None]) / step[..., None]).round().clamp(0, Q4_LEVELS)
        product = q * scale[..., None]
        if not (torch.equal(product.double(), q.double() * scale[..., None].double())
                and torch.equal(product + low[..., None], w)):
            return None
        q = q.to(torch.uint8)
        rows = q.shape[0]
        values[start: start + rows] = (q[..., :half] | (q[..., half:] << 4)).reshape(rows, K // 2)
        scales[start: start + rows] = scale
        offsets[start: start + rows] = low
    return KernelWeight(values, scales, offsets)


def eligible(weight: torch.Tensor) -> bool:
    """A weight the kernel takes as it is: float32 [N, K] contiguous on the CPU, K a
    multiple of `LANES`."""
    return (weight.dim() == 2 and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.is_contiguous() and weight.shape[1] % LANES == 0)


def streamed_linear(kernel: Any, x: torch.Tensor, weight: torch.Tensor | KernelWeight,
                    bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [..., K] @ weight.T + bias through `kernel` (weight `eligible`, or what
    `compact_weight` made of one), or through the AMX kernel where the weight has its layout
    and the call `cpu_amx.MIN_ROWS` rows or more: [..., N]."""
    if isinstance(weight, torch.Tensor):
        weight = KernelWeight(weight)
    if weight.tiles is not None and x.numel() >= cpu_amx.MIN_ROWS * x.shape[-1]:
        amx = cpu_amx.amx_kernel()
        if amx is not None:
            return cpu_amx.amx_linear(amx, x, weight.tiles, bias)
    flat = x.reshape(-1, x.shape[-1]).contiguous()  # [rows, K]
    out = kernel.streamed_linear(flat, weight.values, bias, weight.scales, weight.offsets)  # [rows, N]
    return out.reshape(*x.shape[:-1], weight.out_features)


def twin(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The torch twin of the kernel."""
    return F.linear(x, weight, bias)


def build_name(source: bytes) -> str:
    """The extension's name: the source, flags, CPU and torch hashed (`cpu_extensions`)."""
    return cpu_extensions.build_name("specdec_streamed_linear", source)
