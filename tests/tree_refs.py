"""Slow, obviously correct references of the tree ops, random trees, and the lossless
harness of verify_sampling; shared by test_ops.py (CPU twins) and test_kernels_gpu.py
(kernels). Plain Python loops over requests and nodes, numpy for the arithmetic."""
from __future__ import annotations

import itertools

import numpy as np
import torch
from scipy import stats

SIZES_N = (1, 2, 17, 64, 128)
SIZES_B = (1, 3, 17)


def random_trees(rng: np.random.Generator, batch: int, nodes: int):
    """parents[B, N], num_nodes[B] (int64 tensors): random shapes (random parent, chain,
    bushy), request 0 full, the rest padded to a random size (1 included)."""
    parents = np.full((batch, nodes), -1, dtype=np.int64)
    num = np.empty(batch, dtype=np.int64)
    for b in range(batch):
        n = nodes if b == 0 else int(rng.integers(1, nodes + 1))
        if b == 1:
            n = 1
        num[b] = n
        for i in range(1, n):
            style = b % 3
            if style == 0:
                parents[b, i] = rng.integers(0, i)
            elif style == 1:  # mostly a chain
                parents[b, i] = i - 1 if rng.random() < 0.7 else rng.integers(0, i)
            else:  # bushy
                parents[b, i] = rng.integers(0, min(i, 3))
    return torch.from_numpy(parents), torch.from_numpy(num)


def malformed_trees(rng: np.random.Generator, parents: torch.Tensor, num_nodes: torch.Tensor):
    """Out-of-range parents, parents in the padding and out-of-range counts: the kernels
    and the twins must still agree (docs/DESIGN.md: what the ops ignore)."""
    parents = parents.clone()
    for b, i in itertools.product(range(parents.shape[0]), range(1, parents.shape[1])):
        if rng.random() < 0.1:
            parents[b, i] = -1 if rng.random() < 0.5 else int(rng.integers(0, i))
    return parents, torch.from_numpy(rng.integers(-1, parents.shape[1] + 3, size=len(num_nodes)))


def _nodes(num_nodes, b, nodes):
    return int(min(max(int(num_nodes[b]), 1), nodes))


def ref_build_tree(parents, num_nodes, prefix_len):
    """(mask, positions, depth, first_child, next_sibling) as numpy arrays."""
    par = parents.numpy()
    batch, nodes = par.shape
    mask = np.zeros((batch, nodes, nodes), dtype=bool)
    depth = np.zeros((batch, nodes), dtype=np.int64)
    first_child = np.full((batch, nodes), -1, dtype=np.int64)
    next_sibling = np.full((batch, nodes), -1, dtype=np.int64)
    for b in range(batch):
        n = _nodes(num_nodes, b, nodes)
        for i in range(nodes):
            mask[b, i, i] = True
            if i >= n:
                continue
            j = i
            while j != 0:
                j = par[b, j]
                mask[b, i, j] = True
                depth[b, i] += 1
            children = [c for c in range(1, n) if par[b, c] == i]
            if children:
                first_child[b, i] = children[0]
            if i > 0:
                siblings = [c for c in range(i + 1, n) if par[b, c] == par[b, i]]
                if siblings:
                    next_sibling[b, i] = siblings[0]
    positions = prefix_len.numpy()[:, None] + depth
    return mask, positions, depth, first_child, next_sibling


def ref_verify_greedy(candidates, parents, num_nodes, target_argmax):
    """(accept_len, accepted_nodes, bonus_token) as numpy arrays."""
    cand, par, amax = candidates.numpy(), parents.numpy(), target_argmax.numpy()
    batch, nodes = par.shape
    accept_len = np.zeros(batch, dtype=np.int64)
    accepted_nodes = np.full((batch, nodes), -1, dtype=np.int64)
    bonus = np.zeros(batch, dtype=np.int64)
    for b in range(batch):
        n = _nodes(num_nodes, b, nodes)
        accepted, depth = [True] + [False] * (n - 1), [0] * n
        for i in range(1, n):  # parents precede children
            p = par[b, i]
            accepted[i] = accepted[p] and cand[b, i] == amax[b, p]
            depth[i] = depth[p] + 1
        best = 0
        for i in range(n):
            if accepted[i] and depth[i] > depth[best]:
                best = i  # strictly deeper: the lowest index wins ties
        path = [best]
        while path[-1] != 0:
            path.append(par[b, path[-1]])
        path.reverse()
        accept_len[b] = len(path) - 1
        accepted_nodes[b, :len(path)] = path
        bonus[b] = amax[b, best]
    return accept_len, accepted_nodes, bonus


