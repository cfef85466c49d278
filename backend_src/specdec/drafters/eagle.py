"""EAGLE drafting: EAGLE-1 static trees, EAGLE-2 dynamic trees, EAGLE-3 heads.

Per request the head keeps its own KV cache slot (same slot id as the target) with
`head_len` entries, one per (token x[t+1], target feature at t) pair it has consumed.
The target features of every committed position t live in a static buffer
`feats[slot, t]` (written at prefill and by each step's commit, one batched write for
all requests); those at `[head_len, cached_len)` are pending: not consumed yet (a step
without drafting, when speculation is paused, leaves its features pending too).

A step (one call of `propose` for a group of requests with the same tree settings):
1. catch-up: one head forward over each request's pending pairs (the prompt after
   prefill, the accepted path after a step). Its last output drafts depth 1.
2. expansion: one head forward per depth over the frontier nodes, written into a
   scratch region after `head_len`; each node sees the prefix and its own ancestors.
   EAGLE-2/3 keep the `top_k` frontier nodes of highest cumulative log-probability
   and finally rerank all candidates to `total_tokens - 1`; EAGLE-1 follows a static
   tree of choices.
EAGLE-1/2 heads score their drafts through the target's LM head. With a drafting
vocabulary (`draft_vocab`: the checkpoint's `draft_vocab.safetensors`, the tokens its
training ranked over) they score only those rows of it, as FR-Spec does (frequency-ranked
drafting): on the 2-core Xeon the full 49,152-row head was most of a 2-node EAGLE-2
tree's drafting time. A draft outside the vocabulary is never proposed; verification
against the full target keeps the output exact either way.
The scratch region is simply overwritten by the next catch-up, so the head cache
never needs compaction: it only ever holds pairs built from real target features.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..graphs import CapturedCalls, DecodeGraphs, batch_bucket, keys_bucket
from ..kv_cache import AttentionBatch
from ..models.eagle import EagleHead
from ..models.eagle3 import Eagle3Head
from ..models import cpu_layer_ops
from ..models.layers import causal_mask, vocabulary_projection
from ..models.llama import LlamaModel
from ..transfer import to_device
from .base import AcceptedBatch, DraftTree, TreeSettings

# Longest catch-up batched with others; longer ones (prefill) run alone so short
# requests are not padded to a prompt's length.
BATCHED_CATCH_UP = 16
# Room after the committed prefix for the drafting scratch region.
SCRATCH = 16 * 16 + BATCHED_CATCH_UP
# Past the scratch region: where the padding rows of a CUDA graph's batch write (graphs.py);
# as wide as the widest graphed head forward (top_k <= 16, a catch-up <= BATCHED_CATCH_UP).
GRAPH_SPARE = 16


@dataclass
class EagleState:
    head_len: int  # head KV entries (pairs consumed); features at [head_len, cached_len) are pending


class EagleDrafter:
    def __init__(self, head: EagleHead | Eagle3Head, target: LlamaModel, num_slots: int, max_seq_len: int,
                 score_temperature: float = 1.0, draft_vocab: Optional[torch.Tensor] = None):
        self.head = head
        self.score_temperature = score_temperature  # EAGLE-2/3 ranking only (config.py)
        self.target = target
        self.eagle3 = isinstance(head, Eagle3Head)
        # EAGLE-1/2 with a drafting vocabulary (draft_vocab [K] target ids): the target LM
        # head's rows of those tokens (H -> K) and each row's offset to its target id [K]
        self.vocab_head: Optional[torch.nn.Linear] = None
        self.vocab_d2t: Optional[torch.Tensor] = None
        if draft_vocab is not None and not self.eagle3:
            ids, self.vocab_head = vocabulary_projection(target.lm_head.weight, draft_vocab)
            self.vocab_d2t = ids - torch.arange(len(ids), device=ids.device)
        self.needs_aux = self.eagle3
        self._spare_start = max_seq_len + SCRATCH
        self._cache_len = self._spare_start + GRAPH_SPARE
        # The head's KV cache has a whole scratch region of spare positions: a graphed
        # drafting loop's padding rows grow their (dropped) trees there.
        self._head_cache_len = self._spare_start + SCRATCH
        self.graphs: Optional[DecodeGraphs] = None  # catch-ups and EAGLE-1's depths
        self.loop_graphs: Optional[CapturedCalls] = None  # EAGLE-2/3's whole drafting loop
        self._graph_batch: Optional[int] = None  # set by use_graphs
        self.allocate(num_slots)
        self._plans: dict = {}  # static tree -> _StaticPlan

    def allocate(self, num_slots: int) -> None:
        """(Re)allocates the head's KV cache and the feature buffer for `num_slots`
        requests (at load)."""
        self.cache = self.feats = None
        self.cache = self.head.new_cache(num_slots, self._head_cache_len)
        width = self.target.shape.hidden_size * (3 if self.eagle3 else 1)
        # [slots, positions, F]: the target feature at each committed position (F = H, or 3H for EAGLE-3)
        self.feats = torch.zeros(num_slots, self._cache_len, width, dtype=self.cache.kv.dtype,
                                 device=self.cache.kv.device)
        if self._graph_batch is not None:
            self.use_graphs(self._graph_batch)

    def use_graphs(self, max_batch: int) -> None:
        """Drafting for up to `max_batch` requests runs through CUDA graphs (graphs.py):
        catch-ups of up to BATCHED_CATCH_UP pairs (padded) and EAGLE-1's depths as head
        forwards, and EAGLE-2/3's whole loop after the catch-up (its head forwards and
        the selection between them) as one graph per (batch, top_k, depth, tree size,
        key length) bucket."""
        self._graph_batch = max_batch
        head, cache = self.head, self.cache

        def forward(ids, features, positions, batch, aux):
            return head(ids, features, positions, batch.mask, cache, batch), None
        self.graphs = DecodeGraphs(forward, cache, max_batch, self._spare_start, name="EAGLE head",
                                   max_width=GRAPH_SPARE)
        self.loop_graphs = CapturedCalls(self._grow_static, cache.kv.device, name="EAGLE drafting loop")

    @property
    def slot_bytes(self) -> int:
        """Memory one request's slot takes (head KV cache and features)."""
        return (self.cache.kv.nbytes + self.feats.nbytes) // self.cache.num_slots

    # -- state ---------------------------------------------------------------------------
    def prefill(self, state, hidden: torch.Tensor, aux: Optional[torch.Tensor], start: int = 0) -> None:
        src = aux if self.eagle3 else hidden  # [n, F]: prompt positions [start, start + n)
        self.feats[state.slot, start : start + src.shape[0]] = src
        state.draft = EagleState(head_len=0)  # the first drafting call catches the head up on the prompt

    def commit(self, states: list, accepted: AcceptedBatch) -> None:
        """Writes each request's accepted path features at positions start + j in one
        indexed copy. Rows past a path are written too (from node 0): they land after
        the new cached length, where nothing reads them before the next commit
        overwrites them, and a tree never extends past the slot (the engine caps it)."""
        src = accepted.aux if self.eagle3 else accepted.hidden  # [B, N, F]
        B, N = accepted.nodes.shape
        if N == 1:  # a plain step (every tree turned down): the root's feature alone
            self.feats[accepted.slots, accepted.start] = src[:, 0].to(self.feats.dtype)
            return
        device = src.device
        rows = torch.arange(B, device=device)[:, None]
        positions = accepted.start[:, None] + torch.arange(N, device=device)[None]  # [B, N]
        self.feats[accepted.slots[:, None], positions] = src[rows, accepted.nodes.clamp(min=0)].to(self.feats.dtype)

    def move_slot(self, state, slot: int) -> None:
        """The head's cached pairs and the committed features (positions before the
        target's cached length) go to `slot`."""
        self.cache.move_slot(state.slot, slot, state.draft.head_len)
        self.feats[slot, : state.cached_len] = self.feats[state.slot, : state.cached_len]

    def release(self, state) -> None:
        state.draft = None

    # -- drafting ------------------------------------------------------------------------
    def _head(self, tokens, feats, positions, batch: AttentionBatch) -> torch.Tensor:
        """tokens, positions [B, T]; feats [B, T, H]: the head's forward, through a graph
        when one fits."""
        if self.graphs is not None and self.graphs.fits(*tokens.shape):
            return self.graphs.forward(tokens, positions, batch, features=feats)[0]
        return self.head(tokens, feats, positions, batch.mask, self.cache, batch)

    def _top_log_probs(self, hidden: torch.Tensor, k: int, temperature: float = 1.0
                       ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """The k best draft log-probs [..., k] of the head's outputs `hidden` [..., H], best
        first, their draft ids [..., k] and, over a reduced vocabulary (EAGLE-3's, or a
        drafting vocabulary), the draft-to-target id offsets [V'] (else None)."""
        if self.eagle3:
            logits, d2t = self.head.draft_logits(hidden), self.head.d2t
        elif self.vocab_head is not None:
            logits, d2t = self.vocab_head(hidden).float(), self.vocab_d2t  # [..., K]
        else:
            logits, d2t = self.target.logits(hidden), None
        values, ids = top_log_probs(logits, k, temperature)
        return values, ids, d2t

    @staticmethod
    def _to_target(ids: torch.Tensor, d2t: Optional[torch.Tensor]) -> torch.Tensor:
        return ids if d2t is None else ids + d2t[ids]

    def _catch_up(self, states: list) -> torch.Tensor:
        """Consumes every request's pending pairs; returns the last outputs [B, H]."""
        last: list[Optional[torch.Tensor]] = [None] * len(states)
        pending = [s.cached_len - s.draft.head_len for s in states]
        short = [i for i, m in enumerate(pending) if m <= BATCHED_CATCH_UP]
        groups = [short] if short else []
        groups += [[i] for i, m in enumerate(pending) if m > BATCHED_CATCH_UP]
        for group in groups:
            outs = self._catch_up_group([states[i] for i in group])
            for i, out in zip(group, outs):
                last[i] = out
        return torch.stack(last)

    def _catch_up_group(self, states: list) -> torch.Tensor:
        device = self.cache.kv.device
        lens = [s.cached_len - s.draft.head_len for s in states]
        B, M = len(states), max(lens)
        if self.graphs is not None:  # more padding columns, to a graph's width (short catch-ups)
            M = self.graphs.padded_width(B, M)
        # Pair j of a request: the token after position head_len + j, with its feature.
        pending = [s.tokens[s.draft.head_len + 1: s.cached_len + 1] for s in states]
        tokens = to_device([p + [0] * (M - len(p)) for p in pending], device)  # [B, M]
        host_slots = [s.slot for s in states]
        meta = to_device([[s.draft.head_len for s in states], host_slots, [m - 1 for m in lens]], device)  # [3, B]
        head_len, slots = meta[0], meta[1]
        positions = head_len[:, None] + torch.arange(M, device=device)[None]  # [B, M]
        # Rows past a request's pending count are padding: their outputs are dropped and
        # their head KV entries land in the scratch region.
        feats = self.feats[slots[:, None], positions]  # [B, M, F]
        batch = AttentionBatch.build(slots, head_len, causal_mask(B, M, device), host_slots=host_slots,
                                     max_prefix=max(s.draft.head_len for s in states))
        x = self.head.fc(feats) if self.eagle3 else feats
        for b, s in enumerate(states):
            s.draft.head_len += lens[b]
        if self.graphs is not None and self.graphs.fits(B, M):
            out = self._head(tokens, x, positions, batch)  # [B, M, H]
            return out[torch.arange(B, device=device), meta[2]]
        # Only a row's last pair drafts (depth 1); the others only fill the head's KV
        # cache, so the head's last layer runs its attention output and MLP at one
        # position per row (a 300-pair catch-up: 1.38 ms instead of 4.49 on the CPU,
        # tools/bench/bench_overheads.py).
        return self.head(tokens, x, positions, batch.mask, self.cache, batch, queries=meta[2])[:, 0]

    def propose(self, states: list, settings: list[TreeSettings]) -> list[DraftTree]:
        """All `settings` of one call share method, depth and top_k (or static choices)."""
        last = self._catch_up(states)  # [B, H]
        if settings[0].method == "eagle":
            return self._static(states, last, settings[0].choices)
        return self._dynamic(states, last, settings)

    def _dynamic(self, states: list, last: torch.Tensor, settings: list[TreeSettings]) -> list[DraftTree]:
        """EAGLE-2/3: the tree grown from the catch-up outputs `last` [B, H]; through one
        CUDA graph per bucket when the drafting loop is graphed (`use_graphs`)."""
        device = last.device
        B, H = last.shape
        k, depth = settings[0].top_k, settings[0].depth
        host_slots = [s.slot for s in states]
        host_head = [s.draft.head_len for s in states]
        n_cand = k + (depth - 1) * k * k
        ns = [min(st.total_tokens - 1, n_cand) for st in settings]  # draft nodes kept per request
        n = max(ns)
        trees = None
        max_rows = min(self._graph_batch or 0, self.cache.num_slots)
        if self.loop_graphs is not None and not self.loop_graphs.disabled and B <= max_rows:
            # Padding rows up to the batch bucket: row 0's slot, a prefix at the spare
            # positions (they write there and see every key), outputs dropped.
            rows = min(batch_bucket(B), max_rows)
            pad = rows - B
            keys = keys_bucket(max(host_head) + (depth - 1) * k, self._spare_start)
            slots, head_len, keep = to_device([host_slots + host_slots[:1] * pad,
                                               host_head + [self._spare_start] * pad, ns + [n] * pad], device)
            padded = torch.cat((last, last.new_zeros(pad, H))) if pad else last
            trees = self.loop_graphs((rows, k, depth, n, keys), last=padded, slots=slots, head_len=head_len,
                                     keep=keep)
        if trees is None:
            slots, head_len, keep = to_device([host_slots, host_head, ns], device)  # [B] each

            def attention(local: torch.Tensor, region: int) -> AttentionBatch:
                return AttentionBatch.build(slots, head_len, local, write_offset=region, host_slots=host_slots,
                                            max_prefix=max(host_head))
            trees = self._grow(last, head_len, keep, k, depth, n, attention, self._head)
        tokens, parents = trees
        return [DraftTree(tokens[b, : ns[b] + 1], parents[b, : ns[b] + 1]) for b in range(B)]

    def _grow_static(self, key: tuple, last: torch.Tensor, slots: torch.Tensor, head_len: torch.Tensor,
                     keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`_grow` with every shape fixed by `key` = (rows, top_k, depth, kept nodes, key
        length) and nothing read on the host: what `loop_graphs` captures."""
        _, k, depth, n, keys = key

        def attention(local: torch.Tensor, region: int) -> AttentionBatch:
            return AttentionBatch.build_static(slots, head_len, local, region, keys)

        def head(tokens, feats, positions, batch):
            return self.head(tokens, feats, positions, batch.mask, self.cache, batch)
        return self._grow(last, head_len, keep, k, depth, n, attention, head)

    def _grow(self, last: torch.Tensor, head_len: torch.Tensor, keep: torch.Tensor, k: int, depth: int, n: int,
              attention, head) -> tuple[torch.Tensor, torch.Tensor]:
        """EAGLE-2's dynamic tree. last [B, H]: the catch-up outputs; head_len, keep [B]:
        each request's head KV length and how many draft nodes it keeps (<= n). One head
        forward per depth over the `k` frontier nodes of highest cumulative
        log-probability; then every candidate is reranked and each request keeps its
        best `keep[b]`. `attention(local, region)` builds a depth's AttentionBatch (local
        [B, k, region + k]: the scratch entries each frontier node sees); `head(tokens,
        feats, positions, batch)` runs the head. Returns tokens and parents [B, n + 1],
        node 0 the root, the others best first; row b's nodes past keep[b] are padding."""
        device = last.device
        B, H = last.shape
        score, tok, d2t = self._top_log_probs(last, k, self.score_temperature)  # [B, k] depth-1 candidates, best first
        tok = self._to_target(tok, d2t)
        cand_tok, cand_score, cand_parent, cand_depth = [tok], [score], [torch.full_like(tok, -1)], [1]
        front_tok, front_score, front_feat = tok, score, last[:, None].expand(B, k, H)
        front_cand = torch.arange(k, device=device)[None].expand(B, k)
        anc = torch.zeros(B, k, 0, dtype=torch.bool, device=device)  # ancestors among scratch entries
        eye = torch.eye(k, dtype=torch.bool, device=device)[None].expand(B, k, k)
        n_cand = k
        for d in range(2, depth + 1):
            region = anc.shape[-1]
            local = torch.cat((anc, eye), dim=-1)  # [B, k, region + k]
            positions = (head_len + d - 2)[:, None].expand(B, k)
            out = head(front_tok, front_feat, positions, attention(local, region))  # [B, k, H]
            lp, ctok, _ = self._top_log_probs(out, k, self.score_temperature)  # [B, k, k]
            ctok = self._to_target(ctok, d2t)
            scores = (front_score[:, :, None] + lp).flatten(1)  # [B, k*k]
            cand_tok.append(ctok.flatten(1))
            cand_score.append(scores)
            cand_parent.append(front_cand[:, :, None].expand(B, k, k).flatten(1))
            cand_depth.append(d)
            front_score, pick = scores.topk(k, dim=-1)  # [B, k]
            parent_local = pick // k
            front_tok = ctok.flatten(1).gather(1, pick)
            front_cand = n_cand + pick
            front_feat = out.gather(1, parent_local[..., None].expand(B, k, H))
            anc = local.gather(1, parent_local[..., None].expand(B, k, region + k))
            n_cand += k * k
        all_tok = torch.cat(cand_tok, dim=1)  # [B, n_cand]
        all_parent = torch.cat(cand_parent, dim=1)
        all_depth = torch.cat([torch.full((B, t.shape[1]), d, device=device)
                               for t, d in zip(cand_tok, cand_depth)], dim=1)
        # A child's score never exceeds its parent's (log-probs <= 0); the depth term
        # breaks ties so a selected node's parent is always selected too.
        key = torch.cat(cand_score, dim=1).double() - 1e-6 * all_depth.double()
        # Each request keeps its best keep[b] candidates, for the whole batch at once: the
        # first keep[b] of the batch's top n are a row's own top keep[b]; the rest become
        # padding (index n_cand, last). Nodes are numbered best first, so every parent
        # precedes its children (a child's key is below its parent's) and the first m
        # nodes are the tree a budget of m keeps (what adaptive speculation learns from
        # and prompt lookup's graft and the context's end cut, base.DraftTree).
        top = key.topk(n, dim=-1).indices  # [B, n], best first
        kept = torch.arange(n, device=device)[None] < keep[:, None]  # [B, n]
        sel = torch.where(kept, top, n_cand)  # [B, n]
        node_of = torch.zeros(B, n_cand + 1, dtype=torch.long, device=device)  # candidate -> tree node
        node_of.scatter_(1, sel, torch.arange(1, n + 1, device=device)[None].expand(B, n))
        node_of[:, n_cand].fill_(0)  # column n_cand: the root (a depth-1 candidate's parent) and padding
        cand = sel.clamp(max=n_cand - 1)
        par = all_parent.gather(1, cand)
        parents = node_of.gather(1, torch.where(par < 0, n_cand, par))  # [B, n]
        # Node 0 is the root: the engine writes every request's root token itself.
        tokens = torch.cat((torch.zeros(B, 1, dtype=torch.long, device=device), all_tok.gather(1, cand)), dim=1)
        parents = torch.cat((torch.full((B, 1), -1, dtype=torch.long, device=device), parents), dim=1)
        return tokens, parents

    def _static(self, states: list, last: torch.Tensor, tree) -> list[DraftTree]:
        """EAGLE-1: node i at depth d takes the rank[i]-th best token after its parent."""
        device = last.device
        B, H = last.shape
        plan = self._plan_for(tree, device)
        host_slots = [s.slot for s in states]
        slots, head_len = to_device([host_slots, [s.draft.head_len for s in states]], device)  # [B] each
        max_head = max(s.draft.head_len for s in states)
        tokens = torch.zeros(B, plan.num_nodes, dtype=torch.long, device=device)  # node 0: the engine writes the root
        node_out = torch.zeros(B, plan.num_nodes, H, dtype=last.dtype, device=device)  # head output per node
        _, top, d2t = self._top_log_probs(last, plan.kmax)
        top = self._to_target(top, d2t)  # [B, kmax]
        tokens[:, plan.first] = top[:, plan.first_rank]
        for lv in plan.levels:
            T = lv.nodes.shape[0]
            feats = torch.where(lv.from_root[None, :, None], last[:, None], node_out[:, lv.parents])
            batch = AttentionBatch.build(slots, head_len, lv.local[None].expand(B, T, lv.local.shape[1]),
                                         write_offset=lv.local.shape[1] - T, host_slots=host_slots,
                                         max_prefix=max_head)
            positions = (head_len + lv.depth - 1)[:, None].expand(B, T)
            out = self._head(tokens[:, lv.nodes], feats, positions, batch)
            node_out[:, lv.nodes] = out
            top = self._to_target(self._top_log_probs(out, plan.kmax)[1], d2t)  # [B, T, kmax]
            tokens[:, lv.children] = top[:, lv.child_parent_pos, lv.child_rank]
        return [DraftTree(tokens[b], plan.parents) for b in range(B)]

    def _plan_for(self, tree, device) -> "_StaticPlan":
        key = (id(tree), str(device))
        if key not in self._plans:
            self._plans[key] = _StaticPlan.build(tree, device)
        return self._plans[key]


def top_log_probs(logits: torch.Tensor, k: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`log_softmax(logits / temperature).topk(k)`: the k best log-probs [..., k] of
    logits [..., V], best first, and their indices. Float32 on the CPU in one call
    (models/cpu_layer_ops.py; the lowest index first among equal values; log-probs in the
    last bits of these lines'): the three operators took about 60-80 µs a drafting depth
    over an 8,192-token vocabulary on the 2-core Xeon VM."""
    kernel = cpu_layer_ops.kernel_for(logits)
    if kernel is not None and logits.dim() >= 1 and 1 <= k <= logits.shape[-1]:
        return tuple(kernel.top_log_probs(logits.contiguous(), k, float(temperature)))
    return torch.log_softmax(logits / temperature, dim=-1).topk(k, dim=-1)


@dataclass
class _Level:
    """One head forward of a static tree: the depth-d nodes that have children."""

    depth: int
    nodes: torch.Tensor  # [T] node indices forwarded
    parents: torch.Tensor  # [T] their parents (0 = root)
    from_root: torch.Tensor  # [T] bool: the parent is the root (feature = catch-up output)
    local: torch.Tensor  # [T, R + T] bool: scratch entries visible to each (ancestors, self)
    children: torch.Tensor  # [C] nodes at depth d + 1
    child_parent_pos: torch.Tensor  # [C] index of each child's parent within `nodes`
    child_rank: torch.Tensor  # [C] top-k rank of each child


@dataclass
class _StaticPlan:
    """A static tree turned once into per-depth head forwards (cached per tree)."""

    num_nodes: int
    kmax: int
    parents: torch.Tensor  # [N]
    first: torch.Tensor  # depth-1 nodes
    first_rank: torch.Tensor
    levels: list

    @staticmethod
    def build(tree, device) -> "_StaticPlan":
        parents = [int(p) for p in torch.as_tensor(tree.parents).tolist()]
        depth = [int(d) for d in torch.as_tensor(tree.depth).tolist()]
        rank = [int(r) for r in torch.as_tensor(tree.rank).tolist()]
        N = len(parents)
        has_child = [False] * N
        for p in parents[1:]:
            has_child[p] = True
        entry = [-1] * N  # scratch entry written for each forwarded node
        levels, region = [], 0
        as_t = lambda xs, dt=torch.long: torch.tensor(xs, dtype=dt, device=device)  # noqa: E731
        for d in range(1, max(depth)):
            nodes = [i for i in range(N) if depth[i] == d and has_child[i]]
            T = len(nodes)
            local = torch.zeros(T, region + T, dtype=torch.bool)
            for j, n in enumerate(nodes):
                a = parents[n]
                while a > 0:  # the root has no scratch entry: its pair is in the prefix
                    local[j, entry[a]] = True
                    a = parents[a]
                local[j, region + j] = True
            for j, n in enumerate(nodes):
                entry[n] = region + j
            region += T
            children = [i for i in range(N) if depth[i] == d + 1]
            pos = {n: j for j, n in enumerate(nodes)}
            levels.append(_Level(depth=d, nodes=as_t(nodes), parents=as_t([parents[n] for n in nodes]),
                                 from_root=as_t([parents[n] == 0 for n in nodes], torch.bool),
                                 local=local.to(device), children=as_t(children),
                                 child_parent_pos=as_t([pos[parents[c]] for c in children]),
                                 child_rank=as_t([rank[c] for c in children])))
        first = [i for i in range(N) if depth[i] == 1]
        return _StaticPlan(num_nodes=N, kmax=max(rank) + 1, parents=as_t(parents), first=as_t(first),
                           first_rank=as_t([rank[i] for i in first]), levels=levels)
