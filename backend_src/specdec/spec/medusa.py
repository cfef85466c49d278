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
from .base import AcceptedBatch, DraftTree, TreeSettings


@dataclass
class MedusaState:
    last_hidden: torch.Tensor  # [H] target hidden state after the last emitted token's parent


class MedusaDrafter:
    needs_aux = False

    def __init__(self, heads: MedusaHeads):
        self.heads = heads

    def prefill(self, state, hidden: torch.Tensor, aux: Optional[torch.Tensor]) -> None:
        state.draft = MedusaState(hidden[-1])

    def commit(self, states: list, accepted: AcceptedBatch) -> None:
        B = len(states)
        ends = torch.tensor(accepted.lengths, device=accepted.nodes.device) - 1
        last_node = accepted.nodes.gather(1, ends[:, None])[:, 0]  # [B]
        last = accepted.hidden[torch.arange(B, device=last_node.device), last_node]  # [B, H]
        for b, s in enumerate(states):
            s.draft.last_hidden = last[b]

    def release(self, state) -> None:
        state.draft = None

    def propose(self, states: list, settings: list[TreeSettings]) -> list[DraftTree]:
        tree = settings[0].choices
        device = states[0].draft.last_hidden.device
        parents = torch.as_tensor(tree.parents, device=device)
        depth = torch.as_tensor(tree.depth, device=device)
        rank = torch.as_tensor(tree.rank, device=device)
        kmax = int(rank.max().item()) + 1
        hidden = torch.stack([s.draft.last_hidden for s in states])  # [B, H]
        top = self.heads(hidden).topk(kmax, dim=-1).indices  # [K, B, kmax]
        # Node i (i > 0) takes top[depth[i] - 1, b, rank[i]]; node 0 is the root.
        head_of = (depth - 1).clamp(min=0)
        tokens = top[head_of, :, rank].transpose(0, 1).clone()  # [B, N]
        tokens[:, 0] = torch.tensor([s.tokens[-1] for s in states], device=device)
        return [DraftTree(tokens[b], parents.clone()) for b in range(len(states))]
