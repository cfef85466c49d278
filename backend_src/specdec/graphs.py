"""CUDA graphs for the decode-time forwards (`cuda_graph_mode`): the target's
decode/verify forward, the EAGLE heads' drafting forwards, the draft model's chain.

On a GPU a decode step of a small batch is bound by kernel launches and Python, not
by the weights' bandwidth: a Llama-2-7B forward is ~700 kernels, an EAGLE head's ~30
per depth. A graph replays all of them with one launch. A graph fixes every shape, so
a forward is padded to a bucket of (batch, width, key length) and one graph is
captured per bucket the first time it is needed (a bucket costs one capture, ~the
forward's time; its activations share one memory pool with every other bucket's of
the same model):

- batch: 1, 2, 4, 8, 12, 16, 24, 32, ... up to `cuda_graph_max_batch_size`; larger
  batches run eagerly (they are bandwidth- or compute-bound: a graph saves little);
- width (tokens per request): 1, 2, 4, ... The caller pads to it where padding is
  harmless (the engine pads every tree to the batch's widest anyway: nodes past a
  request's own are padding that verification ignores; a catch-up's short rows are
  padded already); a forward of another width runs eagerly (`fits`);
- key length: the next power of two >= max(prefix) + width, at least 128, at most the
  slot. Keys past a request's own are masked out.
Padding rows (batch bucket > batch) reuse row 0's slot, write their KV into the slot's
spare positions (`spare_start` onwards, which no request ever uses) and attend to
their first key only: they never touch a real request's state, and their outputs are
dropped.

EAGLE-2/3's whole drafting loop (a head forward per depth and the selection between
them) is captured as one function per bucket by `CapturedCalls` (drafters/eagle.py pads
its rows and fixes its key length).

On CPU the same padded static forward runs without capture (no graphs exist there):
that is what the tests use to check that the padding changes no output, and that
nothing inside reads the device from the host (tests/test_host_syncs.py).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .kv_cache import AttentionBatch, KVCache
from .models.llama import LlamaModel

MIN_KEYS = 128
LOG = logging.getLogger("specdec")

# (ids [B, T], features [B, T, F] or None, positions [B, T], batch, aux) ->
# (output [B, T, H], aux features [B, T, A] or None)
Forward = Callable[[torch.Tensor, Optional[torch.Tensor], torch.Tensor, AttentionBatch, bool],
                   tuple[torch.Tensor, Optional[torch.Tensor]]]


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
    """A bucket could not be captured (`DecodeGraphs` then turns itself off)."""


@dataclass(frozen=True)
class GraphKey:
    batch: int
    width: int
    keys: int
    aux: bool
    features: int  # F of the features input, 0 without one


@dataclass
class _Graph:
    """One bucket's static inputs and outputs (and its graph on a GPU)."""

    ids: torch.Tensor  # [Bg, T] long
    positions: torch.Tensor  # [Bg, T] long
    features: Optional[torch.Tensor]  # [Bg, T, F] (an EAGLE head's input features) or None
    batch: AttentionBatch  # slots [Bg], write_pos [Bg, T], mask [Bg, 1, T, K]
    pad_write_pos: torch.Tensor  # [Bg, T] where padding rows write: spare positions past the context
    pad_mask: torch.Tensor  # [Bg, 1, T, K] padding rows see their first key only
    want_aux: bool  # the forward also returns the EAGLE-3 feature layers' inputs
    out: Optional[torch.Tensor] = None  # [Bg, T, H] output of the last run / replay
    aux: Optional[torch.Tensor] = None  # [Bg, T, A] or None
    graph: Optional["torch.cuda.CUDAGraph"] = None


