"""End to end through a real tritonserver: TensorRT-LLM's own client programs' requests,
tensor for tensor, against `ensemble`, `tensorrt_llm_bls` and `speculative_decoding`; the
shapes of the answers; the `stop` input; the BLS entry answers as the ensemble does; a
cancelled BLS stream frees its engine slot.

The requests are built as tensorrtllm_backend's `inflight_batcher_llm/client/` programs
build them, with their defaults: `end_to_end_grpc_client.py` (text_input, max_tokens,
stream, beam_width 1, temperature 1.0, exclude_input_in_output false, each `[1, 1]`, one
row per prompt with `--batch-inputs`; outputs asked by name) and
`inflight_batcher_llm_client.py` (input_ids `[1, L]`, input_lengths, request_output_len,
beam_width 1, temperature 1.0, streaming, end_id, pad_id, runtime_top_k 1, runtime_top_p
0.0; its stop request: input_ids `[1, 1]` uninitialised, input_lengths 0,
request_output_len 0, stop true, under the request's id).

One server for the module: the tiny model, 16 engine slots and no queue (a request that
finds every slot held is refused at once: how a test sees that no slot stays held), and
requests of up to LONG tokens, so that a stream is still running when it is cancelled.
"""
from __future__ import annotations

import json
import queue
import random
import re
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import requests

from conftest import TOKENIZER_DIR, e2e_skip_reason, serve_repository

LONG = 1000
SLOTS = 16
ENTRIES = ("ensemble", "tensorrt_llm_bls")
PERF_OUTPUTS = {  # end_to_end_grpc_client.py --return-perf-metrics asks for these, reads [0][0]
    "kv_cache_alloc_new_blocks": np.int32, "kv_cache_reused_blocks": np.int32,
    "kv_cache_alloc_total_blocks": np.int32, "arrival_time_ns": np.int64, "first_scheduled_time_ns": np.int64,
    "first_token_time_ns": np.int64, "last_token_time_ns": np.int64, "acceptance_rate": np.float32,
    "total_accepted_draft_tokens": np.int32, "total_draft_tokens": np.int32}
TIMES = ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")
SEQUENCE_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end")


@pytest.fixture(scope="module")
def server(tmp_path_factory, e2e_base):
    reason = e2e_skip_reason()
    if reason:
        pytest.skip(reason)
    values = {"max_batch_size": str(SLOTS), "engine_max_queue_size": "0", "max_tokens_limit": str(LONG),
              "max_seq_len": str(LONG + 64)}
    with serve_repository(tmp_path_factory.mktemp("trtllm"), e2e_base, values) as s:
        yield s


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)


# -- the clients' requests -----------------------------------------------------------------------
def end_to_end_client_inputs(prompts: list[str], output_len: int, streaming: bool = False,
                             **flags) -> dict[str, np.ndarray]:
    """end_to_end_grpc_client.py's tensors: one `[1, ...]` row per prompt, stacked (`--batch-inputs`).
    `flags`: the optional tensors it adds when asked (return_log_probs=True, end_id=-1, ...)."""
    rows = []
    for prompt in prompts:
        row = {"text_input": np.array([[prompt]]).astype(object),
               "max_tokens": np.array([[output_len]], dtype=np.int32),
               "stream": np.array([[streaming]], dtype=bool),
               "beam_width": np.array([[1]], dtype=np.int32),
               "temperature": np.array([[1.0]], dtype=np.float32)}
        for name, value in flags.items():
            dtype = {bool: bool, int: np.int32, float: np.float32}[type(value)]
            row[name] = np.array([[value]], dtype=np.uint64 if name == "seed" else dtype)
        row.setdefault("exclude_input_in_output", np.array([[False]], dtype=bool))
        rows.append(row)
    return {name: np.concatenate([row[name] for row in rows], axis=0) for name in rows[0]}


def end_to_end_client_outputs(log_probs=False, perf=False, batch=False) -> list[str]:
    return (["text_output"] + (["cum_log_probs", "output_log_probs"] if log_probs else [])
            + (["batch_index"] if batch else []) + (list(PERF_OUTPUTS) if perf else []))