def ref_verify_sampling(candidates, parents, num_nodes, target_probs, draft_probs, uniforms,
                        bonus_uniforms):
    """(accept_len, accepted_nodes, bonus_token): the rule of verify_sampling's docstring,
    one request and one child at a time."""
    cand, par = candidates.numpy(), parents.numpy()
    tp = target_probs.numpy()
    dp = draft_probs.numpy() if draft_probs is not None else None
    u, bu = uniforms.numpy(), bonus_uniforms.numpy()
    batch, nodes, vocab = tp.shape
    accept_len = np.zeros(batch, dtype=np.int64)
    accepted_nodes = np.full((batch, nodes), -1, dtype=np.int64)
    bonus = np.zeros(batch, dtype=np.int64)
    for b in range(batch):
        n = _nodes(num_nodes, b, nodes)
        p, cur, path = tp[b, 0].copy(), 0, [0]
        while True:
            taken = None
            for c in [c for c in range(1, n) if par[b, c] == cur]:
                x = cand[b, c]
                if not 0 <= x < vocab:
                    continue
                if dp is not None:
                    q = dp[b, cur]
                else:
                    q = np.zeros(vocab, dtype=np.float32)
                    q[x] = 1.0
                if p[x] > 0 and np.float32(u[b, c]) * np.float32(q[x]) <= p[x]:
                    taken = c
                    break
                r = np.maximum(p - q, np.float32(0.0))
                total = r.astype(np.float64).sum()
                if total > 0:
                    p = (r.astype(np.float64) / total).astype(np.float32)
            if taken is None:
                break
            path.append(taken)
            cur, p = taken, tp[b, taken].copy()
        accept_len[b] = len(path) - 1
        accepted_nodes[b, :len(path)] = path
        pd = p.astype(np.float64)
        threshold = np.float64(bu[b]) * pd.sum()
        cdf = np.cumsum(pd)
        hits = [k for k in range(vocab) if p[k] > 0 and cdf[k] > threshold]
        positive = [k for k in range(vocab) if p[k] > 0]
        bonus[b] = hits[0] if hits else (positive[-1] if positive else 0)
    return accept_len, accepted_nodes, bonus


def random_sampling_inputs(rng: np.random.Generator, batch: int, nodes: int, vocab: int,
                           with_draft: bool):
    """Random trees and distributions for verify_sampling: sparse-ish probabilities (some
    exact zeros), tokens mostly from the drafts' support, a few out of range."""
    parents, num_nodes = random_trees(rng, batch, nodes)
    def probs():
        raw = rng.gamma(0.3, size=(batch, nodes, vocab)).astype(np.float32)
        raw[rng.random(raw.shape) < 0.2] = 0.0
        raw[..., 0] += 1e-3  # no all-zero row
        return raw / raw.sum(-1, keepdims=True, dtype=np.float32)
    target = probs()
    draft = probs() if with_draft else None
    # Tokens: the argmax of the parent's draft (likely accepted) or random.
    cand = rng.integers(0, vocab, size=(batch, nodes))
    source = draft if with_draft else target
    for b in range(batch):
        for i in range(1, nodes):
            p = max(int(parents[b, i]), 0)
            if rng.random() < 0.5:
                cand[b, i] = int(np.argmax(source[b, p]))
    cand[rng.random(cand.shape) < 0.02] = vocab  # out of range: never accepted
    return dict(
        candidates=torch.from_numpy(cand.astype(np.int64)), parents=parents, num_nodes=num_nodes,
        target_probs=torch.from_numpy(target),
        draft_probs=torch.from_numpy(draft) if with_draft else None,
        uniforms=torch.from_numpy(rng.random((batch, nodes), dtype=np.float32)),
        bonus_uniforms=torch.from_numpy(rng.random(batch, dtype=np.float32)))


def ref_kv_compact(kv, slots, prefix_len, accepted_nodes, accept_len):
    """Sequential copies in increasing j on a clone (the order DESIGN.md prescribes)."""
    out = kv.clone()
    for b in range(accepted_nodes.shape[0]):
        slot, pre = int(slots[b]), int(prefix_len[b])
        for j in range(1, int(accept_len[b]) + 1):
            out[:, :, slot, :, pre + j] = out[:, :, slot, :, pre + int(accepted_nodes[b, j])]
    return out