class DecodeGraphs:
    """Runs a decode-time forward over `cache` through per-bucket static buffers:
    replayed CUDA graphs on a GPU, the same padded forward eagerly on CPU. When a
    capture fails, the warning is logged once, graphs turn off for this forward
    (`fits` says no from then on) and it runs eagerly: serving goes on."""

    def __init__(self, forward: Forward, cache: KVCache, max_batch: int, spare_start: int, name: str = "target",
                 max_width: Optional[int] = None):
        self._forward = forward
        self.name = name  # for the log
        self.disabled = False
        self.cache = cache
        self.max_batch = min(max_batch, cache.num_slots)  # buckets never exceed the slots (gather buffer)
        self.spare_start = spare_start  # first slot position no request ever uses
        # Padding rows write a forward's width of spare positions: the widest graphed forward.
        self.max_width = min(max_width or cache.max_len, cache.max_len - spare_start)
        assert self.max_width >= 1, (cache.max_len, spare_start)
        self.capture = cache.kv.device.type == "cuda"
        self.graphs: dict[GraphKey, _Graph] = {}
        self.captures = 0  # graphs captured so far (on CPU: buckets created), and the seconds they took
        self.capture_seconds = 0.0
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None

    @classmethod
    def for_model(cls, model: LlamaModel, cache: KVCache, max_batch: int, spare_start: int,
                  aux_layers: Sequence[int] = (), name: str = "target") -> "DecodeGraphs":
        """Graphs of `model(ids, positions, cache, batch, aux_layers)`: the target's
        decode/verify forward, the draft model's."""
        aux_layers = tuple(aux_layers)

        def forward(ids, features, positions, batch, aux):
            return model(ids, positions, cache, batch, aux_layers if aux else ())
        return cls(forward, cache, max_batch, spare_start, name)

    def covers(self, batch: int) -> bool:
        return batch <= self.max_batch

    def width(self, tokens: int) -> int:
        """The width a forward of `tokens` tokens per request is padded to."""
        return width_bucket(tokens)

    def padded_width(self, batch: int, tokens: int) -> int:
        """The width to build a forward of `tokens` tokens per request at: its graph's
        width when a graph takes the padded shape, else `tokens` (the caller pads with
        tokens whose outputs it ignores: a tree's padding nodes, a catch-up's columns)."""
        width = width_bucket(tokens)
        return width if self.fits(batch, width) else tokens

    def fits(self, batch: int, tokens: int) -> bool:
        """A forward of this shape runs through a graph (else the caller runs it eagerly):
        a width bucket no wider than the spare positions (a prompt-sized catch-up that
        happens to be 64 tokens wide is not a decode-time forward)."""
        return (not self.disabled and self.covers(batch) and tokens == width_bucket(tokens)
                and tokens <= self.max_width)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, aux: bool = False,
                features: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """ids, positions: [B, T] with `fits(B, T)`; features [B, T, F] or None; batch
        built for them. Returns (output [B, T, H], aux [B, T, A] or None), fresh tensors
        (a later replay overwrites the graph's own outputs)."""
        B, T = ids.shape
        assert self.fits(B, T), (B, T)
        F = 0 if features is None else features.shape[-1]
        key = GraphKey(min(batch_bucket(B), self.max_batch), T, keys_bucket(batch.key_len, self.cache.max_len),
                       aux, F)
        g = self.graphs.get(key)
        if g is None:
            t0 = time.perf_counter()
            try:
                g = self._new(key, features)
            except GraphUnavailable as e:
                self.disabled = True
                LOG.warning("%s; CUDA graphs are off for the %s forward of this model instance", e, self.name)
                return self._forward(ids, features, positions, batch, aux)
            self.graphs[key] = g
            self.captures += 1
            if self.capture:
                self.capture_seconds += time.perf_counter() - t0
        self._load(g, ids, positions, batch, features)
        if g.graph is not None:
            g.graph.replay()
        else:
            g.out, g.aux = self._run(g)
        return g.out[:B].clone(), None if g.aux is None else g.aux[:B].clone()

    # -- internals -----------------------------------------------------------------------
    def _run(self, g: _Graph) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        return self._forward(g.ids, g.features, g.positions, g.batch, g.want_aux)

    def _load(self, g: _Graph, ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
              features: Optional[torch.Tensor]) -> None:
        """Copies a forward's inputs into the bucket's buffers; rows past B become padding."""
        B, K = ids.shape[0], batch.key_len
        sb = g.batch
        g.ids[:B] = ids
        g.positions[:B] = positions
        if features is not None:
            g.features[:B] = features
        sb.slots[:B] = batch.slots
        sb.write_pos[:B] = batch.write_pos
        sb.mask[:B, :, :, :K] = batch.mask
        sb.mask[:B, :, :, K:].fill_(False)
        if B < g.ids.shape[0]:
            g.ids[B:].fill_(0)
            g.positions[B:].fill_(0)
            if features is not None:
                g.features[B:].fill_(0)
            sb.slots[B:] = batch.slots[0]
            sb.write_pos[B:] = g.pad_write_pos[B:]
            sb.mask[B:] = g.pad_mask[B:]

    def _new(self, key: GraphKey, features: Optional[torch.Tensor]) -> _Graph:
        Bg, T, K = key.batch, key.width, key.keys
        dev = self.cache.kv.device
        assert T <= self.max_width, (T, self.max_width)  # `fits` said so
        pad_write_pos = (self.spare_start + torch.arange(T, device=dev))[None].expand(Bg, T).contiguous()
        # A padding row's query t sees key 0 of row 0's slot: never an empty attention row.
        pad_mask = torch.zeros(Bg, 1, T, K, dtype=torch.bool, device=dev)
        pad_mask[..., 0].fill_(True)
        batch = AttentionBatch(slots=torch.zeros(Bg, dtype=torch.long, device=dev), write_pos=pad_write_pos.clone(),
                               mask=pad_mask.clone(), key_len=K, static=True)
        static_features = None
        if features is not None:
            static_features = torch.zeros(Bg, T, key.features, dtype=features.dtype, device=dev)
        g = _Graph(ids=torch.zeros(Bg, T, dtype=torch.long, device=dev),
                   positions=torch.zeros(Bg, T, dtype=torch.long, device=dev), features=static_features,
                   batch=batch, pad_write_pos=pad_write_pos, pad_mask=pad_mask, want_aux=key.aux)
        if self.capture:
            try:
                self._capture(g)
            except Exception as e:  # `forward` goes on eagerly
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
            g.out, g.aux = self._run(g)


