"""The OpenAI front door without Triton: request validation, stop strings, Triton input
arrays, the request flow over a scripted stream, and the web layer (API key, error
JSON, Server-Sent Events, disconnects) driven by the official `openai` package.
"""
from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest

from openai_frontend import sampling_defaults
from openai_frontend.protocol import CHAT, COMPLETIONS, OpenAIError, parse_request
from openai_frontend.sglang import parse_generate
from openai_frontend.stops import StopMatcher, first_stop
from openai_frontend.triton_grpc import (TEXT, TOKENS, Piece, ServerFacts, TargetModel, build_inputs, csv_word,
                                         model_kind, triton_error)

from conftest import TOKENIZER_DIR

openai = pytest.importorskip("openai")

CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TEXT_BODY = {"model": "m", "prompt": "hi"}
ENSEMBLE_INPUTS = {"text_input": "BYTES", "max_tokens": "INT32", "stream": "BOOL", "exclude_input_in_output": "BOOL",
                   "temperature": "FP32", "top_p": "FP32", "top_k": "INT32", "min_p": "FP32", "seed": "UINT64",
                   "stop_words": "BYTES",
                   "end_id": "INT32", "min_tokens": "INT32", "speculative_method": "BYTES", "eagle_depth": "INT32",
                   "embedding_bias_words": "BYTES", "embedding_bias_weights": "FP32"}
TOKEN_INPUTS = {"input_ids": "INT32", "input_lengths": "INT32", "request_output_len": "INT32", "streaming": "BOOL",
                "runtime_top_p": "FP32", "runtime_top_k": "INT32", "temperature": "FP32", "random_seed": "UINT64",
                "end_id": "INT32", "stop_words_list": "INT32", "return_log_probs": "BOOL", "min_tokens": "INT32",
                "exclude_input_in_output": "BOOL", "top_log_probs": "INT32", "embedding_bias": "FP32",
                "return_prompt_log_probs": "BOOL", "min_p": "FP32"}
ENSEMBLE = TargetModel("ensemble", TEXT, ENSEMBLE_INPUTS, frozenset({"text_output"}), batched=True)
TOKEN_OUTPUTS = {"output_ids", "sequence_length", "output_log_probs", "output_top_token_ids", "output_top_log_probs",
                 "prompt_log_probs", "prompt_top_token_ids", "prompt_top_log_probs"}
TOKEN_MODEL = TargetModel("speculative_decoding", TOKENS, TOKEN_INPUTS, frozenset(TOKEN_OUTPUTS), batched=True)


# -- requests ---------------------------------------------------------------------------------
def test_defaults_follow_openai():
    gen = parse_request(CHAT_BODY, CHAT)
    assert gen.sampling == {"temperature": 1.0, "top_p": 1.0}
    assert (gen.max_tokens, gen.stop, gen.stream, gen.logprobs) == (None, (), False, False)
    assert gen.messages == ({"role": "user", "content": "hi"},)


MODEL_SAMPLING = {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1}


def test_the_models_sampling_fills_only_the_fields_a_request_leaves_out():
    assert parse_request(CHAT_BODY, CHAT, MODEL_SAMPLING).sampling == MODEL_SAMPLING
    assert parse_request({**TEXT_BODY, "temperature": None}, COMPLETIONS, MODEL_SAMPLING).sampling == MODEL_SAMPLING
    # what the client sends wins, off values included: top_k -1 and min_p 0 stay off
    sent = {"temperature": 0, "top_p": 1, "top_k": -1, "min_p": 0, "repetition_penalty": 1.0}
    assert parse_request({**CHAT_BODY, **sent}, CHAT, MODEL_SAMPLING).sampling == {
        "temperature": 0.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}
    partial = parse_request({**TEXT_BODY, "temperature": 0.7}, COMPLETIONS, {"temperature": 0.2, "top_p": 0.9})
    assert partial.sampling == {"temperature": 0.7, "top_p": 0.9}
    # SGLang's /generate: its sampling_params names, the same defaults
    gen, _, _ = parse_generate({"text": "hi", "sampling_params": {"top_p": 0.5, "sampling_seed": 3}}, "m", 16,
                               {"temperature": 0.2, "top_p": 0.9})
    assert gen.sampling == {"temperature": 0.2, "top_p": 0.5, "seed": 3}
    assert parse_generate({"text": "hi"}, "m", 16)[0].sampling == {"temperature": 1.0, "top_p": 1.0}


def _generation_config(directory, **keys):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, **keys}))
    return directory


def test_sampling_defaults_come_from_generation_config(tmp_path):
    model = _generation_config(tmp_path / "model", do_sample=True, temperature=0.6, top_p=0.95, top_k=0, min_p=0,
                               repetition_penalty=1.05, max_new_tokens=99)
    want = {"temperature": 0.6, "top_p": 0.95, "repetition_penalty": 1.05}  # top_k 0 and min_p 0 are off
    assert sampling_defaults.load("auto", model) == want
    assert sampling_defaults.load(str(model), None) == want
    assert sampling_defaults.load("openai", model) == sampling_defaults.load("vllm", model) == {}
    assert sampling_defaults.load("auto", tmp_path) == sampling_defaults.load("auto", None) == {}  # none there
    assert sampling_defaults.describe(want) == "temperature 0.6, top_p 0.95, repetition_penalty 1.05"
    with pytest.raises(sampling_defaults.SamplingDefaultsError, match="--generation-config .*: no generation_config"):
        sampling_defaults.load(str(tmp_path), None)


@pytest.mark.parametrize("key,value,message", [
    ("temperature", "hot", "temperature: must be a number"),
    ("temperature", 2.5, "temperature: must be <= 2.0, got 2.5"),
    ("top_p", 0, "top_p: must be > 0.0, got 0"),
    ("top_k", 1.5, "top_k: must be an integer"),
    ("top_k", -1, "top_k: must be >= 0, got -1"),
    ("top_k", True, "top_k: must be an integer"),
    ("min_p", 1.5, "min_p: must be <= 1.0, got 1.5"),
    ("repetition_penalty", 0, "repetition_penalty: must be > 0.0, got 0"),
])
def test_a_bad_generation_config_is_refused_by_key(tmp_path, key, value, message):
    model = _generation_config(tmp_path, **{key: value})
    with pytest.raises(sampling_defaults.SamplingDefaultsError, match=message) as e:
        sampling_defaults.load("auto", model)
    assert str(model / "generation_config.json") in str(e.value)


def test_the_default_models_sampling_is_its_model_cards():
    """What setup writes for SmolLM2 is what the front door serves by default."""
    import setup_model

    if not (TOKENIZER_DIR / "generation_config.json").is_file():
        pytest.skip("SmolLM2 not set up (python tools/setup_model.py)")
    assert sampling_defaults.load("auto", TOKENIZER_DIR) == setup_model.SMOLLM2_SAMPLING == {
        "temperature": 0.2, "top_p": 0.9}


