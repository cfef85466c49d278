"""Float32 matmuls on CPU: MKL's sgemm (or gemv), oneDNN, MKL's packed gemm or a streamed kernel, by row count.

On the CPU, speculative decoding lives or dies by how much more a forward over a few
tokens (a tree of 4-16 nodes, a drafting depth over top-k nodes) costs than over one.
PyTorch's float32 `linear` calls MKL's sgemm, which re-packs the whole weight matrix on
every call; for the few rows a decode step has, that packing is most of the work. Two
other paths keep the weight packed once:
- oneDNN, with the weight in its own blocked layout (one copy for every row count),
  laid out by `torch.ops.mkldnn._reorder_linear_weight` for `ONEDNN_PACK_ROWS` rows and
  called through `torch.ops.mkldnn._linear_pointwise` on the dense input (what
  `torch.compile` does for CPU linears). The layout matters more than anything else
  here: on a 2-core AMD EPYC (Zen 4), SmolLM2-135M's linears over 1, 3, 8 and 16 rows
  took 13.1-13.8, 16.0-16.2, 15.9-16.8 and 19.0-20.7 ms with a weight laid out for any
  row count from 2 to 64, against 16.6, 20.5, 23.5 and 27.9 ms with `to_mkldnn()`'s
  plain layout, and 18.9, 22.2, 31.4 and 36.0 ms with the input and output converted to
  and from oneDNN tensors as well, as the engine did before
  (docs/bench/cpu_linear_layouts.md). A layout for one row was as slow as the plain
  one. Torch builds without these two ops take the older path: `to_mkldnn()` copies
  and `mkldnn_linear`.
- MKL's packed gemm (`cblas_sgemm_pack`, what `torch.compile` uses for CPU linears):
  a copy of the weight packed for one row count, which serves calls of up to that many
  rows (fewer are padded with zero rows). On a 2-core Xeon with AVX-512, timed at one
  load, the target's linears over 4 rows took 32 ms instead of sgemm's 45, over 8 rows
  36 instead of 56, over 16 rows 45 instead of 60 (docs/bench/row_routing_smollm2_target.json).

- A kernel of this repository (kernels/cpu_streamed_linear.cpp, built at the first load
  on a machine: `cpu_streamed.py`), which reads each weight row once and applies every
  input row to it while it is in L1, on the weight as it is (no copy). On a 2-core Xeon
  with AVX-512, one load timed the target's linears over 4, 8 and 16 rows at 45, 63 and
  75 ms through it, 47, 63 and 74 through oneDNN, 42, 59 and 68 through MKL packs of
  those row counts and 58, 78 and 87 through sgemm
  (docs/bench/row_routing_smollm2_target_streamed.json): as fast as the copies, without
  them, so it took those row counts and MKL's packs only 32 and 64.

One-row calls (plain decoding at batch 1, a drafter's single-row forwards) are routed
the same way: `F.linear` calls MKL's gemv there, which on an Intel Xeon is as fast as
the others, while on AMD EPYC, timed by `choose_row_paths` at one load, the target's
linears over one row took 32.3 ms through it, 25.9 through an MKL pack and 15.3 through
oneDNN (over 3, 8 and 16 rows: 71.2, 41.1 and 48.7 ms through sgemm, 16.7, 17.9 and 20.9
through oneDNN). Plain decoding at batch 1 on that VM went from about 25 tokens/s to 36
with one-row calls routed to the older oneDNN path, and to 42-47 with the layout above
(docs/benchmarks.md, sections 1.16 and 1.17).

Which path wins depends on the CPU and the row count, so the engine measures all four
at load (`choose_row_paths`: a model's own linears, in order, at each row count of
`ROW_LADDER`) and each model's calls take the path chosen for their row count
(`RowRouting`, chosen by `plan_paths`). A path that needs a copy of the weights must
win by `COPY_MARGIN` over the faster of sgemm and the streamed kernel, which need none;
MKL packs, one copy each, are at most `SPECDEC_CPU_MKL_PACKS` (default `MAX_MKL_PACKS`) per model.
`SPECDEC_CPU_ONEDNN=0` keeps every call on `F.linear`, `=1` sends every call to oneDNN
without measuring; `SPECDEC_CPU_STREAMED=0` leaves the streamed kernel out.

Results equal `F.linear` up to float32 rounding (another summation order), so a tree's
logits can differ from plain decoding's in the last bits, as MKL's own gemm and gemv
already do; the engine's exact-equality tests run in float64, which stays on `F.linear`.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import time
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import cpu_streamed

ROW_LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)  # row counts timed at load; more rows take 64's path
COPY_MARGIN = 0.10  # a path that keeps a copy of the weights is chosen only where it is this much faster
MAX_MKL_PACKS = 3  # MKL packs (a copy of the weights each) per model, unless SPECDEC_CPU_MKL_PACKS says otherwise
ONEDNN_PACK_ROWS = 16  # the row count oneDNN's copy of a weight is laid out for (module docstring)
# (rows, F.linear ms, oneDNN ms, MKL packed ms, streamed ms; inf: not timed)
Timing = tuple[int, float, float, float, float]


# this torch build can lay a weight out for ONEDNN_PACK_ROWS rows and call it on dense inputs
_ONEDNN_PREPACKED = all(hasattr(torch.ops.mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise"))


def _step(rows: int) -> int:
    """The ladder step whose path `rows` rows take: the next one up, or the last."""
    return next((r for r in ROW_LADDER if r >= rows), ROW_LADDER[-1])


@dataclasses.dataclass(frozen=True)
class RowRouting:
    """Which path a module's calls take, by row count. A row count takes the
    path of the next ladder step up (`_step`): oneDNN at the steps in `onednn_rows`;
    MKL's packed gemm at the steps of `packs`, each with the pack made for a row count
    at least its own (a call with fewer rows is padded up to it); the streamed kernel at
    the steps in `streamed_rows`; `F.linear` (MKL's sgemm) at the others, and for more
    rows than a pack holds."""

    onednn_rows: frozenset[int]
    packs: tuple[tuple[int, int], ...] = ()  # (ladder step, the row count of the MKL pack it uses)
    timings_ms: tuple[Timing, ...] = ()  # per ladder step timed
    streamed_rows: frozenset[int] = frozenset()

    def onednn(self, rows: int) -> bool:
        return _step(rows) in self.onednn_rows

    def streamed(self, rows: int) -> bool:
        """Never past the ladder: a prompt's hundreds of rows are not a decode step's few."""
        return rows <= ROW_LADDER[-1] and _step(rows) in self.streamed_rows

    def pack_rows(self, rows: int) -> Optional[int]:
        """The row count of the MKL pack a `rows`-row call uses, or None."""
        size = dict(self.packs).get(_step(rows))
        return size if size is not None and size >= rows else None

    def pack_sizes(self) -> list[int]:
        return sorted({size for _, size in self.packs})

    def describe(self) -> str:
        parts = []
        if self.packs:
            padded = [f"{step} to {size}" for step, size in self.packs if step != size]
            parts.append("MKL packed at " + ",".join(map(str, self.pack_sizes())) + " rows"
                         + (f" ({', '.join(padded)} padded)" if padded else ""))
        for name, rows in (("oneDNN", self.onednn_rows), ("streamed", self.streamed_rows)):
            if rows:
                parts.append(f"{name} at " + ("every row count" if len(rows) == len(ROW_LADDER)
                                              else ",".join(map(str, sorted(rows))) + " rows"))
        if not parts:
            return "F.linear at every row count"
        if len(self.onednn_rows) + len(self.packs) + len(self.streamed_rows) < len(ROW_LADDER):
            parts.append("F.linear at the others")
        return ", ".join(parts)


ALWAYS_ONEDNN = RowRouting(frozenset(ROW_LADDER))


def plan_paths(timings: list[Timing], max_packs: int) -> RowRouting:
    """The routing that the timings make fastest. The paths without a copy of the
    weights come first: at each ladder step the faster of `F.linear` and the streamed
    kernel. Every ladder step counts alike, by the share of that time it saves. Of the
    sets of at most `max_packs` MKL packs, the one that saves most (the fewest packs on a
    tie): each step takes the cheapest pack at least its size, padded, where it beats the
    copy-free time by `COPY_MARGIN`. Then oneDNN takes the steps it beats that by
    `COPY_MARGIN` too. The streamed kernel keeps the steps where it is the faster
    copy-free path and neither copy took them."""
    copy_free = {rows: min(plain_ms, streamed_ms) for rows, plain_ms, _, _, streamed_ms in timings}
    packed = {rows: ms for rows, _, _, ms, _ in timings if ms < float("inf")}

    def choice(packs: tuple[int, ...]) -> dict[int, int]:
        """ladder step -> the pack it takes, under the packs `packs`"""
        out = {}
        for rows in copy_free:
            fits = [p for p in packs if p >= rows]
            best = min(fits, key=lambda p: packed[p], default=None)
            if best is not None and packed[best] < (1 - COPY_MARGIN) * copy_free[rows]:
                out[rows] = best
        return out

    def cost(packs: tuple[int, ...]) -> float:
        taken = choice(packs)
        # a step whose F.linear time rounds to 0 ms (a tiny layer) counts as saving nothing
        return sum((packed[taken[r]] / copy_free[r] if r in taken else 1.0) for r in copy_free)

    candidates = sorted(packed)
    subsets = [c for k in range(0, max(0, max_packs) + 1) for c in itertools.combinations(candidates, k)]
    best = min(subsets, key=lambda packs: (round(cost(packs), 9), len(packs)))
    taken = choice(best)
    onednn = frozenset(rows for rows, _, onednn_ms, _, _ in timings
                       if onednn_ms < (1 - COPY_MARGIN) * (packed[taken[rows]] if rows in taken else copy_free[rows]))
    packs = tuple(sorted((rows, size) for rows, size in taken.items() if rows not in onednn))
    streamed = frozenset(rows for rows, plain_ms, _, _, streamed_ms in timings
                         if streamed_ms < plain_ms and rows not in onednn and rows not in taken)
    return RowRouting(onednn, packs, tuple(timings), streamed)


class PackedCpuLinear(nn.Linear):
    """An `nn.Linear` (same parameters, same state-dict names) whose calls go through
    oneDNN, MKL's packed gemm or the streamed kernel, with packed copies of the weight
    made at the first call that needs each, where its `routing` says so (float32,
    without autograd). Only modules that take such calls pay the copies' memory."""

    _packed: Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]  # oneDNN's copy (weight, bias)
    _mkl_packs: dict[int, torch.Tensor]  # row count -> MKL's packed copy of the weight
    _streamable: bool  # the streamed kernel takes this weight as it is (cpu_streamed.eligible)
    _streamed: Optional[Any]  # the streamed kernel, set by `route` where the routing uses it and it takes the weight
    _streamed_weight: Optional[cpu_streamed.KernelWeight]  # what the kernel reads (compact_weight), made at first use
    routing: RowRouting

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, self.in_features)
        if rows < 1 or x.dtype != torch.float32 or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        if self.routing.onednn(rows):
            return self._onednn(x, rows)
        size = self.routing.pack_rows(rows)
        if size is not None:
            return self._mkl_packed(x, rows, size)
        if self._streamed is not None and self.routing.streamed(rows):
            return cpu_streamed.streamed_linear(self._streamed, x, self._kernel_weight(), self.bias)
        return F.linear(x, self.weight, self.bias)

    def _kernel_weight(self) -> cpu_streamed.KernelWeight:
        """What the streamed kernel reads: an exact compact copy of the weight where it has
        one (4-bit or int8 blocks, float16 or bfloat16: `cpu_streamed.compact_weight`), else the
        weight itself; made at the first call, so only modules that take the kernel pay
        its memory."""
        if self._streamed_weight is None:
            self._streamed_weight = cpu_streamed.compact_weight(self.weight.detach())
        return self._streamed_weight

    def _onednn(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        if _ONEDNN_PREPACKED:
            if self._packed is None:
                weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), ONEDNN_PACK_ROWS)
                self._packed = (weight, None if self.bias is None else self.bias.detach())
            weight, bias = self._packed
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")  # [..., out]
        if self._packed is None:
            bias = None if self.bias is None else self.bias.detach().to_mkldnn()
            self._packed = (self.weight.detach().to_mkldnn(), bias)
        weight, bias = self._packed
        flat = x.reshape(rows, self.in_features).contiguous().to_mkldnn()  # [rows, in]
        out = torch._C._nn.mkldnn_linear(flat, weight, bias).to_dense()  # [rows, out]
        return out.reshape(*x.shape[:-1], self.out_features)

    def _mkl_packed(self, x: torch.Tensor, rows: int, size: int) -> torch.Tensor:
        """x @ weight.T + bias through the MKL pack made for `size` >= `rows` rows."""
        pack = self._mkl_packs.get(size)
        if pack is None:
            pack = self._mkl_packs[size] = torch.ops.mkl._mkl_reorder_linear_weight(self.weight.detach(), size)
        flat = x.reshape(rows, self.in_features)  # [rows, in]
        if rows < size:  # the pack is fast at its own row count only: pad with zero rows
            flat = torch.cat([flat, flat.new_zeros(size - rows, self.in_features)])
        out = torch.ops.mkl._mkl_linear(flat.contiguous(), pack, self.weight, self.bias, size)[:rows]  # [rows, out]
        return out.reshape(*x.shape[:-1], self.out_features)


