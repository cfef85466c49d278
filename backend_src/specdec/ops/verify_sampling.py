"""verify_sampling: lossless verification of a batch of token trees by multi-round
rejection sampling (SpecInfer / EAGLE).

Owns the sampling acceptance rule: the torch twin `verify_sampling_torch` (the CPU path
and the reference), the CuPy launcher `verify_sampling_cuda` of
kernels/verify_sampling.cu, and the dispatcher `verify_sampling`. The caller owns the
randomness: it passes the uniforms (seeded runs repeat) and the already-processed
target distributions (temperature, top-k/top-p, penalties applied).

The rule, per request (p, q are rows over the vocabulary):

    p = target_probs[0]; cur = 0
    try the children c of cur in index (= rank) order, x = candidates[c]:
        q = draft_probs[cur] if given, else one-hot at x (deterministic top-k drafts)
        accept c when p[x] > 0 and fl32(uniforms[c] * q[x]) <= p[x]   (u <= p/q)
            -> cur = c, p = target_probs[c], try c's children
        else p = norm(max(p - q, 0))   (float32 residual, float64 sum, rounded to
            float32; an all-zero residual leaves p unchanged)
    no child accepted, or a leaf: bonus = first k with p[k] > 0 and
        cumsum(p)[k] > bonus_uniforms * sum(p) (float64), else the last k with
        p[k] > 0, else 0

The emitted tokens are distributed exactly as sampling the target one token at a time,
for any drafter: children drawn i.i.d. from q (with draft_probs), or distinct top-k
tokens (without). Candidates outside [0, V) are never accepted and leave p unchanged.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from . import _cupy
from ._checks import check_cuda_device, check_tensor
from .tree_mask import tree_jumps, tree_links
from .verify_greedy import VerifyResult, check_verify_inputs, check_verify_out

_KERNEL_FILE = "verify_sampling.cu"


def _check_sampling_inputs(op, candidates, parents, num_nodes, target_probs, draft_probs,
                           uniforms, bonus_uniforms, contiguous=False) -> tuple[int, int, int]:
    batch, nodes = check_verify_inputs(op, candidates, parents, num_nodes, contiguous)
    device = parents.device
    check_tensor(op, "target_probs", target_probs, (batch, nodes, None), torch.float32, device,
                 contiguous)
    vocab = target_probs.shape[2]
    if vocab < 1:
        raise ValueError(f"{op}: target_probs must have a vocabulary of at least 1, got 0")
    if draft_probs is not None:
        check_tensor(op, "draft_probs", draft_probs, (batch, nodes, vocab), torch.float32,
                     device, contiguous)
    check_tensor(op, "uniforms", uniforms, (batch, nodes), torch.float32, device, contiguous)
    check_tensor(op, "bonus_uniforms", bonus_uniforms, (batch,), torch.float32, device,
                 contiguous)
    return batch, nodes, vocab


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)) per row of p[R, V], q[R, V] (float32); rows whose residual is
    all zero keep p. The sum is float64, the result rounded to float32 (as the kernel)."""
    r = (p - q).clamp_min(0.0)
    total = r.double().sum(dim=1, keepdim=True)
    return torch.where(total > 0, (r.double() / total).float(), p)


