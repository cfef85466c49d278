"""Tree ops of a speculative step, one module each: a pure-torch twin (the CPU path and
the reference), a CuPy launcher of the kernel in kernels/, and a dispatcher that picks
the kernel for GPU tensors when CuPy and the kernel load, else the twin. On the CPU,
build_tree and verify_greedy take a C++ kernel of their own (cpu_tree.py).

    build_tree      tree_mask.py        parents -> mask, positions, depth, links
    verify_greedy   verify_greedy.py    greedy acceptance (temperature 0)
    verify_sampling verify_sampling.py  lossless multi-round rejection sampling
    kv_compact      kv_compact.py       move the accepted path's KV into place
"""
from .kv_compact import kv_compact, kv_compact_cuda, kv_compact_torch
from .tree_mask import TreeBuffers, build_tree, build_tree_cuda, build_tree_torch
from .verify_greedy import VerifyResult, verify_greedy, verify_greedy_cuda, verify_greedy_torch
from .verify_sampling import verify_sampling, verify_sampling_cuda, verify_sampling_torch

__all__ = [
    "TreeBuffers", "VerifyResult",
    "build_tree", "build_tree_cuda", "build_tree_torch",
    "verify_greedy", "verify_greedy_cuda", "verify_greedy_torch",
    "verify_sampling", "verify_sampling_cuda", "verify_sampling_torch",
    "kv_compact", "kv_compact_cuda", "kv_compact_torch",
]
