"""The small operations around a decoder layer's matmuls on the CPU, one call each
(kernels/cpu_layer_ops.cpp): RMS norm, SiLU times the up projection, q/k/v split from the
fused projection with RoPE applied, and one request's new keys and values written into
the KV cache.

A decode step runs these over a few rows of a few hundred values: microseconds of
arithmetic, while torch spends several operators on each, each paying its dispatch and
an allocation (a norm is eight). Beside the matmuls that was most of a plain step of
SmolLM2's 30 layers on the 2-core Xeon VM; every forward pays it, a tree's verify and
each EAGLE drafting depth too.

Built at the first use on a machine (`cpu_extensions.py`). Without a compiler, or when
the build fails, `layer_ops_kernel()` logs why once and returns None, and the layers keep
to their torch code, the kernels' twins. `SPECDEC_CPU_LAYER_OPS=0` never builds it and is
read at every call (`bench.py --env-variant` pairs the two in one process).

Taken for float32 tensors on the CPU outside autograd (training keeps to the twins).
`rope_qkv` and `write_kv` equal their twins bit for bit; `rms_norm` and `silu_mul` differ
from theirs in the last bits (another summation order, their own exp), as the streamed
linear does from `F.linear`. A row's result depends on that row alone.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..ops._cupy import kernel_dir
from . import cpu_extensions

SOURCE_NAME = "cpu_layer_ops.cpp"

def _build() -> Optional[Any]:
    return cpu_extensions.load(kernel_dir() / SOURCE_NAME, "specdec_layer_ops", "CPU layer operations",
                               "norms, SiLU and RoPE keep to torch's operators")


KERNEL = cpu_extensions.LazyKernel("SPECDEC_CPU_LAYER_OPS", _build)
wanted = KERNEL.wanted  # SPECDEC_CPU_LAYER_OPS=0 never builds them
layer_ops_kernel = KERNEL.module  # the extension (`rms_norm`, `silu_mul`, `rope_qkv`, `write_kv`), or None
build_id = KERNEL.build_id


def kernel_for(*tensors: torch.Tensor) -> Optional[Any]:
    """The kernel when every tensor is float32 on the CPU and no gradient is wanted, else
    None (the caller runs its twin). The kernels take contiguous tensors: callers pass
    `.contiguous()` (itself where it already is; an EAGLE drafting depth's features are an
    expanded view)."""
    for t in tensors:  # (`is_cpu`, not `device.type`: this runs a few times a layer)
        if t.dtype is not torch.float32 or not t.is_cpu:
            return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    return layer_ops_kernel()
