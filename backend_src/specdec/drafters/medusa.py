"""Medusa drafting: heads on the target's last hidden state fill a static tree.

Per request the drafter keeps the target's final hidden state at the last accepted
node. Head k's top-k tokens fill the tree's depth-(k + 1) nodes: a node with choice
path [.., r] at depth d takes the r-th best token of head d - 1. No drafter KV cache:
the heads are position-free MLPs, so there is nothing to compact.

With a drafting vocabulary (`draft_vocab`, the checkpoint's `draft_vocab.safetensors`:
the tokens the heads were trained to rank) each head keeps only those rows of its
projection, and the full ones are freed at load: every head's projection is as large
as the target's LM head, so on a CPU the full ones cost most of a target forward per
step. Verification is unchanged.
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

    def __init__(self, heads: MedusaHeads, draft_vocab: Optional[torch.Tensor] = None):
        # With a drafting vocabulary (draft_vocab [K] target ids) the heads keep only
        # those rows of their projections (`MedusaHeads.keep_rows`) and output [.., K];
        # `vocab_ids` maps their columns back to target ids.
        self.heads = heads
        self.vocab_ids: Optional[torch.Tensor] = None
        if draft_vocab is not None:
            if heads.rows is None:  # cut at load (`MedusaHeads.from_pretrained(rows=)`) or here
                heads.keep_rows(draft_vocab)
            assert torch.equal(heads.rows.cpu(), draft_vocab.to(dtype=torch.long).cpu()), "heads cut to other rows"
            self.vocab_ids = draft_vocab.to(device=heads[0][-1].weight.device, dtype=torch.long)

    def _top(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """Each head's k best target ids for hidden [B, H]: [num_heads, B, k]."""
        top = self.heads(hidden).topk(k, dim=-1).indices  # columns of the heads' outputs
        return top if self.vocab_ids is None else self.vocab_ids[top]

    def prefill(self, state, hidden: torch.Tensor, aux: Optional[torch.Tensor], start: int = 0) -> None:
        state.draft = MedusaState(hidden[-1])  # the last piece's last position is the one drafted from

    def commit(self, states: list, accepted: AcceptedBatch) -> None:
        B = len(states)
        ends = to_device([n - 1 for n in accepted.lengths], accepted.nodes.device)
        last_node = accepted.nodes.gather(1, ends[:, None])[:, 0]  # [B]
        last = accepted.hidden[torch.arange(B, device=last_node.device), last_node]  # [B, H]
        for b, s in enumerate(states):
            s.draft.last_hidden = last[b]

    def move_slot(self, state, slot: int) -> None:
        """Nothing: the heads read the last hidden state, kept on the request's state."""

    def release(self, state) -> None:
        state.draft = None

    def propose(self, states: list, settings: list[TreeSettings]) -> list[DraftTree]:
        tree = settings[0].choices
        parents, depth, rank = tree.nodes(states[0].draft.last_hidden.device)
        hidden = torch.stack([s.draft.last_hidden for s in states])  # [B, H]
        top = self._top(hidden, tree.max_rank + 1)  # [num_heads, B, kmax]
        # Node i (i > 0) takes top[depth[i] - 1, b, rank[i]]; node 0, the root, is
        # written by the engine.
        tokens = top[(depth - 1).clamp(min=0), :, rank].transpose(0, 1)  # [B, N]
        return [DraftTree(tokens[b], parents) for b in range(len(states))]
