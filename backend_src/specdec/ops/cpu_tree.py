"""The tree work of a speculative step on the CPU, one call each (kernels/cpu_tree.cpp):
`build_tree`, `verify_greedy` and `kv_compact` as kernels/tree_mask.cu,
kernels/verify_greedy.cu and kernels/kv_compact.cu compute them on a GPU, one request after
another.

The torch twins (`build_tree_torch`, `verify_greedy_torch`) run some forty operators each
for a tree of a few nodes: on the 2-core Xeon VM 0.34-0.50 ms each of an 8-node EAGLE-3
step of 20-26 ms, 0.04-0.06 through the kernel (docs/benchmarks.md 1.35). Every output
equals the twins', malformed trees included, so `build_tree` and `verify_greedy`
(tree_mask.py, verify_greedy.py) take the kernel for CPU tensors whatever the model's dtype
(the float64 exact-equality tests run it too). `kv_compact` (kv_compact.py) takes it for a
contiguous CPU cache of any dtype: the same cache as the twin's after every accepted path;
a move outside the cache is skipped, as the CUDA kernel skips it.

Built at the first use on a machine (`models/cpu_extensions.py`). Without a compiler, or
when the build fails, `tree_kernel()` logs why once and returns None, and the ops keep to
their twins. `SPECDEC_CPU_TREE=0` never builds it and is read at every call.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..models import cpu_extensions
from ._cupy import kernel_dir

SOURCE_NAME = "cpu_tree.cpp"


def _build() -> Optional[Any]:
    return cpu_extensions.load(kernel_dir() / SOURCE_NAME, "specdec_tree", "CPU tree kernel",
                               "trees are built and verified by the torch twins")


KERNEL = cpu_extensions.LazyKernel("SPECDEC_CPU_TREE", _build)
wanted = KERNEL.wanted  # SPECDEC_CPU_TREE=0 never builds it
tree_kernel = KERNEL.module  # the extension (`build_tree`, `verify_greedy`, `kv_compact`), or None
build_id = KERNEL.build_id


def kernel_for(*tensors: torch.Tensor) -> Optional[Any]:
    """The kernel when every tensor is an int64 CPU tensor, else None (the caller runs the
    twin). The kernel takes contiguous tensors: callers pass `.contiguous()`."""
    for t in tensors:
        if t.dtype is not torch.int64 or not t.is_cpu:
            return None
    return tree_kernel()