def inflight_client_inputs(ids: list[int], output_len: int, streaming: bool, end_id: int, pad_id: int,
                           **extra) -> dict[str, np.ndarray]:
    """inflight_batcher_llm_client.py's tensors with its defaults."""
    named = {"input_ids": np.array([ids], dtype=np.int32), "input_lengths": np.array([[len(ids)]], dtype=np.int32),
             "request_output_len": np.array([[output_len]], dtype=np.int32),
             "beam_width": np.array([[1]], dtype=np.int32), "temperature": np.array([[1.0]], dtype=np.float32),
             "streaming": np.array([[streaming]], dtype=bool), "end_id": np.array([[end_id]], dtype=np.int32),
             "pad_id": np.array([[pad_id]], dtype=np.int32), "runtime_top_k": np.array([[1]], dtype=np.int32),
             "runtime_top_p": np.array([[0.0]], dtype=np.float32)}
    named.update({k: np.array([[v]], dtype=np.int32 if isinstance(v, int) else bool) for k, v in extra.items()})
    return named


def stop_signal() -> dict[str, np.ndarray]:
    """inflight_batcher_llm_client.py's prepare_stop_signals()."""
    return {"input_ids": np.empty([1, 1], dtype=np.int32), "input_lengths": np.zeros([1, 1], dtype=np.int32),
            "request_output_len": np.array([[0]], dtype=np.int32), "stop": np.array([[True]], dtype="bool")}


@dataclass
class Response:
    outputs: dict = field(default_factory=dict)
    final: bool = False
    error: str | None = None


class Stream:
    """One gRPC stream with its own client, as each of TensorRT-LLM's clients opens one."""

    def __init__(self, server):
        import tritonclient.grpc as grpcclient

        self.results: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.client.start_stream(callback=lambda result, error: self.results.put((result, error)))

    def send(self, model: str, named: dict, request_id: str = "", outputs: list[str] | None = None,
             parameters: dict | None = None) -> "Stream":
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import np_to_triton_dtype

        tensors = []
        for name, array in named.items():
            tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        self.client.async_stream_infer(model, tensors, request_id=request_id, parameters=parameters,
                                       outputs=[grpcclient.InferRequestedOutput(o) for o in outputs or []] or None,
                                       enable_empty_final_response=True)
        return self

    def read(self, finals: int = 1, limit: int | None = None, timeout_s: float = 60.0) -> list[Response]:
        """Responses until `finals` of them were final (errors are final), or `limit` were read."""
        out: list[Response] = []
        while sum(r.final for r in out) < finals and (limit is None or len(out) < limit):
            result, error = self.results.get(timeout=timeout_s)
            if error is not None:
                out.append(Response(final=True, error=str(error)))
                continue
            response = result.get_response()
            out.append(Response({o.name: result.as_numpy(o.name) for o in response.outputs},
                                response.parameters["triton_final_response"].bool_param))
        return out

    def cancel(self) -> None:
        self.client.stop_stream(cancel_requests=True)
        self.client.close()

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def one_stream(server, model, named, **kw) -> list[Response]:
    stream = Stream(server).send(model, named, **kw)
    try:
        return stream.read()
    finally:
        stream.close()


def texts(responses: list[Response]) -> str:
    for r in responses:
        assert r.error is None, r.error
    return "".join(r.outputs["text_output"][0].decode("utf-8") for r in responses if "text_output" in r.outputs)


def generate(server, model: str, body: dict) -> tuple[int, dict]:
    r = requests.post(f"http://{server.http_url}/v2/models/{model}/generate", json=body, timeout=120)
    return r.status_code, r.json()


def emitted(server) -> float:
    """The engine's emitted-token counter, summed over methods."""
    text = requests.get(f"http://localhost:{server.metrics_port}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^specdec_emitted_tokens_total\{[^}]*\} (\S+)$", text, re.M))