# --- Lossless harness ---------------------------------------------------------------
# Tree: root with 3 children (nodes 1-3), each with 2 children (nodes 4-9). The target's
# distribution after a token x is NEXT[x] (it depends on the token only, as with a real
# model); node 0's is P0, which gives token 7 probability 0.
VOCAB = 8
LOSSLESS_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3]
P0 = np.array([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.07, 0.0], dtype=np.float32)
Q0 = np.array([0.05, 0.3, 0.1, 0.2, 0.05, 0.05, 0.05, 0.2], dtype=np.float32)  # drafter


def _lossless_tables():
    rng = np.random.default_rng(1234)
    nxt = rng.dirichlet(np.ones(VOCAB), size=VOCAB).astype(np.float32)
    qnxt = rng.dirichlet(np.full(VOCAB, 0.5), size=VOCAB).astype(np.float32)
    return nxt / nxt.sum(1, keepdims=True), qnxt / qnxt.sum(1, keepdims=True)


def lossless_inputs(trials: int, with_draft: bool, seed: int, device="cpu"):
    """One request per trial. With draft_probs the children are drawn i.i.d. from the
    drafter (q); without, they are the drafter's top-k tokens (distinct)."""
    rng = np.random.default_rng(seed)
    nxt, qnxt = _lossless_tables()
    nodes = len(LOSSLESS_PARENTS)
    cand = np.zeros((trials, nodes), dtype=np.int64)
    if with_draft:
        cand[:, 1:4] = rng.choice(VOCAB, size=(trials, 3), p=Q0 / Q0.sum())
        for c, kids in ((1, (4, 5)), (2, (6, 7)), (3, (8, 9))):
            for x in range(VOCAB):
                rows = cand[:, c] == x
                q = qnxt[x].astype(np.float64)
                cand[np.ix_(rows, kids)] = rng.choice(VOCAB, size=(rows.sum(), 2), p=q / q.sum())
    else:
        cand[:, 1:4] = np.argsort(-Q0, kind="stable")[:3]
        for c, kids in ((1, (4, 5)), (2, (6, 7)), (3, (8, 9))):
            cand[:, kids] = np.argsort(-qnxt[cand[:, c]], axis=1, kind="stable")[:, :2]
    target = np.empty((trials, nodes, VOCAB), dtype=np.float32)
    target[:, 0] = P0
    target[:, 1:] = nxt[cand[:, 1:]]
    draft = np.empty_like(target)
    draft[:, 0] = Q0
    draft[:, 1:] = qnxt[cand[:, 1:]]
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)
    return dict(candidates=t(cand), parents=t(np.tile(np.array(LOSSLESS_PARENTS), (trials, 1))),
                num_nodes=t(np.full(trials, nodes)), target_probs=t(target),
                draft_probs=t(draft) if with_draft else None,
                uniforms=t(rng.random((trials, nodes), dtype=np.float32)),
                bonus_uniforms=t(rng.random(trials, dtype=np.float32)))


def _chi2_pvalue(observed: np.ndarray, expected: np.ndarray, constraints: int) -> float:
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token of probability 0 was emitted"
    stat = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return float(stats.chi2.sf(stat, int(keep.sum()) - constraints))


def lossless_pvalues(verify, trials: int, with_draft: bool, seed: int, device="cpu"):
    """(p-value of the first emitted token ~ P0, p-value of the second ~ NEXT[first]
    given the first was an accepted draft) for the verifier `verify`."""
    inputs = lossless_inputs(trials, with_draft, seed, device)
    res = verify(**inputs)
    cand = inputs["candidates"].cpu().numpy()
    accept_len = res.accept_len.cpu().numpy()
    nodes = res.accepted_nodes.cpu().numpy()
    bonus = res.bonus_token.cpu().numpy()
    # Emitted tokens: the accepted drafts' tokens, then the bonus token.
    emitted = np.full((trials, 3), -1, dtype=np.int64)
    for k in range(2):
        drafted = cand[np.arange(trials), np.maximum(nodes[:, k + 1], 0)]
        emitted[:, k] = np.where(k < accept_len, drafted, -1)
    emitted[np.arange(trials), accept_len] = bonus
    first, second = emitted[:, 0], emitted[:, 1]
    p_first = _chi2_pvalue(np.bincount(first, minlength=VOCAB), trials * P0.astype(np.float64), 1)
    nxt, _ = _lossless_tables()
    went_on = accept_len >= 1
    observed = np.zeros((VOCAB, VOCAB))
    np.add.at(observed, (first[went_on], second[went_on]), 1)
    expected = observed.sum(1, keepdims=True) * nxt.astype(np.float64)
    p_second = _chi2_pvalue(observed.ravel(), expected.ravel(),
                            int((observed.sum(1) > 0).sum()))
    return p_first, p_second
