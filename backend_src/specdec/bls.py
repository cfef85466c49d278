"""The `tensorrt_llm_bls` model: preprocessing → speculative_decoding → postprocessing,
called from Python so that a client's cancellation reaches the engine.

Owns: the three calls of one BLS request, wired exactly as the `ensemble` wires its
steps (`STEPS`, a test checks them against the ensemble's config), the request id
each call to `speculative_decoding` carries (unique per BLS request, `RequestIds`),
when a response carries Triton's final flag, and cancellation: a BLS request whose
client went away sends `speculative_decoding` a request with `stop: true` and that
id, which ends the engine's request at its next step. A stream checks after each
response it sends; `CancelWatch` polls every request in flight (a request that is not
streamed sends nothing until its end).

Why a BLS model: Triton 2.51's ensemble never cancels a step already running (server
issue #6739), and `cancel()` on a BLS child's response iterator came only in 2.57;
TensorRT-LLM answers the same problem with its `tensorrt_llm_bls` model and the `stop`
input of `tensorrt_llm`, and so does this module.

Never imports Triton: the adapter (`model_repository/tensorrt_llm_bls/1/model.py`)
passes `Models` (the BLS calls) and a `Reply` (the request's response sender) per
request; tests pass fakes. Tensors are `name -> numpy array` dicts throughout.
"""
from __future__ import annotations

import itertools
import json
import threading
import uuid
from dataclasses import dataclass, field
from typing import Iterator, Optional, Protocol

import numpy as np

from .errors import InputError
from .request_parameters import SAMPLING_PARAMETERS, parse_parameters, setting_names

Tensors = dict[str, np.ndarray]

GENERATE_MODEL = "speculative_decoding"  # the default of the `tensorrt_llm_model_name` parameter


@dataclass(frozen=True)
class Step:
    """One model call, as an ensemble step: `input_map` {model input: tensor},
    `output_map` {model output: tensor}; a tensor is a BLS input or an earlier output."""

    model: str
    input_map: dict[str, str]
    output_map: dict[str, str]


_PASSED = ("temperature", "min_p", "seed", "min_tokens", "min_length", "repetition_penalty", "presence_penalty",
           "frequency_penalty", "beam_width", "num_return_sequences", "exclude_input_in_output",
           "return_log_probs", "return_perf_metrics", "return_context_logits", "return_generation_logits",
           "speculative_method", "speculative_choices", "eagle_depth", "eagle_top_k", "eagle_total_tokens",
           "num_draft_tokens", "prompt_lookup_tokens", "return_finish_reason", "return_cumulative_logprob",
           "return_logprobs", "return_num_input_tokens", "return_num_output_tokens",
           "sampling_parameters")  # BLS inputs sent to speculative_decoding under the same name
_METRICS = ("cum_log_probs", "output_log_probs", "acceptance_rate", "total_accepted_draft_tokens",
            "total_draft_tokens", "batch_index", "sequence_index", "kv_cache_alloc_new_blocks",
            "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks", "arrival_time_ns",
            "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns",
            "num_output_tokens", "finish_reason", "num_input_tokens",
            "cumulative_logprob")  # through postprocessing

STEPS = (
    Step("preprocessing",
         {"QUERY": "text_input", "REQUEST_OUTPUT_LEN": "max_tokens", "BAD_WORDS_DICT": "bad_words",
          "STOP_WORDS_DICT": "stop_words", "END_ID": "end_id", "PAD_ID": "pad_id",
          "EMBEDDING_BIAS_WORDS": "embedding_bias_words", "EMBEDDING_BIAS_WEIGHTS": "embedding_bias_weights",
          "SAMPLING_PARAMETERS": "sampling_parameters"},
         {"INPUT_ID": "_INPUT_ID", "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN", "BAD_WORDS_IDS": "_BAD_WORDS_IDS",
          "STOP_WORDS_IDS": "_STOP_WORDS_IDS", "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN",
          "OUT_END_ID": "_END_ID", "OUT_PAD_ID": "_PAD_ID", "EMBEDDING_BIAS": "_EMBEDDING_BIAS"}),
    Step(GENERATE_MODEL,
         {"input_ids": "_INPUT_ID", "input_lengths": "_REQUEST_INPUT_LEN", "request_output_len": "_REQUEST_OUTPUT_LEN",
          "end_id": "_END_ID", "pad_id": "_PAD_ID", "stop_words_list": "_STOP_WORDS_IDS",
          "bad_words_list": "_BAD_WORDS_IDS", "embedding_bias": "_EMBEDDING_BIAS",
          "runtime_top_k": "top_k", "runtime_top_p": "top_p",
          "len_penalty": "length_penalty", "streaming": "stream", **{name: name for name in _PASSED}},
         {"output_ids": "_OUTPUT_IDS", "sequence_length": "_SEQUENCE_LENGTH", "context_ids": "_CONTEXT_IDS",
          "is_final": "_IS_FINAL", "context_logits": "context_logits", "generation_logits": "generation_logits",
          **{name: "_" + name.upper() for name in _METRICS}}),
    Step("postprocessing",
         {"TOKENS_BATCH": "_OUTPUT_IDS", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH", "CONTEXT_IDS": "_CONTEXT_IDS",
          "IS_FINAL": "_IS_FINAL", **{name.upper(): "_" + name.upper() for name in _METRICS}},
         {"OUTPUT": "text_output", **{"OUT_" + name.upper(): name for name in _METRICS}}),
)
OUTPUTS = ("text_output", "context_logits", "generation_logits") + _METRICS  # the ensemble's outputs
# the settings that stand for speculative_decoding's num_return_sequences (vLLM's `n` among them)
_SEQUENCE_SETTINGS = setting_names(STEPS[1].input_map)["num_return_sequences"]