def test_fields_are_read():
    gen = parse_request({**CHAT_BODY, "max_tokens": 5, "max_completion_tokens": 7, "stop": "x", "temperature": 0,
                         "seed": 3, "top_k": -1, "stream": True, "stream_options": {"include_usage": True},
                         "logprobs": True, "speculative_method": "eagle2", "eagle_total_tokens": 16,
                         "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                   {"type": "text", "text": "b"}]}]}, CHAT)
    assert gen.max_tokens == 7 and gen.stop == ("x",) and gen.stream and gen.include_usage and gen.logprobs
    assert gen.sampling == {"temperature": 0.0, "top_p": 1.0, "seed": 3, "top_k": 0}
    assert gen.speculative == {"speculative_method": "eagle2", "eagle_total_tokens": 16}
    assert gen.messages[0]["content"] == "a\nb"
    # min_p (vLLM's and SGLang's): 0 is off and is sent to no model, so a model without it takes it
    assert parse_request({**CHAT_BODY, "min_p": 0.05}, CHAT).sampling["min_p"] == pytest.approx(0.05)
    assert "min_p" not in parse_request({**CHAT_BODY, "min_p": 0}, CHAT).sampling
    gen = parse_request({**TEXT_BODY, "prompt": ["one"], "logprobs": 0, "stop": ["a", "b", "a"]}, COMPLETIONS)
    assert gen.prompts == ("one",) and gen.logprobs and gen.stop == ("a", "b") and (gen.n, gen.echo) == (1, False)
    # the API's four prompt forms; n and best_of == n; echo
    for prompt, want in [("a", ("a",)), (["a", "b"], ("a", "b")), ([5, 0, 7], ((5, 0, 7),)),
                         ([[1, 2], [3]], ((1, 2), (3,))), (["a", [4]], ("a", (4,)))]:
        gen = parse_request({**TEXT_BODY, "prompt": prompt, "n": 2, "best_of": 2, "echo": True}, COMPLETIONS)
        assert (gen.prompts, gen.n, gen.echo) == (want, 2, True)


BAD_FIELDS = [  # (endpoint, body changes, the param named)
    (CHAT, {"n": 0}, "n"),
    (CHAT, {"n": 129}, "n"),
    (CHAT, {"n": "two"}, "n"),
    (CHAT, {"temperature": -0.5}, "temperature"),
    (CHAT, {"temperature": "hot"}, "temperature"),
    (CHAT, {"top_p": 0}, "top_p"),
    (CHAT, {"top_p": 1.5}, "top_p"),
    (CHAT, {"max_tokens": 0}, "max_tokens"),
    (CHAT, {"max_completion_tokens": -3}, "max_completion_tokens"),
    (CHAT, {"max_tokens": 2.5}, "max_tokens"),
    (CHAT, {"seed": -1}, "seed"),
    (CHAT, {"stop": [1]}, "stop"),
    (CHAT, {"stop": ""}, "stop"),
    (CHAT, {"stop_token_ids": 2}, "stop_token_ids"),
    (COMPLETIONS, {"stop_token_ids": [2, -1]}, "stop_token_ids"),
    (CHAT, {"stop_token_ids": [True]}, "stop_token_ids"),
    (CHAT, {"logprobs": "yes"}, "logprobs"),
    (CHAT, {"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
    (CHAT, {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    (CHAT, {"stream_options": {"include_usage": True}}, "stream_options"),
    (CHAT, {"stream": "yes"}, "stream"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    (CHAT, {"presence_penalty": 5}, "presence_penalty"),
    (CHAT, {"frequency_penalty": -3}, "frequency_penalty"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (CHAT, {"response_format": {"type": "json_object"}}, "response_format"),
    (CHAT, {"logit_bias": {"x": 1}}, "logit_bias"),
    (CHAT, {"logit_bias": {"5": 101}}, "logit_bias"),
    (CHAT, {"logit_bias": {"5": "high"}}, "logit_bias"),
    (CHAT, {"logit_bias": [5]}, "logit_bias"),
    (CHAT, {"model": ""}, "model"),
    (CHAT, {"speculative_method": "warp"}, "speculative_method"),
    (CHAT, {"eagle_depth": 0}, "eagle_depth"),
    (CHAT, {"num_draft_tokens": -1}, "num_draft_tokens"),
    (CHAT, {"prompt_lookup_tokens": -1}, "prompt_lookup_tokens"),
    (CHAT, {"min_tokens": -1}, "min_tokens"),
    (CHAT, {"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    (CHAT, {"top_k": -2}, "top_k"),
    (CHAT, {"min_p": 1.5}, "min_p"),
    (COMPLETIONS, {"min_p": "0.1"}, "min_p"),
    (CHAT, {"repetition_penalty": 0}, "repetition_penalty"),
    (CHAT, {"ignore_eos": 1}, "ignore_eos"),
    (COMPLETIONS, {"prompt": None}, "prompt"),
    (COMPLETIONS, {"prompt": [1, -2, 3]}, "prompt"),
    (COMPLETIONS, {"prompt": [1, True]}, "prompt"),
    (COMPLETIONS, {"prompt": []}, "prompt"),
    (COMPLETIONS, {"prompt": [[]]}, "prompt"),
    (COMPLETIONS, {"prompt": ["a", ""]}, "prompt"),
    (COMPLETIONS, {"prompt": ["a", 3]}, "prompt"),
    (COMPLETIONS, {"prompt": {"text": "a"}}, "prompt"),
    (COMPLETIONS, {"prompt": ""}, "prompt"),
    (COMPLETIONS, {"prompt": ["a"] * 65, "n": 2}, "n"),
    (COMPLETIONS, {"logprobs": 21}, "logprobs"),
    (COMPLETIONS, {"logprobs": -1}, "logprobs"),
    (COMPLETIONS, {"max_tokens": 0}, "max_tokens"),  # 0 only with echo
    (COMPLETIONS, {"echo": "yes"}, "echo"),
    (COMPLETIONS, {"suffix": "end"}, "suffix"),
    (COMPLETIONS, {"best_of": 2}, "best_of"),
    (COMPLETIONS, {"best_of": 1, "n": 3}, "best_of"),
    (COMPLETIONS, {"max_tokens": "many"}, "max_tokens"),
]


@pytest.mark.parametrize("endpoint, change, param", BAD_FIELDS, ids=[f"{e}-{p}" for e, _, p in BAD_FIELDS])
def test_every_bad_field_is_a_400_naming_it(endpoint, change, param):
    body = {**(CHAT_BODY if endpoint == CHAT else TEXT_BODY), **change}
    with pytest.raises(OpenAIError) as e:
        parse_request(body, endpoint)
    assert e.value.status == 400 and e.value.param == param and e.value.message.startswith(param)
    assert e.value.body()["error"]["type"] == "invalid_request_error"


def test_body_must_be_an_object():
    with pytest.raises(OpenAIError) as e:
        parse_request([1], CHAT)
    assert e.value.status == 400


# -- stop strings -----------------------------------------------------------------------------
def test_stop_matcher_holds_back_a_possible_start():
    m = StopMatcher(["END"])
    assert [m.feed("abcE"), m.feed("N"), m.feed("D more")] == ["abc", "", ""]
    assert m.stopped and m.finish() == ""
    m = StopMatcher(["END"])
    assert m.feed("abcEN") == "abc" and m.feed("x") == "ENx" and m.finish() == "" and not m.stopped
    m = StopMatcher(["\n\n"])
    assert m.feed("a\n") == "a" and m.finish() == "\n"


def test_stop_matcher_equals_cutting_the_whole_text():
    rng = random.Random(0)
    for _ in range(400):
        text = "".join(rng.choice("abc\n") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("abc\n") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        include = rng.random() < 0.5  # vLLM's include_stop_str_in_output
        m = StopMatcher(stops, include)
        out = "".join(m.feed(p) for p in pieces) + m.finish()
        at = first_stop(text, stops)
        matched = next((s for s in stops if text.startswith(s, at)), None) if at >= 0 else None
        end = len(text) if at < 0 else at + (len(matched) if include else 0)
        assert out == text[:end], (text, stops, pieces, include)
        assert m.stopped == (at >= 0) and m.matched == matched


# -- Triton inputs ----------------------------------------------------------------------------
def test_model_kinds():
    assert model_kind(ENSEMBLE_INPUTS, ["text_output"]) == TEXT
    assert model_kind(TOKEN_INPUTS, ["output_ids"]) == TOKENS
    assert model_kind(["QUERY", "REQUEST_OUTPUT_LEN"], ["INPUT_ID"]) is None  # preprocessing
    assert model_kind(["TOKENS_BATCH"], ["OUTPUT"]) is None


def test_inputs_take_the_declared_names_types_and_shapes():
    arrays = build_inputs(ENSEMBLE, {"text_input": "hé", "max_tokens": 5, "stream": True, "top_p": 0.5, "seed": 7,
                                     "stop_words": [csv_word("a,b"), csv_word("c")], "end_id": None})
    assert arrays["text_input"].dtype == np.object_ and arrays["text_input"].shape == (1, 1)
    assert arrays["text_input"][0, 0] == "hé".encode()
    assert arrays["max_tokens"].dtype == np.int32 and arrays["max_tokens"].shape == (1, 1)
    assert arrays["seed"].dtype == np.uint64 and arrays["top_p"].dtype == np.float32
    assert arrays["stop_words"].tolist() == [[b'"a,b"', b"c"]] and "end_id" not in arrays
    arrays = build_inputs(TOKEN_MODEL, {"input_ids": [5, 6, 7], "max_tokens": 4, "stream": False, "top_p": 0.9,
                                        "seed": 1, "stop_words_list": np.array([[5, 6], [2, -1]], np.int32)})
    assert arrays["input_ids"].shape == (1, 3) and arrays["request_output_len"].tolist() == [[4]]
    assert set(arrays) == {"input_ids", "request_output_len", "streaming", "runtime_top_p", "random_seed",
                           "stop_words_list"}
    assert arrays["stop_words_list"].shape == (1, 2, 2)
    unbatched = TargetModel("u", TEXT, ENSEMBLE_INPUTS, frozenset({"text_output"}), batched=False)
    assert build_inputs(unbatched, {"max_tokens": 3})["max_tokens"].shape == (1,)


def test_a_value_the_model_does_not_take_is_a_400_naming_it():
    with pytest.raises(OpenAIError) as e:
        build_inputs(TOKEN_MODEL, {"speculative_method": "eagle2"})
    assert e.value.status == 400 and e.value.param == "speculative_method"
    trtllm = TargetModel("tensorrt_llm", TOKENS, {k: v for k, v in TOKEN_INPUTS.items() if k != "min_p"},
                         frozenset(TOKEN_OUTPUTS), batched=True)
    with pytest.raises(OpenAIError) as e:  # TensorRT-LLM's model has no min_p: refused, not ignored
        build_inputs(trtllm, {"min_p": 0.1})
    assert e.value.param == "min_p"


def test_triton_errors_map_to_statuses():
    assert triton_error("the request queue is full (2 waiting); retry later").status == 503
    assert triton_error("internal error: boom").status == 500
    assert triton_error("max_tokens must be <= 64, got 100").status == 400


# -- the request flow over a scripted stream --------------------------------------------------
class ScriptedStream:
    def __init__(self, pieces, error=None, delay_s=0.0):
        self.pieces, self.error, self.delay_s = pieces, error, delay_s
        self.finished = self.closed = self.cancelled = False

    async def __aiter__(self):
        for piece in self.pieces:
            await asyncio.sleep(self.delay_s)
            self.finished = piece.final
            yield piece
        if self.error is not None:
            self.finished = True
            raise self.error

    def close(self):
        self.closed = True
        self.cancelled = not self.finished


class ScriptedClient:
    """Answers every request with `script(arrays)`'s pieces; keeps the streams it made."""

    def __init__(self, script):
        self.script, self.streams, self.requests = script, [], []

    def stream(self, target, arrays, request_id, outputs):
        self.requests.append(arrays)
        self.outputs = outputs
        stream = self.script(arrays)
        self.streams.append(stream)
        return stream


@pytest.fixture(scope="module")
def front_tokenizer():
    from openai_frontend.tokenization import Tokenizer
    return Tokenizer(TOKENIZER_DIR)


def make_frontend(tokenizer, script, targets=(TOKEN_MODEL, ENSEMBLE)):
    from openai_frontend.service import Frontend
    return Frontend(ScriptedClient(script), list(targets), tokenizer, ServerFacts(max_tokens_limit=64, max_seq_len=512))


def token_pieces(tokenizer, text, per_piece=2, log_prob=-0.5):
    ids = tokenizer.hf.encode(text, add_special_tokens=False)
    groups = [ids[i:i + per_piece] for i in range(0, len(ids), per_piece)]
    return [Piece(token_ids=g, log_probs=[log_prob] * len(g), final=i == len(groups) - 1)
            for i, g in enumerate(groups)]


def run(coro):
    return asyncio.run(coro)


async def collect(agen):
    return [chunk async for chunk in agen]


def test_a_token_model_answer_is_exact(front_tokenizer):
    text = "Hello there, how are you doing today?"
    frontend = make_frontend(front_tokenizer, lambda arrays: ScriptedStream(token_pieces(front_tokenizer, text)))
    n = len(front_tokenizer.hf.encode(text, add_special_tokens=False))
    body = run(frontend.complete(parse_request({**CHAT_BODY, "model": "speculative_decoding", "max_tokens": n,
                                                "logprobs": True}, CHAT)))
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == text
    assert body["choices"][0]["finish_reason"] == "length"  # n tokens of max_tokens n
    prompt = front_tokenizer.hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                    add_generation_prompt=True)
    prompt_ids = front_tokenizer.hf.encode(prompt, add_special_tokens=False)
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": n,
                             "total_tokens": len(prompt_ids) + n}
    sent = frontend.client.requests[0]
    assert sent["input_ids"].tolist() == [prompt_ids] and sent["end_id"].tolist() == [[front_tokenizer.eos_id]]
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == n and "".join(e["token"] for e in content) == text
    assert frontend.client.streams[0].closed and not frontend.client.streams[0].cancelled


def test_top_alternatives_come_with_each_token(front_tokenizer):
    text = "one two three"
    ids = front_tokenizer.hf.encode(text, add_special_tokens=False)
    alternatives = [[(t, -0.1), (7, -2.5), (8, float("-inf"))] for t in ids]  # -inf: ruled out by top_k

    def script(arrays):
        assert arrays["top_log_probs"].tolist() == [[3]] and arrays["return_log_probs"].tolist() == [[True]]
        return ScriptedStream([Piece(token_ids=[t], log_probs=[-0.1], top=[a], final=i == len(ids) - 1)
                               for i, (t, a) in enumerate(zip(ids, alternatives))])

    frontend = make_frontend(front_tokenizer, script)
    seven, eight = front_tokenizer.token_text(7), front_tokenizer.token_text(8)
    chat = run(frontend.complete(parse_request({**CHAT_BODY, "model": "speculative_decoding", "logprobs": True,
                                                "top_logprobs": 3}, CHAT)))
    assert "output_top_log_probs" in frontend.client.outputs
    content = chat["choices"][0]["logprobs"]["content"]
    assert [[a["token"] for a in c["top_logprobs"]] for c in content] == [[c["token"], seven, eight] for c in content]
    assert [a["logprob"] for a in content[0]["top_logprobs"]] == [-0.1, -2.5, -9999.0]  # JSON has no -inf
    text = run(frontend.complete(parse_request({**TEXT_BODY, "model": "speculative_decoding", "logprobs": 3},
                                               COMPLETIONS)))
    top = text["choices"][0]["logprobs"]["top_logprobs"]
    assert top == [{token: -0.1, seven: -2.5, eight: -9999.0} for token in text["choices"][0]["logprobs"]["tokens"]]
    json.dumps(chat, allow_nan=False), json.dumps(text, allow_nan=False)
    old = TargetModel("speculative_decoding", TOKENS, {k: v for k, v in TOKEN_INPUTS.items()
                                                       if k != "top_log_probs"}, TOKEN_MODEL.outputs, batched=True)
    with pytest.raises(OpenAIError) as e:  # a repository whose model has no such input
        make_frontend(front_tokenizer, script, targets=(old,)).prepare(
            parse_request({**TEXT_BODY, "model": "speculative_decoding", "logprobs": 2}, COMPLETIONS))
    assert e.value.param == "logprobs"


def test_logit_bias_reaches_each_kind_of_model_in_its_own_inputs(front_tokenizer):
    frontend = make_frontend(front_tokenizer, lambda arrays: ScriptedStream([Piece(token_ids=[5], final=True)]))
    paris = front_tokenizer.encode_word(" Paris")
    assert len(paris) == 1
    bias = {str(paris[0]): -100, "2": 3.5}  # 2: a special token, its text encodes back to it
    for call in frontend.prepare(parse_request({**CHAT_BODY, "model": "speculative_decoding", "logit_bias": bias,
                                                "n": 2}, CHAT)):
        dense = call.arrays["embedding_bias"]
        assert dense.shape == (1, len(front_tokenizer.hf)) and dense.dtype == np.float32
        assert {int(i): float(dense[0, i]) for i in np.flatnonzero(dense)} == {paris[0]: -100.0, 2: 3.5}
    (call,) = frontend.prepare(parse_request({**CHAT_BODY, "model": "ensemble", "logit_bias": bias}, CHAT))
    assert call.arrays["embedding_bias_words"].tolist() == [[b" Paris", front_tokenizer.token_text(2).encode()]]
    assert call.arrays["embedding_bias_weights"].tolist() == [[-100.0, 3.5]]
    split = next(t for t in range(1000, len(front_tokenizer.hf))  # a token whose text encodes otherwise
                 if front_tokenizer.encode_word(front_tokenizer.token_text(t)) != [t])
    for model, token, words in (("ensemble", split, "encode back"), ("speculative_decoding", 10 ** 6, "outside")):
        with pytest.raises(OpenAIError) as e:
            frontend.prepare(parse_request({**CHAT_BODY, "model": model, "logit_bias": {str(token): 1}}, CHAT))
        assert e.value.param == "logit_bias" and words in e.value.message
    frontend.prepare(parse_request({**CHAT_BODY, "model": "speculative_decoding",
                                    "logit_bias": {str(split): 1}}, CHAT))  # the token model takes it


def test_echo_with_logprobs_scores_the_prompt(front_tokenizer):
    prompt = "The three rivers"
    ids = front_tokenizer.prompt_ids(prompt, templated=False)
    scores = [-1.0 - i for i in range(len(ids) - 1)]
    a, b = front_tokenizer.encode_word(" are long")[:2]

    def script(arrays):
        assert arrays["return_prompt_log_probs"].tolist() == [[True]]
        return ScriptedStream([Piece(token_ids=[a], log_probs=[-0.5], top=[[(a, -0.5)]], prompt_log_probs=scores,
                                     prompt_top=[[(t, s)] for t, s in zip(ids[1:], scores)]),
                               Piece(token_ids=[b], log_probs=[-0.25], top=[[(b, -0.25)]], final=True)])

    frontend = make_frontend(front_tokenizer, script)
    texts = [front_tokenizer.token_text(t) for t in ids]
    alone = run(frontend.complete(parse_request({**TEXT_BODY, "model": "speculative_decoding", "prompt": prompt,
                                                 "echo": True, "logprobs": 1, "max_tokens": 0}, COMPLETIONS)))
    assert frontend.client.requests[-1]["request_output_len"].tolist() == [[1]]  # one token, dropped
    choice = alone["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert alone["usage"]["completion_tokens"] == 0 and alone["usage"]["prompt_tokens"] == len(ids)
    lp = choice["logprobs"]
    assert lp["tokens"] == texts and lp["token_logprobs"] == [None] + scores
    assert lp["top_logprobs"] == [None] + [{t: s} for t, s in zip(texts[1:], scores)]
    assert lp["text_offset"] == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    both = run(frontend.complete(parse_request({**TEXT_BODY, "model": "speculative_decoding", "prompt": prompt,
                                                "echo": True, "logprobs": 1, "max_tokens": 2}, COMPLETIONS)))
    lp = both["choices"][0]["logprobs"]
    generated = [front_tokenizer.token_text(a), front_tokenizer.token_text(b)]
    assert both["choices"][0]["text"] == prompt + "".join(generated)
    assert lp["tokens"] == texts + generated and lp["token_logprobs"] == [None] + scores + [-0.5, -0.25]
    assert lp["text_offset"][len(texts):] == [len(prompt), len(prompt) + len(generated[0])]


def test_a_stop_string_cuts_the_text_and_cancels_the_rest(front_tokenizer):
    text = "one two three four five six seven eight"
    frontend = make_frontend(front_tokenizer, lambda arrays: ScriptedStream(token_pieces(front_tokenizer, text, 1)))
    gen = parse_request({**TEXT_BODY, "model": "speculative_decoding", "stop": [" four", "zzz"], "logprobs": 0},
                        COMPLETIONS)
    body = run(frontend.complete(gen))
    choice = body["choices"][0]
    assert choice["text"] == "one two three" and choice["finish_reason"] == "stop"
    assert choice["logprobs"]["tokens"] == ["one", " two", " three"] and choice["logprobs"]["text_offset"] == [0, 3, 7]
    assert frontend.client.streams[0].cancelled  # the final response never came
    assert frontend.client.requests[0]["streaming"].tolist() == [[True]]  # so the match ends it early
    assert choice["stop_reason"] == " four"  # vLLM's field: the stop string that ended it
    chunks = run(collect(frontend.chunks(parse_request({**TEXT_BODY, "model": "speculative_decoding",
                                                        "stop": " four", "stream": True}, COMPLETIONS))))
    assert "".join(c["choices"][0]["text"] for c in chunks) == "one two three"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["choices"][0]["stop_reason"] == " four"
    assert all(c["choices"][0]["stop_reason"] is None for c in chunks[:-1])
    assert frontend.client.streams[1].cancelled
    # vLLM's include_stop_str_in_output: the text ends after the stop string, its token's log-prob with it
    body = run(frontend.complete(parse_request({**TEXT_BODY, "model": "speculative_decoding", "stop": [" four"],
                                                "logprobs": 0, "include_stop_str_in_output": True}, COMPLETIONS)))
    choice = body["choices"][0]
    assert choice["text"] == "one two three four" and choice["stop_reason"] == " four"
    assert choice["logprobs"]["tokens"] == ["one", " two", " three", " four"]
    # an answer that ends at its length has no stop reason
    body = run(frontend.complete(parse_request({**TEXT_BODY, "model": "speculative_decoding", "max_tokens": 3},
                                               COMPLETIONS)))
    assert body["choices"][0]["stop_reason"] is None


@pytest.mark.parametrize("per_piece", [1, 3])
def test_stop_token_ids_end_a_token_models_answer_before_the_token(front_tokenizer, per_piece):
    text = "one two three four five six seven eight"
    ids = front_tokenizer.hf.encode(text, add_special_tokens=False)
    four = front_tokenizer.encode_word(" four")[0]
    assert ids.count(four) == 1
    frontend = make_frontend(front_tokenizer, lambda arrays: ScriptedStream(token_pieces(front_tokenizer, text,
                                                                                         per_piece)))
    gen = parse_request({**TEXT_BODY, "model": "speculative_decoding", "stop_token_ids": [four, 10 ** 3, four],
                         "logprobs": 0}, COMPLETIONS)
    assert gen.stop_token_ids == (four, 10 ** 3)
    body = run(frontend.complete(gen))
    choice = body["choices"][0]
    assert choice["text"] == "one two three" and choice["finish_reason"] == "stop"
    assert choice["logprobs"]["tokens"] == ["one", " two", " three"]  # the stop token's is left out
    assert body["usage"]["completion_tokens"] == ids.index(four) + 1  # it counts, as in vLLM
    sent = frontend.client.requests[0]
    assert sent["streaming"].tolist() == [[True]]  # so the front door sees the token as it comes
    assert sent["stop_words_list"][0].tolist() == [[four, 10 ** 3], [1, 2]]  # and the engine stops on it too
    assert frontend.client.streams[0].cancelled
    assert choice["stop_reason"] == four  # vLLM's field: the token id that ended it
    chunks = run(collect(frontend.chunks(parse_request({**CHAT_BODY, "model": "speculative_decoding", "stream": True,
                                                        "stop_token_ids": [four]}, CHAT))))
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "one two three"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["choices"][0]["stop_reason"] == four
    # with include_stop_str_in_output the stop token's text and log-prob stay; the count is the same
    body = run(frontend.complete(parse_request({**TEXT_BODY, "model": "speculative_decoding", "stop_token_ids": [four],
                                                "logprobs": 0, "include_stop_str_in_output": True}, COMPLETIONS)))
    choice = body["choices"][0]
    assert choice["text"] == "one two three four" and choice["stop_reason"] == four
    assert choice["logprobs"]["tokens"] == ["one", " two", " three", " four"]
    assert body["usage"]["completion_tokens"] == ids.index(four) + 1


def test_stop_token_ids_become_stop_strings_for_a_text_model(front_tokenizer):
    four = front_tokenizer.encode_word(" four")[0]
    frontend = make_frontend(front_tokenizer, lambda arrays: ScriptedStream(
        [Piece(text="one two"), Piece(text=" three four"), Piece(text=" five", final=True)]))
    body = run(frontend.complete(parse_request({**CHAT_BODY, "model": "ensemble", "stop": ["zzz"],
                                                "stop_token_ids": [four]}, CHAT)))
    assert body["choices"][0]["message"]["content"] == "one two three"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["stop_reason"] == four  # reported as the token the client named
    assert frontend.client.requests[0]["stop_words"].tolist() == [[b"zzz", b" four"]]
    split = next(t for t in range(1000, len(front_tokenizer.hf))  # a token whose text encodes otherwise
                 if front_tokenizer.encode_word(front_tokenizer.token_text(t)) != [t])
    for model, token, words in (("ensemble", split, "encode back"), ("speculative_decoding", 10 ** 6, "outside")):
        with pytest.raises(OpenAIError) as e:
            frontend.prepare(parse_request({**CHAT_BODY, "model": model, "stop_token_ids": [token]}, CHAT))
        assert e.value.param == "stop_token_ids" and words in e.value.message


def test_chunks_open_with_the_role_and_end_with_usage(front_tokenizer):
    text = "abc def ghi"
    frontend = make_frontend(front_tokenizer, lambda arrays: ScriptedStream(
        [Piece(text="abc"), Piece(text=" def"), Piece(text=" ghi", final=True)]))
    gen = parse_request({**CHAT_BODY, "model": "ensemble", "stream": True, "stream_options": {"include_usage": True},
                         "max_tokens": 50}, CHAT)
    chunks = run(collect(frontend.chunks(gen)))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "abc"}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == text
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and all("usage" in c for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == front_tokenizer.count(text)
    sent = frontend.client.requests[0]
    assert sent["stream"].tolist() == [[True]] and sent["exclude_input_in_output"].tolist() == [[True]]
    assert sent["temperature"].tolist() == [[1.0]] and "end_id" not in sent


def test_refusals_come_before_any_chunk(front_tokenizer):
    frontend = make_frontend(front_tokenizer, lambda arrays: ScriptedStream([], error=triton_error("max_tokens must "
                                                                                                  "be <= 64, got 99")))
    agen = frontend.chunks(parse_request({**CHAT_BODY, "model": "ensemble", "stream": True, "max_tokens": 99}, CHAT))
    with pytest.raises(OpenAIError) as e:
        run(agen.__anext__())
    assert e.value.status == 400 and "max_tokens" in e.value.message
    with pytest.raises(OpenAIError) as e:  # text models return no tokens to attach log-probs to
        frontend.prepare(parse_request({**CHAT_BODY, "model": "ensemble", "logprobs": True}, CHAT))
    assert e.value.param == "logprobs"
    with pytest.raises(OpenAIError) as e:
        frontend.prepare(parse_request({**CHAT_BODY, "model": "gpt-4"}, CHAT))
    assert e.value.status == 404 and e.value.code == "model_not_found"



def scripted_by_seed(tokenizer, texts, delays=None):
    """A script that answers the request seeded k with texts[k], one token per piece,
    each piece after delays[k] seconds."""
    def script(arrays):
        seed = int(arrays["random_seed" if "random_seed" in arrays else "seed"].item())
        return ScriptedStream(token_pieces(tokenizer, texts[seed], 1), delay_s=(delays or {}).get(seed, 0.0))
    return script


def test_n_choices_and_several_prompts_are_one_request_each(front_tokenizer):
    texts = {10: "alpha beta gamma", 11: "one two", 12: "red green blue yellow"}
    frontend = make_frontend(front_tokenizer, scripted_by_seed(front_tokenizer, texts))
    ids = front_tokenizer.hf.encode("Count:", add_special_tokens=False)
    body = run(frontend.complete(parse_request(
        {**TEXT_BODY, "model": "speculative_decoding", "prompt": ["Say:", ids], "n": 3, "seed": 10, "echo": True,
         "stop": " gamma", "max_tokens": 50}, COMPLETIONS)))
    sent = frontend.client.requests
    assert [a["random_seed"].item() for a in sent] == [10, 11, 12] * 2  # choice j samples with seed + j
    prompt_ids = front_tokenizer.prompt_ids("Say:", templated=False)
    assert [a["input_ids"].tolist()[0] for a in sent] == [prompt_ids] * 3 + [ids] * 3
    echoes = ["Say:"] * 3 + [front_tokenizer.decode(ids)] * 3
    answers = ["alpha beta", "one two", "red green blue yellow"] * 2
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert [c["text"] for c in body["choices"]] == [e + a for e, a in zip(echoes, answers)]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop"] * 6
    generated = sum(len(front_tokenizer.hf.encode(t, add_special_tokens=False)) for t in texts.values())
    assert body["usage"]["prompt_tokens"] == len(prompt_ids) + len(ids)  # each prompt once
    assert body["usage"]["completion_tokens"] == 2 * generated  # every choice's tokens, " gamma" too
    assert all(stream.closed for stream in frontend.client.streams)
    with pytest.raises(OpenAIError) as e:  # a text model takes no token ids
        frontend.prepare(parse_request({**TEXT_BODY, "model": "ensemble", "prompt": ids}, COMPLETIONS))
    assert e.value.param == "prompt" and "speculative_decoding" in e.value.message
    with pytest.raises(OpenAIError) as e:  # an id the tokenizer does not have
        frontend.prepare(parse_request({**TEXT_BODY, "model": "speculative_decoding",
                                        "prompt": [1, len(front_tokenizer.hf)]}, COMPLETIONS))
    assert e.value.param == "prompt" and "vocabulary" in e.value.message


def test_streamed_choices_interleave_and_each_ends_once(front_tokenizer):
    texts = {0: "the slow one has many words in it", 1: "fast", 2: "a middle answer"}
    delays = {0: 0.02, 1: 0.0, 2: 0.01}
    frontend = make_frontend(front_tokenizer, scripted_by_seed(front_tokenizer, texts, delays))
    chunks = run(collect(frontend.chunks(parse_request(
        {**CHAT_BODY, "model": "speculative_decoding", "n": 3, "seed": 0, "stream": True, "max_tokens": 50,
         "stream_options": {"include_usage": True}}, CHAT))))
    assert chunks[-1]["choices"] == [] and all(len(c["choices"]) == 1 for c in chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1
    order = [c["choices"][0]["index"] for c in chunks[:-1]]
    assert order != sorted(order)  # they interleave
    for k, text in texts.items():
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == k]
        assert mine[0]["delta"]["role"] == "assistant" and not any("role" in m["delta"] for m in mine[1:])
        assert "".join(m["delta"].get("content", "") for m in mine) == text
        assert [m["finish_reason"] for m in mine] == [None] * (len(mine) - 1) + ["stop"]
    count = sum(len(front_tokenizer.hf.encode(t, add_special_tokens=False)) for t in texts.values())
    assert chunks[-1]["usage"]["completion_tokens"] == count


def test_merge_keeps_each_order_and_closing_it_closes_every_iterator():
    from openai_frontend.merge import merge

    closed = []

    async def count(k, delay_s):
        try:
            for i in range(100):
                await asyncio.sleep(delay_s)
                yield k, i
        finally:
            closed.append(k)

    async def scenario():
        merged = merge([count(0, 0.003), count(1, 0.001), count(2, 0.002)])
        got = [await merged.__anext__() for _ in range(12)]
        await merged.aclose()
        return got

    got = run(scenario())
    for k in range(3):
        mine = [i for j, i in got if j == k]
        assert mine == list(range(len(mine)))
    assert {k for k, _ in got} == {0, 1, 2} and sorted(closed) == [0, 1, 2]


def test_merge_reads_at_most_limit_iterators_at_once():
    from openai_frontend.merge import merge

    running, most = set(), [0]

    async def count(k):
        running.add(k)
        most[0] = max(most[0], len(running))
        try:
            for i in range(3):
                await asyncio.sleep(0.001 * (1 + k % 3))
                yield k, i
        finally:
            running.discard(k)

    async def scenario():
        return [item async for item in merge([count(k) for k in range(10)], limit=3)]

    got = run(scenario())
    assert sorted(got) == [(k, i) for k in range(10) for i in range(3)] and most[0] == 3


def test_a_request_keeps_at_most_the_engines_batch_of_choices_in_flight(front_tokenizer):
    """128 choices against an engine of 4 slots: never more than 4 Triton requests open
    (the engine's queue would refuse the rest), every choice answered."""
    open_now, most = set(), [0]

    class Tracked(ScriptedStream):
        def __init__(self, seed):
            super().__init__(token_pieces(front_tokenizer, f"answer {seed}", 1), delay_s=0.001)
            self.seed = seed
            open_now.add(seed)
            most[0] = max(most[0], len(open_now))

        def close(self):
            super().close()
            open_now.discard(self.seed)

    from openai_frontend.service import Frontend
    frontend = Frontend(ScriptedClient(lambda arrays: Tracked(int(arrays["random_seed"].item()))), [TOKEN_MODEL],
                        front_tokenizer, ServerFacts(max_tokens_limit=64, max_seq_len=512, max_batch_size=4))
    body = run(frontend.complete(parse_request({**TEXT_BODY, "model": "speculative_decoding", "n": 128, "seed": 0,
                                                "max_tokens": 8}, COMPLETIONS)))
    assert [c["text"] for c in body["choices"]] == [f"answer {k}" for k in range(128)]
    assert most[0] == 4 and not open_now


def test_an_error_in_one_choice_closes_the_others(front_tokenizer):
    def script(arrays):
        if arrays["random_seed"].item() == 1:
            return ScriptedStream([Piece(token_ids=[5])], error=triton_error("internal error: boom"), delay_s=0.05)
        return ScriptedStream(token_pieces(front_tokenizer, "word " * 100, 1), delay_s=0.02)

    for stream in (False, True):
        frontend = make_frontend(front_tokenizer, script)
        gen = parse_request({**TEXT_BODY, "model": "speculative_decoding", "n": 3, "seed": 0, "stream": stream,
                             "max_tokens": 64}, COMPLETIONS)
        with pytest.raises(OpenAIError) as e:
            run(frontend.complete(gen) if not stream else collect(frontend.chunks(gen)))
        assert e.value.status == 500 and "boom" in e.value.message
        streams = frontend.client.streams
        assert len(streams) == 3 and all(s.closed for s in streams)
        assert streams[0].cancelled and streams[2].cancelled  # stopped mid-answer

# -- the web layer ----------------------------------------------------------------------------
@contextmanager
def serving(frontend, api_key=None):
    """The aiohttp app on a free port, in a thread with its own event loop."""
    from aiohttp import web

    from openai_frontend.app import create_app

    ready, loop_box = threading.Event(), {}

    def main():
        loop = asyncio.new_event_loop()
        runner = web.AppRunner(create_app(frontend, api_key), handler_cancellation=True, access_log=None)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        loop_box.update(loop=loop, port=site._server.sockets[0].getsockname()[1])
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield f"http://127.0.0.1:{loop_box['port']}"
    finally:
        loop_box["loop"].call_soon_threadsafe(loop_box["loop"].stop)
        thread.join(10)


def test_the_api_key_is_checked(front_tokenizer):
    frontend = make_frontend(front_tokenizer, lambda arrays: ScriptedStream([Piece(text="ok", final=True)]))
    with serving(frontend, api_key="sesame") as url:
        good = openai.OpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0)
        assert [m.id for m in good.models.list()] == ["speculative_decoding", "ensemble"]
        for key in ("wrong", None):
            bad = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                default_headers={"Authorization": f"Bearer {key}"} if key else {"Authorization": ""})
            with pytest.raises(openai.AuthenticationError) as e:
                bad.chat.completions.create(model="ensemble", messages=[{"role": "user", "content": "hi"}])
            assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        import requests
        assert requests.get(url + "/health", timeout=5).status_code == 200  # no key needed


def test_tokenize_and_detokenize_as_vllm_answers_them(front_tokenizer):
    import requests

    frontend = make_frontend(front_tokenizer, lambda arrays: ScriptedStream([Piece(text="ok", final=True)]))
    messages = [{"role": "user", "content": "hi"}]
    with serving(frontend, api_key="k") as url:
        auth = {"Authorization": "Bearer k"}
        post = lambda path, body: requests.post(url + path, json=body, headers=auth, timeout=10)  # noqa: E731
        r = post("/tokenize", {"model": "ensemble", "prompt": "Hello there"}).json()
        assert r["tokens"] == front_tokenizer.prompt_ids("Hello there", templated=False)
        assert (r["count"], r["max_model_len"]) == (len(r["tokens"]), 512)
        r = post("/tokenize", {"model": "ensemble", "messages": messages}).json()
        assert r["tokens"] == front_tokenizer.prompt_ids(front_tokenizer.chat_prompt(messages), templated=True)
        bare = post("/tokenize", {"model": "ensemble", "messages": messages, "add_generation_prompt": False}).json()
        assert bare["count"] < r["count"] and r["tokens"][:bare["count"]] == bare["tokens"]
        assert post("/detokenize", {"model": "ensemble", "tokens": r["tokens"]}).json()["prompt"] == \
            front_tokenizer.decode(r["tokens"])
        for path, body, param in (("/tokenize", {"model": "ensemble", "prompt": 5}, "prompt"),
                                  ("/detokenize", {"model": "ensemble", "tokens": [-1]}, "tokens"),
                                  ("/tokenize", {"prompt": "x"}, "model")):
            answer = post(path, body)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == param
        assert post("/tokenize", {"model": "gpt-4", "prompt": "x"}).status_code == 404
        keyless = requests.post(url + "/tokenize", json={"model": "ensemble", "prompt": "x"}, timeout=10)
        assert keyless.status_code == 401


def test_errors_are_openai_json(front_tokenizer):
    import requests

    frontend = make_frontend(front_tokenizer, lambda arrays: ScriptedStream([Piece(text="ok", final=True)]))
    with serving(frontend) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="ensemble", messages=[{"role": "user", "content": "hi"}], n=200)
        assert e.value.param == "n" and e.value.type == "invalid_request_error"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="hi")
        r = requests.post(url + "/v1/completions", data=b"{not json", timeout=5)
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        r = requests.get(url + "/v1/nothing", timeout=5)
        assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
        r = requests.get(url + "/v1/completions", timeout=5)
        assert r.status_code == 405


def test_sse_framing_and_a_mid_stream_error(front_tokenizer):
    import requests

    def script(arrays):
        return ScriptedStream([Piece(text="a"), Piece(text="b")], error=triton_error("internal error: boom"))

    frontend = make_frontend(front_tokenizer, script)
    with serving(frontend) as url:
        r = requests.post(url + "/v1/completions", json={"model": "ensemble", "prompt": "hi", "stream": True},
                          timeout=10)
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.text.split("\n\n") if line]
        assert events[-1] == "[DONE]"
        bodies = [json.loads(e) for e in events[:-1]]
        assert [b["choices"][0]["text"] for b in bodies[:2]] == ["a", "b"]
        assert bodies[2]["error"]["message"] == "internal error: boom"


def test_a_client_that_goes_away_cancels_its_stream(front_tokenizer):
    pieces = [Piece(text=f"w{i} ") for i in range(200)] + [Piece(final=True)]
    frontend = make_frontend(front_tokenizer, lambda arrays: ScriptedStream(pieces, delay_s=0.02))
    with serving(frontend) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        for stream_it, choices in ((True, 1), (False, 1), (True, 3), (False, 3)):
            n = len(frontend.client.streams)
            if stream_it:
                stream = client.chat.completions.create(model="ensemble", stream=True, n=choices,
                                                        messages=[{"role": "user", "content": "hi"}])
                next(iter(stream)), next(iter(stream))
                stream.close()
            else:
                with pytest.raises(openai.APITimeoutError):
                    client.with_options(timeout=0.3).completions.create(model="ensemble", prompt="hi", n=choices)
            deadline = time.monotonic() + 5
            mine = frontend.client.streams[n:]
            while not (len(mine) == choices and all(s.closed for s in mine)):
                assert time.monotonic() < deadline, "a stream was not closed"
                time.sleep(0.05)
                mine = frontend.client.streams[n:]
            assert all(s.cancelled for s in mine)


# -- startup ----------------------------------------------------------------------------------
def test_readiness_is_seen_soon_after_a_slow_server_comes_up():
    """The front door starts beside a server that loads for minutes: once the server
    listens, the front door sees it ready within about a second, whatever gRPC's
    reconnect backoff had grown to (its default grows 1.6x per refusal, from 1 s up to
    120 s, each by +-20 %: after 20 s of refusals the next try would come about 5-8 s after
    the server is up)."""
    import socket

    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    from openai_frontend.triton_grpc import TritonClient

    class Ready(service_pb2_grpc.GRPCInferenceServiceServicer):
        def ServerReady(self, request, context):
            return service_pb2.ServerReadyResponse(ready=True)

    with socket.socket() as s:  # a free port, nothing listening on it yet
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def scenario() -> float:
        client = TritonClient(f"127.0.0.1:{port}")
        waiting = asyncio.ensure_future(client.wait_ready(timeout_s=60))
        await asyncio.sleep(20.0)
        assert not waiting.done()
        server = grpc.aio.server()
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Ready(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        up = time.perf_counter()
        try:
            await asyncio.wait_for(waiting, timeout=30)
            return time.perf_counter() - up
        finally:
            await server.stop(None)

    assert asyncio.run(scenario()) < 2.5


# -- SGLang's /generate ------------------------------------------------------------------------
def test_sglang_generate_answers_in_sglangs_shape(front_tokenizer):
    import requests

    texts = {10: "alpha beta gamma", 11: "one two", 12: "red green"}
    frontend = make_frontend(front_tokenizer, scripted_by_seed(front_tokenizer, texts))
    with serving(frontend) as url:
        params = {"max_new_tokens": 40, "temperature": 0.5, "top_k": -1, "min_p": 0.05, "sampling_seed": 10,
                  "stop": " gamma"}
        one = requests.post(url + "/generate", json={"text": "Say:", "sampling_params": params}, timeout=10).json()
        assert one["text"] == "alpha beta" and set(one) == {"text", "meta_info"}
        meta = one["meta_info"]
        assert meta["finish_reason"] == {"type": "stop", "matched": " gamma"}
        assert meta["prompt_tokens"] == len(front_tokenizer.prompt_ids("Say:", templated=False))
        assert meta["completion_tokens"] == len(front_tokenizer.hf.encode("alpha beta gamma", add_special_tokens=False))
        sent = frontend.client.requests[-1]  # SGLang's names reached the model as its inputs
        assert (sent["request_output_len"].item(), sent["random_seed"].item()) == (40, 10)
        assert sent["temperature"].item() == pytest.approx(0.5) and sent["runtime_top_k"].item() == 0
        assert sent["min_p"].item() == pytest.approx(0.05)
        # a list of prompts, n answers each, one rid per answer; a length-limited answer says so
        ids = front_tokenizer.hf.encode("Count:", add_special_tokens=False)
        many = requests.post(url + "/generate", json={
            "input_ids": [ids, ids], "rid": ["a", "b", "c", "d"],
            "sampling_params": {"max_new_tokens": 2, "n": 2, "sampling_seed": 11}}, timeout=10).json()
        assert [m["meta_info"]["id"] for m in many] == ["a", "b", "c", "d"]
        assert [m["text"] for m in many] == ["one two", "red green"] * 2
        assert all(m["meta_info"]["finish_reason"] == {"type": "length", "length": 2} for m in many)
        # defaults: SGLang's 128 new tokens, here the server's limit of 64
        requests.post(url + "/generate", json={"text": "hi", "sampling_params": {"sampling_seed": 12}}, timeout=10)
        assert frontend.client.requests[-1]["request_output_len"].item() == 64


def test_sglang_generate_streams_the_text_so_far_and_names_bad_fields(front_tokenizer):
    import requests

    frontend = make_frontend(front_tokenizer, scripted_by_seed(front_tokenizer, {10: "alpha beta gamma"}))
    with serving(frontend) as url:
        r = requests.post(url + "/generate", json={"text": "Say:", "stream": True,
                                                   "sampling_params": {"max_new_tokens": 40, "sampling_seed": 10}},
                          timeout=10)
        events = [line[len("data: "):] for line in r.text.split("\n\n") if line]
        assert r.headers["Content-Type"].startswith("text/event-stream") and events[-1] == "[DONE]"
        bodies = [json.loads(e) for e in events[:-1]]
        assert [b["text"] for b in bodies] == ["alpha", "alpha beta", "alpha beta gamma", "alpha beta gamma"]
        assert [b["meta_info"]["finish_reason"] for b in bodies[:-1]] == [None] * 3
        # the end of the script, not the limit: the end token, named by its id as SGLang does
        assert bodies[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": front_tokenizer.eos_id}
        for body, param in (({"text": "hi", "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
                            ({"text": "hi", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
                            ({"text": "hi", "input_ids": [1]}, "text"),
                            ({"input_ids": "hi"}, "input_ids"),
                            ({"text": "hi", "sampling_params": [{}]}, "sampling_params"),
                            ({"text": ["a", "b"], "rid": "one"}, "rid")):
            for stream in (False, True):
                answer = requests.post(url + "/generate", json={**body, "stream": stream}, timeout=10)
                assert answer.status_code == 400 and answer.json()["error"]["param"] == param, (body, answer.text)
                assert answer.json()["error"]["message"].startswith(param + ":")
