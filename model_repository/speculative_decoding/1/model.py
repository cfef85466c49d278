"""Triton `speculative_decoding`: a thin adapter over `specdec.engine.Engine`.

Owns only Triton plumbing: config parameters → `EngineConfig.from_params`, request
tensors → `GenerationRequest`s (via `specdec.serving`, one per batch entry), engine
`StepOutput`s → responses, errors → Triton errors, client cancellation and
TensorRT-LLM's `stop` requests → `Engine.cancel`.

- Decoupled (`decoupled_mode:true`): `execute` submits and returns at once; each
  `emit` from the engine thread becomes one response on the request's sender, and
  the response that ends the request's last batch entry carries the final flag —
  also when the request fails or is cancelled.
- Not decoupled: `execute` submits every request of the batch, then blocks until
  all of them finished, and returns one response each (one batch entry each).
- `stop: true` with a request_id ends every running request of that id (TensorRT-LLM's
  `tensorrt_llm` model does the same) and is answered by an empty final response.
- Settings sent as request parameters or in vLLM's `sampling_parameters` JSON count where
  their inputs were not sent, under the ensemble's names (`specdec.request_parameters`).
`InputError` → INVALID_ARG (HTTP 400), `BusyError` (engine queue full) → UNAVAILABLE
(HTTP 503); the model stays READY.
- Metrics: the engine's per-method counters become Triton custom metrics on the
  metrics port (`specdec.metrics`: names, labels, increments since the last export),
  exported from the engine thread on emission, at most once a second and on every
  request's final output; and load gauges in TensorRT-LLM's names (requests active and
  waiting, KV slots used and free, the last step), set by a thread of their own every
  LOAD_POLL_S.
"""
from __future__ import annotations

import os
import sys

# The Python-backend stub runs an isolated interpreter that ignores PYTHONPATH; put its
# entries first (tools/triton_env.py sets it) so the environment's packages (numpy<2)
# and `specdec` are found. Must run before numpy or triton_python_backend_utils load.
sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]

import itertools  # noqa: E402
import json  # noqa: E402
import threading  # noqa: E402
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import triton_python_backend_utils as pb_utils

from specdec.bls import STEPS
from specdec.config import EngineConfig
from specdec.engine import Engine
from specdec.errors import BusyError, InputError
from specdec.metrics import COUNTERS, GAUGES, CounterExport, gauge_labels, gauge_values, metric_labels
from specdec.model_config import flag, is_decoupled, string_params
from specdec.request import METHODS, StepOutput
from specdec.request_parameters import SAMPLING_PARAMETERS, ParameterInputs, parse_parameters, setting_names
from specdec.serving import (BatchAnswer, ResponseBuilder, batch_entries, batch_rows, build_request,
                             is_stop_request, refuse_batch, return_sequences)
from specdec.triton_glue import input_reader, request_parameters, triton_error

ADAPTER_PARAMS = ("exclude_input_in_output",)
CANCEL_POLL_S = 0.2
LOAD_POLL_S = 0.5  # how often the load gauges are brought up to date
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _error(message: str, code: str = "INVALID_ARG"):
    return triton_error(pb_utils, message, code)


def _response(arrays: dict[str, np.ndarray]):
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in arrays.items()])