class ModelError(Exception):
    """A called model answered with an error; `code` is Triton's name for its kind."""

    def __init__(self, message: str, code: str = "INTERNAL"):
        super().__init__(message)
        self.code = code


class Models(Protocol):
    """The BLS calls, as the adapter makes them."""

    def call(self, model: str, inputs: Tensors) -> Tensors:
        """One request, one response (preprocessing, postprocessing); raises `ModelError`."""

    def stream(self, model: str, inputs: Tensors, request_id: str, decoupled: bool) -> Iterator[Tensors]:
        """The responses of one request with `request_id` (one unless decoupled); raises `ModelError`."""

    def stop(self, model: str, request_id: str) -> None:
        """Sends `model` a request with `stop: true` and `request_id`."""


class Reply(Protocol):
    """The BLS request's own responses."""

    def send(self, outputs: Tensors, final: bool) -> None: ...

    def fail(self, message: str, code: str) -> None:
        """An error response with the final flag; never raises."""

    def is_cancelled(self) -> bool: ...


def step_inputs(step: Step, tensors: Tensors) -> Tensors:
    """The inputs of `step` among `tensors`; absent optional tensors stay absent."""
    return {name: tensors[source] for name, source in step.input_map.items() if source in tensors}


def take_outputs(step: Step, outputs: Tensors, tensors: Tensors) -> None:
    for name, target in step.output_map.items():
        if name in outputs:
            tensors[target] = outputs[name]


class RequestIds:
    """Request ids for `speculative_decoding`, unique per BLS request.

    A `stop` request ends every running request with its id, so ids must never be
    shared: `<client id>#bls-<8 hex digits drawn at load>-<counter>`. The random part
    keeps instances (and servers restarted behind the same clients) apart; the
    client's id, when it sent one, stays readable in logs.
    """

    def __init__(self, prefix: Optional[str] = None):
        self._prefix = prefix or uuid.uuid4().hex[:8]
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def next(self, client_id: str = "") -> str:
        with self._lock:
            n = next(self._counter)
        return f"{client_id}#bls-{self._prefix}-{n}"


def _rows(tensors: Tensors) -> int:
    """Batch entries of the request, from preprocessing's `[N, L]` token ids."""
    ids = tensors.get("_INPUT_ID")
    return 1 if ids is None or ids.ndim < 2 else int(ids.shape[0])


def _answers(tensors: Tensors, settings: dict) -> int:
    """The answers speculative_decoding sends, each ended by its own final response: each
    batch entry's num_return_sequences (the input, else a setting of that name or vLLM's
    `n`). A value it refuses makes its error the one answer."""
    rows, sent = _rows(tensors), tensors.get("num_return_sequences")
    if sent is not None:
        values = np.asarray(sent).reshape(-1).tolist()
        return sum(max(1, int(v)) for v in values) if len(values) == rows else rows
    value = next((settings[name] for name in _SEQUENCE_SETTINGS if name in settings), 1)
    try:
        return rows * max(1, int(value))
    except (TypeError, ValueError):
        return rows


