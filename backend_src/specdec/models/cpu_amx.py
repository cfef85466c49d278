"""A float32 linear over 4-bit and int8 block weights on Intel AMX tiles (kernels/cpu_amx_linear.cpp).

The target's decoder layers are GGUF Q4_1 blocks and its LM head Q8_0 blocks, which the
streamed kernel (`cpu_streamed.py`) reads as 4-bit and int8 values and widens to float32:
one vector multiply-add per 16 weights and row, so its calls cost about 2.6x one row's at
8 rows, and a tree verify pays for it. A CPU with AMX (Intel Sapphire Rapids on)
multiplies a 16 x 32 block of bfloat16 by a 32 x 16 one in one instruction. Each 4-bit or
int8 value is exact in bfloat16 and each float32 input is the exact sum of three bfloat16
parts, so three tile products give a block's dot products in float32 as the streamed
kernel's multiply-adds do; a block's scale (and offset) are applied after (the source says
how). On the 2-core Xeon VM the target's 120 layer matmuls took 4.3 / 4.6 / 5.3 / 6.6 /
8.8 ms over 1 / 2 / 4 / 8 / 16 rows against the streamed kernel's 3.7 / 4.5 / 6.2 / 9.8 /
19.7 with hot caches, its LM head 1.0 / 1.1 / 1.5 / 1.8 against 0.9 / 1.5 / 2.5 / 4.9 over
1 / 4 / 8 / 16 rows (tools/bench/streamed_kernel_rows.py, docs/bench/amx_kernel_rows.md);
at a load's routing timings, where a forward's other work leaves the caches cold, the
target's layers took 7.5 / 8.8 / 10.9 ms over 4 / 8 / 16 rows with it and 7.5 / 11.1 /
20.5 without. So calls of `MIN_ROWS` rows or more take it.

The weight is laid out for the tiles once (`tile_weight`, `tile_int8`: the same bytes as
the blocks, reordered), a second copy beside the streamed kernel's (the target's layers
80 MB, its LM head 32 MB). `cpu_streamed.compact_weight` makes it for 4-bit and int8 weights
where the kernel is available, and `cpu_streamed.streamed_linear` sends calls of
`MIN_ROWS` rows or more to it.

It is built at the first 4-bit weight on a CPU that reports AMX (`cpu_has_amx`;
`cpu_extensions.py` builds it) and is available where the OS grants the process AMX's tile
state (Linux 5.16 on); elsewhere, or without a compiler, `amx_kernel()` returns None and
the streamed kernel takes every row count. `SPECDEC_CPU_AMX=0` never builds it.

Its torch twin is `twin` (`F.linear` on the dequantized weight): results equal it up to
float32 rounding (another summation order, and the offset multiplies a block's sum of
inputs). A row's result does not depend on the rows beside it in a call, but differs from
the streamed kernel's in the last bits, so a tree's logits can differ from plain
decoding's there, as they do wherever routing sends row counts to different paths.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ..ops._cupy import kernel_dir
from . import cpu_extensions

SOURCE_NAME = "cpu_amx_linear.cpp"
TILE_FEATURES = 16  # output features a tile product gives: N must be a multiple
BLOCK = 32  # inputs per scale and offset (GGUF's Q4_1 blocks): K must be a multiple
MIN_ROWS = 4  # calls with fewer rows keep to the streamed kernel (as fast or faster there)


def _build() -> Optional[Any]:
    """The extension where the CPU reports AMX (no 35 s build for nothing on every other CPU)
    and the OS grants its tiles, else None."""
    if not cpu_has_amx():
        return None
    module = cpu_extensions.load(kernel_dir() / SOURCE_NAME, "specdec_amx_linear", "AMX linear",
                                 "4-bit and int8 matmuls keep to the streamed kernel")
    return module if module is not None and module.available() else None


def cpu_has_amx() -> bool:
    """The CPU reports AMX's tiles and bfloat16 products (/proc/cpuinfo's flags, Linux)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return {"amx_tile", "amx_bf16"} <= flags


