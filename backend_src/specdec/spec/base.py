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
    """One request's proposal for one step."""

    tokens: torch.Tensor  # [N] int64, node 0 = the root (last emitted token)
    parents: torch.Tensor  # [N] int64, parents[0] = -1, parents[i] < i
    draft_probs: Optional[torch.Tensor] = None  # [N, V] float32: row n = the distribution node n's children were sampled from

    @staticmethod
    def root_only(root: int, device) -> "DraftTree":
        return DraftTree(torch.tensor([root], device=device), torch.tensor([-1], device=device))

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


@dataclass
class Accepted:
    """What verification kept for one request, handed back to its drafter."""

    nodes: torch.Tensor  # [a + 1] int64 node indices of the accepted path, nodes[0] = 0
    hidden: torch.Tensor  # [a + 1, H] target final hidden states at those nodes
    aux: Optional[torch.Tensor]  # [a + 1, 3H] EAGLE-3 features at those nodes, or None
    new_tokens: list[int]  # accepted draft tokens + the bonus token


class Drafter(Protocol):
    """A proposer of draft trees (one per method family)."""

    needs_aux: bool  # wants the target's EAGLE-3 features

    def prefill(self, state, hidden: torch.Tensor, aux: Optional[torch.Tensor]) -> None:
        """After the target's prefill of `state`: hidden [L, H] / aux [L, 3H] of the prompt."""

    def propose(self, states: list, settings: list[TreeSettings]) -> list[DraftTree]:
        """One tree per state."""

    def commit(self, state, accepted: Accepted) -> None:
        """After verification of `state`'s tree."""

    def release(self, state) -> None:
        """The request is gone; drop its drafter state."""