def settled_emitted(server, quiet_s: float = 1.5, timeout_s: float = 20.0) -> tuple[float, float]:
    """(the counter once it held still for `quiet_s`, seconds until it last moved)."""
    start = time.monotonic()
    value, moved = emitted(server), start
    while time.monotonic() - moved < quiet_s:
        assert time.monotonic() - start < timeout_s, "the engine kept emitting"
        time.sleep(0.1)
        now = emitted(server)
        if now != value:
            value, moved = now, time.monotonic()
    return value, moved - start


# -- shapes: end_to_end_grpc_client.py on both entries --------------------------------------------
@pytest.mark.parametrize("model", ENTRIES)
@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
def test_end_to_end_client_reads_one_string_per_response(server, model, streaming):
    prompt = "What is ML?"
    named = end_to_end_client_inputs([prompt], 12, streaming, return_log_probs=True, return_perf_metrics=True,
                                     end_id=-1)
    responses = one_stream(server, model, named, outputs=end_to_end_client_outputs(log_probs=True, perf=True))
    assert responses[-1].final and len(responses) == (12 if streaming else 1)
    for r in responses:
        assert r.error is None, r.error
        assert r.outputs["text_output"].shape == (1,)  # the client reads output[0].decode("utf-8")
        assert r.outputs["cum_log_probs"].shape == (1, 1)
        assert r.outputs["output_log_probs"].shape[:2] == (1, 1)
        for name, dtype in PERF_OUTPUTS.items():
            assert r.outputs[name].shape == (1, 1) and r.outputs[name].dtype == dtype, name
    last = responses[-1].outputs
    assert last["arrival_time_ns"][0][0] <= last["first_scheduled_time_ns"][0][0] \
        <= last["first_token_time_ns"][0][0] <= last["last_token_time_ns"][0][0]
    assert last["kv_cache_alloc_new_blocks"][0][0] == 1
    # A stream never repeats the prompt (TensorRT-LLM's executor); the one response does.
    status, alone = generate(server, model, {"text_input": prompt, "max_tokens": 12, "end_id": -1,
                                             "exclude_input_in_output": True})
    assert status == 200, alone
    assert texts(responses) == (alone["text_output"] if streaming else prompt + alone["text_output"])


@pytest.mark.parametrize("model", ENTRIES)
def test_end_to_end_client_batch_inputs_answer_per_batch_index(server, model):
    prompts = ["This is a test", "I want you to", "The cat is"]
    named = end_to_end_client_inputs(prompts, 5)
    responses = one_stream(server, model, named, outputs=end_to_end_client_outputs(batch=True))
    got = {}
    for r in responses:
        assert r.error is None and r.outputs["batch_index"].shape == (1, 1), r
        got[int(r.outputs["batch_index"][0][0])] = r.outputs["text_output"][0].decode()
    assert responses[-1].final and sum(r.final for r in responses) == 1
    for i, prompt in enumerate(prompts):
        assert got[i] == texts(one_stream(server, model, end_to_end_client_inputs([prompt], 5)))


@pytest.mark.parametrize("model", ENTRIES)
def test_num_return_sequences_answer_as_single_requests_seeded_one_apart(server, model):
    """TensorRT-LLM's num_return_sequences (vLLM's n): each sequence its own responses,
    told apart by sequence_index, each the answer of a single request whose seed is the
    request's plus its index; the final flag ends the last."""
    sampled = dict(temperature=0.9, top_p=1.0, end_id=-1)
    named = end_to_end_client_inputs(["The cat is"], 8, seed=7, num_return_sequences=3, **sampled)
    responses = one_stream(server, model, named)
    got = {}
    for r in responses:
        assert r.error is None and r.outputs["sequence_index"].shape == (1, 1), r
        got[int(r.outputs["sequence_index"][0][0])] = r.outputs["text_output"][0].decode()
    assert [r.final for r in responses] == [False, False, True] and sorted(got) == [0, 1, 2]
    for s in range(3):
        assert got[s] == texts(one_stream(server, model, end_to_end_client_inputs(["The cat is"], 8, seed=7 + s,
                                                                                  **sampled)))
    assert len(set(got.values())) > 1, got