KERNEL = cpu_extensions.LazyKernel("SPECDEC_CPU_AMX", _build)
wanted = KERNEL.wanted  # SPECDEC_CPU_AMX=0 never builds it
# The extension (its `amx_linear(x, q, scales, offsets, bias)`), or None: off, not built, or
# no AMX tiles on this CPU or from this OS.
amx_kernel = KERNEL.module
build_id = KERNEL.build_id


@dataclass(frozen=True)
class TiledWeight:
    """A weight [N, K] laid out for the kernel: 4-bit (`tile_weight`), `q` [K / 32, N / 16, 256]
    uint8 with `scales` and `offsets` [K / 32, N / 16, 16] float32; or int8 (`tile_int8`), `q`
    [K / 32, N / 16, 512] int8 with `scales` and no offsets."""

    q: torch.Tensor
    scales: torch.Tensor
    offsets: Optional[torch.Tensor] = None

    @property
    def out_features(self) -> int:
        return self.q.shape[1] * TILE_FEATURES

    @property
    def in_features(self) -> int:
        return self.q.shape[0] * BLOCK


def tileable(out_features: int, in_features: int) -> bool:
    return out_features % TILE_FEATURES == 0 and in_features % BLOCK == 0


def tile_weight(values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> TiledWeight:
    """4-bit blocks as `cpu_streamed.q4_blocks` packs them (values [N, K / 2] uint8, a block's
    byte j holding value j low and 16 + j high; scales and offsets [N, K / 32]) laid out for
    the kernel. For features t (16 of them) and block b, 256 bytes as 4 loads of 32 16-bit
    words: word 2n + j of load L holds, in its nibbles from the lowest, the block's values
    2r + j of feature 16 t + n for r = L, L + 4, L + 8, L + 12 (the bfloat16 pairs along k
    of the weight tile's rows r)."""
    N, half = values.shape
    K = half * 2
    T, B = N // TILE_FEATURES, K // BLOCK
    blocks = values.reshape(N, B, BLOCK // 2)
    q = torch.cat([blocks & 15, blocks >> 4], dim=-1).reshape(N, K)  # [N, K] in [0, 15]
    # k = 32 b + 2 (4 p + L) + j  ->  [b, t, L, n, j, p]
    q = q.reshape(T, TILE_FEATURES, B, 4, 4, 2).permute(2, 0, 4, 1, 5, 3).to(torch.int32)
    words = q[..., 0] | (q[..., 1] << 4) | (q[..., 2] << 8) | (q[..., 3] << 12)  # [b, t, 4, 16, 2]
    packed = words.to(torch.int16).contiguous().view(torch.uint8).reshape(B, T, 256)  # little-endian words

    def by_tile(blocks_nb: torch.Tensor) -> torch.Tensor:  # [N, B] -> [B, T, 16]
        return blocks_nb.reshape(T, TILE_FEATURES, B).permute(2, 0, 1).contiguous()
    return TiledWeight(packed, by_tile(scales), by_tile(offsets))


def tile_int8(values: torch.Tensor, scales: torch.Tensor) -> TiledWeight:
    """int8 blocks as `cpu_streamed.int8_blocks` makes them (values [N, K] int8, scales [N, K /
    32]; the LM head) laid out for the kernel: for features t (16 of them) and block b, 512
    bytes, the weight tile's 16 rows of 32 values each, row r's value 2n + j being the
    block's value 2r + j of feature 16 t + n."""
    N, K = values.shape
    T, B = N // TILE_FEATURES, K // BLOCK
    # k = 32 b + 2 r + j  ->  [b, t, r, n, j]
    packed = values.reshape(T, TILE_FEATURES, B, BLOCK // 2, 2).permute(2, 0, 3, 1, 4).reshape(B, T, 512)
    return TiledWeight(packed.contiguous(), scales.reshape(T, TILE_FEATURES, B).permute(2, 0, 1).contiguous())


def amx_linear(kernel: Any, x: torch.Tensor, weight: TiledWeight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [..., K] @ weight.T + bias through `kernel`: [..., N]."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()  # [rows, K]
    out = kernel.amx_linear(flat, weight.q, weight.scales, weight.offsets, bias)  # [rows, N]
    return out.reshape(*x.shape[:-1], weight.out_features)


def twin(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The torch twin of the kernel (`weight` the dequantized float32 [N, K])."""
    return F.linear(x, weight, bias)