@dataclass
class BlsRequest:
    """One request to `tensorrt_llm_bls`: `run()` in a worker thread, `cancel()` from any."""

    inputs: Tensors
    models: Models
    reply: Reply
    request_id: str  # the id its speculative_decoding call carries (RequestIds)
    decoupled: bool = True
    generate_model: str = GENERATE_MODEL
    # The request's own parameters (a JSON object string): a BLS call carries none, so they
    # travel to preprocessing and speculative_decoding merged into `sampling_parameters`.
    parameters: Optional[str] = None
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _cancelled: bool = field(default=False, init=False)
    _generating: bool = field(default=False, init=False)  # the speculative_decoding request may run
    _stopped: bool = field(default=False, init=False)  # a stop request was sent for it

    def run(self) -> None:
        """Answers the request; never raises. On an error a generation still running is
        stopped (nobody will read it), and the client gets the error as its final response."""
        try:
            self._run()
        except ModelError as e:
            self.cancel()
            self.reply.fail(str(e), e.code)
        except InputError as e:  # its parameters, read before any call
            self.reply.fail(str(e), "INVALID_ARG")
        except Exception as e:  # a bug, a send that failed: the client still gets its final response
            self.cancel()
            self.reply.fail(f"tensorrt_llm_bls: internal error: {type(e).__name__}: {e}", "INTERNAL")
        finally:
            with self._lock:
                self._generating = False

    def _run(self) -> None:
        pre, generate, post = STEPS
        tensors = dict(self.inputs)
        sent = tensors.get(SAMPLING_PARAMETERS)
        settings = parse_parameters(self.parameters, sent) if self.parameters else {}
        if settings:
            tensors[SAMPLING_PARAMETERS] = np.array([[json.dumps(settings).encode("utf-8")]], dtype=np.object_)
        take_outputs(pre, self.models.call(pre.model, step_inputs(pre, tensors)), tensors)
        # without request parameters the sent settings were not read here yet (preprocessing checked them)
        answers = _answers(tensors, settings if self.parameters else parse_parameters(None, sent))
        finished = 0
        with self._lock:
            cancelled = self._cancelled
            self._generating = not cancelled
        if cancelled:
            self.reply.fail("the request was cancelled", "CANCELLED")
            return
        responses = self.models.stream(self.generate_model, step_inputs(generate, tensors), self.request_id,
                                       self.decoupled)
        for response in responses:
            step = dict(tensors)
            take_outputs(generate, response, step)
            take_outputs(post, self.models.call(post.model, step_inputs(post, step)), step)
            final_tensor = step.get("_IS_FINAL")
            finished += 1 if final_tensor is None or bool(np.asarray(final_tensor).reshape(-1)[0]) else 0
            # speculative_decoding ends with the response that ends its last answer
            self.reply.send({name: step[name] for name in OUTPUTS if name in step}, final=finished >= answers)
            if finished < answers and self.reply.is_cancelled():
                self.cancel()  # a stream notices at its next response, before any poll does
        if finished < answers:  # the stream ended early (cannot happen unless a model misbehaves)
            self.reply.fail(f"{self.generate_model} ended after {finished} of {answers} answers", "INTERNAL")

    def cancel(self) -> None:
        """The client went away: stop the engine's request (once), or never start it."""
        with self._lock:
            self._cancelled = True
            if not self._generating or self._stopped:
                return
            self._stopped = True
        self.models.stop(self.generate_model, self.request_id)


class CancelWatch:
    """Polls the BLS requests in flight every `poll_s`; a cancelled one is `cancel()`ed.

    Triton 2.51 tells a decoupled Python model of a client's cancellation only through
    `is_cancelled()` on the request's response sender, so it is polled. One thread for
    all requests; `add` when a request arrives, `discard` when it is answered.
    """

    def __init__(self, poll_s: float = 0.1, on_error=None):
        self.poll_s = poll_s
        self._on_error = on_error
        self._by_key: dict[int, BlsRequest] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="bls-cancel-watch")
        self._thread.start()

    def add(self, request: BlsRequest) -> None:
        with self._lock:
            self._by_key[id(request)] = request

    def discard(self, request: BlsRequest) -> None:
        with self._lock:
            self._by_key.pop(id(request), None)

    def poll(self) -> None:
        """One pass over the requests in flight."""
        with self._lock:
            requests = list(self._by_key.values())
        for request in requests:
            try:
                if request.reply.is_cancelled():
                    self.discard(request)
                    request.cancel()
            except Exception as e:  # a poll must never end the watch
                if self._on_error is not None:
                    self._on_error(e)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