def onednn_available() -> bool:
    """oneDNN is in this torch build and not turned off (SPECDEC_CPU_ONEDNN=0)."""
    return torch.backends.mkldnn.is_available() and os.environ.get("SPECDEC_CPU_ONEDNN", "auto") != "0"


def mkl_packs_allowed() -> int:
    """How many MKL packs a model may keep: 0 when this torch build has no MKL, else
    SPECDEC_CPU_MKL_PACKS (default `MAX_MKL_PACKS`)."""
    if not (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")):
        return 0
    value = os.environ.get("SPECDEC_CPU_MKL_PACKS", str(MAX_MKL_PACKS))
    try:
        return max(0, int(value))
    except ValueError:
        raise ValueError(f"SPECDEC_CPU_MKL_PACKS must be a whole number of packs, got {value!r}") from None


def use_packed_cpu_linears(module: nn.Module) -> int:
    """Turns every float32 CPU `nn.Linear` under `module` into a `PackedCpuLinear` in
    place (parameters, and weights shared with other modules, stay as they are).
    Returns how many were turned; 0 when oneDNN is not available."""
    if not onednn_available():
        return 0
    count = 0
    for sub in module.modules():
        if type(sub) is nn.Linear and sub.weight.device.type == "cpu" and sub.weight.dtype == torch.float32:
            sub.__class__ = PackedCpuLinear
            sub._packed = None
            sub._mkl_packs = {}
            sub._streamable = cpu_streamed.eligible(sub.weight)
            sub._streamed = None
            sub._streamed_weight = None
            sub.routing = ALWAYS_ONEDNN
            count += 1
    return count


def packed_layers(module: nn.Module) -> list[PackedCpuLinear]:
    """The `PackedCpuLinear`s under `module`, in module order."""
    return [m for m in module.modules() if isinstance(m, PackedCpuLinear)]


def choose_row_paths(layers: list[PackedCpuLinear], max_rows: int = ROW_LADDER[-1],
                     repeats: int = 3) -> Optional[RowRouting]:
    """Times `layers` in order (as a forward streams their weights) through `F.linear`,
    oneDNN, MKL's packed gemm and the streamed kernel at each ladder row count up to `max_rows`
    (`_time_paths`), and routes their calls as `plan_paths` chooses. None
    (routing left as it is) when there is nothing to time or SPECDEC_CPU_ONEDNN=1 asks
    for oneDNN throughout."""
    if not measuring_wanted(layers):
        return None
    timed = _called(layers)
    max_packs = mkl_packs_allowed()
    streamed = streamed_kernel_for(timed)
    timings = []
    with torch.inference_mode():
        for rows in [r for r in ROW_LADDER if r <= max(2, max_rows)]:
            times = _time_paths(timed, rows, repeats, mkl=max_packs > 0, streamed=streamed)
            timings.append((rows, *(round(ms, 2) for ms in times)))
    routing = plan_paths(timings, max_packs)
    last = timings[-1][0]  # row counts past the ones timed take the last one's path (a pack holds too few)
    if last in routing.onednn_rows:
        routing = dataclasses.replace(routing, onednn_rows=routing.onednn_rows | {r for r in ROW_LADDER if r > last})
    route(layers, routing)
    return routing


def streamed_kernel_for(layers: list[PackedCpuLinear]) -> Optional[Any]:
    """The streamed kernel, when it is built and takes every one of `layers`' weights
    as it is; else None (the routing leaves it out)."""
    if not layers or not all(m._streamable for m in layers):
        return None
    return cpu_streamed.streamed_kernel()


def measuring_wanted(layers: list[PackedCpuLinear]) -> bool:
    """There are layers to route and SPECDEC_CPU_ONEDNN does not fix their path."""
    return bool(layers) and os.environ.get("SPECDEC_CPU_ONEDNN", "auto") != "1"


def route(layers: list[PackedCpuLinear], routing: RowRouting) -> None:
    """Sends `layers`' calls the way `routing` says; packed copies that no
    chosen path uses are dropped. The streamed kernel is looked up here, once, not at
    every call."""
    sizes = set(routing.pack_sizes())
    kernel = cpu_streamed.streamed_kernel() if routing.streamed_rows else None
    for m in layers:
        m.routing = routing
        m._streamed = kernel if m._streamable else None
        if m._streamed is None:
            m._streamed_weight = None  # a compact copy the timing made, which no call reads
        if not routing.onednn_rows:
            m._packed = None
        m._mkl_packs = {size: pack for size, pack in m._mkl_packs.items() if size in sizes}


def layer_shapes(layers: list[PackedCpuLinear]) -> list[list[int]]:
    """[in, out, has bias] of each layer a forward calls, in order: what the timings of
    `choose_row_paths` depend on besides the machine."""
    return [[m.in_features, m.out_features, int(m.bias is not None)] for m in _called(layers)]


def _called(layers: list[PackedCpuLinear]) -> list[PackedCpuLinear]:
    """The layers a forward calls: without the parts of a fused projection (q/k/v, gate/up:
    `layers._fused_linear`), whose weights are slices of the fused one's."""
    largest: dict[int, int] = {}
    for m in layers:
        key = m.weight.untyped_storage().data_ptr()
        largest[key] = max(largest.get(key, 0), m.weight.numel())
    return [m for m in layers if m.weight.numel() == largest[m.weight.untyped_storage().data_ptr()]]


def time_routed(layers: list[PackedCpuLinear], rows: int, repeats: int) -> tuple[float, float]:
    """Milliseconds of one pass over `layers` (those a forward calls, `_called`) with
    `rows`-row inputs: through the routing they have (a pack it needs is made in the
    untimed pass), and through the faster of the two paths that need no copy (`F.linear`,
    and the streamed kernel where it takes them); the fastest of `repeats` passes each
    after an untimed one, taking turns. Every path is timed through the layers' own calls,
    so each pays the same per-call cost. The layers keep their routing after. What
    `routing_cache` checks a saved routing with."""
    inputs = [torch.randn(rows, m.in_features) for m in layers]  # [rows, in] each
    kernel = streamed_kernel_for(layers)
    own = [(m.routing, m._streamed) for m in layers]
    copy_free = [RowRouting(frozenset())]  # F.linear at every row count
    if kernel is not None:
        copy_free.append(RowRouting(frozenset(), streamed_rows=frozenset(ROW_LADDER)))
    routings = [None] + copy_free  # None: the layers' own

    def take(k: int) -> None:
        for m, (routed, routed_kernel) in zip(layers, own):
            m.routing, m._streamed = ((routed, routed_kernel) if routings[k] is None else
                                      (routings[k], kernel if routings[k].streamed_rows else None))

    def run() -> None:
        for m, x in zip(layers, inputs):
            m(x)
    try:
        with torch.inference_mode():
            best = _fastest_passes([run] * len(routings), repeats, before=take)
    finally:
        take(0)
        for m, (_, routed_kernel) in zip(layers, own):
            if routed_kernel is None:
                m._streamed_weight = None  # a compact copy only the timing read
    return best[0] * 1e3, min(best[1:]) * 1e3


def _fastest_passes(paths: list[Optional[Callable[[], Any]]], repeats: int,
                    before: Optional[Callable[[int], None]] = None) -> list[float]:
    """Seconds of the fastest of `repeats` timed passes of each path (None: not timed,
    inf), after an untimed first pass of each (it makes packs and warms caches); the
    paths take turns, so that other work on the machine slows them alike rather than one.
    `before(k)`, when given, runs untimed before each pass of path k."""
    best = [float("inf")] * len(paths)
    for attempt in range(max(1, repeats) + 1):
        for k, run in enumerate(paths):
            if run is None:
                continue
            if before is not None:
                before(k)
            t0 = time.perf_counter()
            run()
            if attempt > 0:
                best[k] = min(best[k], time.perf_counter() - t0)
    return best


def _time_paths(layers: list[PackedCpuLinear], rows: int, repeats: int, mkl: bool = True,
                streamed: Optional[Any] = None) -> tuple[float, float, float, float]:
    """Milliseconds of one pass over `layers` with `rows`-row inputs: (F.linear, oneDNN,
    MKL packed for `rows` rows (inf when `mkl` is false), the `streamed` kernel (inf
    without one)), the fastest of `repeats` passes each after an untimed one. The paths
    take turns, so that other work on the machine (a server loads its other models
    meanwhile) slows them alike rather than one. The MKL packs made here are dropped
    after."""
    inputs = [torch.randn(rows, m.in_features) for m in layers]  # [rows, in] each
    paths = [lambda: [F.linear(x, m.weight, m.bias) for m, x in zip(layers, inputs)],
             lambda: [m._onednn(x, rows) for m, x in zip(layers, inputs)]]
    paths.append((lambda: [m._mkl_packed(x, rows, rows) for m, x in zip(layers, inputs)]) if mkl else None)
    if streamed is not None:
        paths.append(lambda: [cpu_streamed.streamed_linear(streamed, x, m._kernel_weight(), m.bias)
                              for m, x in zip(layers, inputs)])
    paths += [None] * (4 - len(paths))  # no streamed kernel: not timed
    had = [set(m._mkl_packs) for m in layers]
    try:
        best = _fastest_passes(paths, repeats)
    finally:
        for m, keep in zip(layers, had):
            m._mkl_packs = {size: pack for size, pack in m._mkl_packs.items() if size in keep}
    return best[0] * 1e3, best[1] * 1e3, best[2] * 1e3, best[3] * 1e3