def inverse_cdf(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row of p[B, V] (float32, not necessarily normalised) with
    u[B] in [0, 1): the first k with p[k] > 0 and cumsum(p)[k] > u * sum(p), else the
    last k with p[k] > 0, else 0. Sums in float64."""
    vocab = p.shape[1]
    k = torch.arange(vocab, device=p.device)
    pd = p.double()
    threshold = u.double() * pd.sum(dim=1)
    positive = p > 0
    hit = positive & (pd.cumsum(dim=1) > threshold.unsqueeze(1))
    first = torch.where(hit, k, vocab).amin(dim=1)
    last = torch.where(positive, k, -1).amax(dim=1)
    return torch.where(first < vocab, first, last.clamp(min=0))


def verify_sampling_torch(candidates: torch.Tensor, parents: torch.Tensor,
                          num_nodes: torch.Tensor, target_probs: torch.Tensor,
                          draft_probs: Optional[torch.Tensor], uniforms: torch.Tensor,
                          bonus_uniforms: torch.Tensor) -> VerifyResult:
    """Twin of kernels/verify_sampling.cu (any device). See the module docstring.

    candidates[B, N], parents[B, N], num_nodes[B]: int64 trees (node 0: the root);
    target_probs[B, N, V]: the target's next-token distribution at each node (float32);
    draft_probs[B, N, V] | None: the distribution each node's children were drawn from;
    uniforms[B, N]: one U[0, 1) per node (its acceptance test); bonus_uniforms[B].

    The requests advance in lockstep, one child trial per round: at most N - 1 rounds
    of O(B V) tensor work, no per-request Python loop.
    """
    batch, nodes, vocab = _check_sampling_inputs(
        "verify_sampling", candidates, parents, num_nodes, target_probs, draft_probs,
        uniforms, bonus_uniforms)
    device = parents.device
    rows = torch.arange(batch, device=device)
    valid, _ = tree_jumps(parents, num_nodes)
    first_child, next_sibling = tree_links(parents, valid)

    p = target_probs[:, 0].clone()  # [B, V] current distribution
    cur = torch.zeros(batch, dtype=torch.int64, device=device)
    length = torch.zeros(batch, dtype=torch.int64, device=device)
    accepted_nodes = torch.full((batch, nodes), -1, dtype=torch.int64, device=device)
    accepted_nodes[:, 0] = 0
    trial = first_child[:, 0].clone()  # [B] child to try next, -1 when done
    for _ in range(nodes - 1):  # every node is tried at most once
        active = trial >= 0
        # Host decision; on GPU tensors this syncs, but the GPU path is the kernel.
        if not bool(active.any()):
            break
        c = trial.clamp(min=0)
        x = candidates[rows, c]
        x_ok = active & (x >= 0) & (x < vocab)
        xc = x.clamp(0, vocab - 1)
        px = p[rows, xc]
        qx = draft_probs[rows, cur, xc] if draft_probs is not None else torch.ones_like(px)
        accept = x_ok & (px > 0) & (uniforms[rows, c] * qx <= px)
        reject = x_ok & ~accept

        if bool(reject.any()):
            q = (draft_probs[rows, cur] if draft_probs is not None
                 else torch.nn.functional.one_hot(xc, vocab).float())
            p = torch.where(reject.unsqueeze(1), residual(p, q), p)
        p = torch.where(accept.unsqueeze(1), target_probs[rows, c], p)
        cur = torch.where(accept, c, cur)
        length = length + accept.long()
        accepted_nodes[rows[accept], length[accept]] = c[accept]
        trial = torch.where(accept, first_child[rows, c],
                            torch.where(active, next_sibling[rows, c], trial))

    return VerifyResult(accept_len=length, accepted_nodes=accepted_nodes,
                        bonus_token=inverse_cdf(p, bonus_uniforms))


def verify_sampling_cuda(candidates: torch.Tensor, parents: torch.Tensor,
                         num_nodes: torch.Tensor, target_probs: torch.Tensor,
                         draft_probs: Optional[torch.Tensor], uniforms: torch.Tensor,
                         bonus_uniforms: torch.Tensor,
                         *, out: Optional[VerifyResult] = None) -> VerifyResult:
    """kernels/verify_sampling.cu on torch's current stream; same contract as the twin.

    All inputs contiguous on one GPU; `out`: preallocated outputs to write, every element
    of which is overwritten. One block per request, threads over V; a [B, V] float32
    workspace holds the residuals. Raises RuntimeError when the kernel is unavailable
    (`verify_sampling` falls back to the twin)."""
    op = "verify_sampling_cuda"
    device = check_cuda_device(op, parents)
    batch, nodes, vocab = _check_sampling_inputs(
        op, candidates, parents, num_nodes, target_probs, draft_probs, uniforms,
        bonus_uniforms, contiguous=True)
    kernel = _cupy.require_kernel(_KERNEL_FILE, "verify_sampling", device)
    out = check_verify_out(op, out, batch, nodes, device)
    if batch > 0:
        workspace = torch.empty((batch, vocab), dtype=torch.float32, device=device)
        has_draft = draft_probs is not None
        _cupy.launch(kernel, (batch,), (_cupy.pow2_threads_for(vocab, 1024),),
                     (candidates, parents, num_nodes, target_probs,
                      draft_probs if has_draft else target_probs,  # unread without drafts
                      uniforms, bonus_uniforms, workspace, out.accept_len, out.accepted_nodes,
                      out.bonus_token, np.int32(nodes), np.int32(vocab), np.int32(has_draft)),
                     device)
    return out


def verify_sampling(candidates: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                    target_probs: torch.Tensor, draft_probs: Optional[torch.Tensor],
                    uniforms: torch.Tensor, bonus_uniforms: torch.Tensor) -> VerifyResult:
    """Lossless tree verification: the CUDA kernel for GPU tensors when CuPy and the
    kernel load, else the torch twin. Arguments as in `verify_sampling_torch`."""
    if (parents.is_cuda
            and _cupy.get_kernel(_KERNEL_FILE, "verify_sampling", parents.device) is not None):
        return verify_sampling_cuda(
            candidates.contiguous(), parents.contiguous(), num_nodes.contiguous(),
            target_probs.contiguous(),
            draft_probs.contiguous() if draft_probs is not None else None,
            uniforms.contiguous(), bonus_uniforms.contiguous())
    return verify_sampling_torch(candidates, parents, num_nodes, target_probs, draft_probs,
                                 uniforms, bonus_uniforms)
