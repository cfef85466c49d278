"""The engine: in-flight batching of requests over one target model and its drafters.

A step reads top to bottom:
1. admit waiting requests into free KV slots and prefill their prompts: whole, several
   per forward where their lengths allow, and with chunked prefill a prompt longer than
   the piece size one piece a step (`prefill.py`; a request's first token is emitted
   when its whole prompt is cached);
2. plan the tree of each running request whose prompt is cached (method, size: `policy.py`);
3. drafters propose trees (one call per group of requests with equal settings), and
   EAGLE and Medusa trees take prompt lookup's branch (drafters/lookup.py);
4. ONE target forward verifies every request's tree (plain decoding is a one-node tree);
   with mixed prefill (`mixed_prefill`) the step's prompt pieces ride in it, sharing
   its matmuls (`LlamaModel.forward_parts`), instead of a forward of their own;
5. verification picks each request's accepted path and bonus token (greedy: exact
   match; sampling: lossless rejection sampling);
6. the accepted path is compacted in the target KV cache, drafters update their state,
   new tokens are emitted, finished requests give their slot back.

The engine knows nothing about Triton or tokenization. `submit` may be called from
any thread; the loop runs in the thread that loaded the engine (`launch`) or in the
caller's (`generate`).
"""
from __future__ import annotations

import collections
import gc
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .config import EngineConfig
from .errors import BusyError, ConfigError
from .graphs import DecodeGraphs
from .host_memory import keep_freed_memory
from .kv_cache import AttentionBatch, SlotAllocator
from .memory import free_device_bytes, kv_budget
from .models import cpu_amx, cpu_attention, cpu_layer_ops
from .models.checkpoint import read_config, torch_dtype
from .models.eagle3 import eagle3_feature_layers
from .models.layers import attention_without_per_shape_plans, causal_mask
from .models.cpu_linear import RowRouting, packed_layers, use_packed_cpu_linears
from .models.llama import LlamaModel
from .ops import cpu_tree
from .ops.kv_compact import kv_compact
from .ops.tree_mask import TreeBuffers, build_tree
from .ops.verify_greedy import verify_greedy
from .ops.verify_sampling import verify_sampling
from .policy import MAX_TREE, SpeculationPolicy, describe
from .prefill import PREFILL_TOKENS, PrefillChunk, prefill_chunks, prefill_groups
from .request import AcceptanceStats, GenerationRequest, StepOutput
from .routing_cache import cached_row_paths, routing_cache_dir
from .sampling import (LogitsRow, RequestRng, greedy_tokens, needs_plain_steps, probabilities, process_logits,
                       sample_inverse_cdf, sampling_tensors)
from .transfer import host_to_device, to_device
from .drafters.base import AcceptedBatch, DraftTree, TreeSettings
from .drafters.loader import load_drafters
from .drafters.lookup import NgramIndex, graft
from .stopping import cut_new_tokens

Emit = Callable[[StepOutput], None]
SCORE_CHUNK = 512  # prompt positions per LM-head call when scoring a prompt


def freeze_loaded_objects() -> None:
    """Moves every object alive after a load (the models' modules and parameters, the
    libraries' own) out of the garbage collector's view (`gc.freeze`), as long-running
    Python servers do: the collector's full passes then walk only what serving
    allocates. Unfrozen, they walked all of it; with 2 requests of adaptive EAGLE-3 on
    the 2-core Xeon, whose plan and drafter allocate more per step than plain decoding,
    the steps ran ~15 % slower than plain decoding's at the same shapes (0.83-0.85x of
    its tokens/s), and with the collector off both ran alike (docs/benchmarks.md 2.1).
    Objects frozen stay alive until `gc.unfreeze` (at `shutdown`) only if they are in
    reference cycles; everything else is freed as before."""
    gc.collect()
    gc.freeze()


def top_pairs(values: list[float], K: int, k: int) -> list[tuple[int, float]]:
    """The first `k` alternatives, `(token id, log-prob)`, of `values`: K ids (as floats)
    then their K log-probs, most likely first, as they come back from the device."""
    return [(int(values[i]), values[K + i]) for i in range(k)]


@dataclass
class RequestState:
    """A running request. Between steps every token but the last (the root of the
    next tree) has its KV cached: `cached_len == len(tokens) - 1`; before that, while
    its prompt is prefilled in chunks, `cached_len < prompt_len == len(tokens)`."""

    req: GenerationRequest
    emit: Emit
    slot: int
    tokens: list[int]  # prompt + output
    prompt_len: int
    rng: RequestRng
    settings: TreeSettings  # the request's resolved method and tree
    cached_len: int = 0
    output: list[int] = field(default_factory=list)
    cum_log_prob: float = 0.0
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    draft: object = None  # the drafter's per-request state
    adaptive: object = None  # the policy's running statistics (policy.AdaptiveState)
    cancelled: bool = False
    finished: bool = False
    scheduled_ns: int = 0  # time.monotonic_ns() at admission (TensorRT-LLM's first_scheduled_time)
    prompt_scores: Optional[dict] = None  # StepOutput's prompt_* fields, until the first output carries them
    ngrams: Optional[NgramIndex] = None  # for prompt lookup, made at its first tree that takes a branch
    copy_offered: list = field(default_factory=list)  # prompt lookup's copy grafted onto this step's tree

    @property
    def prefilling(self) -> bool:
        """Part of its prompt is not cached yet: it is not decoded, and has no first token."""
        return self.cached_len < self.prompt_len


@dataclass(frozen=True)
class StepLoad:
    """What one engine step scheduled."""

    context_requests: int = 0  # prompts prefilled (whole or a chunk of them)
    context_tokens: int = 0  # the prompt tokens prefilled
    generation_requests: int = 0  # requests decoded (a tree verified or a plain step)
    unix_time: float = 0.0  # when it ended (time.time())


