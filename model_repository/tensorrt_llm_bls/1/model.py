"""Triton `tensorrt_llm_bls`: a thin adapter over `specdec.bls`.

Owns only Triton plumbing: the BLS calls (`pb_utils.InferenceRequest`) behind
`specdec.bls.Models`, each request's response sender behind `specdec.bls.Reply`, and
one worker thread per request so that one instance serves many streams at once.

- Decoupled (`decoupled_mode:true`, the default): `execute` starts each request's
  worker and returns; the worker streams the responses of speculative_decoding, each
  through postprocessing, and the last one carries the final flag. A watcher polls
  `is_cancelled()` of the requests in flight; a cancelled one sends speculative_decoding
  a `stop` request (`specdec.bls.BlsRequest.cancel`).
- Not decoupled: `execute` runs the requests of its batch in workers, waits for them
  and returns one response each (no streaming, no cancellation).
Errors of the called models reach the client with their own message and code.
"""
from __future__ import annotations

import os
import sys

# The Python-backend stub runs an isolated interpreter that ignores PYTHONPATH; put its
# entries first (tools/triton_env.py sets it) so the environment's packages (numpy<2)
# and `specdec` are found. Must run before numpy or triton_python_backend_utils load.
sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]

import json  # noqa: E402
import threading  # noqa: E402

import numpy as np
import triton_python_backend_utils as pb_utils

from specdec.bls import GENERATE_MODEL, BlsRequest, CancelWatch, ModelError, RequestIds, Tensors
from specdec.model_config import is_decoupled, param
from specdec.triton_glue import error_code_name, request_parameters, triton_error

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _error(message: str, code: str = "INTERNAL"):
    return triton_error(pb_utils, message, code)


def _outputs(response) -> Tensors:
    if response.has_error():
        raise ModelError(response.error().message(), error_code_name(pb_utils, response.error()))
    return {tensor.name(): tensor.as_numpy() for tensor in response.output_tensors()}


def _request(model: str, inputs: Tensors, request_id: str = ""):
    return pb_utils.InferenceRequest(model_name=model, request_id=request_id, requested_output_names=[],
                                     inputs=[pb_utils.Tensor(name, array) for name, array in inputs.items()])


class _Models:
    """`specdec.bls.Models` through Python-backend BLS calls."""

    def __init__(self, logger):
        self.logger = logger

    def call(self, model, inputs):
        return _outputs(_request(model, inputs).exec())

    def stream(self, model, inputs, request_id, decoupled):
        if not decoupled:
            yield _outputs(_request(model, inputs, request_id).exec())
            return
        for response in _request(model, inputs, request_id).exec(decoupled=True):
            outputs = _outputs(response)
            if outputs:  # a response without tensors only carries the final flag
                yield outputs

    def stop(self, model, request_id):
        inputs = {"stop": np.array([[True]]), "input_ids": np.zeros((1, 1), np.int32),
                  "input_lengths": np.zeros((1, 1), np.int32), "request_output_len": np.zeros((1, 1), np.int32)}
        try:
            for response in _request(model, inputs, request_id).exec(decoupled=True):
                _outputs(response)
        except ModelError as e:
            self.logger.log_warn(f"tensorrt_llm_bls: stopping {request_id!r}: {e}")


class _Reply:
    """`specdec.bls.Reply` over a decoupled response sender."""

    def __init__(self, sender, logger):
        self.sender, self.logger = sender, logger
        self.closed = False
        # Held around every send and every is_cancelled() poll: once the final flag is
        # sent Triton frees the response factory, and polling it then crashes the server.
        self.lock = threading.Lock()

    def send(self, outputs, final):
        response = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in outputs.items()])
        with self.lock:
            if not self.closed:
                self.closed = final
                self.sender.send(response, flags=FINAL if final else 0)

    def fail(self, message, code):
        with self.lock:
            if self.closed:
                return
            self.closed = True
            try:
                self.sender.send(pb_utils.InferenceResponse(output_tensors=[], error=_error(message, code)),
                                 flags=FINAL)
            except Exception as e:  # the client is gone: nothing more can be said to it
                self.logger.log_warn(f"tensorrt_llm_bls: sending {message!r}: {e!r}")

    def is_cancelled(self):
        with self.lock:
            return not self.closed and self.sender.is_cancelled()


class _Collect:
    """`specdec.bls.Reply` of a non-decoupled request: keeps its one response."""

    def __init__(self):
        self.response = None

    def send(self, outputs, final):
        if final:
            self.response = pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor(k, v) for k, v in outputs.items()])

    def fail(self, message, code):
        if self.response is None:
            self.response = pb_utils.InferenceResponse(output_tensors=[], error=_error(message, code))

    def is_cancelled(self):
        return False


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.logger = pb_utils.Logger
        self.decoupled = is_decoupled(config)
        self.generate_model = param(config, "tensorrt_llm_model_name", GENERATE_MODEL) or GENERATE_MODEL
        self.models = _Models(self.logger)
        self.ids = RequestIds()
        self.watch = CancelWatch(on_error=lambda e: self.logger.log_warn(f"tensorrt_llm_bls: cancel poll: {e!r}"))

    def _bls_request(self, request, reply) -> BlsRequest:
        # Copied: the worker outlives execute(), and with it the request's input buffers.
        inputs = {tensor.name(): np.array(tensor.as_numpy(), copy=True) for tensor in request.inputs()}
        return BlsRequest(inputs, self.models, reply, self.ids.next(request.request_id()),
                          decoupled=self.decoupled, generate_model=self.generate_model,
                          parameters=request_parameters(request))

    def execute(self, requests):
        if not self.decoupled:
            replies = [_Collect() for _ in requests]
            workers = [threading.Thread(target=self._bls_request(r, reply).run, daemon=True)
                       for r, reply in zip(requests, replies)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
            return [reply.response for reply in replies]
        for request in requests:
            bls = self._bls_request(request, _Reply(request.get_response_sender(), self.logger))
            self.watch.add(bls)
            threading.Thread(target=self._serve, args=(bls,), daemon=True, name="bls-request").start()
        return None

    def _serve(self, bls: BlsRequest) -> None:
        try:
            bls.run()
        finally:
            self.watch.discard(bls)

    def finalize(self):
        self.watch.close()
