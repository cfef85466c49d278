"""The front door's side of Triton: which models it can serve, their input tensors,
and one gRPC stream per generation that a client's disconnect cancels.

Owns: reading the model repository over gRPC (index, metadata, config parameters),
classifying a model by the tensors it declares, building a request's input arrays
(`build_inputs`, pure), turning responses into `Piece`s, and the stream's life:
the request stays open until its final response, and `close()` before that cancels
the gRPC call, which Triton passes to the model as a cancelled request. Knows nothing
of HTTP or OpenAI's JSON shapes.

Two kinds of model are served, told apart by their tensors:

    text    text_input -> text_output      ensemble, tensorrt_llm_bls (TensorRT-LLM's names)
    tokens  input_ids  -> output_ids       speculative_decoding (the front door tokenizes
                                           and detokenizes itself)

Input names differ between them and between TensorRT-LLM versions (`top_p` or
`runtime_top_p`, `seed` or `random_seed`, `stream` or `streaming`, ...); a value goes
to the first name in `ALIASES` that the model declares, in the model's declared
datatype. A value the client set that the model does not take is a 400 naming it.
"""
from __future__ import annotations

import asyncio
import csv
import io
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Sequence

import numpy as np

from .protocol import OpenAIError, bad_field

TEXT, TOKENS = "text", "tokens"
NUMPY_TYPES = {"BOOL": np.bool_, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
               "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
               "FP16": np.float16, "FP32": np.float32, "FP64": np.float64, "BYTES": np.object_}
# value -> input names, first declared wins
ALIASES = {
    "max_tokens": ("max_tokens", "request_output_len"),
    "stream": ("stream", "streaming"),
    "top_p": ("top_p", "runtime_top_p"),
    "top_k": ("top_k", "runtime_top_k"),
    "seed": ("seed", "random_seed"),
    "min_tokens": ("min_tokens", "min_length"),
}
# Triton error messages that are not the client's fault (specdec's adapter: BusyError,
# INTERNAL errors); anything else a model refuses is a bad request.
BUSY_MARK = "queue is full"
INTERNAL_MARKS = ("internal error", "request failed", "generation failed")


@dataclass(frozen=True)
class TargetModel:
    """A Triton model the front door serves: its declared tensors and batching."""

    name: str
    kind: str  # TEXT | TOKENS
    inputs: dict[str, str]  # input name -> Triton datatype
    outputs: frozenset[str]
    batched: bool  # max_batch_size > 0: every tensor gets a leading batch dim of 1

    def input_for(self, value_name: str) -> Optional[str]:
        """The input that carries `value_name` here, or None."""
        return next((n for n in ALIASES.get(value_name, (value_name,)) if n in self.inputs), None)


def model_kind(inputs: Sequence[str], outputs: Sequence[str]) -> Optional[str]:
    """TEXT, TOKENS or None (a model the front door cannot drive)."""
    inputs, outputs = set(inputs), set(outputs)
    has_max = bool(inputs & set(ALIASES["max_tokens"]))
    if "text_input" in inputs and "text_output" in outputs and has_max:
        return TEXT
    if "input_ids" in inputs and "output_ids" in outputs and has_max:
        return TOKENS
    return None


@dataclass(frozen=True)
class ServerFacts:
    """What the repository's configs say about tokenization and limits (None: not found)."""

    tokenizer_dir: Optional[str] = None  # preprocessing's (or any model's) tokenizer_dir
    model_dir: Optional[str] = None  # speculative_decoding's base_model_dir (its generation_config.json)
    add_special_tokens: bool = True  # preprocessing's: how a text prompt is encoded
    skip_special_tokens: bool = True  # postprocessing's: how output is decoded
    max_tokens_limit: Optional[int] = None  # speculative_decoding's
    max_seq_len: Optional[int] = None  # prompt + output tokens per request
    max_batch_size: Optional[int] = None  # the engine's slots (requests decoded together)


@dataclass
class Piece:
    """One Triton response: new text (TEXT) or new token ids (TOKENS), and their log-probs."""

    text: str = ""
    token_ids: Sequence[int] = ()
    log_probs: Sequence[float] = ()
    final: bool = False
    num_tokens: Optional[int] = None  # TEXT: the tokens behind `text`, when the model says (num_output_tokens)
    top: Sequence[Sequence[tuple[int, float]]] = ()  # TOKENS: each token's alternatives, when asked
    # TOKENS, first response, when asked: prompt tokens 2..L scored, and their alternatives
    prompt_log_probs: Sequence[float] = ()
    prompt_top: Sequence[Sequence[tuple[int, float]]] = ()


def csv_word(word: str) -> str:
    """One stop string as one CSV field (the ensemble splits its `stop_words` items as CSV)."""
    out = io.StringIO()
    csv.writer(out, lineterminator="").writerow([word])
    return out.getvalue()