@dataclass(eq=False)
class _Pending:
    """One Triton request in flight; each of its batch entries is one engine request."""

    triton_id: str  # the client's request_id: what a `stop` request names
    sender: Optional[object] = None  # decoupled: the request's response sender
    engine_ids: list[str] = field(default_factory=list)
    answer: Optional[BatchAnswer] = None  # set once the request's tensors parsed
    response: Optional[object] = None  # not decoupled: the one response, once finished
    done: threading.Event = field(default_factory=threading.Event)
    closed: bool = False  # the final response (or error) was sent or stored
    # Held around every send and every is_cancelled() poll: once the final flag is sent
    # Triton frees the response factory, and polling it then crashes the server.
    send_lock: threading.Lock = field(default_factory=threading.Lock)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.logger = pb_utils.Logger
        self.decoupled = is_decoupled(config)
        self.exclude_input_default = flag(config, "exclude_input_in_output", False)
        self.settings = ParameterInputs.from_config(config, setting_names(STEPS[1].input_map))
        params = {k: v for k, v in string_params(config).items() if k not in ADAPTER_PARAMS}
        # device "cuda" without an index: each instance on the GPU Triton gave it.
        if params.get("device", "").strip() == "cuda" and args.get("model_instance_kind") == "GPU":
            params["device"] = f"cuda:{args['model_instance_device_id']}"
        # Loaded, and then stepping, in the engine's own thread (see Engine.launch).
        self.engine = Engine.launch(EngineConfig.from_params(params))  # ConfigError fails the load
        self.logger.log_info(f"speculative_decoding: {self.engine.load_note}")
        self._export = CounterExport()
        self._export.skip(self.engine.metrics)  # load-time calibration is not traffic
        self._families = {spec.field: pb_utils.MetricFamily(name=spec.name, description=spec.description,
                                                             kind=pb_utils.MetricFamily.COUNTER)
                          for spec in COUNTERS}
        self._labels = (args["model_name"], args["model_version"])
        self._counters: dict[tuple[str, str], object] = {}
        for spec in COUNTERS:  # every (counter, method) exists from the start: rates begin at zero
            for method in METHODS:
                self._counter(spec.field, method)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[_Pending, int]] = {}  # engine request id -> (request, its answer)
        self._open: set[_Pending] = set()  # requests not yet answered in full
        self._stop = threading.Event()
        self._watcher = None
        if self.decoupled:
            self._watcher = threading.Thread(target=self._watch_cancellation, daemon=True,
                                             name="specdec-cancel-watcher")
            self._watcher.start()
        gauge_families = {spec.name: pb_utils.MetricFamily(name=spec.name, description=spec.description,
                                                            kind=pb_utils.MetricFamily.GAUGE) for spec in GAUGES}
        specs = {spec.name: spec for spec in GAUGES}
        self._gauges = {key: gauge_families[key[0]].Metric(labels=gauge_labels(*self._labels, specs[key[0]], key[1]))
                        for key in gauge_values(self.engine.load())}
        self._gauge_families = list(gauge_families.values())
        self._load_watcher = threading.Thread(target=self._watch_load, daemon=True, name="specdec-load-gauges")
        self._load_watcher.start()

    def execute(self, requests):
        answered = []
        for request in requests:
            sender = request.get_response_sender() if self.decoupled else None
            answered.append(self._handle(request, sender))
        if self.decoupled:
            return None
        for pending in answered:
            pending.done.wait()
        return [p.response for p in answered]

    def _handle(self, request, sender) -> _Pending:
        get = input_reader(pb_utils, request)
        pending = _Pending(triton_id=request.request_id(), sender=sender)
        try:
            if is_stop_request(get):
                self._stop_requests(pending)
            else:
                settings = parse_parameters(request_parameters(request), get(SAMPLING_PARAMETERS))
                self._submit(pending, self.settings.getter(get, settings, batch_entries(get)))
        except InputError as e:
            self._fail(pending, _error(str(e)))
        except BusyError as e:
            self._fail(pending, _error(str(e), "UNAVAILABLE"))
        except Exception as e:  # the engine refused for another reason
            self._fail(pending, _error(f"request failed: {e}", "INTERNAL"))
        return pending

    def _submit(self, pending: _Pending, get) -> None:
        rows = batch_rows(get)
        # one engine request per answer: each batch entry's num_return_sequences of them
        answers = [(row, sequence, get_row) for row, get_row in enumerate(rows)
                   for sequence in range(return_sequences(get_row))]
        refuse_batch(len(rows), len(answers), self.decoupled)
        n = next(self._ids)
        built, builders = [], []
        for row, sequence, get_row in answers:
            engine_id = (f"{n}.{row}.{sequence}:{pending.triton_id}" if len(answers) > 1
                         else f"{n}:{pending.triton_id}")
            gen, options = build_request(engine_id, get_row, self.exclude_input_default, batch_index=row,
                                         sequence_index=sequence)
            if options.streaming and not self.decoupled:
                raise InputError("stream=true needs the model in decoupled mode (decoupled_mode:true)")
            built.append(gen)
            builders.append(ResponseBuilder(prompt=list(gen.input_ids), options=options))
        pending.answer = BatchAnswer(builders)
        with self._lock:
            for answer, gen in enumerate(built):
                pending.engine_ids.append(gen.request_id)
                self._entries[gen.request_id] = (pending, answer)
            self._open.add(pending)
        try:
            for gen in built:
                self.engine.submit(gen, lambda step, rid=gen.request_id: self._emit(rid, step))
        except Exception:
            self._cancel(pending)  # entries already submitted end at the engine's next step
            raise

    def _stop_requests(self, pending: _Pending) -> None:
        """TensorRT-LLM's stop request: ends every running request with this request_id
        and answers with an empty final response (also when none is running any more)."""
        if not pending.triton_id:
            raise InputError("stop: true needs the request_id of the request to stop (none was sent)")
        with self._lock:
            targets = [p for p in self._open if p.triton_id == pending.triton_id]
        for target in targets:
            self._cancel(target)
        with pending.send_lock:
            pending.closed = True
            if self.decoupled:
                pending.sender.send(pb_utils.InferenceResponse(output_tensors=[]), flags=FINAL)
            else:
                pending.response = pb_utils.InferenceResponse(output_tensors=[])
            pending.done.set()

    def _cancel(self, pending: _Pending) -> None:
        for engine_id in pending.engine_ids:
            self.engine.cancel(engine_id)

    def _emit(self, engine_id: str, step: StepOutput) -> None:
        """Called from the engine thread; must never raise into it."""
        self._export_metrics(step.finished)
        with self._lock:
            entry = self._entries.get(engine_id)
        if entry is None:  # already answered (failed or closed)
            return
        pending, answer = entry
        try:
            if step.error is not None or step.finish_reason == "error":
                self._cancel(pending)  # the request's other entries
                self._fail(pending, _error(step.error or "generation failed", "INTERNAL"))
                return
            arrays, last = pending.answer.add(answer, step)
            if arrays is None:
                return
            with pending.send_lock:
                if pending.closed or (last and not self._close(pending)):
                    return
                if self.decoupled:
                    pending.sender.send(_response(arrays), flags=FINAL if last else 0)
                elif last:
                    pending.response = _response(arrays)
                    pending.done.set()
        except Exception as e:  # a send on a closed stream, a bug: end the request, keep the engine
            self.logger.log_error(f"speculative_decoding: request {engine_id}: {e!r}")
            self._cancel(pending)  # nobody will read the rest
            self._fail(pending, _error(f"internal error: {e}", "INTERNAL"), force=True)

    def _export_metrics(self, final: bool) -> None:
        if not self._export.due(final):
            return
        try:
            for inc in self._export.increments(self.engine.metrics):
                self._counter(inc.spec.field, inc.method).increment(inc.value)
        except Exception as e:  # metrics must never fail a request
            self.logger.log_warn(f"speculative_decoding: exporting metrics: {e!r}")

    def _counter(self, field: str, method: str):
        key = (field, method)
        if key not in self._counters:
            self._counters[key] = self._families[field].Metric(labels=metric_labels(*self._labels, method))
        return self._counters[key]

    def _close(self, pending: _Pending) -> bool:
        """Marks the request answered; False when it already was."""
        with self._lock:
            for engine_id in pending.engine_ids:
                self._entries.pop(engine_id, None)
            self._open.discard(pending)
            if pending.closed:
                return False
            pending.closed = True
            return True

    def _fail(self, pending: _Pending, error, force: bool = False) -> None:
        """Ends a request with an error (with the final flag when decoupled). `force`: also
        when it was marked answered but the final send itself failed."""
        with pending.send_lock:
            if not self._close(pending) and not force:
                return
            if self.decoupled:
                try:
                    pending.sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error), flags=FINAL)
                except Exception as e:  # already closed: nothing more can be said to the client
                    self.logger.log_warn(f"speculative_decoding: request {pending.triton_id!r}: {e!r}")
            else:
                pending.response = pb_utils.InferenceResponse(output_tensors=[], error=error)
            pending.done.set()

    def _watch_cancellation(self) -> None:
        """Polls the senders of requests in flight; a cancelled one is cancelled in the engine
        (which still emits a final, cancelled StepOutput per entry that closes the stream)."""
        cancelled: set[_Pending] = set()
        while not self._stop.wait(CANCEL_POLL_S):
            with self._lock:
                pendings = list(self._open)
            for pending in pendings:
                if pending in cancelled:
                    continue
                try:
                    with pending.send_lock:
                        if pending.closed:
                            continue
                        is_cancelled = pending.sender.is_cancelled()
                except Exception:
                    continue
                if is_cancelled:
                    cancelled.add(pending)
                    self._cancel(pending)
            cancelled &= set(pendings)

    def _watch_load(self) -> None:
        """Sets the load gauges (TensorRT-LLM's names, `specdec.metrics.GAUGES`) every
        LOAD_POLL_S, those that changed only (each set is a round trip to the server)."""
        shown: dict = {}
        while True:
            try:
                for key, value in gauge_values(self.engine.load()).items():
                    if shown.get(key) != value:
                        self._gauges[key].set(value)
                        shown[key] = value
            except Exception as e:  # metrics must never fail the model
                self.logger.log_warn(f"speculative_decoding: exporting load gauges: {e!r}")
            if self._stop.wait(LOAD_POLL_S):
                return

    def finalize(self):
        self._stop.set()
        self._load_watcher.join(timeout=2)
        if self._watcher is not None:
            self._watcher.join(timeout=2)
        self.engine.shutdown()
        with self._lock:
            left = list(self._open)
        for pending in left:
            self._fail(pending, _error("the model is shutting down", "INTERNAL"))
        self._counters.clear()  # Triton requires metrics to go before their families
        self._gauges.clear()
        self._families.clear()
