"""Triton `speculative_decoding`: a thin adapter over `specdec.engine.Engine`.

Owns only Triton plumbing: config parameters → `EngineConfig.from_params`, request
tensors → `GenerationRequest` (via `specdec.serving`), engine `StepOutput`s →
responses, errors → Triton errors, client cancellation → `Engine.cancel`.

- Decoupled (`decoupled_mode:true`): `execute` submits and returns at once; each
  `emit` from the engine thread becomes one response on the request's sender, and
  the last one carries the final flag — also when the request fails or is cancelled.
- Not decoupled: `execute` submits every request of the batch, then blocks until
  all of them finished, and returns one response each.
`InputError` → INVALID_ARG (HTTP 400), `BusyError` (engine queue full) → UNAVAILABLE
(HTTP 503); the model stays READY.
- Metrics: the engine's per-method counters become Triton custom metrics on the
  metrics port (`specdec.metrics`: names, labels, increments since the last export),
  exported from the engine thread on emission, at most once a second and on every
  request's final output.
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

from specdec.config import EngineConfig
from specdec.engine import Engine
from specdec.errors import BusyError, InputError
from specdec.metrics import COUNTERS, CounterExport, metric_labels
from specdec.model_config import flag, is_decoupled, string_params
from specdec.request import METHODS, StepOutput
from specdec.serving import ResponseBuilder, build_request

ADAPTER_PARAMS = ("exclude_input_in_output",)
CANCEL_POLL_S = 0.2
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _error(message: str, code: str = "INVALID_ARG"):
    """A TritonError with `code` (INVALID_ARG, INTERNAL, UNAVAILABLE), or a plain one where
    the Python backend has no error codes."""
    value = getattr(pb_utils.TritonError, code, None)
    return pb_utils.TritonError(message, value) if value is not None else pb_utils.TritonError(message)


def _response(arrays: dict[str, np.ndarray]):
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in arrays.items()])


@dataclass
class _Pending:
    """One request in flight."""

    builder: Optional[ResponseBuilder] = None  # set once the request's tensors parsed
    sender: Optional[object] = None  # decoupled: the request's response sender
    response: Optional[object] = None  # not decoupled: the one response, once finished
    done: threading.Event = field(default_factory=threading.Event)
    closed: bool = False  # the final response (or error) was sent or stored
    # Held around every final send and every is_cancelled() poll: once the final flag
    # is sent Triton frees the response factory, and polling it then crashes the server.
    send_lock: threading.Lock = field(default_factory=threading.Lock)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.logger = pb_utils.Logger
        self.decoupled = is_decoupled(config)
        self.exclude_input_default = flag(config, "exclude_input_in_output", False)
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
        self._pending: dict[str, _Pending] = {}
        self._stop = threading.Event()
        self._watcher = None
        if self.decoupled:
            self._watcher = threading.Thread(target=self._watch_cancellation, daemon=True,
                                             name="specdec-cancel-watcher")
            self._watcher.start()

    def execute(self, requests):
        submitted = []
        for request in requests:
            sender = request.get_response_sender() if self.decoupled else None
            request_id = f"{next(self._ids)}:{request.request_id()}"
            pending = self._submit(request, request_id, sender)
            submitted.append(pending)
        if self.decoupled:
            return None
        for pending in submitted:
            pending.done.wait()
        return [p.response for p in submitted]

    def _submit(self, request, request_id: str, sender) -> _Pending:
        def get(name):
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy()

        pending = _Pending(sender=sender)
        try:
            gen, options = build_request(request_id, get, self.exclude_input_default)
            if options.streaming and not self.decoupled:
                raise InputError("stream=true needs the model in decoupled mode (decoupled_mode:true)")
            pending.builder = ResponseBuilder(prompt=list(gen.input_ids), options=options)
            with self._lock:
                self._pending[request_id] = pending
            self.engine.submit(gen, lambda step: self._emit(request_id, step))
        except InputError as e:
            self._fail(request_id, pending, _error(str(e)))
        except BusyError as e:
            self._fail(request_id, pending, _error(str(e), "UNAVAILABLE"))
        except Exception as e:  # the engine refused for another reason
            self._fail(request_id, pending, _error(f"request failed: {e}", "INTERNAL"))
        return pending

    def _emit(self, request_id: str, step: StepOutput) -> None:
        """Called from the engine thread; must never raise into it."""
        self._export_metrics(step.finished)
        with self._lock:
            pending = self._pending.get(request_id)
        if pending is None:  # already answered (failed or closed)
            return
        try:
            if step.error is not None or step.finish_reason == "error":
                self._fail(request_id, pending, _error(step.error or "generation failed", "INTERNAL"))
                return
            arrays = pending.builder.add(step)
            if arrays is None:
                return
            with pending.send_lock:
                if step.finished and not self._close(request_id, pending):
                    return
                if self.decoupled:
                    pending.sender.send(_response(arrays), flags=FINAL if step.finished else 0)
                elif step.finished:
                    pending.response = _response(arrays)
                    pending.done.set()
        except Exception as e:  # a send on a closed stream, a bug: end the request, keep the engine
            self.logger.log_error(f"speculative_decoding: request {request_id}: {e!r}")
            if not step.finished:
                self.engine.cancel(request_id)  # nobody will read the rest
            self._fail(request_id, pending, _error(f"internal error: {e}", "INTERNAL"), force=True)

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

    def _close(self, request_id: str, pending: _Pending) -> bool:
        """Marks the request answered; False when it already was."""
        with self._lock:
            self._pending.pop(request_id, None)
            if pending.closed:
                return False
            pending.closed = True
            return True

    def _fail(self, request_id: str, pending: _Pending, error, force: bool = False) -> None:
        """Ends a request with an error (with the final flag when decoupled). `force`: also
        when it was marked answered but the final send itself failed."""
        with pending.send_lock:
            if not self._close(request_id, pending) and not force:
                return
            self._send_error(request_id, pending, error)

    def _send_error(self, request_id: str, pending: _Pending, error) -> None:
        if self.decoupled:
            try:
                pending.sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error), flags=FINAL)
            except Exception as e:  # already closed: nothing more can be said to the client
                self.logger.log_warn(f"speculative_decoding: request {request_id}: {e!r}")
        else:
            pending.response = pb_utils.InferenceResponse(output_tensors=[], error=error)
        pending.done.set()

    def _watch_cancellation(self) -> None:
        """Polls the senders of requests in flight; a cancelled one is cancelled in the engine
        (which still emits a final, cancelled StepOutput that closes the stream)."""
        cancelled: set[str] = set()
        while not self._stop.wait(CANCEL_POLL_S):
            with self._lock:
                items = list(self._pending.items())
            for request_id, pending in items:
                if request_id in cancelled:
                    continue
                try:
                    with pending.send_lock:
                        if pending.closed:
                            continue
                        is_cancelled = pending.sender.is_cancelled()
                except Exception:
                    continue
                if is_cancelled:
                    cancelled.add(request_id)
                    self.engine.cancel(request_id)
            cancelled &= {rid for rid, _ in items}

    def finalize(self):
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=2)
        self.engine.shutdown()
        with self._lock:
            left = list(self._pending.items())
        for request_id, pending in left:
            self._fail(request_id, pending, _error("the model is shutting down", "INTERNAL"))
        self._counters.clear()  # Triton requires metrics to go before their families
        self._families.clear()
