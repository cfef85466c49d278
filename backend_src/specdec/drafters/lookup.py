"""Prompt lookup: a branch copied from the request's own text, grafted onto a drafter's tree.

Answers repeat their context: code answers reuse the prompt's names and signatures, and
a small model's answers repeat themselves ("10 years past 10 years past ..."). When the
request's last `n` tokens (n from `max_ngram` down to `min_ngram`) occurred earlier in
its prompt or output, the tokens that followed their latest earlier occurrence are a
guess at what comes next that costs no forward at all (prompt lookup decoding, as
`transformers`' `prompt_lookup_num_tokens` and vLLM's n-gram speculator do).

Here the guess is not a method of its own: the engine grafts it onto the tree the
request's EAGLE or Medusa drafter proposed, as one more branch from the root that shares
the nodes the tree already has. Verification is the same as for any tree, so the output
is exactly what it would have been; only the number of tokens a step accepts changes.
The branch takes the place of the tree's last nodes, so a step verifies as many nodes
as the drafter proposed and costs what adaptive speculation planned.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import DraftTree

# The drafters whose trees take a grafted branch: their commit reads the accepted path
# whatever its shape. The draft model's commit assumes its own chain was the path.
GRAFTED_METHODS = ("eagle", "eagle2", "eagle3", "medusa")


@dataclass
class NgramIndex:
    """One request's n-grams, indexed as its tokens grow (each token is indexed once)."""

    max_ngram: int = 3
    min_ngram: int = 2
    indexed: int = 0  # the n-grams ending at positions below this one are in `latest`
    # n-gram -> position of its last token, at its latest occurrence that has a next token
    latest: dict[tuple[int, ...], int] = field(default_factory=dict)

    def _update(self, tokens: list[int]) -> None:
        end = len(tokens) - 1  # the last token has no next token yet: not indexed
        for p in range(self.indexed, end):
            for n in range(self.min_ngram, min(self.max_ngram, p + 1) + 1):
                self.latest[tuple(tokens[p - n + 1: p + 1])] = p
        self.indexed = max(self.indexed, end)

    def continuation(self, tokens: list[int], length: int) -> list[int]:
        """The `length` tokens that followed the latest earlier occurrence of the
        longest n-gram ending `tokens`; [] when none occurred. A copy that
        reaches the end of `tokens` goes on from its own start: text that repeats with
        period k is predicted to keep repeating."""
        self._update(tokens)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(tokens) <= n:
                continue
            p = self.latest.get(tuple(tokens[-n:]))
            if p is None:
                continue
            out: list[int] = []
            for i in range(p + 1, p + 1 + length):
                out.append(tokens[i] if i < len(tokens) else out[i - len(tokens)])
            return out
        return []


def graft(tree: DraftTree, chain: torch.Tensor) -> DraftTree:
    """`tree` with `chain` [L] (L < the tree's N nodes, on its device) hung from its root,
    in the same N nodes, computed on the device without reading anything back.

    The chain follows the tree's own nodes as far as their tokens agree and branches off
    there; the tree's last nodes make room for the rest (a prefix of a tree's nodes is a
    tree: parents come first). The result always has N nodes: keeping m of the tree's
    nodes leaves m + (L - shared(m)) nodes, which grows by 0 or 1 with m, and the largest
    m that fits fills N exactly unless the tree already held the whole chain. Siblings
    keep distinct tokens, which sampling's verification relies on."""
    tokens, parents = tree.tokens, tree.parents  # [N] each
    N, L = tokens.shape[0], chain.shape[0]
    if L == 0:
        return tree
    assert L < N, "the chain is cut to the tree's draft nodes"
    device = tokens.device
    # on_path[i]: node i spells the chain's first depth(i) tokens from the root (at most
    # one node per depth, since siblings differ)
    position = torch.arange(N, device=device)
    frontier = position == 0  # the root
    on_path = torch.zeros_like(frontier)
    has_parent = parents >= 0
    parent = parents.clamp(min=0)
    for j in range(L):
        frontier = frontier[parent] & has_parent & (tokens == chain[j])
        on_path |= frontier
    shared_before = on_path.long().cumsum(0)  # [N]: path nodes among nodes 0..i
    # [1]: the most nodes to keep, m, with m + L - shared(m) <= N (the m that fit are 1..keep)
    keep = (position + 1 + L - shared_before <= N).sum(0, keepdim=True)
    shared = shared_before.gather(0, keep - 1)  # [1]
    # the branch leaves the tree below its deepest kept path node (the root when none)
    attach = (on_path & (shared_before == shared)).long().argmax()
    new = position >= keep
    chain_at = (shared + position - keep).clamp(0, L - 1)
    out_tokens = torch.where(new, chain[chain_at], tokens)
    out_parents = torch.where(new, torch.where(position == keep, attach, position - 1), parents)
    return DraftTree(out_tokens, out_parents)
