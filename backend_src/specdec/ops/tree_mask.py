"""build_tree: a batch of token trees -> attention mask, positions, depth, child links.

Owns the per-step tree buffers (docs/DESIGN.md, "Tree layout" and "Ops"): the torch
twin `build_tree_torch` (the CPU path and the reference), the CuPy launcher
`build_tree_cuda` of kernels/tree_mask.cu, and the dispatcher `build_tree`. Also owns
the ancestor "jump" tables that verify_greedy reuses. Knows nothing about tokens.

    node      0  1  2  3          parents -1 0 0 1, num_nodes 4, prefix_len 7
    depth    [0, 1, 1, 2]         positions [7, 8, 8, 9]
    tree_mask (row attends to column: ancestors and self)
        1 0 0 0
        1 1 0 0
        1 0 1 0
        1 1 0 1
    first_child [1, 3, -1, -1]    next_sibling [-1, 2, -1, -1]

Node 0 always exists (num_nodes is clamped to [1, N]). Padding nodes (index >=
num_nodes) get a diagonal-only mask row (attention over them never sees an empty row),
depth 0, position prefix_len and no links; the parent pointers of node 0 and of padding
nodes are never followed.
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from . import _cupy, cpu_tree
from ._checks import check_cuda_device, check_tensor

_KERNEL_FILE = "tree_mask.cu"
assert sys.byteorder == "little", "build_tree_torch unpacks bitsets as little-endian bytes"


@dataclass(frozen=True)
class TreeBuffers:
    """The tree buffers of one verify step, for a batch padded to N nodes."""

    tree_mask: torch.Tensor  # [B, N, N] bool: row i attends to column j (ancestors, self)
    positions: torch.Tensor  # [B, N] int64: prefix_len + depth
    depth: torch.Tensor  # [B, N] int64: edges to the root; 0 for the root and padding
    first_child: torch.Tensor  # [B, N] int64: lowest-index (best) child, -1 when none
    next_sibling: torch.Tensor  # [B, N] int64: next child of the same parent, -1 when none


def check_tree_inputs(op: str, parents: torch.Tensor, num_nodes: torch.Tensor,
                      contiguous: bool = False) -> tuple[int, int]:
    """Checks parents[B, N] and num_nodes[B] (int64, one device); returns (B, N)."""
    check_tensor(op, "parents", parents, (None, None), torch.int64, contiguous=contiguous)
    batch, nodes = parents.shape
    if nodes < 1:
        raise ValueError(f"{op}: parents must have at least one node (the root), got N = 0")
    check_tensor(op, "num_nodes", num_nodes, (batch,), torch.int64, parents.device, contiguous)
    return batch, nodes


def check_build_tree_inputs(parents: torch.Tensor, num_nodes: torch.Tensor,
                            prefix_len: torch.Tensor) -> tuple[int, int]:
    """build_tree's checks (the twin's and the CPU kernel's): parents[B, N], num_nodes[B] and
    prefix_len[B], int64 on one device; returns (B, N)."""
    batch, nodes = check_tree_inputs("build_tree", parents, num_nodes)
    check_tensor("build_tree", "prefix_len", prefix_len, (batch,), torch.int64, parents.device)
    return batch, nodes


def tree_jumps(parents: torch.Tensor, num_nodes: torch.Tensor):
    """Ancestor jump table of a padded batch of trees.

    Returns (valid[B, N] bool, jump[B, N] int64): `valid` marks real nodes; `jump[b, i]`
    is the parent that build_tree follows from node i, or N (a sentinel "above the
    root") for the root, padding nodes and out-of-range parents.
    """
    batch, nodes = parents.shape
    idx = torch.arange(nodes, device=parents.device)
    valid = idx < num_nodes.clamp(1, nodes).unsqueeze(1)  # [B, N]
    follow = valid & (idx > 0) & (parents >= 0) & (parents < nodes)
    return valid, torch.where(follow, parents, nodes)


def jump_steps(nodes: int) -> int:
    """Pointer-doubling rounds that cover any root path of a tree of `nodes` nodes."""
    return (nodes - 1).bit_length()


def extend_with_sentinel(x: torch.Tensor, value) -> torch.Tensor:
    """[B, N, ...] -> [B, N + 1, ...]: appends the sentinel row N filled with `value`."""
    pad = torch.full((x.shape[0], 1) + tuple(x.shape[2:]), value, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], dim=1)


def tree_links(parents: torch.Tensor, valid: torch.Tensor):
    """(first_child[B, N], next_sibling[B, N]) int64, -1 when none; only real nodes link.

    Sorting the real non-root nodes by (parent, index) lines up each parent's children
    in rank order: a child's next sibling is its successor in that order when it has
    the same parent, and a parent's first child is the lowest such index."""
    batch, nodes = parents.shape
    device = parents.device
    idx = torch.arange(nodes, device=device).expand(batch, nodes)
    linked = valid & (idx > 0) & (parents >= 0) & (parents < nodes)
    group = torch.where(linked, parents, nodes)  # unlinked nodes sort last, in group N
    order = torch.sort(group * (nodes + 1) + idx, dim=1).values % (nodes + 1)  # [B, N]
    group_sorted = group.gather(1, order)
    succ = torch.cat([order[:, 1:], torch.full_like(order[:, :1], -1)], dim=1)
    same = torch.cat([group_sorted[:, 1:] == group_sorted[:, :-1],
                      torch.zeros_like(group_sorted[:, :1], dtype=torch.bool)], dim=1)
    same &= group_sorted < nodes
    next_sibling = torch.full((batch, nodes), -1, dtype=torch.int64, device=device)
    next_sibling.scatter_(1, order, torch.where(same, succ, -1))
    # First child: the lowest index in each parent's group (column N collects the rest).
    first = torch.full((batch, nodes + 1), nodes, dtype=torch.int64, device=device)
    first.scatter_reduce_(1, group, idx, reduce="amin")
    first_child = first[:, :nodes]
    # Children of padding nodes (malformed input) are not links: the kernel ignores them.
    first_child = torch.where(valid & (first_child < nodes) & (first_child > idx),
                              first_child, -1)
    return first_child, next_sibling


@functools.lru_cache(maxsize=None)
def _byte_bits(device: torch.device) -> torch.Tensor:
    """[256, 8] bool: bit j of byte value v."""
    v = torch.arange(256).unsqueeze(1)
    return ((v >> torch.arange(8)) & 1).bool().to(device)


@functools.lru_cache(maxsize=None)
def _byte_popcount(device: torch.device) -> torch.Tensor:
    """[256] int64: set bits of byte value v."""
    return _byte_bits(torch.device("cpu")).sum(dim=1).to(device)


def _bits(index: torch.Tensor, keep: torch.Tensor, words: int) -> torch.Tensor:
    """[B, N] node indices -> [B, N, words] int64 bitsets holding that one node (or none
    where not `keep`)."""
    one = torch.zeros(index.shape + (words,), dtype=torch.int64, device=index.device)
    safe = torch.where(keep, index, 0)
    value = torch.where(keep, torch.ones_like(index) << (safe % 64), 0)
    return one.scatter_(2, (safe // 64).unsqueeze(2), value.unsqueeze(2))


def build_tree_torch(parents: torch.Tensor, num_nodes: torch.Tensor,
                     prefix_len: torch.Tensor) -> TreeBuffers:
    """Twin of kernels/tree_mask.cu (any device). See the module docstring.

    parents[B, N], num_nodes[B], prefix_len[B]: int64 on one device.
    """
    batch, nodes = check_build_tree_inputs(parents, num_nodes, prefix_len)
    device = parents.device
    valid, jump = tree_jumps(parents, num_nodes)
    rows = torch.arange(batch, device=device).unsqueeze(1)  # [B, 1]
    idx = torch.arange(nodes, device=device).expand(batch, nodes)
    words = (nodes + 63) // 64

    # Mask rows as 64-bit bitsets, by pointer doubling: after round k, row i holds i's
    # ancestors up to distance 2^k and jump[i] is its 2^k-th ancestor (N: above the
    # root, whose row, the extra row N, stays empty).
    rows_ext = torch.zeros((batch, nodes + 1, words), dtype=torch.int64, device=device)
    rows_ext[:, :nodes] = (_bits(idx, torch.ones_like(valid), words)
                           | _bits(jump, jump < nodes, words))
    jump_ext = torch.full((batch, nodes + 1), nodes, dtype=torch.int64, device=device)
    jump_ext[:, :nodes] = jump
    for _ in range(jump_steps(nodes)):
        rows_ext[:, :nodes] |= rows_ext[rows, jump_ext[:, :nodes]]  # gathers before writing
        jump_ext[:, :nodes] = jump_ext[rows, jump_ext[:, :nodes]]

    # Unpack through a byte table: byte k of a little-endian word holds bits 8k..8k+7.
    row_bytes = rows_ext[:, :nodes].contiguous().view(torch.uint8).long()  # [B, N, 8 W]
    mask = _byte_bits(device)[row_bytes].view(batch, nodes, words * 64)[:, :, :nodes]
    depth = _byte_popcount(device)[row_bytes].sum(dim=2) - 1
    first_child, next_sibling = tree_links(parents, valid)
    return TreeBuffers(tree_mask=mask.contiguous(), positions=prefix_len.unsqueeze(1) + depth,
                       depth=depth, first_child=first_child, next_sibling=next_sibling)


def build_tree_cuda(parents: torch.Tensor, num_nodes: torch.Tensor, prefix_len: torch.Tensor,
                    *, out: Optional[TreeBuffers] = None) -> TreeBuffers:
    """kernels/tree_mask.cu on torch's current stream; same contract as the twin.

    All inputs contiguous int64 on one GPU; `out`: preallocated outputs to write (static
    buffers, e.g. for CUDA graphs), every element of which is overwritten. Raises
    RuntimeError when the kernel is unavailable (`build_tree` falls back to the twin)."""
    op = "build_tree_cuda"
    device = check_cuda_device(op, parents)
    batch, nodes = check_tree_inputs(op, parents, num_nodes, contiguous=True)
    check_tensor(op, "prefix_len", prefix_len, (batch,), torch.int64, device, contiguous=True)
    kernel = _cupy.require_kernel(_KERNEL_FILE, "build_tree", device)
    if out is None:
        out = TreeBuffers(
            tree_mask=torch.empty((batch, nodes, nodes), dtype=torch.bool, device=device),
            positions=torch.empty((batch, nodes), dtype=torch.int64, device=device),
            depth=torch.empty((batch, nodes), dtype=torch.int64, device=device),
            first_child=torch.empty((batch, nodes), dtype=torch.int64, device=device),
            next_sibling=torch.empty((batch, nodes), dtype=torch.int64, device=device))
    check_tensor(op, "out.tree_mask", out.tree_mask, (batch, nodes, nodes), torch.bool, device,
                 contiguous=True)
    for name in ("positions", "depth", "first_child", "next_sibling"):
        check_tensor(op, f"out.{name}", getattr(out, name), (batch, nodes), torch.int64, device,
                     contiguous=True)
    if batch > 0:
        _cupy.launch(kernel, (batch,), (_cupy.threads_for(nodes),),
                     (parents, num_nodes, prefix_len, out.tree_mask, out.positions, out.depth,
                      out.first_child, out.next_sibling, np.int32(nodes)), device)
    return out


def build_tree(parents: torch.Tensor, num_nodes: torch.Tensor,
               prefix_len: torch.Tensor) -> TreeBuffers:
    """Tree buffers of a padded batch of trees: the CUDA kernel for GPU tensors when
    CuPy and the kernel load, the CPU kernel (cpu_tree.py) for int64 CPU tensors when it
    is built, else the torch twin.

    parents[B, N]: parent of each node (-1 for the root and padding), parents[i] < i;
    num_nodes[B]: real nodes per tree (>= 1); prefix_len[B]: tokens already cached.
    """
    if (parents.is_cuda
            and _cupy.get_kernel(_KERNEL_FILE, "build_tree", parents.device) is not None):
        return build_tree_cuda(parents.contiguous(), num_nodes.contiguous(),
                               prefix_len.contiguous())
    kernel = cpu_tree.kernel_for(parents, num_nodes, prefix_len)
    if kernel is not None:
        check_build_tree_inputs(parents, num_nodes, prefix_len)  # the twin's checks: the same errors either way
        mask, positions, depth, first_child, next_sibling = kernel.build_tree(
            parents.contiguous(), num_nodes.contiguous(), prefix_len.contiguous())
        return TreeBuffers(tree_mask=mask, positions=positions, depth=depth, first_child=first_child,
                           next_sibling=next_sibling)
    return build_tree_torch(parents, num_nodes, prefix_len)
