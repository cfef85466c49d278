"""End to end through a real tritonserver: the ensemble over HTTP and gRPC, streaming
text exactness, and every bad input answered with an error naming the field while the
server stays READY. One server for the module (the `triton` fixture, decoupled mode)."""
from __future__ import annotations

import json
import queue

import numpy as np
import pytest
import requests

from conftest import E2E_LIMITS

CURL_BODY = {"text_input": "What is ML?", "max_tokens": 50, "bad_words": "", "stop_words": "",
             "pad_id": 2, "end_id": 2}
LIMIT = int(E2E_LIMITS["max_tokens_limit"])


def generate(server, body: dict):
    r = requests.post(f"http://{server.http_url}/v2/models/ensemble/generate", json=body, timeout=120)
    return r.status_code, r.json()


def generate_stream(server, body: dict) -> tuple[int, list[dict]]:
    r = requests.post(f"http://{server.http_url}/v2/models/ensemble/generate_stream", json=body,
                      timeout=120, stream=True)
    lines = list(r.iter_lines())
    events = [json.loads(line[len(b"data: "):]) for line in lines if line.startswith(b"data: ")]
    if not events and lines:  # refused before streaming began (e.g. a missing input): plain JSON
        events = [json.loads(b"".join(lines))]
    return r.status_code, events


def assert_healthy(server):
    assert server.is_ready()
    status, out = generate(server, {"text_input": "hello", "max_tokens": 3})
    assert status == 200 and isinstance(out["text_output"], str), out


def test_curl_generate(triton):
    status, out = generate(triton, CURL_BODY)
    assert status == 200, out
    assert out["text_output"].startswith("What is ML?")  # exclude_input_in_output defaults to false
    for key in ("cum_log_probs", "output_log_probs", "acceptance_rate", "total_accepted_draft_tokens",
                "total_draft_tokens"):
        assert key in out


def test_vllms_additional_outputs_and_the_flags_that_ask_for_them(triton, tokenizer):
    """vLLM's backend answers `finish_reason`, `num_input_tokens` and `cumulative_logprob`
    when its flags ask; here they are on every response, and the flags are accepted (a
    stream: "None" until the last)."""
    flags = {f"return_{name}": True for name in ("finish_reason", "cumulative_logprob", "logprobs",
                                                  "num_input_tokens", "num_output_tokens")}
    body = {"text_input": "What is ML?", "max_tokens": 6, "end_id": -1, **flags}
    status, out = generate(triton, body)
    assert status == 200, out
    assert (out["finish_reason"], out["num_output_tokens"]) == ("length", 6)
    assert out["num_input_tokens"] == len(tokenizer.encode("What is ML?"))
    assert len(out["output_log_probs"]) == 6  # return_logprobs is return_log_probs
    assert out["cumulative_logprob"] == pytest.approx(sum(out["output_log_probs"]), abs=1e-4)
    assert out["cumulative_logprob"] < 0
    status, alone = generate(triton, {"text_input": "What is ML?", "max_tokens": 6, "end_id": -1,
                                      "return_cumulative_logprob": True})  # asks for log-probs by itself
    assert status == 200 and alone["cumulative_logprob"] == pytest.approx(out["cumulative_logprob"], abs=1e-4)
    status, events = generate_stream(triton, {**body, "stream": True})
    assert [e["finish_reason"] for e in events] == ["None"] * 5 + ["length"], events


@pytest.mark.parametrize("exclude", [True, False])
def test_generate_stream_pieces_concatenate_to_the_generate_text(triton, exclude):
    body = {"text_input": "The history of the world, in short: é, 日本, 😀.", "max_tokens": 24,
            "exclude_input_in_output": True, "end_id": -1}  # -1: never stop early
    status, whole = generate(triton, body)
    assert status == 200, whole
    # A stream never repeats the prompt, whatever exclude_input_in_output says (TensorRT-LLM's
    # convention): its pieces make the text generate answers without the prompt.
    status, events = generate_stream(triton, {**body, "exclude_input_in_output": exclude, "stream": True})
    assert status == 200 and all("error" not in e for e in events), events
    assert len(events) > 1
    assert "".join(e["text_output"] for e in events) == whole["text_output"]


def _grpc_stream(server, requests_inputs, parameters=None):
    """Sends each request's inputs (and `parameters[n]`, its request parameters) on one gRPC
    stream; returns [(texts, error)] per request."""
    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    answers = []
    try:
        for n, named in enumerate(requests_inputs):
            inputs = []
            for name, array in named.items():
                dtype = "BYTES" if array.dtype == object else {np.int32: "INT32", np.bool_: "BOOL",
                                                               np.float32: "FP32"}[array.dtype.type]
                tensor = grpcclient.InferInput(name, list(array.shape), dtype)
                tensor.set_data_from_numpy(array)
                inputs.append(tensor)
            client.async_stream_infer("ensemble", inputs, request_id=str(n), enable_empty_final_response=True,
                                      parameters=parameters[n] if parameters else None)
            texts, error = [], None
            while True:
                result, err = results.get(timeout=120)
                if err is not None:
                    error = str(err)
                    break
                response = result.get_response()
                out = result.as_numpy("text_output")
                if out is not None:
                    texts.extend(t.decode("utf-8") for t in out.reshape(-1))
                if response.parameters["triton_final_response"].bool_param:
                    break
            answers.append((texts, error))
    finally:
        client.stop_stream()
        client.close()
    return answers


