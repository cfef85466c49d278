"""Draft-model speculation: a small LM with the target's tokenizer proposes a chain.

Per request the draft model keeps its own KV cache slot (same slot id) holding
`draft_len` tokens. A step first feeds the tokens it has not seen (the accepted path
and bonus token of the last step: a catch-up), then extends a chain of
`num_draft_tokens` tokens one forward at a time: greedy for greedy requests, sampled
from its own (temperature/top-k/top-p-processed) distribution otherwise, with those
distributions returned as `draft_probs` so verification applies Leviathan et al.'s
rule. Chain entries beyond the accepted prefix are simply overwritten later.

With a drafting vocabulary (`draft_vocab`, the checkpoint's `draft_vocab.safetensors`)
the draft model scores only those rows of its LM head, the most costly part of a small
draft model's forward on a CPU; the other tokens get logit -inf, so greedy drafts and
sampled drafts (and the `draft_probs` verification divides by) come from those rows alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..graphs import DecodeGraphs
from ..kv_cache import AttentionBatch
from ..models.layers import causal_mask, vocabulary_projection
from ..models.llama import LlamaModel
from ..sampling import LogitsRow, greedy_tokens, probabilities, sample_inverse_cdf, sampling_tensors
from ..transfer import host_to_device, to_device
from .base import AcceptedBatch, DraftTree, TreeSettings
from .eagle import BATCHED_CATCH_UP, GRAPH_SPARE


@dataclass
class DraftModelState:
    draft_len: int  # tokens of the request in the draft model's KV cache
    chain: int = 0  # tokens drafted in the last proposal


class DraftModelDrafter:
    needs_aux = False

    def __init__(self, model: LlamaModel, num_slots: int, max_seq_len: int,
                 draft_vocab: Optional[torch.Tensor] = None):
        self.model = model
        # With a drafting vocabulary (draft_vocab [K] target ids): the LM head's rows for
        # those tokens (H -> K), and the ids themselves.
        self.vocab_ids: Optional[torch.Tensor] = None
        self.vocab_head: Optional[torch.nn.Linear] = None
        if draft_vocab is not None:
            self.vocab_ids, self.vocab_head = vocabulary_projection(model.lm_head.weight, draft_vocab)
        # Room after the context for the chain and a batched catch-up's padding, then
        # the spare positions of a CUDA graph's padding rows (graphs.py).
        self._spare_start = max_seq_len + 2 * BATCHED_CATCH_UP + 32
        self._cache_len = self._spare_start + GRAPH_SPARE
        self.graphs: Optional[DecodeGraphs] = None
        self._graph_batch: Optional[int] = None  # set by use_graphs
        self.allocate(num_slots)

    def allocate(self, num_slots: int) -> None:
        """(Re)allocates the draft model's KV cache for `num_slots` requests (at load)."""
        self.cache = None
        self.cache = self.model.new_cache(num_slots, self._cache_len)
        if self._graph_batch is not None:
            self.use_graphs(self._graph_batch)

    def use_graphs(self, max_batch: int) -> None:
        """Forwards of up to `max_batch` requests run through CUDA graphs (graphs.py):
        the chain's one-token steps and catch-ups of up to BATCHED_CATCH_UP tokens
        (padded)."""
        self._graph_batch = max_batch
        self.graphs = DecodeGraphs.for_model(self.model, self.cache, max_batch, self._spare_start,
                                             name="draft model")

    @property
    def slot_bytes(self) -> int:
        """Memory one request's slot takes."""
        return self.cache.kv.nbytes // self.cache.num_slots

    def prefill(self, state, hidden: torch.Tensor, aux: Optional[torch.Tensor], start: int = 0) -> None:
        state.draft = DraftModelState(draft_len=0)  # the first catch-up reads the prompt

    def commit(self, states: list, accepted: AcceptedBatch) -> None:
        for state, n in zip(states, accepted.lengths):
            d = state.draft
            if d.chain:
                # Cached: root at cached_len, then the chain's first chain-1 tokens.
                d.draft_len = state.cached_len + 1 + min(n - 1, d.chain - 1)
            d.chain = 0

    def move_slot(self, state, slot: int) -> None:
        self.cache.move_slot(state.slot, slot, state.draft.draft_len)

    def release(self, state) -> None:
        state.draft = None

    def _forward(self, states, tokens: torch.Tensor, lens: list[int]) -> torch.Tensor:
        """Feeds tokens [B, T] (row b's first lens[b] are real) after each draft_len;
        returns logits [B, V] at each row's last real token."""
        device = tokens.device
        B, T = tokens.shape
        host_slots = [s.slot for s in states]
        # [3, B]: cached draft lengths, slots, last real column of each row
        meta = to_device([[s.draft.draft_len for s in states], host_slots, [n - 1 for n in lens]], device)
        start, slots = meta[0], meta[1]
        batch = AttentionBatch.build(slots, start, causal_mask(B, T, device), host_slots=host_slots,
                                     max_prefix=max(s.draft.draft_len for s in states))
        positions = start[:, None] + torch.arange(T, device=device)[None]  # [B, T]
        if self.graphs is not None and self.graphs.fits(B, T):
            hidden, _ = self.graphs.forward(tokens, positions, batch)
        else:
            hidden, _ = self.model(tokens, positions, self.cache, batch)
        last = hidden[torch.arange(B, device=device), meta[2]]
        for s, n in zip(states, lens):
            s.draft.draft_len += n
        return self._logits(last)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] -> logits [B, V] float32 (-inf outside a drafting vocabulary)."""
        if self.vocab_head is None:
            return self.model.logits(hidden)
        logits = torch.full((hidden.shape[0], self.model.shape.vocab_size), float("-inf"), device=hidden.device)
        logits[:, self.vocab_ids] = self.vocab_head(hidden).float()
        return logits

    def _catch_up(self, states: list) -> torch.Tensor:
        """Feeds every request the tokens it has not seen; logits [B, V] after the last.
        Long catch-ups (a prompt) run alone, so short ones are not padded to their
        length (and padding never writes past a slot's end)."""
        device = self.cache.kv.device
        unseen = [s.tokens[s.draft.draft_len:] for s in states]
        short = [i for i, u in enumerate(unseen) if len(u) <= BATCHED_CATCH_UP]
        groups = ([short] if short else []) + [[i] for i, u in enumerate(unseen) if len(u) > BATCHED_CATCH_UP]
        out: list = [None] * len(states)
        for group in groups:
            lens = [len(unseen[i]) for i in group]
            width = max(lens)
            if self.graphs is not None:  # more padding columns, to a graph's width (short catch-ups)
                width = self.graphs.padded_width(len(group), width)
            tokens = to_device([unseen[i] + [0] * (width - len(unseen[i])) for i in group], device)
            logits = self._forward([states[i] for i in group], tokens, lens)
            for row, i in enumerate(group):
                out[i] = logits[row]
        return torch.stack(out)

    def propose(self, states: list, settings: list[TreeSettings]) -> list[DraftTree]:
        device = self.cache.kv.device
        B = len(states)
        gamma = max(1, settings[0].num_draft_tokens)
        logits = self._catch_up(states)
        rows = [LogitsRow(s.req, s.tokens, len(s.tokens) - s.prompt_len) for s in states]
        greedy = all(s.req.sampling.greedy for s in states)
        chain, dists = [], []
        for j in range(gamma):
            if greedy:
                nxt = greedy_tokens(logits)
            else:
                probs = probabilities(logits[:, None], sampling_tensors(rows, device))[:, 0]
                u = host_to_device(torch.cat([s.rng.uniforms(1) for s in states]), device)
                nxt = sample_inverse_cdf(probs, u)
                dists.append(probs)
            chain.append(nxt)
            if j + 1 < gamma:
                logits = self._forward(states, nxt[:, None], [1] * B)
        for s in states:
            s.draft.chain = gamma
            s.draft.draft_len -= gamma - 1  # chain entries are scratch until accepted
        # [B, 1 + gamma]; node 0 is the root, which the engine writes itself
        toks = torch.stack([torch.zeros_like(chain[0])] + chain, dim=1)
        parents = torch.arange(-1, gamma, device=device)
        trees = []
        for b, s in enumerate(states):
            q = None
            if dists:
                q = torch.zeros(gamma + 1, logits.shape[-1], device=device)
                q[:gamma] = torch.stack([d[b] for d in dists])
            trees.append(DraftTree(toks[b], parents.clone(), q))
        return trees
