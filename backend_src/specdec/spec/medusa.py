"""Medusa drafting: heads on the target's last hidden state fill a static tree.

Per request the drafter keeps the target's final hidden state at the last accepted
node. Head k's top-k tokens fill the tree's depth-(k + 1) nodes: a node with choice
path [.., r] at depth d takes the r-th best token of head d - 1. No drafter KV cache:
the heads are position-free MLPs, so there is nothing to compact.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..models.medusa import MedusaHeads
from ..transfer import to_device
from .base import AcceptedBatch, DraftTree, TreeSettings


@dataclass
class MedusaState:
    last_hidden: torch.Tensor  # [H] target hidden state after the last emitted token's parent


class MedusaDrafter:
    needs_aux = False

    def __init__(self, heads: MedusaHeads):
        self.heads = heads
        self._trees: dict = {}  # (id(tree), device) -> (tree, parents [N], head index [N], rank [N], kmax)

    def prefill(self, state, hidden: torch.Tensor, aux: Optional[torch.Tensor]) -> None:
        state.draft = MedusaState(hidden[-1])

    def commit(self, states: list, accepted: AcceptedBatch) -> None:
        B = len(states)
        ends = to_device([n - 1 for n in accepted.lengths], accepted.nodes.device)
        last_node = accepted.nodes.gather(1, ends[:, None])[:, 0]  # [B]
        last = accepted.hidden[torch.arange(B, device=last_node.device), last_node]  # [B, H]
        for b, s in enumerate(states):
            s.draft.last_hidden = last[b]

    def release(self, state) -> None:
        state.draft = None

    def propose(self, states: list, settings: list[TreeSettings]) -> list[DraftTree]:
        device = states[0].draft.last_hidden.device
        _, parents, head_of, rank, kmax = self._tree_tensors(settings[0].choices, device)
        hidden = torch.stack([s.draft.last_hidden for s in states])  # [B, H]
        top = self.heads(hidden).topk(kmax, dim=-1).indices  # [K, B, kmax]
        # Node i (i > 0) takes top[depth[i] - 1, b, rank[i]]; node 0, the root, is
        # written by the engine.
        tokens = top[head_of, :, rank].transpose(0, 1)  # [B, N]
        return [DraftTree(tokens[b], parents) for b in range(len(states))]

    def _tree_tensors(self, tree, device) -> tuple:
        """A static tree's tensors on `device`, made once (not a copy per step)."""
        key = (id(tree), str(device))
        if key not in self._trees:
            rank = torch.as_tensor(tree.rank)
            self._trees[key] = (tree, torch.as_tensor(tree.parents).to(device),
                                (torch.as_tensor(tree.depth) - 1).clamp(min=0).to(device), rank.to(device),
                                int(rank.max()) + 1)
        return self._trees[key]
