"""Attention of a few queries over the KV cache on the CPU (kernels/cpu_tree_attention.cpp).

A decode step's attention on the CPU is a few queries (one per request, a tree's nodes,
an EAGLE head's frontier) over a few hundred cached keys: a few million multiply-adds,
which torch's CPU flash kernel spends several times as long on as they take, because its
blocking is made for long sequences. The kernel keeps each KV head's query rows (its
grouped query heads times the step's tokens) in the lanes of a vector and reads each key
and value once for up to 16 of them (the source says how).

It is built at the first attention on a machine (`cpu_extensions.py`), and takes every
float32 attention over a KV cache on the CPU of up to MAX_QUERY_TOKENS queries a row whose
head dim is a multiple of 16 up to 128 (the target's, the drafters'; not prefill past
that, nor training, which runs without a cache). Right after a weight stream it was about
1.5x as fast as torch's kernels at 1-64 queries (docs/DESIGN.md, ad hoc timings). Without a
compiler, or when the build fails, `attention_kernel()` logs why once and returns None,
and the layers keep to `scaled_dot_product_attention`. `SPECDEC_CPU_ATTENTION=0` never
builds it.

Its torch twin is `twin` (`scaled_dot_product_attention` with `enable_gqa`): results equal
it up to float32 rounding (another summation order and exp). A query row's result does not
depend on the rows beside it in a call.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from ..ops._cupy import kernel_dir
from . import cpu_extensions

SOURCE_NAME = "cpu_tree_attention.cpp"
LANES = 16  # the head dim must be a multiple of this
MAX_HEAD_DIM = 128
MAX_QUERY_TOKENS = 64  # longer forwards (prefill) keep to torch's flash kernel, made for them

def _build() -> Optional[Any]:
    return cpu_extensions.load(kernel_dir() / SOURCE_NAME, "specdec_tree_attention", "CPU attention kernel",
                               "attention keeps to torch's kernels")


KERNEL = cpu_extensions.LazyKernel("SPECDEC_CPU_ATTENTION", _build)
wanted = KERNEL.wanted  # SPECDEC_CPU_ATTENTION=0 never builds it
attention_kernel = KERNEL.module  # the extension (its `tree_attention(q, k, v, mask)`), or None
build_id = KERNEL.build_id


def takes(q: torch.Tensor, k: torch.Tensor, mask: Optional[torch.Tensor]) -> bool:
    """The kernel's shapes: q [B, H, T, D] and k [B, H_kv, S, D] float32 on the CPU, T up
    to MAX_QUERY_TOKENS, D a multiple of LANES up to MAX_HEAD_DIM, H a multiple of H_kv;
    mask bool."""
    D = q.shape[-1]
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k.dtype == torch.float32
            and mask is not None and mask.dtype == torch.bool and D % LANES == 0 and D <= MAX_HEAD_DIM
            and q.shape[2] <= MAX_QUERY_TOKENS and q.shape[1] % k.shape[1] == 0)


def attend(kernel: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [B, H, T, D]; k, v [B, H_kv, S, D]; mask [B or 1, 1, T, S] bool (`takes`):
    [B, T, H, D] (as the output projection reads it) through `kernel`."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return kernel.tree_attention(q, k, v, mask.contiguous())


def twin(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The torch twin of `attend`: [B, T, H, D]."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)
