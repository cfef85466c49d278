"""verify_greedy: greedy (temperature 0) acceptance of a batch of token trees.

Owns the greedy acceptance rule and `VerifyResult`, the output every verifier shares:
the torch twin `verify_greedy_torch` (the CPU path and the reference), the CuPy
launcher `verify_greedy_cuda` of kernels/verify_greedy.cu, and the dispatcher
`verify_greedy`. Speculative greedy output equals plain greedy output because a draft
token is kept only when it is the target's own argmax after its parent.

    parents        -1  0  0  1        candidates [r, a, b, c]
    target_argmax  [a, c, x, y]       (the target's next token after each node)
    node 1: a == argmax[0] -> accepted; node 2: b != a -> rejected;
    node 3: c == argmax[1] and node 1 accepted -> accepted (deepest)
    accept_len 2, accepted_nodes [0, 1, 3, -1], bonus_token argmax[3] = y
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from . import _cupy, cpu_tree
from ._checks import check_cuda_device, check_tensor
from .tree_mask import check_tree_inputs, extend_with_sentinel, jump_steps, tree_jumps

_KERNEL_FILE = "verify_greedy.cu"


@dataclass(frozen=True)
class VerifyResult:
    """What a verify step keeps, per request."""

    accept_len: torch.Tensor  # [B] int64: accepted draft tokens (the root not counted)
    accepted_nodes: torch.Tensor  # [B, N] int64: path node indices, 0 first, -1 padded
    bonus_token: torch.Tensor  # [B] int64: the target's token after the path's last node


def check_verify_inputs(op: str, candidates: torch.Tensor, parents: torch.Tensor,
                        num_nodes: torch.Tensor, contiguous: bool = False) -> tuple[int, int]:
    """Checks candidates[B, N], parents[B, N], num_nodes[B]; returns (B, N)."""
    batch, nodes = check_tree_inputs(op, parents, num_nodes, contiguous)
    check_tensor(op, "candidates", candidates, (batch, nodes), torch.int64, parents.device,
                 contiguous)
    return batch, nodes


def check_greedy_inputs(candidates: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                        target_argmax: torch.Tensor) -> tuple[int, int]:
    """verify_greedy's checks (the twin's and the CPU kernel's): `check_verify_inputs` and
    target_argmax [B, N] int64 on parents' device; returns (B, N)."""
    batch, nodes = check_verify_inputs("verify_greedy", candidates, parents, num_nodes)
    check_tensor("verify_greedy", "target_argmax", target_argmax, (batch, nodes), torch.int64,
                 parents.device)
    return batch, nodes


def check_verify_out(op: str, out: Optional[VerifyResult], batch: int, nodes: int,
                     device: torch.device) -> VerifyResult:
    """`out` checked (contiguous int64 of the result's shapes on `device`), or new outputs."""
    if out is None:
        return VerifyResult(
            accept_len=torch.empty(batch, dtype=torch.int64, device=device),
            accepted_nodes=torch.empty((batch, nodes), dtype=torch.int64, device=device),
            bonus_token=torch.empty(batch, dtype=torch.int64, device=device))
    for name, shape in (("accept_len", (batch,)), ("accepted_nodes", (batch, nodes)),
                        ("bonus_token", (batch,))):
        check_tensor(op, f"out.{name}", getattr(out, name), shape, torch.int64, device,
                     contiguous=True)
    return out


def ancestor_path(jumps: list[torch.Tensor], node: torch.Tensor, length: torch.Tensor,
                  nodes: int) -> torch.Tensor:
    """Root-first path to `node` [B] of `length` [B] edges, -1 padded to [B, nodes].

    `jumps[m]` [B, N] is every node's 2^m-th ancestor (N above the root); the k-th
    ancestor of `node` is found by binary lifting on the bits of k."""
    batch = node.shape[0]
    rows = torch.arange(batch, device=node.device).unsqueeze(1)
    k = torch.arange(nodes, device=node.device)
    anc = node.unsqueeze(1).expand(batch, nodes)  # anc[b, k]: k-th ancestor of node[b]
    for m, jump in enumerate(jumps):
        up = extend_with_sentinel(jump, nodes)[rows, anc]
        anc = torch.where(((k >> m) & 1).bool(), up, anc)
    # Position j of the path holds the (length - j)-th ancestor.
    path = anc.gather(1, (length.unsqueeze(1) - k).clamp(min=0))
    return torch.where(k <= length.unsqueeze(1), path, -1)