def _inputs(text: str, max_tokens: int, **extra):
    named = {"text_input": np.array([[text.encode()]], dtype=object),
             "max_tokens": np.array([[max_tokens]], dtype=np.int32),
             "stream": np.array([[True]]), "exclude_input_in_output": np.array([[True]])}
    named.update(extra)
    return named


def test_grpc_streaming_and_errors_end_with_the_final_flag(triton):
    prompt = "Once upon a time"
    status, whole = generate(triton, {"text_input": prompt, "max_tokens": 16, "exclude_input_in_output": True})
    assert status == 200
    answers = _grpc_stream(triton, [
        _inputs(prompt, 16),
        _inputs(prompt, 16, temperature=np.array([[-1.0]], np.float32)),  # error mid-stream session
        _inputs(prompt, 16),
    ])
    assert "".join(answers[0][0]) == whole["text_output"] and answers[0][1] is None
    assert "temperature" in answers[1][1]
    assert "".join(answers[2][0]) == whole["text_output"]


def test_grpc_wrong_datatype_names_the_field(triton):
    answers = _grpc_stream(triton, [{**_inputs("hi", 4), "max_tokens": np.array([[4.0]], np.float32)}])
    assert "max_tokens" in answers[0][1]
    assert_healthy(triton)


BAD_BODIES = [
    ({"text_input": "", "max_tokens": 4}, "text_input"),
    ({"max_tokens": 4}, "text_input"),
    ({"text_input": "hi", "max_tokens": 0}, "max_tokens"),
    ({"text_input": "hi", "max_tokens": -5}, "max_tokens"),
    ({"text_input": "hi", "max_tokens": LIMIT + 1}, "max_tokens"),
    ({"text_input": "hi " * 400, "max_tokens": 4}, "prompt"),
    ({"text_input": "hi", "max_tokens": 4, "beam_width": 2}, "beam_width"),
    ({"text_input": "hi", "max_tokens": 4, "temperature": -0.5}, "temperature"),
    ({"text_input": "hi", "max_tokens": 4, "top_p": 1.5}, "top_p"),
    ({"text_input": "hi", "max_tokens": 4, "top_k": -2}, "top_k"),
    ({"text_input": "hi", "max_tokens": 4, "min_p": 1.5}, "min_p"),
    ({"text_input": "hi", "max_tokens": 4, "repetition_penalty": 0.0}, "repetition_penalty"),
    ({"text_input": "hi", "max_tokens": 4, "speculative_method": "magic"}, "speculative_method"),
    ({"text_input": "hi", "max_tokens": 4, "prompt_lookup_tokens": -1}, "prompt_lookup_tokens"),
    # The generate endpoint makes a parameter named as an input into that input; the others
    # (vLLM's stop) reach the models as request parameters.
    ({"text_input": "hi", "parameters": {"max_tokens": 0}}, "max_tokens"),
    ({"text_input": "hi", "parameters": {"stop": 5}}, "stop"),
    ({"text_input": "hi", "sampling_parameters": "{not json"}, "sampling_parameters"),
    ({"text_input": "hi", "sampling_parameters": json.dumps({"top_p": 1.5})}, "top_p"),
    ({"text_input": "hi", "sampling_parameters": json.dumps({"seed": -1})}, "seed"),
    ({"text_input": "hi", "sampling_parameters": json.dumps({"min_p": -0.1})}, "min_p"),
    ({"text_input": "hi", "sampling_parameters": json.dumps({"max_tokens": 2.5})}, "max_tokens"),
    ({"text_input": "hi", "sampling_parameters": json.dumps({"n": 0})}, "num_return_sequences"),
]


@pytest.mark.parametrize("body,field", BAD_BODIES, ids=[f for _, f in BAD_BODIES])
def test_bad_input_is_a_400_naming_the_field_and_the_server_stays_ready(triton, body, field):
    status, out = generate(triton, body)
    assert status == 400, out
    assert field in out["error"], out
    status, events = generate_stream(triton, {**body, "stream": True})  # the stream ends, with the error
    assert events and field in events[-1].get("error", ""), events
    assert_healthy(triton)


@pytest.mark.parametrize("body", [{"text_input": "hi", "max_tokens": "abc"},
                                  {"text_input": 7, "max_tokens": 4},
                                  {"text_input": "hi", "max_tokens": 4, "stream": "yes"},
                                  {"text_input": "hi", "parameters": {"temperature": "hot"}},
                                  {"text_input": "hi", "max_tokens": 4, "parameters": {"max_tokens": 9}}])
def test_wrong_json_types_are_refused_and_the_server_stays_ready(triton, body):
    # Triton's generate endpoint refuses these before any model runs; its message does not
    # name the field (the gRPC path does, see test_grpc_wrong_datatype_names_the_field).
    status, out = generate(triton, body)
    assert status >= 400 and "error" in out
    assert_healthy(triton)


