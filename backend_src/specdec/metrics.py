"""Engine counters → the increments of Triton custom metrics, without Triton.

Owns the names, descriptions and labels of the counters that the `speculative_decoding`
adapter exports on Triton's metrics port, and the bookkeeping that turns the engine's
cumulative `EngineMetrics` (server-wide, per method) into increments since the last
export. The adapter only creates `pb_utils.MetricFamily` counters from `COUNTERS` and
applies what `CounterExport.increments` returns. Also the load gauges, in TensorRT-LLM's
names (`GAUGES`, `gauge_values`), which the adapter sets from `Engine.load()`.

Derived figures (docs/DESIGN.md, "Metrics"), over any interval, per method:

    τ (tau)          = emitted_tokens / verify_steps     tokens per target forward
    acceptance rate  = accepted_draft_tokens / draft_tokens

A verify step that carried no draft tokens (plain decoding, or a speculative request
whose tree was cut to its root) counts under method "none", one that verified prompt
lookup's copy alone under "prompt_lookup"; `requests` counts each
request under the method it asked for (or the model's default).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # only for annotations: this module needs neither torch nor the engine
    from .engine import EngineLoad, EngineMetrics

TAU = "τ = emitted_tokens / verify_steps"
ACCEPTANCE = "acceptance rate = accepted_draft_tokens / draft_tokens"


@dataclass(frozen=True)
class CounterSpec:
    field: str  # the EngineMetrics counter
    name: str  # the metric family on Triton's metrics port
    description: str


COUNTERS = (
    CounterSpec("draft_tokens", "specdec_draft_tokens_total",
                f"Draft tokens proposed and verified by the target, per method ({ACCEPTANCE})"),
    CounterSpec("accepted_tokens", "specdec_accepted_draft_tokens_total",
                f"Draft tokens accepted by verification, per method ({ACCEPTANCE})"),
    CounterSpec("verify_steps", "specdec_verify_steps_total",
                f"Target forwards that verified a request's tree (prefill excluded), per method ({TAU})"),
    CounterSpec("emitted_tokens", "specdec_emitted_tokens_total",
                f"Tokens emitted by verify steps, accepted drafts + 1 bonus each, per method ({TAU})"),
    CounterSpec("requests", "specdec_requests_total", "Requests admitted to the engine, per requested method"),
)


@dataclass(frozen=True)
class GaugeSpec:
    name: str  # the metric family: TensorRT-LLM's backend's name
    label: str  # the label that tells its values apart
    description: str


# The load gauges TensorRT-LLM's Triton backend exports, under its names and labels, so
# that dashboards and autoscalers built on them read this engine too. Its "block" is a
# request's KV slot here (one per request, as many positions as the longest request).
GAUGES = (
    GaugeSpec("nv_trt_llm_request_metrics", "request_type", "TRT LLM request metrics"),
    GaugeSpec("nv_trt_llm_kv_cache_block_metrics", "kv_cache_block_type", "TRT LLM KV cache block metrics"),
    GaugeSpec("nv_trt_llm_inflight_batcher_metrics", "inflight_batcher_specific_metric",
              "TRT LLM inflight_batcher-specific metrics"),
    GaugeSpec("nv_trt_llm_general_metrics", "general_type", "General TRT LLM metrics"),
)


def gauge_values(load: EngineLoad) -> dict[tuple[str, str], float]:
    """{(gauge family, label value): value} for an `Engine.load()` snapshot.

    requests: active (holding a slot), waiting (queued for one), max (slots), and of the
    last step: scheduled (its requests), context (its prompts prefilled). KV blocks: max,
    used, free, fraction (used / max), tokens_per (positions of a slot). In-flight
    batcher, the last step: generation_requests, total_context_tokens, micro_batch_id 0.
    General: iteration_counter (steps), timestamp (the last step's end, unix seconds).
    """
    step = load.last_step
    requests, blocks, batcher, general = (spec.name for spec in GAUGES)
    return {
        (requests, "active"): load.running, (requests, "waiting"): load.waiting, (requests, "max"): load.slots,
        (requests, "scheduled"): step.context_requests + step.generation_requests,
        (requests, "context"): step.context_requests,
        (blocks, "max"): load.slots, (blocks, "used"): load.running, (blocks, "free"): load.slots - load.running,
        (blocks, "fraction"): load.running / load.slots if load.slots else 0.0,
        (blocks, "tokens_per"): load.slot_tokens,
        (batcher, "generation_requests"): step.generation_requests,
        (batcher, "total_context_tokens"): step.context_tokens, (batcher, "micro_batch_id"): 0,
        (general, "iteration_counter"): load.iterations, (general, "timestamp"): int(step.unix_time),
    }


def gauge_labels(model: str, version: str, spec: GaugeSpec, value: str) -> dict[str, str]:
    """Labels of one gauge value, as TensorRT-LLM's backend sets them."""
    return {"model": model, "version": version, spec.label: value}


def metric_labels(model: str, version: str, method: str) -> dict[str, str]:
    """Labels of one counter: Triton's own `model`/`version` plus the speculative method."""
    return {"model": model, "version": version, "method": method}


@dataclass(frozen=True)
class Increment:
    spec: CounterSpec
    method: str
    value: int  # > 0


class CounterExport:
    """What of `EngineMetrics` was already exported, and when.

    `increments(metrics)` returns the growth of every (counter, method) since the last
    call and remembers the new values; `due(final)` rate-limits exports to one per
    `interval_s` (each increment is an IPC round trip to the server), except that a
    request's final output always exports, so counters are exact once the engine idles.
    """

    def __init__(self, interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_s
        self._clock = clock
        self._last = float("-inf")
        self._seen: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def due(self, final: bool = False) -> bool:
        return final or self._clock() - self._last >= self.interval_s

    def skip(self, metrics: EngineMetrics) -> None:
        """Treats everything counted so far as exported (the engine's load-time calibration
        runs requests that are no traffic)."""
        self.increments(metrics)
        self._last = float("-inf")

    def increments(self, metrics: EngineMetrics) -> list[Increment]:
        with self._lock:
            self._last = self._clock()
            out = []
            for spec in COUNTERS:
                # dict(): one copy, so a counter the engine thread grows meanwhile is read once
                for method, total in dict(getattr(metrics, spec.field)).items():
                    key = (spec.field, method)
                    grown = total - self._seen.get(key, 0)
                    if grown > 0:
                        out.append(Increment(spec, method, grown))
                        self._seen[key] = total
            return out