@dataclass(frozen=True)
class EngineLoad:
    """What the engine holds now (exported as load gauges, TensorRT-LLM's, by metrics.py)."""

    running: int  # requests holding a KV slot
    waiting: int  # requests queued for one
    slots: int  # KV slots: the most requests decoded together
    slot_tokens: int  # positions of one slot: prompt, output and a step's tree
    iterations: int  # engine steps so far (load-time calibration included)
    last_step: StepLoad


@dataclass(frozen=True)
class PrefillForward:
    """One prefill forward's inputs, prepared on the device: run alone (`Engine._run_prefill`)
    or riding in a step's verify forward (`Engine._verify`)."""

    states: list  # [RequestState], one per row
    chunks: list[PrefillChunk]  # row b prefills chunks[b] of states[b]
    ids: torch.Tensor  # [B, L] the chunks' tokens, padded to the longest
    positions: torch.Tensor  # [B, L]
    batch: AttentionBatch  # their slots and causal mask after each cached prefix
    aux_layers: tuple  # the target layers whose inputs the drafters need (EAGLE-3), or ()
    last_positions: torch.Tensor  # [B] each chunk's last position in its row


@dataclass
class EngineMetrics:
    """Server-wide counters (exported as Triton custom metrics), per method."""

    draft_tokens: collections.Counter = field(default_factory=collections.Counter)
    accepted_tokens: collections.Counter = field(default_factory=collections.Counter)
    verify_steps: collections.Counter = field(default_factory=collections.Counter)
    emitted_tokens: collections.Counter = field(default_factory=collections.Counter)
    requests: collections.Counter = field(default_factory=collections.Counter)


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        dtype = torch_dtype(config.dtype)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"parameter 'device' is {config.device!r} but no GPU is visible")
        attention = ("attention without cuDNN (it plans each new shape)"
                     if attention_without_per_shape_plans(self.device) else None)
        try:
            self.target = LlamaModel.from_pretrained(config.base_model_dir, dtype, self.device)
        except (KeyError, ValueError, OSError) as e:
            raise ConfigError(f"cannot load base model from {config.base_model_dir!r}: {e}") from None
        base_cfg = read_config(config.base_model_dir)
        self.max_context = min(config.max_seq_len, base_cfg.get("max_position_embeddings", config.max_seq_len))
        self.vocab_size = self.target.shape.vocab_size
        self.max_tokens_limit = config.max_tokens_limit
        # Weights first (caches of one slot), then as many slots as the KV budget allows.
        loaded = load_drafters(config, self.target, self.max_context + 1, slots=1)
        self.drafters = loaded.drafters
        # CPU: freed host memory kept for the next step (before anything is timed)
        host_memory = keep_freed_memory() if self.device.type == "cpu" and config.keep_host_memory else None
        # float32 CPU: matmuls through oneDNN, MKL packs or the streamed kernel where they measure faster
        # (models/cpu_linear.py)
        self.packed_linears = 0
        self.row_routing: Optional[RowRouting] = None  # the target's decoder layers'
        self.head_routing: Optional[RowRouting] = None  # the target's LM head's
        self.row_routing_source = ""  # where it came from (routing_cache.py)
        if self.device.type == "cpu":
            # The CPU kernels are compiled at their first use on a machine, a minute or more
            # each on 2 cores: built now, so that a server is ready only once it can answer,
            # not answering its first request minutes late. Trees are built and verified on
            # int64 tensors whatever the model's dtype (ops/cpu_tree.py).
            cpu_tree.tree_kernel()
        if self.device.type == "cpu" and dtype == torch.float32:
            # The layers' kernels (the routing below builds the streamed and AMX kernels: its
            # cache names their builds)
            cpu_layer_ops.layer_ops_kernel()
            cpu_attention.attention_kernel()
            drafter_modules = [m for d in {id(d): d for d in loaded.drafters.values()}.values()
                               for m in vars(d).values() if isinstance(m, torch.nn.Module)]
            self.packed_linears = sum(use_packed_cpu_linears(m) for m in [self.target] + drafter_modules)
            # The LM head is routed on its own: it may have an exact compact form (SmolLM2's, from GGUF's
            # Q8_0 blocks, is int8) that makes the streamed kernel its fastest path where the layers' is another.
            groups = [self.target.model, self.target.lm_head] + drafter_modules
            routed: set[int] = set()  # a drafter holding the target's modules leaves their routing alone
            routing_dir = routing_cache_dir(config.calibration_cache_dir)
            for i, m in enumerate(groups):
                layers = [lin for lin in packed_layers(m) if id(lin) not in routed]
                routing, source = cached_row_paths(layers, routing_dir)
                routed |= {id(lin) for lin in layers}
                if i == 0:
                    self.row_routing, self.row_routing_source = routing, source
                elif i == 1:
                    self.head_routing = routing
        cached = [d for d in {id(d): d for d in loaded.drafters.values()}.values() if hasattr(d, "allocate")]
        positions = self.max_context + 1
        # The target's slots carry MAX_TREE spare positions past the context: a step pads
        # every request's tree to the batch's largest, and the padding's KV writes of a
        # request at the end of its context land there, never out of bounds.
        self.cache_positions = positions + MAX_TREE
        slot_bytes = (self.target.new_cache(1, self.cache_positions).kv.nbytes
                      + sum(d.slot_bytes for d in cached))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.kv_budget = kv_budget(config.max_batch_size, slot_bytes, positions, config.kv_cache_max_tokens,
                                   free_device_bytes(self.device), config.kv_cache_free_gpu_mem_fraction)
        self.num_slots = self.kv_budget.slots
        self.cache = self.target.new_cache(self.num_slots, self.cache_positions)
        for drafter in cached:
            drafter.allocate(self.num_slots)
        self.slots = SlotAllocator(self.num_slots)
        self.aux_layers = eagle3_feature_layers(self.target.shape.num_hidden_layers)
        self.graphs: Optional[DecodeGraphs] = None
        if config.cuda_graph_mode:
            self.graphs = DecodeGraphs.for_model(self.target, self.cache, config.cuda_graph_max_batch_size,
                                                 spare_start=positions, aux_layers=self.aux_layers)
            for drafter in cached:  # the EAGLE heads' and the draft model's forwards
                drafter.use_graphs(config.cuda_graph_max_batch_size)
        self.mixed_prefill = config.mixed_prefill and self.graphs is None  # step(): prefill in the verify forward
        self._graph_sets = [g for g in [self.graphs] + [getattr(d, name, None) for d in cached
                                                        for name in ("graphs", "loop_graphs")] if g is not None]
        self.policy = SpeculationPolicy(config, loaded.drafters, loaded.trees, loaded.medusa_heads)
        self.metrics = EngineMetrics()
        self.iterations = 0  # engine steps so far
        self.last_step = StepLoad()
        self._seeds = random.Random(config.seed)  # seeds of requests that send none
        self._waiting: collections.deque = collections.deque()
        self._running: list[RequestState] = []
        self._cancel: set[str] = set()
        self._lock = threading.Condition()
        self._thread: Optional[threading.Thread] = None  # the loop's thread, once launched
        self.owner = threading.current_thread()  # loaded here: the thread to run every step in
        self._stop = False
        self.policy.calibrate(self)
        graphs = None
        if self.graphs is not None:
            graphs = (f"CUDA graphs for the decode-time forwards (target, drafters) of <= {self.graphs.max_batch} "
                      "requests"
                      + ("" if self.graphs.capture else " (emulated on CPU: padded static forwards, no capture)"))
        packed = None
        if self.packed_linears:
            routing = self.row_routing.describe() if self.row_routing else "oneDNN at every row count"
            head = self.head_routing.describe() if self.head_routing else "oneDNN at every row count"
            packed = (f"{self.packed_linears} float32 linears can take their inputs through oneDNN, MKL "
                      f"packs or the streamed kernel (the target, {self.row_routing_source or 'measured at load'}: "
                      f"{routing}; its LM head: {head})")
            if self.row_routing is not None and self.row_routing.streamed_rows and cpu_amx.amx_kernel() is not None:
                packed += (f"; the streamed kernel's 4-bit and int8 weights take AMX tiles at {cpu_amx.MIN_ROWS} "
                           "rows or more")
        self.load_note = "; ".join(filter(None, [self.kv_budget.describe(positions), attention, host_memory, graphs,
                                                 packed, describe(self.policy)]))

    # -- public API ----------------------------------------------------------------------
    def graph_captures(self) -> tuple[int, float]:
        """CUDA graphs captured so far (target, drafters, drafting loops) and the seconds
        their captures took: a bucket is captured when first needed, in the step that
        needs it. On CPU: the emulated buckets created, 0 seconds."""
        return (sum(p.captures for p in self._graph_sets),
                sum(p.capture_seconds for p in self._graph_sets))

    def submit(self, req: GenerationRequest, emit: Emit) -> None:
        """Validates (raises InputError) and queues (raises BusyError when the queue is
        full); `emit` gets every step's output from the engine thread, the last one with
        `finished=True`."""
        req.validate(self.vocab_size, self.max_context, self.max_tokens_limit)
        settings = self.policy.resolve(req)  # raises InputError for bad choices / unloaded methods
        with self._lock:
            # Requests that a free slot will take at the next step are not waiting for one.
            if len(self._waiting) >= self.config.max_queue_size + self.slots.available:
                raise BusyError(f"the request queue is full ({self.config.max_queue_size} waiting); retry later")
            self._waiting.append((req, emit, settings))
            self._lock.notify_all()

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancel.add(request_id)
            self._lock.notify_all()

    @classmethod
    def launch(cls, config: EngineConfig) -> "Engine":
        """Loads an engine in a new thread and runs its loop there; returns once loaded
        (a load error is raised here). One thread does all the torch work, from loading
        and calibration to every step: on CPU each thread that runs torch ops gets its
        own OpenMP pool, and a loop thread whose pool is not the only one runs the same
        matmuls 1.3-1.7x slower (measured on 2 cores: an EAGLE-2 step took 21 ms instead
        of 14 ms); on GPU the current device and stream are per thread too."""
        loaded = threading.Event()
        box: dict = {}

        def run() -> None:
            try:
                box["engine"] = engine = cls(config)
            except BaseException as e:  # handed to the caller below
                box["error"] = e
                loaded.set()
                return
            engine._thread = engine.owner
            freeze_loaded_objects()
            loaded.set()
            engine._loop()

        threading.Thread(target=run, name="specdec-engine", daemon=True).start()
        loaded.wait()
        if "error" in box:
            raise box["error"]
        return box["engine"]

    def shutdown(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            gc.unfreeze()  # what `launch` froze can be collected again once dropped
        for state in list(self._running):
            self._finish(state, [], "error", "the server is shutting down")
        while self._waiting:
            req, emit, _ = self._waiting.popleft()
            emit(StepOutput(req.request_id, [], [], True, "error", "the server is shutting down"))

    def generate(self, req: GenerationRequest) -> tuple[list[int], list[float], StepOutput]:
        """Runs one request to completion (in the loop thread if started, else here).
        Returns (output tokens, log-probs, last output)."""
        outs: list[StepOutput] = []
        done = threading.Event()

        def emit(o: StepOutput) -> None:
            outs.append(o)
            if o.finished:
                done.set()

        self.submit(req, emit)
        if self._thread is None:
            while not done.is_set():
                self.step()
        else:
            done.wait()
        return ([t for o in outs for t in o.token_ids], [p for o in outs for p in o.log_probs], outs[-1])

    @property
    def num_active(self) -> int:
        return len(self._running) + len(self._waiting)

    def load(self) -> EngineLoad:
        """A snapshot for load gauges; safe from any thread."""
        with self._lock:
            waiting = len(self._waiting)
        return EngineLoad(running=self.num_slots - self.slots.available, waiting=waiting, slots=self.num_slots,
                          slot_tokens=self.cache_positions, iterations=self.iterations, last_step=self.last_step)

    # -- the loop ------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self._waiting and not self._running:
                    self._lock.wait()
                if self._stop:
                    return
            try:
                self.step()
            except Exception as e:  # a bug must not hang clients: fail the batch, keep serving
                for state in list(self._running):
                    self._finish(state, [], "error", f"internal error: {type(e).__name__}: {e}")

    def step(self) -> None:
        """One iteration: admit newcomers, prefill (every admitted prompt, or with chunked
        prefill the next piece of a long one), then one decode/verify step of every
        request whose prompt is cached."""
        self._apply_cancellations()
        self._pack_slots()
        self._admit()
        # Mixed prefill: with requests to decode, this step's prompt pieces ride in the
        # verify forward (up to PREFILL_TOKENS); the rest are prefilled first, alone.
        # (A prefill forward run alone ends none of the requests already decoding.)
        mix = self.mixed_prefill and any(not s.prefilling for s in self._running)
        chunks, riders = self._prefill_pending(PREFILL_TOKENS if mix else 0)
        decoding = [s for s in self._running if not s.prefilling]  # (riders are still prefilling)
        if decoding:
            # By slot: consecutive slots let attention read the KV cache in place.
            self._decode(sorted(decoding, key=lambda s: s.slot), riders)
        self.iterations += 1
        self.last_step = StepLoad(len(chunks), sum(c.length for c in chunks), len(decoding), time.time())

    def _apply_cancellations(self) -> None:
        with self._lock:
            cancel, self._cancel = self._cancel, set()
            kept = collections.deque()
            for item in self._waiting:
                if item[0].request_id in cancel:
                    item[1](StepOutput(item[0].request_id, [], [], True, "cancelled"))
                else:
                    kept.append(item)
            self._waiting = kept
        for state in list(self._running):
            if state.req.request_id in cancel:
                self._finish(state, [], "cancelled")

    def _pack_slots(self) -> None:
        """Keeps the running requests in the lowest slots: each request above them moves
        into the lowest free slot (its cached positions copied, in the target's cache and
        its drafter's, `move_slot`), so a batch's slots are consecutive and attention
        reads its keys and values in place (`KVCache.read`) instead of gathering them at
        every layer (docs/DESIGN.md "KV cache layout"); a move copies one request's cache
        once."""
        n = len(self._running)
        for state in sorted(self._running, key=lambda s: s.slot, reverse=True):
            if state.slot < n:
                break
            to = self.slots.lowest_free  # below n: n requests hold n slots, and one is above n
            self.cache.move_slot(state.slot, to, state.cached_len)
            drafter = self.drafters.get(state.settings.method)
            if drafter is not None and state.draft is not None:
                drafter.move_slot(state, to)
            self.slots.move(state.slot, to)
            state.slot = to

    def _admit(self) -> None:
        """Takes waiting requests into free slots (their prompts are prefilled next)."""
        while self.slots.available:
            with self._lock:
                if not self._waiting:
                    break
                req, emit, settings = self._waiting.popleft()
            seed = req.sampling.seed
            if seed is None:
                seed = self._seeds.getrandbits(62)
            state = RequestState(req=req, emit=emit, slot=self.slots.take(), tokens=list(req.input_ids),
                                 prompt_len=len(req.input_ids), rng=RequestRng(seed), settings=settings,
                                 scheduled_ns=time.monotonic_ns())
            self._running.append(state)
            self.metrics.requests[settings.method] += 1

    def _prefill_pending(self, ride_tokens: int = 0) -> tuple[list[PrefillChunk], list[PrefillForward]]:
        """Prefills this step's chunks of the admitted prompts (`prefill.py`): whole
        prompts in groups that share a forward, a piece of a longer one alone. Forwards
        of up to `ride_tokens` padded tokens in all, oldest first, are only prepared:
        they ride in this step's verify forward (`_verify`). Returns the chunks and
        those forwards."""
        pending = [s for s in self._running if s.prefilling]  # oldest first
        if not pending:
            return [], []
        piece = self.config.prefill_chunk_tokens if self.config.enable_chunked_context else None
        chunks = prefill_chunks([(s.cached_len, s.prompt_len) for s in pending], piece)
        whole = [c for c in chunks if c.whole]
        forwards = [[whole[i] for i in group] for group in prefill_groups([c.length for c in whole])]
        forwards += [[c] for c in chunks if not c.whole]
        forwards.sort(key=lambda forward: min(c.index for c in forward))
        riders: list[PrefillForward] = []
        for forward in forwards:
            states = [pending[c.index] for c in forward]
            padded = len(forward) * max(c.length for c in forward)
            try:
                prepared = self._prefill_inputs(states, forward)
                if padded <= ride_tokens:
                    riders.append(prepared)
                    ride_tokens -= padded
                else:
                    self._run_prefill(prepared)
            except Exception as e:
                self._prefill_failed(states, e)
        return chunks, riders

    def _prefill_failed(self, states: list[RequestState], e: Exception) -> None:
        for state in states:
            self._finish(state, [], "error", f"internal error in prefill: {type(e).__name__}: {e}")

    def _run_prefill(self, forward: PrefillForward) -> None:
        """The prefill forward alone, then what it gives (`_prefill_outputs`)."""
        with torch.inference_mode():
            hidden, aux = self.target(forward.ids, forward.positions, self.cache, forward.batch, forward.aux_layers)
        self._prefill_outputs(forward, hidden, aux)

    def _prefill_inputs(self, states: list[RequestState], chunks: list[PrefillChunk]) -> PrefillForward:
        """The inputs on the device of one target forward over each request's chunk of
        prompt (after its `cached_len` cached tokens), padded to the longest (the
        padding's KV entries land past each piece, where the next piece or step
        overwrites them); a request whose chunk ends its prompt gets its first token from
        the chunk's last position. Only whole prompts share a forward, so padded rows all
        start at 0."""
        dev = self.device
        B, starts, lengths = len(states), [c.start for c in chunks], [c.length for c in chunks]
        L = max(lengths)
        pieces = [s.tokens[a: a + n] + [0] * (L - n) for s, a, n in zip(states, starts, lengths)]
        ids = to_device(pieces, dev)  # [B, L]
        drafters = [self.drafters.get(s.settings.method) for s in states]
        aux_layers = self.aux_layers if any(d is not None and d.needs_aux for d in drafters) else ()
        host_slots = [s.slot for s in states]
        # First tokens are due from every row (whole prompts) or none (a piece alone that does not end its prompt).
        assert all(c.last == chunks[0].last for c in chunks), chunks
        # [3, B]: slots, cached lengths, the pieces' last positions
        meta = to_device([host_slots, starts, [n - 1 for n in lengths]], dev)
        batch = AttentionBatch.build(meta[0], meta[1], causal_mask(B, L, dev), host_slots=host_slots,
                                     max_prefix=max(starts))
        positions = meta[1][:, None] + torch.arange(L, device=dev)[None]  # [B, L]
        return PrefillForward(states, chunks, ids, positions, batch, aux_layers, meta[2])

    def _prefill_outputs(self, forward: PrefillForward, hidden: torch.Tensor, aux: Optional[torch.Tensor]) -> None:
        """What a prefill forward's hidden states [B, L, H] (and aux) give: the drafters'
        prefill, the requests' cached lengths, prompt scores, first tokens."""
        states, chunks, dev = forward.states, forward.chunks, self.device
        B, starts, lengths = len(states), [c.start for c in chunks], [c.length for c in chunks]
        drafters = [self.drafters.get(s.settings.method) for s in states]
        ends_prompts = chunks[0].last
        with torch.inference_mode():
            for b, (s, drafter) in enumerate(zip(states, drafters)):
                s.cached_len = starts[b] + lengths[b]
                if drafter is not None:
                    n = lengths[b]
                    drafter.prefill(s, hidden[b, :n], aux[b, :n] if aux is not None else None, starts[b])
            # A piece scores the prompt tokens after each of its positions; the prompt's
            # last position has none after it.
            scored = {b: self._prompt_scores(s, hidden[b, : min(lengths[b], s.prompt_len - 1 - starts[b])],
                                             starts[b])
                      for b, s in enumerate(states) if s.req.return_prompt_log_probs}
            host, K = [], 0
            if ends_prompts:
                last = hidden[torch.arange(B, device=dev), forward.last_positions]  # [B, H]
                logits = self.target.logits(last[:, None])  # [B, 1, V]
                firsts = [self._first_token(s, logits[b: b + 1]) for b, s in enumerate(states)]
                # The prefill's one host sync: the first tokens are emitted from the host
                # (ids travel as float64, exact below 2**53, beside their log-probs), with
                # the K most likely ids and their log-probs where a request asked for
                # alternatives. A piece that ends no prompt needs none.
                K = max(s.req.top_log_probs for s in states)
                rows = []
                for token, logp, log_dist in firsts:
                    parts = [token.double()[None], logp.double()[None]]
                    if K:
                        top = log_dist.topk(K)
                        parts += [top.indices.double(), top.values.double()]
                    rows.append(torch.cat(parts))
                host = torch.stack(rows).tolist()  # [B, 2 + 2K]
            for b, scores in scored.items():  # asked for: one more transfer per such request
                self._add_prompt_scores(states[b], scores.tolist())
        for s, row in zip(states, host):
            top = [top_pairs(row[2:], K, s.req.top_log_probs)] if s.req.top_log_probs else None
            self._emit(s, [int(row[0])], [row[1]], top)

    @staticmethod
    def _add_prompt_scores(state: RequestState, rows: list[list[float]]) -> None:
        """Appends a piece's scored prompt positions (`_prompt_scores`' rows) to what the
        request's first output will carry."""
        k = state.req.top_log_probs
        if state.prompt_scores is None:
            state.prompt_scores = {"prompt_log_probs": [], "prompt_top_log_probs": []}
        state.prompt_scores["prompt_log_probs"] += [r[0] for r in rows]
        if k:
            state.prompt_scores["prompt_top_log_probs"] += [top_pairs(r[1:], k, k) for r in rows]

    def _prompt_scores(self, state: RequestState, hidden: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """hidden [P, H] at prompt positions offset..offset+P-1 -> [P, 1 + 2k] float64 on
        the device: the log-prob of the prompt token that follows each position under the
        target's own distribution (no sampling settings apply to a prompt), then the k
        most likely ids and their log-probs (k = top_log_probs). The LM head runs over
        `SCORE_CHUNK` positions at a time, so a long prompt never holds [L, V] logits."""
        following = to_device(state.tokens[offset + 1: offset + hidden.shape[0] + 1], self.device, torch.long)
        k = state.req.top_log_probs
        chunks = []
        for start in range(0, hidden.shape[0], SCORE_CHUNK):
            part = hidden[start: start + SCORE_CHUNK]
            log_dist = torch.log_softmax(self.target.logits(part[None])[0].float(), -1)  # [chunk, V]
            cols = [log_dist.gather(1, following[start: start + len(part), None]).double()]
            if k:
                top = log_dist.topk(k, dim=-1)
                cols += [top.indices.double(), top.values.double()]
            chunks.append(torch.cat(cols, dim=1))
        return torch.cat(chunks) if chunks else torch.zeros(0, 1 + 2 * k, dtype=torch.float64, device=self.device)

    @staticmethod
    def _path_alternatives(states: list[RequestState], log_dist: torch.Tensor, nodes: torch.Tensor, K: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """The K most likely ids and their log-probs after each path node, [B, N * K] each
        (float64), for the requests that asked (zeros for the others): log_dist [B, N, V],
        nodes [B, N] the accepted path (padded with 0). Only the asking rows are ranked."""
        B, N, _ = log_dist.shape
        asked = [b for b, s in enumerate(states) if s.req.top_log_probs]
        rows = log_dist if len(asked) == B else log_dist[to_device(asked, log_dist.device)]
        top = rows.topk(K, dim=-1)  # [B', N, K] after every node
        path = (nodes if len(asked) == B else nodes[to_device(asked, nodes.device)])[:, :, None].expand(-1, -1, K)
        ids, values = top.indices.gather(1, path), top.values.gather(1, path)  # [B', N, K] along the path
        if len(asked) == B:
            return ids.flatten(1).double(), values.flatten(1).double()
        full_ids = torch.zeros(B, N * K, dtype=torch.float64, device=log_dist.device)
        full_values = torch.zeros_like(full_ids)
        index = to_device(asked, log_dist.device)
        full_ids[index], full_values[index] = ids.flatten(1).double(), values.flatten(1).double()
        return full_ids, full_values

    def _first_token(self, state: RequestState, logits: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """First token after prefill, its log-prob (both 0-d) and the log of the
        distribution it was drawn from ([V]), on the device: logits [1, 1, V]."""
        row = LogitsRow(state.req, state.tokens, 0)
        processed = process_logits(logits, [row], torch.zeros(1, 1, dtype=torch.long, device=self.device))
        if state.req.sampling.greedy:
            token = greedy_tokens(processed[0, 0])
            log_dist = torch.log_softmax(processed[0, 0], -1)
            return token, log_dist[token], log_dist
        probs = probabilities(processed, sampling_tensors([row], self.device))[0]  # [1, V]
        token = sample_inverse_cdf(probs, host_to_device(state.rng.uniforms(1), self.device))[0]
        log_dist = torch.log(probs[0])
        return token, log_dist[token], log_dist

    def _decode(self, states: list[RequestState], riders: list[PrefillForward] = ()) -> None:
        """One decode/verify step of `states` (their prompts cached), with `riders`'
        prefill in its verify forward."""
        B = len(states)
        settings = self.policy.plan(states)
        trees: list[Optional[DraftTree]] = [None] * B
        groups: dict[tuple, list[int]] = collections.defaultdict(list)
        for i, (s, st) in enumerate(zip(states, settings)):
            room = self.max_context - s.cached_len  # KV positions left for this step's tree
            plain = needs_plain_steps(s.req) or room < 2
            if st.method == "none" and st.lookup_tokens and not plain:  # its tree is off; a copy is not
                trees[i] = self._copy_alone(s, min(st.lookup_tokens, room - 1))
            elif st.method == "none" or plain:
                trees[i] = DraftTree.root_only(s.tokens[-1])
            else:
                groups[self.policy.group_key(st) + (s.req.sampling.greedy,)].append(i)
        with torch.inference_mode():
            # A step that captured a CUDA graph (a bucket's first use) paid a one-time cost:
            # its times would teach the policy that trees cost tens of milliseconds.
            captures = self.graph_captures()[0]
            for idx in groups.values():
                method = settings[idx[0]].method
                t0 = time.perf_counter()
                proposed = self.drafters[method].propose([states[i] for i in idx], [settings[i] for i in idx])
                if self.graph_captures()[0] == captures:
                    self.policy.record_draft_time(settings[idx[0]], time.perf_counter() - t0,
                                                  [states[i] for i in idx])
                for i, tree in zip(idx, proposed):
                    room = self.max_context - states[i].cached_len
                    if settings[i].budget is not None:
                        room = min(room, settings[i].budget)
                    if tree.num_nodes > room:  # topological order: any prefix of nodes is a tree
                        tree = DraftTree(tree.tokens[:room], tree.parents[:room],
                                         None if tree.draft_probs is None else tree.draft_probs[:room])
                    if settings[i].lookup_tokens and tree.draft_probs is None:
                        tree = self._graft_lookup(states[i], tree, settings[i].lookup_tokens)
                    trees[i] = tree
            key_len = max(s.cached_len for s in states)
            t0 = time.perf_counter()
            self._verify(states, settings, trees, riders)  # ends with a host sync: the time includes the device work
            if self.graph_captures()[0] == captures and not riders:  # (a prefill's work is not the tree's)
                self.policy.record_verify_time(B, max(t.num_nodes for t in trees), key_len, time.perf_counter() - t0)

    @staticmethod
    def _offer_copy(state: RequestState, tokens: int) -> list[int]:
        """Up to `tokens` tokens prompt lookup copies from the request's own text
        (drafters/lookup.py), noted for the policy to learn how far it is taken."""
        if state.ngrams is None:
            state.ngrams = NgramIndex()
        state.copy_offered = state.ngrams.continuation(state.tokens, tokens)
        return state.copy_offered

    def _graft_lookup(self, state: RequestState, tree: DraftTree, tokens: int) -> DraftTree:
        """The request's tree with prompt lookup's branch grafted on: up to `tokens`
        tokens, within the tree's own node count, so the step's verify costs what the
        policy planned (docs/DESIGN.md, "Prompt lookup")."""
        chain = self._offer_copy(state, min(tokens, tree.num_nodes - 1))
        if not chain:
            return tree
        return graft(tree, to_device(chain, tree.tokens.device, torch.long))

    def _copy_alone(self, state: RequestState, tokens: int) -> DraftTree:
        """The tree of a step whose drafter is off but whose copy is on (the policy's
        `_copies_alone`): prompt lookup's copy of up to `tokens` tokens as a chain from
        the root; the root alone when nothing is on offer."""
        chain = self._offer_copy(state, tokens)
        if not chain:
            return DraftTree.root_only(state.tokens[-1])
        tree = to_device([[state.tokens[-1]] + chain, list(range(-1, len(chain)))], self.device, torch.long)  # [2, N]
        return DraftTree(tree[0], tree[1])

    def _verify(self, states: list[RequestState], settings: list[TreeSettings],
                trees: list[DraftTree], riders: list[PrefillForward] = ()) -> None:
        B, dev = len(states), self.device
        N = max(t.num_nodes for t in trees)
        if self.graphs is not None:
            N = self.graphs.padded_width(B, N)  # extra nodes are padding, as a smaller tree's are
        host_slots = [s.slot for s in states]
        # [4, B]: nodes, cached lengths, slots, roots: one transfer for the step's host values
        meta = to_device([[t.num_nodes for t in trees], [s.cached_len for s in states], host_slots,
                          [s.tokens[-1] for s in states]], dev)
        num_nodes, prefix, slots = meta[0], meta[1], meta[2]
        cand = torch.zeros(B, N, dtype=torch.long, device=dev)
        parents = torch.full((B, N), -1, dtype=torch.long, device=dev)
        cand[:, 0] = meta[3]  # every tree's root is its request's last token
        for b, t in enumerate(trees):
            if t.num_nodes > 1:
                cand[b, 1: t.num_nodes] = t.tokens[1:]
                parents[b, 1: t.num_nodes] = t.parents[1:]
        if N == 1:  # plain decoding for the whole batch: no tree to build, verify or compact
            tb = TreeBuffers(tree_mask=torch.ones(B, 1, 1, dtype=torch.bool, device=dev), positions=prefix[:, None],
                             depth=torch.zeros(B, 1, dtype=torch.long, device=dev), first_child=None,
                             next_sibling=None)
        else:
            tb = build_tree(parents, num_nodes, prefix)
        batch = AttentionBatch.build(slots, prefix, tb.tree_mask, host_slots=host_slots,
                                     max_prefix=max(s.cached_len for s in states))
        need_aux = any(self.drafters.get(st.method) is not None and self.drafters[st.method].needs_aux
                       for st in (s.settings for s in states))
        if riders:
            hidden, aux = self._forward_with_riders(cand, tb.positions, batch, need_aux, riders)
        else:
            hidden, aux = self.target_step(cand, tb.positions, batch, need_aux)
        rows = [LogitsRow(s.req, s.tokens, len(s.tokens) - s.prompt_len) for s in states]
        logits = process_logits(self.target.logits(hidden), rows, tb.depth)  # [B, N, V]

        accept_len = torch.zeros(B, dtype=torch.long, device=dev)
        accepted = torch.full((B, N), -1, dtype=torch.long, device=dev)
        accepted[:, 0].fill_(0)  # the root is on every path
        bonus = torch.zeros(B, dtype=torch.long, device=dev)
        # Log of the distribution each token was drawn from: only when someone asked for it.
        K = max(s.req.top_log_probs for s in states)  # alternatives per token, the most asked
        wanted = K > 0 or any(s.req.return_log_probs for s in states)
        log_dist = torch.empty_like(logits) if wanted else None
        greedy = [b for b, s in enumerate(states) if s.req.sampling.greedy]
        sampled = [b for b, s in enumerate(states) if not s.req.sampling.greedy]
        if greedy:
            g = to_device(greedy, dev)
            greedy_logits = logits if len(greedy) == B else logits[g]  # (a gather copies [G, N, V])
            argmax = greedy_tokens(greedy_logits)
            if N == 1:
                bonus[g] = argmax[:, 0]
            else:
                r = verify_greedy(cand[g], parents[g], num_nodes[g], argmax)
                accept_len[g], accepted[g], bonus[g] = r.accept_len, r.accepted_nodes, r.bonus_token
            if log_dist is not None:
                log_dist[g] = torch.log_softmax(greedy_logits, -1)
        # Requests whose drafter sampled its proposals pass draft_probs; the others were
        # proposed deterministically (top-k), which verification treats as one-hot.
        for with_q in (False, True):
            part = [b for b in sampled if (trees[b].draft_probs is not None) == with_q]
            if not part:
                continue
            p_idx = to_device(part, dev)
            probs = probabilities(logits[p_idx], sampling_tensors([rows[b] for b in part], dev))
            # Each request draws exactly one uniform per own node plus one for the bonus,
            # whatever the batch's padding: its random stream never depends on others.
            uniforms = torch.ones(len(part), N + 1)
            for j, b in enumerate(part):
                n = trees[b].num_nodes
                draws = states[b].rng.uniforms(n + 1)
                uniforms[j, :n], uniforms[j, N] = draws[:n], draws[n]
            uniforms = host_to_device(uniforms, dev)
            q = None
            if with_q:
                q = torch.zeros_like(probs)
                for j, b in enumerate(part):
                    q[j, : trees[b].num_nodes] = trees[b].draft_probs
            r = verify_sampling(cand[p_idx], parents[p_idx], num_nodes[p_idx], probs, q,
                                uniforms[:, :N].contiguous(), uniforms[:, N].contiguous())
            accept_len[p_idx], accepted[p_idx], bonus[p_idx] = r.accept_len, r.accepted_nodes, r.bonus_token
            if log_dist is not None:
                log_dist[p_idx] = torch.log(probs)
        if N > 1:
            kv_compact(self.cache.kv, slots, prefix, accepted, accept_len)

        result = torch.cat((accept_len[:, None], bonus[:, None], accepted, cand), dim=1)  # [B, 2 + 2N]
        if log_dist is not None:
            # Log-prob of each emitted token: after path node j comes the next path node's
            # token, after the last one the bonus token.
            nodes = accepted.clamp(min=0)  # [B, N]
            nxt = torch.cat((cand.gather(1, nodes[:, 1:]), bonus[:, None]), dim=1)  # [B, N]
            nxt = torch.where(torch.arange(N, device=dev)[None] >= accept_len[:, None], bonus[:, None], nxt)
            path_lp = log_dist[torch.arange(B, device=dev)[:, None], nodes, nxt]  # [B, N]
            result = torch.cat((result.double(), path_lp.double()), dim=1)  # ids exact in float64
            if K:  # the K most likely tokens after each path node: [B, N * K] ids, then log-probs
                result = torch.cat((result, *self._path_alternatives(states, log_dist, nodes, K)), dim=1)
        # The step's one necessary host sync: the accepted tokens are emitted from the host.
        host = result.tolist()
        if log_dist is not None:
            host = [[int(v) for v in row[: 2 + 2 * N]] + row[2 + 2 * N:] for row in host]
        accept_host = [row[0] for row in host]
        bonus_host = [row[1] for row in host]
        accepted_host = [row[2: 2 + N] for row in host]
        cand_host = [row[2 + N: 2 + 2 * N] for row in host]
        # Drafters update their state in one call each, before any request finishes.
        by_drafter: dict[int, list[int]] = collections.defaultdict(list)
        for b, s in enumerate(states):
            if self.drafters.get(s.settings.method) is not None:
                by_drafter[id(self.drafters[s.settings.method])].append(b)
        for rows in by_drafter.values():
            sel = None if len(rows) == B else to_device(rows, dev)
            pick = lambda t: t if sel is None or t is None else t[sel]  # noqa: E731
            self.drafters[states[rows[0]].settings.method].commit(
                [states[b] for b in rows],
                AcceptedBatch(nodes=pick(accepted), lengths=[accept_host[b] + 1 for b in rows], start=pick(prefix),
                              slots=pick(slots), hidden=pick(hidden), aux=pick(aux)))
        for b, s in enumerate(states):
            a = accept_host[b]
            nodes = accepted_host[b][: a + 1]
            new_tokens = [cand_host[b][n] for n in nodes[1:]] + [bonus_host[b]]
            log_probs = host[b][2 + 2 * N: 3 + 2 * N + a] if s.req.return_log_probs else []
            top = None
            if s.req.top_log_probs:
                ids, lps = host[b][2 + 3 * N: 2 + 3 * N + N * K], host[b][2 + 3 * N + N * K:]  # N * K each
                top = [top_pairs(ids[j * K: (j + 1) * K] + lps[j * K: (j + 1) * K], K, s.req.top_log_probs)
                       for j in range(a + 1)]
            drafted = trees[b].num_nodes - 1
            drafter_off = settings[b].method == "none"  # drafts, if any, were a copy verified alone
            self._count(s, drafted, a, copy_alone=drafter_off)
            s.cached_len += a + 1
            self._emit(s, new_tokens, log_probs, top)
            if not drafter_off:  # (a copy verified alone says nothing of the drafter)
                self.policy.observe(s, drafted, a, path=nodes[1:], copied=len(s.copy_offered))
            if s.copy_offered:
                self.policy.observe_copy(s, s.copy_offered, new_tokens[:-1])
                s.copy_offered = []

    def _forward_with_riders(self, ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, aux: bool,
                             riders: list[PrefillForward]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The verify forward (ids [B, N]) with the riders' prefill forwards as parts of it
        (`LlamaModel.forward_parts`): returns the verify's hidden states and aux; each
        rider's prefill is finished here (first tokens emitted)."""
        aux = aux or any(r.aux_layers for r in riders)
        parts = [(ids, positions, batch)] + [(r.ids, r.positions, r.batch) for r in riders]
        outs = self.target.forward_parts(parts, self.cache, self.aux_layers if aux else ())
        for rider, (hidden, rider_aux) in zip(riders, outs[1:]):
            try:
                self._prefill_outputs(rider, hidden, rider_aux)
            except Exception as e:
                self._prefill_failed(rider.states, e)
        return outs[0]

    def target_step(self, ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, aux: bool
                    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The target forward of a decode/verify step (ids [B, N]): through a CUDA
        graph when one covers the batch (graphs.py), else eagerly."""
        if self.graphs is not None and self.graphs.fits(*ids.shape):
            return self.graphs.forward(ids, positions, batch, aux)
        return self.target(ids, positions, self.cache, batch, self.aux_layers if aux else ())

    def _count(self, s: RequestState, drafted: int, accepted: int, copy_alone: bool) -> None:
        """A verify step's counts, per request and server-wide under the method whose
        drafts it verified: "none" without drafts, "prompt_lookup" for a copy verified
        alone (its drafter's tree was off), else the request's method."""
        st = s.stats
        st.total_draft_tokens += drafted
        st.total_accepted_draft_tokens += accepted
        st.target_forwards += 1
        st.emitted_tokens += accepted + 1
        m = self.metrics
        method = "none" if not drafted else "prompt_lookup" if copy_alone else s.settings.method
        m.draft_tokens[method] += drafted
        m.accepted_tokens[method] += accepted
        m.verify_steps[method] += 1
        m.emitted_tokens[method] += accepted + 1

    def _emit(self, state: RequestState, new_tokens: list[int], log_probs: list[float],
              top: Optional[list[list[tuple[int, float]]]] = None) -> None:
        """Sends the new tokens (cut at a stop word, the end token or the context), with
        their log-probs and `top` alternatives (one list per token) where asked."""
        new_tokens = new_tokens[: self.max_context - len(state.tokens)]  # prompt + output <= max_seq_len
        emitted, reason = cut_new_tokens(state.req, state.output, new_tokens)
        state.output += emitted
        state.tokens += new_tokens
        lps = log_probs[: len(emitted)] if state.req.return_log_probs else []
        tops = (top or [])[: len(emitted)] if state.req.top_log_probs else []
        state.cum_log_prob += sum(lps)
        if reason is None and len(state.tokens) >= self.max_context:
            reason = "length"  # the KV slot is full
        if reason is not None:
            self._finish(state, emitted, reason, log_probs=lps, top_log_probs=tops)
        else:
            prompt, state.prompt_scores = state.prompt_scores or {}, None
            state.emit(StepOutput(state.req.request_id, emitted, lps, False, None, None, state.stats,
                                  state.scheduled_ns, top_log_probs=tops, **prompt))

    def _finish(self, state: RequestState, tokens: list[int], reason: str, error: Optional[str] = None,
                log_probs: Optional[list[float]] = None,
                top_log_probs: Optional[list[list[tuple[int, float]]]] = None) -> None:
        if state.finished:
            return
        state.finished = True
        self._running.remove(state)
        self.slots.give_back(state.slot)
        drafter = self.drafters.get(state.settings.method)
        if drafter is not None and state.draft is not None:
            drafter.release(state)
        # (a request ended before its prompt was all scored, cancelled, sends none of the scores)
        prompt = {} if state.prefilling else state.prompt_scores or {}
        state.prompt_scores = None
        state.emit(StepOutput(state.req.request_id, tokens, log_probs or [], True, reason, error, state.stats,
                              state.scheduled_ns, top_log_probs=top_log_probs or [], **prompt))