@pytest.mark.parametrize("model", ENTRIES)
def test_values_the_engine_cannot_honour_are_refused_with_the_reason(server, model):
    for flag, reason in [({"beam_width": np.array([[2]], np.int32)}, "beam search is not supported"),
                         ({"num_return_sequences": np.array([[0]], np.int32)}, "num_return_sequences must be in"),
                         ({"return_context_logits": np.array([[True]])}, "does not return logits"),
                         ({"return_generation_logits": np.array([[True]])}, "does not return logits")]:
        responses = one_stream(server, model, {**end_to_end_client_inputs(["hi"], 4), **flag})
        assert len(responses) == 1 and reason in (responses[0].error or ""), (flag, responses)
    for body in ({"top_p": 0.0}, {"top_k": 0, "top_p": 0.0}, {"top_k": 1}, {"num_return_sequences": 1},
                 {"beam_width": 1, "return_context_logits": False, "return_generation_logits": False}):
        status, out = generate(server, model, {"text_input": "hi", "max_tokens": 4, **body})
        assert status == 200, (body, out)


@pytest.mark.parametrize("model", ENTRIES)
def test_our_client_reads_the_same_shapes(server, model, capsys):
    import end_to_end_grpc_client

    common = ["-u", server.grpc_url, "-p", "What is ML?", "-o", "8", "--end-id", "-1", "--model-name", model,
              "--include-input"]
    assert end_to_end_grpc_client.main(common + ["--perf-metrics"]) == 0
    whole = capsys.readouterr()
    assert end_to_end_grpc_client.main(common + ["--streaming"]) == 0
    streamed = capsys.readouterr()
    assert whole.out == streamed.out and whole.out.startswith("What is ML?")
    assert "total_draft_tokens: 0" in whole.err and "first_token_time_ns: " in whole.err


# -- speculative_decoding: inflight_batcher_llm_client.py and its stop request --------------------
def test_inflight_client_streams_the_greedy_tokens(server, tokenizer):
    ids = tokenizer.encode("Born in north-east France, Soyer trained as a")
    pad_token = tokenizer.pad_token or tokenizer.eos_token
    end_id = tokenizer.encode(tokenizer.eos_token, add_special_tokens=False)[0]
    pad_id = tokenizer.encode(pad_token, add_special_tokens=False)[0]
    streamed = one_stream(server, "speculative_decoding", inflight_client_inputs(ids, 16, True, end_id, pad_id))
    tokens = []
    for r in streamed:
        assert r.error is None and r.outputs["output_ids"].shape[:2] == (1, 1), r
        assert r.outputs["sequence_length"].shape == (1, 1)
        tokens += list(r.outputs["output_ids"][0][0])  # the client's streaming callback
    # -n 1: the same request on the stream API, not streamed: one response, the prompt first.
    whole = one_stream(server, "speculative_decoding",
                       inflight_client_inputs(ids, 16, False, end_id, pad_id, num_return_sequences=1))
    assert len(whole) == 1 and whole[0].error is None
    assert list(whole[0].outputs["output_ids"][0][0]) == ids + tokens
    assert whole[0].outputs["sequence_length"][0][0] == len(ids) + len(tokens)


