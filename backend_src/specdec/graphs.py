"""CUDA graphs for the target's decode-step forward (`cuda_graph_max_batch_size`).

On a GPU a decode step of a small batch is bound by kernel launches and Python, not
by the weights' bandwidth: a Llama-2-7B forward is ~700 kernels. A graph replays all
of them with one launch. A graph fixes every shape, so a step's forward is padded to
a bucket of (batch, tree width, key length) and one graph is captured per bucket the
first time it is needed (a bucket costs one capture, ~the forward's time; its
activations share one memory pool with every other bucket's):

- batch: 1, 2, 4, 8, 12, 16, 24, 32, ... up to `cuda_graph_max_batch_size`; larger
  batches run eagerly (they are bandwidth- or compute-bound: a graph saves little);
- tree width: 1, 2, 4, ..., `MAX_TREE` (the engine pads trees to it: nodes past a
  request's own are already padding that verification ignores);
- key length: the next power of two >= max(prefix) + width, at least 128, at most the
  slot. Keys past a request's own are masked out.
Padding rows (batch bucket > batch) reuse row 0's slot, write their KV into the slot's
spare positions past the context (`Engine.cache_positions`) and attend to key 0 only:
they never touch a real request's state, and their outputs are dropped.

On CPU the same padded static forward runs without capture (no graphs exist there):
that is what the tests use to check that the padding changes no output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .kv_cache import AttentionBatch, KVCache
from .models.llama import LlamaModel

MIN_KEYS = 128


def batch_bucket(n: int) -> int:
    """1, 2, 4, 8, then multiples of 8 up to 32 (12 and 24 too), then of 16."""
    if n <= 8:
        return 1 << (n - 1).bit_length()
    if n <= 32:
        return next(b for b in (12, 16, 24, 32) if b >= n)
    return -(-n // 16) * 16


def width_bucket(n: int) -> int:
    return 1 << (n - 1).bit_length()


def keys_bucket(n: int, limit: int) -> int:
    return min(limit, max(MIN_KEYS, 1 << (n - 1).bit_length()))


class GraphUnavailable(RuntimeError):
    """A bucket could not be captured: the caller turns graphs off and runs eagerly."""


@dataclass(frozen=True)
class GraphKey:
    batch: int
    width: int
    keys: int
    aux: bool


@dataclass
class _Graph:
    """One bucket's static inputs and outputs (and its graph on a GPU)."""

    ids: torch.Tensor  # [Bg, T] long
    positions: torch.Tensor  # [Bg, T] long
    batch: AttentionBatch  # slots [Bg], write_pos [Bg, T], mask [Bg, 1, T, K]
    pad_write_pos: torch.Tensor  # [Bg, T] where padding rows write: spare positions past the context
    pad_mask: torch.Tensor  # [Bg, 1, T, K] padding rows see key 0 only
    want_aux: bool  # the forward also returns the EAGLE-3 feature layers' inputs
    hidden: Optional[torch.Tensor] = None  # [Bg, T, H] output of the last run / replay
    aux: Optional[torch.Tensor] = None  # [Bg, T, A] or None
    graph: Optional["torch.cuda.CUDAGraph"] = None


class DecodeGraphs:
    """Runs `model(ids, positions, cache, batch, aux_layers)` for decode steps through
    per-bucket static buffers: replayed CUDA graphs on a GPU, the same padded forward
    eagerly on CPU."""

    def __init__(self, model: LlamaModel, cache: KVCache, aux_layers: Sequence[int], max_batch: int,
                 spare_start: int):
        self.model, self.cache, self.aux_layers = model, cache, tuple(aux_layers)
        self.max_batch = min(max_batch, cache.num_slots)  # buckets never exceed the slots (gather buffer)
        self.spare_start = spare_start  # first slot position no request ever uses
        self.capture = cache.kv.device.type == "cuda"
        self.graphs: dict[GraphKey, _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None

    def covers(self, batch: int) -> bool:
        return batch <= self.max_batch

    def width(self, nodes: int) -> int:
        """The tree width a step of `nodes` nodes is padded to."""
        return width_bucket(nodes)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, aux: bool
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """ids, positions: [B, T] (T a `width` bucket); batch built for them. Returns
        (hidden [B, T, H], aux [B, T, A] or None), fresh tensors (a later replay
        overwrites the graph's own outputs)."""
        B, T = ids.shape
        assert T == width_bucket(T) and self.covers(B), (B, T)
        key = GraphKey(min(batch_bucket(B), self.max_batch), T, keys_bucket(batch.key_len, self.cache.max_len), aux)
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._new(key)
        self._load(g, ids, positions, batch)
        if g.graph is not None:
            g.graph.replay()
        else:
            g.hidden, g.aux = self._run(g)
        return g.hidden[:B].clone(), None if g.aux is None else g.aux[:B].clone()

    # -- internals -----------------------------------------------------------------------
    def _run(self, g: _Graph) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        return self.model(g.ids, g.positions, self.cache, g.batch, self.aux_layers if g.want_aux else ())

    def _load(self, g: _Graph, ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> None:
        """Copies a step's inputs into the bucket's buffers; rows past B become padding."""
        B, K = ids.shape[0], batch.key_len
        sb = g.batch
        g.ids[:B] = ids
        g.positions[:B] = positions
        sb.slots[:B] = batch.slots
        sb.write_pos[:B] = batch.write_pos
        sb.mask[:B, :, :, :K] = batch.mask
        sb.mask[:B, :, :, K:].fill_(False)
        if B < g.ids.shape[0]:
            g.ids[B:].fill_(0)
            g.positions[B:].fill_(0)
            sb.slots[B:] = batch.slots[0]
            sb.write_pos[B:] = g.pad_write_pos[B:]
            sb.mask[B:] = g.pad_mask[B:]

    def _new(self, key: GraphKey) -> _Graph:
        Bg, T, K = key.batch, key.width, key.keys
        dev = self.cache.kv.device
        assert self.spare_start + T <= self.cache.max_len, "the cache has no spare positions for padding rows"
        pad_write_pos = (self.spare_start + torch.arange(T, device=dev))[None].expand(Bg, T).contiguous()
        pad_mask = torch.zeros(Bg, 1, T, K, dtype=torch.bool, device=dev)
        pad_mask[..., 0] = True
        batch = AttentionBatch(slots=torch.zeros(Bg, dtype=torch.long, device=dev), write_pos=pad_write_pos.clone(),
                               mask=pad_mask.clone(), key_len=K, static=True)
        g = _Graph(ids=torch.zeros(Bg, T, dtype=torch.long, device=dev),
                   positions=torch.zeros(Bg, T, dtype=torch.long, device=dev), batch=batch,
                   pad_write_pos=pad_write_pos, pad_mask=pad_mask, want_aux=key.aux)
        if self.capture:
            try:
                self._capture(g)
            except Exception as e:  # the engine goes on eagerly (Engine.target_step)
                raise GraphUnavailable(f"CUDA graph capture of {key} failed: {type(e).__name__}: {e}") from e
        return g

    def _capture(self, g: _Graph) -> None:
        """Warm-up on a side stream (cuBLAS workspaces, the cache's gather buffer), then
        capture. The buffers hold padding only: the capture's KV writes land in spare
        positions."""
        self.cache.reserve_gather()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run(g)
        torch.cuda.current_stream().wait_stream(side)
        g.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g.graph, pool=self._pool):
            g.hidden, g.aux = self._run(g)