def build_inputs(target: TargetModel, values: dict[str, Any]) -> dict[str, np.ndarray]:
    """Arrays for `target` from named values, each in its declared datatype and shape.

    `values` uses ensemble names (`text_input`, `max_tokens`, `top_p`, ...) or the token
    model's (`input_ids`, `stop_words_list`); None values are left out. A scalar becomes
    `[1, 1]` on a batched model (`[1]` unbatched), a list `[1, n]`, a `[2, L]` word list
    `[1, 2, L]`. Raises a 400 naming the value when `target` has no input for it.
    """
    arrays = {}
    for key, value in values.items():
        if value is None:
            continue
        name = target.input_for(key)
        if name is None:
            raise bad_field(key, f"the model '{target.name}' does not take it")
        dtype = NUMPY_TYPES[target.inputs[name]]
        if dtype is np.object_:
            items = value if isinstance(value, (list, tuple)) else [value]
            array = np.array([v.encode("utf-8") if isinstance(v, str) else v for v in items], dtype=np.object_)
            if not isinstance(value, (list, tuple)):
                array = array.reshape(1)
        else:
            array = np.asarray(value, dtype=dtype)
            if array.ndim == 0:
                array = array.reshape(1)
        arrays[name] = array[None] if target.batched else array
    return arrays


def wanted_outputs(target: TargetModel, log_probs: bool, top: bool = False, prompt: bool = False) -> list[str]:
    """The outputs a generation reads: Triton then sends only these (an ensemble declares
    many more, and every streamed response would carry them all)."""
    names = ["text_output", "num_output_tokens"] if target.kind == TEXT else ["output_ids", "sequence_length"]
    if log_probs:
        names.append("output_log_probs")
    if top:
        names += ["output_top_token_ids", "output_top_log_probs"]
    if prompt:
        names += ["prompt_log_probs"] + (["prompt_top_token_ids", "prompt_top_log_probs"] if top else [])
    return [n for n in names if n in target.outputs]


def response_piece(target: TargetModel, get, final: bool) -> Piece:
    """A `Piece` from one response; `get(name)` returns an output array or None."""
    log_probs = get("output_log_probs")
    log_probs = [] if log_probs is None else log_probs.reshape(-1).tolist()
    if target.kind == TEXT:
        out = get("text_output")
        text = "" if out is None else "".join(
            t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in out.reshape(-1))
        count = get("num_output_tokens")
        num_tokens = int(count.reshape(-1)[0]) if count is not None and count.size else None
        return Piece(text=text, log_probs=log_probs, final=final, num_tokens=num_tokens)
    ids = get("output_ids")
    ids = [] if ids is None else ids.reshape(-1).tolist()
    length = get("sequence_length")
    if length is not None and length.size:
        ids = ids[:int(length.reshape(-1)[0])]
    prompt_log_probs = get("prompt_log_probs")
    return Piece(token_ids=ids, log_probs=log_probs[:len(ids)], final=final,
                 top=_alternatives(get("output_top_token_ids"), get("output_top_log_probs"))[:len(ids)],
                 prompt_log_probs=[] if prompt_log_probs is None else prompt_log_probs.reshape(-1).tolist(),
                 prompt_top=_alternatives(get("prompt_top_token_ids"), get("prompt_top_log_probs")))


def _alternatives(ids: Optional[np.ndarray], log_probs: Optional[np.ndarray]) -> list[list[tuple[int, float]]]:
    """[1, 1, tokens, k] ids and log-probs as one list of (id, log-prob) per token."""
    if ids is None or log_probs is None or not ids.size:
        return []
    k = ids.shape[-1]
    return [list(zip(i, lp)) for i, lp in zip(ids.reshape(-1, k).tolist(), log_probs.reshape(-1, k).tolist())]


def triton_error(message: str) -> OpenAIError:
    """A model's error message as the HTTP answer it deserves."""
    lower = message.lower()
    if BUSY_MARK in lower:
        return OpenAIError(503, message, code="server_busy")
    if any(mark in lower for mark in INTERNAL_MARKS):
        return OpenAIError(500, message)
    return OpenAIError(400, message)


def _unreachable(error: Exception) -> OpenAIError:
    details = getattr(error, "details", lambda: None)() or str(error)
    return OpenAIError(503, f"the inference server is unreachable: {details}", code="triton_unavailable")