@pytest.mark.parametrize("model", ENTRIES)
def test_bias_words_steer_the_answer_as_a_dense_embedding_bias_does(server, model, tokenizer):
    """TensorRT-LLM's `embedding_bias_words`/`_weights` through an entry equal the same
    bias sent to speculative_decoding as `embedding_bias` [vocab], and a word weighted
    -100 is never generated."""
    ids = tokenizer.encode("Born in north-east France, Soyer trained as a")
    end_id = tokenizer.encode(tokenizer.eos_token, add_special_tokens=False)[0]

    def tokens(bias=None):
        named = inflight_client_inputs(ids, 12, False, end_id, end_id)
        if bias is not None:
            named["embedding_bias"] = bias[None]
        (r,) = one_stream(server, "speculative_decoding", named)
        assert r.error is None, r.error
        return list(r.outputs["output_ids"][0][0])[len(ids):]

    plain = tokens()
    banned = next(t for t in plain if tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False) == [t])
    dense = np.zeros(len(tokenizer), np.float32)
    dense[banned] = -100.0
    steered = tokens(dense)
    assert banned not in steered and steered != plain
    body = {"text_input": "Born in north-east France, Soyer trained as a", "max_tokens": 12, "end_id": end_id,
            "embedding_bias_words": [tokenizer.decode([banned])], "embedding_bias_weights": [-100.0]}
    status, out = generate(server, model, body)
    assert status == 200, out
    assert out["text_output"].endswith(tokenizer.decode(steered, skip_special_tokens=True))
    status, out = generate(server, model, {**body, "embedding_bias_weights": [1.0, 2.0]})
    assert status == 400 and "embedding_bias_words and embedding_bias_weights" in out["error"], out


def test_stop_request_ends_the_running_request(server):
    """--stop-after-ms with the csv input path's ids: end_id -1, pad_id 50256 (GPT-2's)."""
    stream = Stream(server)
    try:
        stream.send("speculative_decoding", inflight_client_inputs([1, 5, 6, 7], LONG, True, -1, 50256),
                    request_id="42")
        before = stream.read(limit=3)
        stream.send("speculative_decoding", stop_signal(), request_id="42", parameters={"Streaming": True})
        after = stream.read(finals=2)
    finally:
        stream.close()
    assert all(r.error is None for r in before + after), before + after
    stop_answers = [r for r in after if not r.outputs]
    assert len(stop_answers) == 1 and stop_answers[0].final  # the stop request's empty final response
    generated = sum(r.outputs["output_ids"].shape[2] for r in before + after if r.outputs)
    assert sum(r.final for r in after if r.outputs) == 1 and generated < LONG / 2


def test_a_stop_request_ends_an_ensemble_request_of_that_id(server):
    """The ensemble's call to speculative_decoding carries the client's request_id, so a client
    of the ensemble that sent one can end it (an ensemble never passes a cancellation on)."""
    start, _ = settled_emitted(server)
    stream = Stream(server).send("ensemble", end_to_end_client_inputs(["Once upon a time"], LONG, True, end_id=-1),
                                 request_id="ensemble-7")
    try:
        assert len(stream.read(limit=3)) == 3
        stopper = one_stream(server, "speculative_decoding", stop_signal(), request_id="ensemble-7")
        assert len(stopper) == 1 and stopper[0].error is None and not stopper[0].outputs
        rest = stream.read()
    finally:
        stream.close()
    assert rest[-1].final and all(r.error is None for r in rest)
    stopped, _ = settled_emitted(server)
    assert stopped - start < LONG / 10


def test_stop_needs_a_request_id(server):
    responses = one_stream(server, "speculative_decoding", stop_signal())
    assert "request_id" in (responses[0].error or ""), responses


