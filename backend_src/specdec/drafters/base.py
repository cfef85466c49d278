"""What every drafter shares: the per-step tree it proposes and the interface it serves.

A drafter proposes, for each request of a step, a `DraftTree` rooted at the request's
last emitted token (see docs/DESIGN.md for the layout). The engine verifies all
requests' trees in one target forward, then tells the drafter which nodes were
accepted together with the target's hidden states there, so the drafter can bring
its own state (KV cache, pending features) up to date.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch


@dataclass
class DraftTree:
    """One request's proposal for one step. Nodes are numbered so that the first m form
    the tree a budget of m nodes keeps: a static tree's choices in their order, a chain
    from its root, EAGLE-2/3's nodes best first (a smaller tree drafted anew is also
    narrower, so its prefix of m is a near match there). The engine cuts a tree at the
    context's end and grafts prompt lookup's branch in place of its last nodes; the
    policy reads, from the accepted nodes of a step, what each smaller tree would have
    accepted (`SpeculationPolicy.observe`)."""

    # [N] int64. Node 0 is the root (the last emitted token); the engine writes it from
    # the request, so a drafter may leave any value there.
    tokens: torch.Tensor
    parents: torch.Tensor  # [N] int64, parents[0] = -1, parents[i] < i
    # [N, V] float32: row n = the distribution node n's children were sampled from
    draft_probs: Optional[torch.Tensor] = None

    @staticmethod
    def root_only(root: int) -> "DraftTree":
        """Plain decoding's one-node tree, on the host: the engine writes every tree's
        root to the device itself (one transfer per step), so this never travels."""
        return DraftTree(torch.full((1,), root), torch.full((1,), -1))

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class TreeSettings:
    """The tree a request asks for this step (resolved from config + request + policy)."""

    method: str
    choices: Optional[object] = None  # a StaticTree for medusa / eagle
    depth: int = 5
    top_k: int = 8
    total_tokens: int = 60  # nodes including the root
    num_draft_tokens: int = 4
    pinned: bool = False  # the request fixed its tree size: adaptive speculation leaves it alone
    budget: Optional[int] = None  # this step's node limit for a static tree (adaptive speculation)
    lookup_tokens: int = 0  # eagle/medusa: most tokens of the branch copied from the text (lookup.py)


@dataclass
class AcceptedBatch:
    """What verification kept for the requests of one drafter, handed back to it in one
    call (per-request tensor work here cost more than the step's forward at batch 32)."""

    nodes: torch.Tensor  # [B, N] int64 accepted node indices in path order, nodes[:, 0] = 0, then -1
    lengths: list[int]  # [B] accepted path lengths (accepted drafts + 1)
    start: torch.Tensor  # [B] int64 cache position of each root (the cached length before the step)
    slots: torch.Tensor  # [B] int64 cache slot of each request
    hidden: torch.Tensor  # [B, N, H] target final hidden states at every node
    aux: Optional[torch.Tensor]  # [B, N, 3H] EAGLE-3 features at every node, or None


class Drafter(Protocol):
    """A proposer of draft trees (one per method family)."""

    needs_aux: bool  # wants the target's EAGLE-3 features

    def prefill(self, state, hidden: torch.Tensor, aux: Optional[torch.Tensor], start: int = 0) -> None:
        """After the target's prefill of a piece of `state`'s prompt: hidden [n, H] / aux
        [n, 3H] at prompt positions `[start, start + n)`. A chunked prompt comes in
        pieces, in order, over several steps (prefill.py); a whole one in one, start 0."""

    def propose(self, states: list, settings: list[TreeSettings]) -> list[DraftTree]:
        """One tree per state."""

    def commit(self, states: list, accepted: AcceptedBatch) -> None:
        """After verification of these requests' trees (row b of `accepted` is states[b]),
        before any of them is released."""

    def move_slot(self, state, slot: int) -> None:
        """Between steps, before `state.slot` becomes `slot` (a free slot): copies what the
        drafter keeps in the request's slot there (`Engine._pack_slots`)."""

    def release(self, state) -> None:
        """The request is gone; drop its drafter state."""