def test_genai_perf_request_shape(triton):
    """GenAI-Perf (kserve, tensorrtllm) sends each input with dims [1], min_length when deterministic."""
    answers = _grpc_stream(triton, [{**_inputs("Tell me a story", 8), "min_length": np.array([[8]], np.int32)}])
    assert answers[0][1] is None and answers[0][0]


def test_stop_words_and_bad_words_are_accepted(triton):
    status, out = generate(triton, {"text_input": "hi", "max_tokens": 8, "stop_words": "foo,bar",
                                    "bad_words": ["x", "y,z"], "exclude_input_in_output": True})
    assert status == 200, out


def test_vllms_curl_as_its_readme_writes_it(triton):
    """vLLM's Triton backend README: no max_tokens (vLLM's default, 16, applies), the
    settings as request parameters."""
    status, out = generate(triton, {"text_input": "What is Triton Inference Server?",
                                    "parameters": {"stream": False, "temperature": 0}})
    assert status == 200, out
    assert 1 <= int(np.asarray(out["num_output_tokens"]).reshape(-1)[0]) <= 16
    assert out["text_output"].startswith("What is Triton Inference Server?")


def test_settings_as_request_parameters_or_sampling_parameters_equal_the_same_inputs(triton):
    """One seeded sampled request sent three ways gives one answer. Were the parameters
    ignored it would be greedy and 16 tokens long (end_id -1: never stops early)."""
    settings = {"max_tokens": 12, "temperature": 1.5, "top_k": 40, "seed": 11, "end_id": -1,
                "exclude_input_in_output": True}
    prompt = {"text_input": "Write a word about the sea:"}
    answers = []
    vllm = {**{k: v for k, v in settings.items() if k != "end_id"}, "ignore_eos": True}  # vLLM's name for it
    for body in ({**prompt, **settings}, {**prompt, "parameters": settings},
                 {**prompt, "sampling_parameters": json.dumps(vllm)}):
        status, out = generate(triton, body)
        assert status == 200, out
        answers.append((out["text_output"], int(np.asarray(out["num_output_tokens"]).reshape(-1)[0])))
    assert answers[0][1] == 12 and answers.count(answers[0]) == 3, answers
    # gRPC request parameters (which no endpoint turns into inputs) reach the models as such;
    # a sent input wins over a parameter of the same meaning
    named = {"text_input": np.array([[prompt["text_input"].encode()]], dtype=object),
             "stream": np.array([[True]])}
    grpc = _grpc_stream(triton, [named, {**named, "max_tokens": np.array([[12]], np.int32)}, named],
                        [settings, {**settings, "max_tokens": 3}, {**settings, "temperature": "hot"}])
    for texts, error in grpc[:2]:
        assert ("".join(texts), error) == (answers[0][0], None), grpc
    assert "request parameter temperature" in grpc[2][1] and not grpc[2][0], grpc
    status, greedy = generate(triton, {**prompt, **settings, "temperature": 0.0, "seed": 0})
    assert status == 200 and greedy["text_output"] != answers[0][0]


def test_min_p_of_one_keeps_only_the_likeliest_token_sent_any_way(triton):
    """min_p 1 keeps the tokens as likely as the likeliest: a sampled request answers as a
    greedy one, whatever its seed, as an input, a request parameter (beside vLLM's top_k -1,
    no top-k) or in sampling_parameters. min_p asks for sampling as top_k and top_p do, so
    at min_p 0.001 the same seeds answer differently."""
    prompt = {"text_input": "Write a word about the sea:", "max_tokens": 12, "exclude_input_in_output": True}
    status, greedy = generate(triton, {**prompt, "temperature": 0.0})
    assert status == 200, greedy
    sampled = {"temperature": 1.5, "min_p": 1.0}
    bodies = [{**prompt, **sampled, "seed": 1}, {**prompt, "parameters": {**sampled, "seed": 2, "top_k": -1}},
              {**prompt, "sampling_parameters": json.dumps({**sampled, "seed": 3})}]
    for body in bodies:
        status, out = generate(triton, body)
        assert (status, out.get("text_output")) == (200, greedy["text_output"]), (body, out)
    texts = set()
    for seed in (1, 2, 3):
        status, out = generate(triton, {**prompt, "temperature": 1.5, "min_p": 0.001, "seed": seed})
        texts.add(out.get("text_output"))
    assert greedy["text_output"] not in texts and len(texts) == 3, texts


def test_grpc_sampling_parameters_as_vllms_client_sends_them(triton):
    status, whole = generate(triton, {"text_input": "Once upon a time", "max_tokens": 10,
                                      "exclude_input_in_output": True})
    assert status == 200, whole
    as_json = np.array([[json.dumps({"max_tokens": 10, "temperature": 0}).encode()]], dtype=object)
    named = _inputs("Once upon a time", 1, sampling_parameters=as_json)
    del named["max_tokens"]
    answers = _grpc_stream(triton, [named])
    assert answers[0][1] is None and "".join(answers[0][0]) == whole["text_output"]