# -- tensorrt_llm_bls answers as the ensemble -------------------------------------------------------
def _comparable(responses: list[Response]) -> list[dict]:
    """The responses' outputs with the time stamps left out (their shapes kept)."""
    out = []
    for r in responses:
        assert r.error is None, r.error
        out.append({k: (v.shape, v.dtype.str) if k in TIMES else (v.dtype.str, v.tolist())
                    for k, v in r.outputs.items()})
    return out


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9, "seed": 7}], ids=["greedy", "sampled"])
def test_bls_answers_equal_the_ensembles(server, streaming, sampling):
    named = end_to_end_client_inputs(["The history of the world, in short: é, 日本, 😀."], 16, streaming,
                                     return_log_probs=True, return_perf_metrics=True, end_id=-1, **sampling)
    answers = {model: _comparable(one_stream(server, model, named)) for model in ENTRIES}
    assert answers["tensorrt_llm_bls"] == answers["ensemble"]
    assert len(answers["ensemble"]) == (16 if streaming else 1)
    body = {"text_input": "def fibonacci(n):", "max_tokens": 8, "return_log_probs": True, **sampling}
    http = {}
    for model in ENTRIES:
        status, http[model] = generate(server, model, body)
        assert status == 200, http[model]
        # The ensemble's responses also carry Triton's sequence parameters, which /generate
        # lists (sequence_id, sequence_start, sequence_end); a Python model's carry none (nor
        # do those of TensorRT-LLM's BLS).
        http[model] = {k: v for k, v in http[model].items() if k not in TIMES + SEQUENCE_PARAMETERS + ("model_name",)}
    assert http["tensorrt_llm_bls"] == http["ensemble"]


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
def test_bls_takes_request_parameters_as_the_ensemble_does(server, tokenizer, streaming):
    """A BLS call carries no request parameters: the BLS hands its own on in vLLM's
    `sampling_parameters`. vLLM's `stop` (no input has that name) ends both answers early."""
    named = end_to_end_client_inputs(["Count: one, two, three, four, five, six"], 1, streaming, end_id=-1,
                                     exclude_input_in_output=True)
    del named["max_tokens"], named["temperature"]
    sampled = {"max_tokens": 12, "temperature": 0.9, "seed": 5}
    answers = {model: _comparable(one_stream(server, model, named, parameters=sampled)) for model in ENTRIES}
    assert answers["tensorrt_llm_bls"] == answers["ensemble"]
    assert len(answers["ensemble"]) == (12 if streaming else 1)  # max_tokens 12, not the default 16
    greedy = {"max_tokens": 12, "temperature": 0}
    responses = one_stream(server, "ensemble", named, parameters=greedy)
    whole = texts(responses)
    assert finish_reasons(responses) == ["None"] * (len(responses) - 1) + ["length"]
    # A stop word: a token's text from the answer (retokenized, the answer's ids may differ,
    # so the first few that end the answer early will do). Each answer stays a prefix.
    ids = tokenizer.encode(whole, add_special_tokens=False)
    words = [w for w in dict.fromkeys(tokenizer.decode([i]) for i in ids[2:]) if w.strip()][:6]
    for stop in words:
        answers = {model: one_stream(server, model, named, parameters={**greedy, "stop": stop}) for model in ENTRIES}
        stopped = {model: texts(responses) for model, responses in answers.items()}
        assert stopped["tensorrt_llm_bls"] == stopped["ensemble"] and whole.startswith(stopped["ensemble"])
        if len(stopped["ensemble"]) < len(whole):
            assert stopped["ensemble"].endswith(stop), (stop, stopped, whole)
            assert [finish_reasons(answers[model])[-1] for model in ENTRIES] == ["stop", "stop"]
            break
    else:
        pytest.fail(f"no stop word of {words} ended {whole!r} early")


def finish_reasons(responses: list[Response]) -> list[str]:
    """Each response's `finish_reason` (vLLM's output), in order."""
    return [r.outputs["finish_reason"].reshape(-1)[0].decode() for r in responses if "finish_reason" in r.outputs]


@pytest.mark.parametrize("body,field", [({"max_tokens": 4}, "text_input"),
                                        ({"text_input": "hi", "max_tokens": 4, "temperature": -1.0}, "temperature"),
                                        ({"text_input": "hi", "max_tokens": LONG + 1}, "max_tokens"),
                                        ({"text_input": "hi", "parameters": {"stop": 5}}, "stop"),
                                        ({"text_input": "hi", "sampling_parameters": "[1]"}, "sampling_parameters")])
def test_bls_errors_name_the_field(server, body, field):
    status, out = generate(server, "tensorrt_llm_bls", body)
    assert status == 400 and field in out["error"], out
    r = requests.post(f"http://{server.http_url}/v2/models/tensorrt_llm_bls/generate_stream",
                      json={**body, "stream": True}, timeout=60)
    events = [json.loads(line[len(b"data: "):]) for line in r.iter_lines() if line.startswith(b"data: ")]
    assert events and field in events[-1].get("error", ""), events


