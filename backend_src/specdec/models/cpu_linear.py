"""Multi-row float32 matmuls on CPU through oneDNN, with the weight packed once.

On the CPU, speculative decoding lives or dies by how much more a forward over a few
tokens (a tree of 4-16 nodes, a drafting depth over top-k nodes) costs than over one.
PyTorch's float32 `linear` calls MKL's sgemm, which re-packs the whole weight matrix on
every call; for the few rows a decode step has, that packing is most of the work, and
on AMD EPYC (AVX2) MKL's sgemm for 2-16 rows ran 2-4x slower than its one-row gemv
(docs/DESIGN.md, "The step on a CPU"). oneDNN keeps the weight in its own blocked
layout, packed once: measured there, SmolLM2-135M's target forward over 8 tree tokens
took 82-88 ms instead of 95-101 ms, a batch of 4 single tokens 79-81 ms instead of
96-106 ms, and the LM head over 8 rows 14 ms instead of 23 ms.

One-row calls (plain decoding) stay on MKL's gemv, which was as fast or faster there.

Which path wins depends on the CPU: on a 2-core Intel Xeon with AVX-512, MKL's sgemm
took 2 rows for the price of one (target forward 32 ms against 31 ms for one token)
where oneDNN took 53 ms. So the engine measures both paths at load
(`choose_row_paths`: a model's own linears, in order, at each row count of
`ROW_LADDER`) and each model's multi-row calls take the faster one for their row
count (`RowRouting`); oneDNN must win by `ONEDNN_MARGIN`, so that a tie keeps the path
that needs no second copy of the weights. `SPECDEC_CPU_ONEDNN=0` keeps every call on
`F.linear`, `=1` sends every multi-row call to oneDNN without measuring.

Results equal `F.linear` up to float32 rounding (another summation order), so a tree's
logits can differ from plain decoding's in the last bits, as MKL's own gemm and gemv
already do; the engine's exact-equality tests run in float64, which stays on `F.linear`.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


ROW_LADDER = (2, 3, 4, 6, 8, 12, 16, 32, 64)  # row counts timed at load; more rows take 64's path
ONEDNN_MARGIN = 0.10  # oneDNN is chosen for a row count only where it is this much faster


@dataclasses.dataclass(frozen=True)
class RowRouting:
    """Which path a module's multi-row calls take, by row count: oneDNN at the ladder's
    row counts in `onednn_rows`, `F.linear` (MKL's sgemm) at the others. A row count
    between two ladder steps takes the path of the next step up."""

    onednn_rows: frozenset[int]
    timings_ms: tuple[tuple[int, float, float], ...] = ()  # (rows, F.linear ms, oneDNN ms) per ladder step

    def use_onednn(self, rows: int) -> bool:
        step = next((r for r in ROW_LADDER if r >= rows), ROW_LADDER[-1])
        return step in self.onednn_rows

    def describe(self) -> str:
        chosen = sorted(self.onednn_rows)
        if not chosen:
            return "F.linear at every row count"
        if len(chosen) == len(ROW_LADDER):
            return "oneDNN at every row count"
        return "oneDNN at " + ",".join(map(str, chosen)) + " rows, F.linear at the others"


ALWAYS_ONEDNN = RowRouting(frozenset(ROW_LADDER))


class PackedCpuLinear(nn.Linear):
    """An `nn.Linear` (same parameters, same state-dict names) whose multi-row calls go
    through oneDNN with a packed copy of the weight, made at the first such call, where
    its `routing` says oneDNN is faster. Only modules that take such calls pay the
    copy's memory."""

    _packed: Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]
    routing: RowRouting

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, self.in_features)
        if (rows <= 1 or x.dtype != torch.float32 or torch.is_grad_enabled()
                or not self.routing.use_onednn(rows)):
            return F.linear(x, self.weight, self.bias)
        return self._onednn(x, rows)

    def _onednn(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        if self._packed is None:
            bias = None if self.bias is None else self.bias.detach().to_mkldnn()
            self._packed = (self.weight.detach().to_mkldnn(), bias)
        weight, bias = self._packed
        flat = x.reshape(rows, self.in_features).contiguous().to_mkldnn()  # [rows, in]
        out = torch._C._nn.mkldnn_linear(flat, weight, bias).to_dense()  # [rows, out]
        return out.reshape(*x.shape[:-1], self.out_features)


def onednn_available() -> bool:
    """oneDNN is in this torch build and not turned off (SPECDEC_CPU_ONEDNN=0)."""
    return torch.backends.mkldnn.is_available() and os.environ.get("SPECDEC_CPU_ONEDNN", "auto") != "0"


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
            sub.routing = ALWAYS_ONEDNN
            count += 1
    return count


def packed_layers(module: nn.Module) -> list[PackedCpuLinear]:
    """The `PackedCpuLinear`s under `module`, in module order."""
    return [m for m in module.modules() if isinstance(m, PackedCpuLinear)]


def choose_row_paths(layers: list[PackedCpuLinear], max_rows: int = ROW_LADDER[-1],
                     repeats: int = 3) -> Optional[RowRouting]:
    """Times `layers` in order (as a forward streams their weights) through `F.linear`
    and through oneDNN at each ladder row count up to `max_rows` (`_time_paths`), and
    routes their multi-row calls to the faster path (`route`). None (routing left as it
    is) when there is nothing to time or SPECDEC_CPU_ONEDNN=1 asks for oneDNN throughout."""
    if not measuring_wanted(layers):
        return None
    timed = _called(layers)
    chosen, timings = set(), []
    with torch.inference_mode():
        for rows in [r for r in ROW_LADDER if r <= max(2, max_rows)]:
            plain_ms, onednn_ms = _time_paths(timed, rows, repeats)
            timings.append((rows, round(plain_ms, 2), round(onednn_ms, 2)))
            if onednn_ms < (1 - ONEDNN_MARGIN) * plain_ms:
                chosen.add(rows)
    if timings:  # row counts past the ones timed take the last one's path
        last = timings[-1][0]
        chosen |= {r for r in ROW_LADDER if r > last and last in chosen}
    routing = RowRouting(frozenset(chosen), tuple(timings))
    route(layers, routing)
    return routing


def measuring_wanted(layers: list[PackedCpuLinear]) -> bool:
    """There are layers to route and SPECDEC_CPU_ONEDNN does not fix their path."""
    return bool(layers) and os.environ.get("SPECDEC_CPU_ONEDNN", "auto") != "1"


def route(layers: list[PackedCpuLinear], routing: RowRouting) -> None:
    """Sends `layers`' multi-row calls the way `routing` says; packed copies that no
    chosen path uses are dropped."""
    for m in layers:
        m.routing = routing
        if not routing.onednn_rows:
            m._packed = None


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


def _time_paths(layers: list[PackedCpuLinear], rows: int, repeats: int) -> tuple[float, float]:
    """Milliseconds of one pass over `layers` with `rows`-row inputs: (F.linear, oneDNN),
    the fastest of `repeats` passes each after an untimed one. The paths take turns, so
    that other work on the machine (a server loads its other models meanwhile) slows
    both alike rather than one."""
    inputs = [torch.randn(rows, m.in_features) for m in layers]  # [rows, in] each
    paths = (lambda: [F.linear(x, m.weight, m.bias) for m, x in zip(layers, inputs)],
             lambda: [m._onednn(x, rows) for m, x in zip(layers, inputs)])
    best = [float("inf"), float("inf")]
    for attempt in range(max(1, repeats) + 1):
        for k, run in enumerate(paths):
            t0 = time.perf_counter()
            run()
            if attempt > 0:  # the first pass of each packs weights and warms caches
                best[k] = min(best[k], time.perf_counter() - t0)
    return best[0] * 1e3, best[1] * 1e3