class TritonStream:
    """One generation on its own gRPC stream: iterate for `Piece`s, then `close()`.

    The request side stays open until the final response arrives (so nothing depends on
    how the server treats a half-closed stream); `close()` before that cancels the call,
    and Triton marks the request cancelled (a model that polls it stops generating).
    """

    def __init__(self, client, target: TargetModel, arrays: dict[str, np.ndarray], request_id: str,
                 outputs: Sequence[str], headers: Optional[dict[str, str]] = None):
        import tritonclient.grpc.aio as grpcaio

        inputs = []
        for name, array in arrays.items():
            tensor = grpcaio.InferInput(name, list(array.shape), target.inputs[name])
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        request = {"model_name": target.name, "inputs": inputs, "request_id": request_id,
                   "outputs": [grpcaio.InferRequestedOutput(name) for name in outputs] or None,
                   # every response then says whether it is the last one
                   "parameters": {"triton_enable_empty_final_response": True}}
        self.target = target
        self._done = asyncio.Event()
        self._finished = False
        self._call = client.stream_infer(self._requests(request), headers=headers)

    async def _requests(self, request):
        yield request
        await self._done.wait()

    async def __aiter__(self) -> AsyncIterator[Piece]:
        import grpc

        while not self._finished:
            try:
                result, error = await self._call.__anext__()
            except StopAsyncIteration:
                self._finished = True
                yield Piece(final=True)
                return
            except grpc.RpcError as e:
                self._finished = True
                raise _unreachable(e) from None
            if error is not None:
                self._finished = True
                raise triton_error(error.message() if hasattr(error, "message") else str(error))
            final = result.get_response().parameters["triton_final_response"].bool_param
            piece = response_piece(self.target, result.as_numpy, final)
            self._finished = final
            yield piece

    def close(self) -> None:
        """Ends the stream; cancels the request unless its final response arrived."""
        self._done.set()
        if not self._finished:
            self._call.cancel()
            self._finished = True


class TritonClient:
    """A gRPC connection to Triton (one channel, one stream per generation)."""

    def __init__(self, url: str, headers: Optional[dict[str, str]] = None):
        import tritonclient.grpc.aio as grpcaio

        self.url = url
        self.headers = headers or None
        from tritonclient.grpc import KeepAliveOptions
        from tritonclient.grpc._client import MAX_GRPC_MESSAGE_SIZE

        keepalive = KeepAliveOptions()
        # tritonclient's own channel options, plus a reconnect backoff capped at 1 s:
        # gRPC's default grows to 120 s, so a front door started beside a server that
        # loads for minutes kept being refused long after the server was up.
        channel_args = [
            ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
            ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
            ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
            ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
            ("grpc.initial_reconnect_backoff_ms", 250),
            ("grpc.min_reconnect_backoff_ms", 250),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        self._client = grpcaio.InferenceServerClient(url, channel_args=channel_args)

    async def wait_ready(self, timeout_s: float) -> None:
        """Waits until the server says READY (every model loaded)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            try:
                if await self._client.is_server_ready(headers=self.headers, client_timeout=5):
                    return
            except Exception:  # connection refused while the server starts
                pass
            if loop.time() > deadline:
                raise RuntimeError(f"Triton at {self.url} is not ready after {timeout_s:.0f} s")
            await asyncio.sleep(0.5)

    async def _params(self, name: str) -> dict[str, str]:
        config = (await self._client.get_model_config(name, headers=self.headers, as_json=True))["config"]
        return {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}

    async def discover(self, names: Sequence[str]) -> tuple[list[TargetModel], ServerFacts]:
        """The READY models among `names` that the front door can drive, in that order, and
        the repository's tokenizer and limits."""
        index = await self._client.get_model_repository_index(headers=self.headers, as_json=True)
        ready = {m["name"] for m in index.get("models", []) if m.get("state") == "READY"}
        targets = []
        for name in names:
            if name not in ready:
                continue
            meta = await self._client.get_model_metadata(name, headers=self.headers, as_json=True)
            config = (await self._client.get_model_config(name, headers=self.headers, as_json=True))["config"]
            inputs = {t["name"]: t["datatype"] for t in meta.get("inputs", [])}
            outputs = frozenset(t["name"] for t in meta.get("outputs", []))
            kind = model_kind(inputs, outputs)
            if kind is not None:
                targets.append(TargetModel(name, kind, inputs, outputs, int(config.get("max_batch_size", 0)) > 0))
        params = {m: await self._params(m) for m in ("preprocessing", "postprocessing", "speculative_decoding")
                  if m in ready}
        tokenizer_dir = next((p["tokenizer_dir"] for p in params.values() if p.get("tokenizer_dir")), None)

        def flag(model, key, default):
            value = params.get(model, {}).get(key, "").strip().lower()
            return default if value == "" else value in ("true", "1", "yes", "on")

        def number(key):
            value = params.get("speculative_decoding", {}).get(key, "").strip()
            return int(value) if value.isdigit() else None

        facts = ServerFacts(tokenizer_dir=tokenizer_dir,
                            model_dir=params.get("speculative_decoding", {}).get("base_model_dir") or None,
                            add_special_tokens=flag("preprocessing", "add_special_tokens", True),
                            skip_special_tokens=flag("postprocessing", "skip_special_tokens", True),
                            max_tokens_limit=number("max_tokens_limit"), max_seq_len=number("max_seq_len"),
                            max_batch_size=number("max_batch_size"))
        return targets, facts

    def stream(self, target: TargetModel, arrays: dict[str, np.ndarray], request_id: str,
               outputs: Sequence[str] = ()) -> TritonStream:
        """One generation; `outputs` (default: all) are the outputs Triton sends back."""
        return TritonStream(self._client, target, arrays, request_id, outputs, self.headers)

    async def close(self) -> None:
        await self._client.close()