# -- cancellation through tensorrt_llm_bls ---------------------------------------------------------
def long_stream(server, prompt: str, request_id: str = "") -> Stream:
    named = end_to_end_client_inputs([prompt], LONG, True, end_id=-1)
    return Stream(server).send("tensorrt_llm_bls", named, request_id=request_id)


def test_a_cancelled_stream_frees_its_slot_and_the_next_request_is_served(server):
    start, _ = settled_emitted(server)
    stream = long_stream(server, "Once upon a time", request_id="me")
    assert len(stream.read(limit=3)) == 3
    stream.cancel()
    stopped, after_s = settled_emitted(server)
    # The counter stops at once (metrics are exported on a request's last output): the stream
    # notices the cancellation at its next response and stops the engine's request, which
    # ends at the engine's next step (about 4 tokens in all here; the bound allows a slow client).
    assert after_s < 2.0 and stopped - start < LONG / 10, (after_s, stopped - start)
    answer = one_stream(server, "tensorrt_llm_bls", end_to_end_client_inputs(["next"], 8, True, end_id=-1))
    assert answer[-1].final and len(answer) == 8 and all(r.error is None for r in answer)
    assert server.is_ready()


def test_a_generate_stream_disconnect_cancels_too(server):
    """Triton 2.51 reports an HTTP client that closes its generate_stream as a cancellation."""
    start, _ = settled_emitted(server)
    r = requests.post(f"http://{server.http_url}/v2/models/tensorrt_llm_bls/generate_stream", stream=True,
                      json={"text_input": "Once upon a time", "max_tokens": LONG, "end_id": -1, "stream": True},
                      timeout=60)
    events = 0
    for line in r.iter_lines():
        events += line.startswith(b"data: ")
        if events == 3:
            break
    r.close()
    stopped, after_s = settled_emitted(server)
    assert after_s < 2.0 and stopped - start < LONG / 10, (after_s, stopped - start)


def test_sixteen_streams_cancelled_at_random_points(server):
    rng = random.Random(3)
    prompts = [f"Story number {i}: once upon a time" for i in range(SLOTS)]
    cancelled = set(rng.sample(range(SLOTS), SLOTS // 2))
    cut_after = {i: rng.randint(1, 6) for i in cancelled}
    whole_len = 24
    answers: dict[int, list[Response]] = {}
    start = threading.Barrier(SLOTS)

    def client(i):
        start.wait()
        if i in cancelled:
            stream = long_stream(server, prompts[i])
            answers[i] = stream.read(limit=cut_after[i])
            time.sleep(rng.random() * 0.3)
            stream.cancel()
        else:
            answers[i] = one_stream(server, "tensorrt_llm_bls",
                                    end_to_end_client_inputs([prompts[i]], whole_len, True, end_id=-1))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(SLOTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    for i in range(SLOTS):
        assert all(r.error is None for r in answers[i]), (i, answers[i])
    settled_emitted(server)
    # Every stream that was not cancelled is whole: its text is its request's alone.
    for i in sorted(set(range(SLOTS)) - cancelled):
        status, alone = generate(server, "ensemble", {"text_input": prompts[i], "max_tokens": whole_len,
                                                      "end_id": -1, "exclude_input_in_output": True})
        assert status == 200 and texts(answers[i]) == alone["text_output"], i
        assert answers[i][-1].final
    # No slot is held: with no queue, SLOTS requests at once are all admitted.
    results: list = [None] * SLOTS

    def short(i):
        results[i] = one_stream(server, "tensorrt_llm_bls", end_to_end_client_inputs([prompts[i]], 4, True))

    threads = [threading.Thread(target=short, args=(i,)) for i in range(SLOTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for i, answer in enumerate(results):
        assert answer and all(r.error is None for r in answer) and answer[-1].final, (i, answer)
    assert server.is_ready()
