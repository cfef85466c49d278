"""kv_compact: after verification, move each request's accepted path to contiguous KV
cache positions, for all layers, keys and values, in place.

Owns the KV move of a verify step (docs/DESIGN.md, "KV cache layout"): the torch twin
`kv_compact_torch` (the reference, and the CPU path without the CPU tree kernel), the CuPy
launcher `kv_compact_cuda` of kernels/kv_compact.cu (one launch for all layers; float32,
float16, bfloat16), and the dispatcher `kv_compact`, which sends CPU caches to
kernels/cpu_tree.cpp (ops/cpu_tree.py). Knows nothing about attention.

    kv[L, 2, S, H, T, D]; request b owns slot slots[b]; its tree's KV entries sit at
    prefix_len[b] + node. For j = 1..accept_len[b]:
        kv[:, :, slot, :, prefix + j] = kv[:, :, slot, :, prefix + accepted_nodes[b, j]]

    accepted_nodes [0, 2, 3], prefix 7:  pos 9 -> 8, then pos 10 -> 9

Copy 2 writes position 9, which copy 1 reads: the copies must run in increasing j (the
kernel orders them with barriers), or read every source before writing (the twin
gathers first). Both are equivalent because accepted_nodes[b, j] >= j and increases.
Requests must own distinct slots; positions must stay below T.
"""
from __future__ import annotations

import numpy as np
import torch

from . import _cupy, cpu_tree
from ._checks import check_cuda_device, check_tensor

_KERNEL_FILE = "kv_compact.cu"
_KERNELS = {torch.float32: "kv_compact_f32", torch.float16: "kv_compact_f16",
            torch.bfloat16: "kv_compact_bf16"}


def _check_compact_inputs(op, kv, slots, prefix_len, accepted_nodes, accept_len,
                          contiguous=False) -> tuple[int, int]:
    if not isinstance(kv, torch.Tensor) or kv.dim() != 6 or kv.shape[1] != 2:
        shape = list(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
        raise ValueError(f"{op}: kv must have shape [L, 2, S, H, T, D], got {shape}")
    device = kv.device
    check_tensor(op, "accepted_nodes", accepted_nodes, (None, None), torch.int64, device,
                 contiguous)
    batch, nodes = accepted_nodes.shape
    for name, t in (("slots", slots), ("prefix_len", prefix_len), ("accept_len", accept_len)):
        check_tensor(op, name, t, (batch,), torch.int64, device, contiguous)
    return batch, nodes


def kv_compact_torch(kv: torch.Tensor, slots: torch.Tensor, prefix_len: torch.Tensor,
                     accepted_nodes: torch.Tensor, accept_len: torch.Tensor) -> None:
    """Twin of kernels/kv_compact.cu (any device, any dtype). In place; returns None.

    kv[L, 2, S, H, T, D]; slots[B], prefix_len[B], accept_len[B]: int64;
    accepted_nodes[B, N]: int64 path from verification (0 first, increasing).
    """
    batch, nodes = _check_compact_inputs("kv_compact", kv, slots, prefix_len, accepted_nodes,
                                         accept_len)
    j = torch.arange(nodes, device=kv.device)
    moved = (j >= 1) & (j <= accept_len.clamp(max=nodes - 1).unsqueeze(1))  # [B, N]
    moved &= accepted_nodes != j  # a node already in place needs no copy
    b, j = moved.nonzero(as_tuple=True)  # host sync: fine on the CPU path
    if b.numel() == 0:
        return
    slot = slots[b]
    src = prefix_len[b] + accepted_nodes[b, j]
    dst = prefix_len[b] + j
    # Advanced indices on dims 2 and 4 (split by a slice): both sides are [M, L, 2, H, D].
    # The right-hand side is gathered in full before anything is written.
    kv[:, :, slot, :, dst] = kv[:, :, slot, :, src]


def kv_compact_cuda(kv: torch.Tensor, slots: torch.Tensor, prefix_len: torch.Tensor,
                    accepted_nodes: torch.Tensor, accept_len: torch.Tensor) -> None:
    """kernels/kv_compact.cu on torch's current stream, one launch for all layers, in
    place; same contract as the twin. kv contiguous float32/float16/bfloat16 and the
    index tensors contiguous int64, all on one GPU. Raises RuntimeError when the kernel
    is unavailable (use `kv_compact` to fall back to the twin)."""
    op = "kv_compact_cuda"
    device = check_cuda_device(op, kv)
    batch, nodes = _check_compact_inputs(op, kv, slots, prefix_len, accepted_nodes, accept_len,
                                         contiguous=True)
    if kv.dtype not in _KERNELS:
        raise ValueError(f"{op}: kv must be float32, float16 or bfloat16, got {kv.dtype}")
    if not kv.is_contiguous():
        raise ValueError(f"{op}: kv must be contiguous")
    layers, _, num_slots, heads, positions, head_dim = kv.shape
    if heads * head_dim >= 2**31 or positions >= 2**31 or num_slots >= 2**31:
        raise ValueError(f"{op}: kv dimensions must fit in int32, got {list(kv.shape)}")
    if batch > 65535:
        raise ValueError(f"{op}: at most 65535 requests per launch, got {batch}")
    kernel = _cupy.require_kernel(_KERNEL_FILE, _KERNELS[kv.dtype], device)
    if batch == 0 or kv.numel() == 0:
        return
    _cupy.launch(kernel, (2 * layers, batch), (_cupy.threads_for(heads * head_dim),),
                 (kv, slots, prefix_len, accepted_nodes, accept_len, np.int32(num_slots),
                  np.int32(heads), np.int32(positions), np.int32(head_dim), np.int32(nodes)),
                 device)


def kv_compact(kv: torch.Tensor, slots: torch.Tensor, prefix_len: torch.Tensor,
               accepted_nodes: torch.Tensor, accept_len: torch.Tensor) -> None:
    """Moves accepted KV entries into place: the CUDA kernel for a contiguous
    float32/float16/bfloat16 cache on a GPU when CuPy and the kernel load; for a
    contiguous cache on the CPU, of any dtype, the CPU tree kernel (ops/cpu_tree.py: a
    copy per moved row: 0.02 ms of a 4-node EAGLE-3 step, where the twin's indexing took 0.09-0.18 on
    the 2-core Xeon VM); else the torch twin. Arguments as in `kv_compact_torch`."""
    if (kv.is_cuda and kv.is_contiguous() and kv.dtype in _KERNELS
            and _cupy.get_kernel(_KERNEL_FILE, _KERNELS[kv.dtype], kv.device) is not None):
        kv_compact_cuda(kv, slots.contiguous(), prefix_len.contiguous(),
                        accepted_nodes.contiguous(), accept_len.contiguous())
        return
    if kv.is_cpu and kv.is_contiguous():
        kernel = cpu_tree.kernel_for(slots, prefix_len, accepted_nodes, accept_len)
        if kernel is not None:
            _check_compact_inputs("kv_compact", kv, slots, prefix_len, accepted_nodes, accept_len)  # the twin's errors
            kernel.kv_compact(kv, slots.contiguous(), prefix_len.contiguous(), accepted_nodes.contiguous(),
                              accept_len.contiguous())
            return
    kv_compact_torch(kv, slots, prefix_len, accepted_nodes, accept_len)
