"""Triton `speculative_decoding`: a thin adapter over `specdec.engine.Engine`.

Owns only Triton plumbing: config parameters → `EngineConfig.from_params`, request
tensors → `GenerationRequest` (via `specdec.serving`), engine `StepOutput`s →
responses, errors → Triton errors, client cancellation → `Engine.cancel`.

- Decoupled (`decoupled_mode:true`): `execute` submits and returns at once; each
  `emit` from the engine thread becomes one response on the request's sender, and
  the last one carries the final flag — also when the request fails or is cancelled.
- Not decoupled: `execute` submits every request of the batch, then blocks until
  all of them finished, and returns one response each.
`InputError` → INVALID_ARG (HTTP 400); the model stays READY.
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
from specdec.errors import InputError
from specdec.model_config import flag, is_decoupled, string_params
from specdec.request import StepOutput
from specdec.serving import ResponseBuilder, build_request

ADAPTER_PARAMS = ("exclude_input_in_output",)
CANCEL_POLL_S = 0.2
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _error(message: str, invalid_arg: bool = True):
    code = getattr(pb_utils.TritonError, "INVALID_ARG" if invalid_arg else "INTERNAL", None)
    return pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)


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


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.logger = pb_utils.Logger
        self.decoupled = is_decoupled(config)
        self.exclude_input_default = flag(config, "exclude_input_in_output", False)
        params = {k: v for k, v in string_params(config).items() if k not in ADAPTER_PARAMS}
        self.engine = Engine(EngineConfig.from_params(params))  # ConfigError fails the load
        self.engine.start()
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
        except Exception as e:  # the engine refused for another reason (queue full, ...)
            self._fail(request_id, pending, _error(f"request failed: {e}", invalid_arg=False))
        return pending

    def _emit(self, request_id: str, step: StepOutput) -> None:
        """Called from the engine thread; must never raise into it."""
        with self._lock:
            pending = self._pending.get(request_id)
        if pending is None:  # already answered (failed or closed)
            return
        try:
            if step.error is not None or step.finish_reason == "error":
                self._fail(request_id, pending, _error(step.error or "generation failed", invalid_arg=False))
                return
            arrays = pending.builder.add(step)
            if arrays is None or (step.finished and not self._close(request_id, pending)):
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
            self._fail(request_id, pending, _error(f"internal error: {e}", invalid_arg=False), force=True)

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
        if not self._close(request_id, pending) and not force:
            return
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
            self._fail(request_id, pending, _error("the model is shutting down", invalid_arg=False))