def verify_greedy_torch(candidates: torch.Tensor, parents: torch.Tensor,
                        num_nodes: torch.Tensor, target_argmax: torch.Tensor) -> VerifyResult:
    """Twin of kernels/verify_greedy.cu (any device). See the module docstring.

    candidates[B, N]: token of each node (node 0: the root, the last emitted token);
    parents[B, N], num_nodes[B]: the trees (docs/DESIGN.md); target_argmax[B, N]: the
    target's argmax at each node. All int64 on one device.
    """
    batch, nodes = check_greedy_inputs(candidates, parents, num_nodes, target_argmax)
    device = parents.device
    idx = torch.arange(nodes, device=device)
    rows = torch.arange(batch, device=device).unsqueeze(1)
    valid, jump = tree_jumps(parents, num_nodes)
    num = num_nodes.clamp(1, nodes).unsqueeze(1)

    # A node matches when its parent is a real node and the target's argmax there is
    # the node's token. Padding never matches; the root always does.
    parent_real = valid & (idx > 0) & (parents >= 0) & (parents < num)
    at_parent = target_argmax.gather(1, parents.clamp(0, nodes - 1))
    ok = (parent_real & (candidates == at_parent)) | (idx == 0)
    edge = (jump < nodes).long()  # 1 where a parent is followed

    # Pointer doubling: after round k, ok[i] covers i and its 2^k - 1 nearest ancestors,
    # edge[i] counts the edges among them, and jump[i] is i's 2^k-th ancestor.
    jumps = []
    for _ in range(jump_steps(nodes)):
        jumps.append(jump)
        ok = ok & extend_with_sentinel(ok, True)[rows, jump]
        edge = edge + extend_with_sentinel(edge, 0)[rows, jump]
        jump = extend_with_sentinel(jump, nodes)[rows, jump]

    # Deepest accepted node, lowest index on ties (argmax returns the first maximum).
    winner = torch.where(ok, edge, -1).argmax(dim=1)
    accept_len = edge.gather(1, winner.unsqueeze(1)).squeeze(1)
    return VerifyResult(accept_len=accept_len,
                        accepted_nodes=ancestor_path(jumps, winner, accept_len, nodes),
                        bonus_token=target_argmax.gather(1, winner.unsqueeze(1)).squeeze(1))


def verify_greedy_cuda(candidates: torch.Tensor, parents: torch.Tensor,
                       num_nodes: torch.Tensor, target_argmax: torch.Tensor,
                       *, out: Optional[VerifyResult] = None) -> VerifyResult:
    """kernels/verify_greedy.cu on torch's current stream; same contract as the twin.

    All inputs contiguous int64 on one GPU; `out`: preallocated outputs to write, every
    element of which is overwritten. Raises RuntimeError when the kernel is unavailable
    (`verify_greedy` falls back to the twin)."""
    op = "verify_greedy_cuda"
    device = check_cuda_device(op, parents)
    batch, nodes = check_verify_inputs(op, candidates, parents, num_nodes, contiguous=True)
    check_tensor(op, "target_argmax", target_argmax, (batch, nodes), torch.int64, device,
                 contiguous=True)
    kernel = _cupy.require_kernel(_KERNEL_FILE, "verify_greedy", device)
    out = check_verify_out(op, out, batch, nodes, device)
    if batch > 0:
        _cupy.launch(kernel, (batch,), (_cupy.threads_for(nodes),),
                     (candidates, parents, num_nodes, target_argmax, out.accept_len,
                      out.accepted_nodes, out.bonus_token, np.int32(nodes)), device)
    return out


def verify_greedy(candidates: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                  target_argmax: torch.Tensor) -> VerifyResult:
    """Greedy acceptance: the CUDA kernel for GPU tensors when CuPy and the kernel load,
    the CPU kernel (cpu_tree.py) for int64 CPU tensors when it is built, else the torch
    twin. Arguments as in `verify_greedy_torch`."""
    if (parents.is_cuda
            and _cupy.get_kernel(_KERNEL_FILE, "verify_greedy", parents.device) is not None):
        return verify_greedy_cuda(candidates.contiguous(), parents.contiguous(),
                                  num_nodes.contiguous(), target_argmax.contiguous())
    tensors = (candidates, parents, num_nodes, target_argmax)
    kernel = cpu_tree.kernel_for(*tensors)
    if kernel is not None:
        check_greedy_inputs(*tensors)  # the twin's checks: the same errors either way
        accept_len, accepted_nodes, bonus_token = kernel.verify_greedy(*(t.contiguous() for t in tensors))
        return VerifyResult(accept_len=accept_len, accepted_nodes=accepted_nodes, bonus_token=bonus_token)
    return verify_greedy_torch(candidates, parents, num_nodes, target_argmax)