@dataclass
class _Captured:
    """One key of `CapturedCalls`: its static inputs and outputs, and its graph."""

    inputs: dict  # name -> tensor: where each call's inputs are copied
    outputs: tuple  # the graph's outputs, overwritten by each replay
    graph: "torch.cuda.CUDAGraph"


class CapturedCalls:
    """One CUDA graph per key of a whole function of tensors (the EAGLE-2/3 drafting
    loop: head forwards and the tree selection between them, ~300 kernels a step). The
    key fixes every shape inside; the inputs are copied into the key's buffers, the
    graph replays, and the outputs come back as fresh tensors. The function must read
    nothing on the host and take everything that varies as an input tensor
    (tests/test_host_syncs.py checks this on CPU).

    The first call of a key warms up on a side stream with the real inputs, then
    captures: every write the function makes (a drafter's scratch KV entries) is
    made again, identically, by the replay that follows. On CPU the function simply
    runs. When a capture fails, the warning is logged once, `disabled` turns on and the
    call returns None: the caller runs its eager path from then on."""

    def __init__(self, function: Callable[..., tuple[torch.Tensor, ...]], device: torch.device, name: str):
        self._function = function  # function(key, **inputs) -> tuple of tensors
        self.name = name
        self.capture = device.type == "cuda"
        self.disabled = False
        self.keys: dict = {}  # key -> _Captured; on CPU, key -> None
        self.captures = 0  # as DecodeGraphs'
        self.capture_seconds = 0.0
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None

    def __call__(self, key, **inputs: torch.Tensor) -> Optional[tuple[torch.Tensor, ...]]:
        if not self.capture:
            if key not in self.keys:
                self.keys[key] = None
                self.captures += 1
            return self._function(key, **inputs)
        entry = self.keys.get(key)
        if entry is None:
            t0 = time.perf_counter()
            try:
                entry = self._new(key, inputs)
            except Exception as e:  # the caller goes on eagerly
                self.disabled = True
                LOG.warning("CUDA graph capture of the %s for %s failed (%s: %s); it runs eagerly from now on",
                            self.name, key, type(e).__name__, e)
                return None
            self.keys[key] = entry
            self.captures += 1
            self.capture_seconds += time.perf_counter() - t0
        else:
            for name, value in inputs.items():
                entry.inputs[name].copy_(value)
        entry.graph.replay()
        return tuple(out.clone() for out in entry.outputs)

    def _new(self, key, inputs: dict) -> _Captured:
        static = {name: value.clone() for name, value in inputs.items()}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._function(key, **static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = self._function(key, **static)
        return _Captured(static, tuple(outputs), graph)
