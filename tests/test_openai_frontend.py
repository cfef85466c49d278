"""The OpenAI front door end to end: `tools/launch_triton_server.py --openai_port` serves a
real tritonserver and the front door, and the official `openai` package talks to it.

One server for the module, with ONE engine slot (`max_batch_size: 1`), so that a
generation whose slot was not freed holds up the next request. Every model the front
door serves is tested: `speculative_decoding` (token ids: the front door tokenizes
and detokenizes), `ensemble` (text), and `tensorrt_llm_bls` (text, cancellable) where
the repository has it. The served model is a tiny random one: its text is gibberish,
which is all a protocol test needs.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

import build_model_repo
import triton_env
from conftest import E2E_LIMITS, ROOT, TOKENIZER_DIR, e2e_skip_reason

openai = pytest.importorskip("openai")

LONG = 3000  # max_tokens of a generation that must not run to its end
TEXT_MODELS = ("tensorrt_llm_bls", "ensemble")
CANCELLABLE = ("tensorrt_llm_bls", "speculative_decoding")  # an ensemble step is not (DESIGN.md)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three rivers."}]
PROMPT = "The three longest rivers are"


class Served:
    def __init__(self, openai_port: int, metrics_port: int, models: list[str]):
        self.url = f"http://localhost:{openai_port}/v1"
        self.metrics_url = f"http://localhost:{metrics_port}/metrics"
        self.models = models

    def client(self, **options):
        return openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=120, **options)

    def emitted(self) -> float:
        """Tokens the engine emitted so far (all methods)."""
        text = requests.get(self.metrics_url, timeout=10).text
        return sum(float(v) for v in re.findall(r"^specdec_emitted_tokens_total\{[^}]*\} (\S+)$", text, re.M))


def _wait_http(url: str, process: subprocess.Popen, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the launcher exited with {process.returncode}: {log.read_text()[-3000:]}")
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not up after {timeout_s} s: {log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def served(tmp_path_factory, e2e_base):
    reason = e2e_skip_reason()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("openai")
    limits = {**E2E_LIMITS, "max_batch_size": "1", "max_tokens_limit": str(LONG), "max_seq_len": str(LONG + 256)}
    no_drafters = {key: None for key in build_model_repo.DRAFTERS}  # the family's would not fit this base
    repo = build_model_repo.build(tmp / "repo", build_model_repo.repo_values(
        e2e_base, method="none", tokenizer_dir=TOKENIZER_DIR, drafters=no_drafters, extra=limits))
    ports = {name: triton_env.free_port() for name in ("http", "grpc", "metrics", "openai")}
    log = tmp / "launch.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, str(ROOT / "tools" / "launch_triton_server.py"), "--world_size=1",
             f"--model_repo={repo}", "--http_port", str(ports["http"]), "--grpc_port", str(ports["grpc"]),
             "--metrics_port", str(ports["metrics"]), "--exit_timeout_secs", "3",
             "--log-file", str(tmp / "server.log"), "--openai_port", str(ports["openai"])],
            stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_http(f"http://localhost:{ports['openai']}/health", process, 300, log)
        models = [m["id"] for m in requests.get(f"http://localhost:{ports['openai']}/v1/models", timeout=10)
                  .json()["data"]]
        yield Served(ports["openai"], ports["metrics"], models)
    finally:
        process.terminate()
        process.wait(timeout=60)
    with pytest.raises(requests.ConnectionError):  # the front door stopped with the server
        requests.get(f"http://localhost:{ports['openai']}/health", timeout=2)


def _model(served: Served, name: str) -> str:
    if name not in served.models:
        pytest.skip(f"{name} is not in this repository (served: {', '.join(served.models)})")
    return name


ALL_MODELS = ("tensorrt_llm_bls", "speculative_decoding", "ensemble")


def test_models_are_listed_preferred_first(served):
    ids = [m.id for m in served.client().models.list()]
    assert {"speculative_decoding", "ensemble"} <= set(ids)
    assert ids[0] == ("tensorrt_llm_bls" if "tensorrt_llm_bls" in ids else "speculative_decoding")
    assert served.client().models.retrieve("ensemble").id == "ensemble"


def _chat(client, model, stream, **kw):
    """(text, finish_reason, usage) of one chat request, streamed or not."""
    if not stream:
        r = client.chat.completions.create(model=model, messages=MESSAGES, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage
    pieces, finish, usage = [], None, None
    for chunk in client.chat.completions.create(model=model, messages=MESSAGES, stream=True,
                                                stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(pieces), finish, usage


def _complete(client, model, stream, **kw):
    if not stream:
        r = client.completions.create(model=model, prompt=PROMPT, **kw)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage
    pieces, finish, usage = [], None, None
    for chunk in client.completions.create(model=model, prompt=PROMPT, stream=True,
                                           stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.text)
            finish = choice.finish_reason or finish
    return "".join(pieces), finish, usage


@pytest.mark.parametrize("name", ALL_MODELS)
@pytest.mark.parametrize("call", [_chat, _complete], ids=["chat", "completions"])
def test_streamed_text_equals_non_streamed_at_temperature_0(served, name, call):
    model, client = _model(served, name), served.client()
    whole = call(client, model, False, max_tokens=24, temperature=0)
    streamed = call(client, model, True, max_tokens=24, temperature=0)
    assert whole[0] and streamed == whole
    text, finish, usage = whole
    assert finish in ("stop", "length") and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_sglangs_generate_answers_as_the_completions_endpoint(served):
    """SGLang's native /generate, on the first served model, streamed and not, equals
    /v1/completions at temperature 0 (SGLang's sampling defaults to temperature 1)."""
    model, client = served.models[0], served.client()
    text, finish, usage = _complete(client, model, False, max_tokens=12, temperature=0)
    url = served.url.removesuffix("/v1") + "/generate"
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    whole = requests.post(url, json=body, timeout=120).json()
    assert whole["text"] == text, (whole, text)
    meta = whole["meta_info"]
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (usage.prompt_tokens, usage.completion_tokens)
    assert meta["finish_reason"]["type"] == finish  # "length" or "stop", as OpenAI's
    r = requests.post(url, json={**body, "stream": True}, timeout=120)
    events = [line[len("data: "):] for line in r.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["text"] == text and {**last["meta_info"], "id": meta["id"]} == meta


@pytest.mark.parametrize("call", [_chat, _complete], ids=["chat", "completions"])
def test_usage_is_exact_on_the_token_model(served, call, tokenizer):
    client = served.client()
    text, finish, usage = call(client, "speculative_decoding", False, max_tokens=20, temperature=0,
                               extra_body={"min_tokens": 20})
    if call is _chat:
        prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    else:
        prompt_ids = tokenizer.encode(PROMPT)
    assert (usage.prompt_tokens, usage.completion_tokens, finish) == (len(prompt_ids), 20, "length")
    # The same tokens reach the text model (its preprocessing encodes the same prompt).
    assert call(client, "ensemble", False, max_tokens=20, temperature=0, extra_body={"min_tokens": 20})[0] == text


@pytest.mark.parametrize("name", ALL_MODELS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_usage_counts_the_generated_tokens_on_text_models_too(served, name, stream):
    """The text models send `num_output_tokens` with each response, so usage is the count
    generated, not the text re-encoded (which differs by a token or two: the 80-token
    answer of a SmolLM2 chat request re-encoded to 81)."""
    model, client = _model(served, name), served.client()
    for max_tokens in (7, 23):
        _, finish, usage = _chat(client, model, stream, max_tokens=max_tokens, temperature=0,
                                 extra_body={"min_tokens": max_tokens})
        assert (usage.completion_tokens, finish) == (max_tokens, "length")


@pytest.mark.parametrize("name", ALL_MODELS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_stop_strings_end_the_text_before_them(served, name, stream):
    model, client = _model(served, name), served.client()
    text = _complete(client, model, False, max_tokens=40, temperature=0, extra_body={"min_tokens": 40})[0]
    words = text.split()
    assert len(words) >= 6, text
    stop = words[len(words) // 2]
    cut = text[:text.index(stop)]
    # min_tokens keeps the greedy path of the text above (no end token; the engine's own
    # stop-word check waits for it too, so the front door's text check cuts here).
    got, finish, usage = _complete(client, model, stream, max_tokens=40, temperature=0,
                                   stop=["never-in-this-text", stop], extra_body={"min_tokens": 40})
    assert (got, finish) == (cut, "stop")
    if stream and model == "speculative_decoding":  # the rest was cancelled, not generated and dropped
        assert usage.completion_tokens < 40
    got, finish, _ = _chat(client, model, stream, max_tokens=8, temperature=0, stop="\u2603")  # never produced
    assert finish in ("stop", "length") and "\u2603" not in got


@pytest.mark.parametrize("name", ALL_MODELS)
def test_stop_token_ids_end_the_text_before_the_token(served, name, tokenizer):
    """vLLM's stop_token_ids: a word token from the middle of the greedy answer ends it
    there, on the token model (the front door cuts at the token) and on the text models
    (its text as a stop string)."""
    model, client = _model(served, name), served.client()
    kw = dict(model=model, prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"min_tokens": 40})
    text = client.completions.create(**kw).choices[0].text
    ids = tokenizer.encode(text, add_special_tokens=False)
    middle = [t for t in ids[len(ids) // 3:] if tokenizer.decode([t]).strip().isalpha()
              and tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False) == [t]]
    assert middle, text
    stop = middle[0]
    r = client.completions.create(**{**kw, "extra_body": {"min_tokens": 40, "stop_token_ids": [stop]}})
    got, finish = r.choices[0].text, r.choices[0].finish_reason
    end = text.index(tokenizer.decode([stop]))
    assert (got, finish) == (text[:end], "stop")
    assert r.choices[0].model_extra["stop_reason"] == stop  # vLLM's field: the token that ended it
    # vLLM's include_stop_str_in_output: the answer ends after the token instead
    r = client.completions.create(**{**kw, "extra_body": {"min_tokens": 40, "stop_token_ids": [stop],
                                                          "include_stop_str_in_output": True}})
    assert r.choices[0].text == text[: end + len(tokenizer.decode([stop]))]


def test_log_probs_come_with_their_tokens(served):
    client = served.client()
    r = client.chat.completions.create(model="speculative_decoding", messages=MESSAGES, max_tokens=12,
                                       temperature=0, logprobs=True, extra_body={"min_tokens": 12})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 12
    assert all(e.logprob <= 0 for e in content)
    r = client.completions.create(model="speculative_decoding", prompt=PROMPT, max_tokens=6, temperature=0,
                                  logprobs=0, extra_body={"min_tokens": 6})
    assert len(r.choices[0].logprobs.token_logprobs) == 6
    with pytest.raises(openai.BadRequestError) as e:  # the text model returns no tokens
        client.completions.create(model="ensemble", prompt=PROMPT, max_tokens=6, logprobs=0)
    assert e.value.param == "logprobs"


@pytest.mark.parametrize("name", ALL_MODELS)
def test_logit_bias_bans_a_token_on_every_model(served, name, tokenizer):
    """The greedy answer's first token that encodes back to itself, biased -100, never
    appears, and every model answers alike (the text models get it as bias words)."""
    model, client = _model(served, name), served.client()
    kw = dict(model=model, messages=MESSAGES, max_tokens=12, temperature=0, extra_body={"min_tokens": 12})
    r = client.chat.completions.create(**kw)
    ids = tokenizer.encode(r.choices[0].message.content, add_special_tokens=False)
    banned = next(t for t in ids if tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False) == [t])
    steered = client.chat.completions.create(**kw, logit_bias={str(banned): -100}).choices[0].message.content
    assert banned not in tokenizer.encode(steered, add_special_tokens=False)
    reference = client.chat.completions.create(**{**kw, "model": "speculative_decoding"},
                                               logit_bias={str(banned): -100}).choices[0].message.content
    assert steered == reference


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_top_alternatives_lead_with_the_greedy_token(served, stream):
    client = served.client()
    kw = dict(model="speculative_decoding", messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True,
              top_logprobs=4, extra_body={"min_tokens": 10})
    if stream:
        entries = [e for chunk in client.chat.completions.create(stream=True, **kw) for c in chunk.choices
                   if c.logprobs for e in c.logprobs.content]
    else:
        entries = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(entries) == 10
    for e in entries:
        values = [a.logprob for a in e.top_logprobs]
        assert len(values) == 4 and values == sorted(values, reverse=True)
        assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)
    r = client.completions.create(model="speculative_decoding", prompt=PROMPT, max_tokens=5, temperature=0,
                                  logprobs=2, extra_body={"min_tokens": 5})
    lp = r.choices[0].logprobs
    assert len(lp.top_logprobs) == 5 and all(len(t) <= 2 and lp.tokens[i] in t for i, t in enumerate(lp.top_logprobs))


def test_seeded_sampling_repeats(served):
    client = served.client()
    runs = [_chat(client, "speculative_decoding", stream, max_tokens=16, temperature=1.0, seed=11)[0]
            for stream in (False, True)]
    assert runs[0] == runs[1]


def test_fields_left_out_take_the_models_sampling(served, e2e_base):
    """A request that sets no temperature or top_p samples with what the served checkpoint's
    generation_config.json recommends (vLLM's and SGLang's default), not with OpenAI's
    temperature 1: seeded, it answers as a request that sends those values, on chat,
    completions and SGLang's /generate."""
    config = json.loads((e2e_base / "generation_config.json").read_text())
    model = {k: config[k] for k in ("temperature", "top_p") if k in config}
    if not model or model == {"temperature": 1.0, "top_p": 1.0}:
        pytest.skip(f"{e2e_base} recommends no sampling of its own")
    client = served.client()
    kw = dict(model="speculative_decoding", messages=MESSAGES, max_tokens=24, seed=3, extra_body={"min_tokens": 24})
    left_out = client.chat.completions.create(**kw).choices[0].message.content
    assert left_out == client.chat.completions.create(**kw, **model).choices[0].message.content
    assert left_out != client.chat.completions.create(**kw, temperature=1.0, top_p=1.0).choices[0].message.content
    first = served.models[0]  # /generate's
    kw = dict(model=first, prompt=PROMPT, max_tokens=24, seed=3, extra_body={"min_tokens": 24})
    text = client.completions.create(**kw).choices[0].text
    assert text == client.completions.create(**kw, **model).choices[0].text
    params = {"max_new_tokens": 24, "min_new_tokens": 24, "sampling_seed": 3}
    url = served.url.removesuffix("/v1") + "/generate"
    assert requests.post(url, json={"text": PROMPT, "sampling_params": params}, timeout=120).json()["text"] == text


@pytest.mark.parametrize("name", ALL_MODELS)
def test_min_p_of_one_samples_the_greedy_answer(served, name):
    """vLLM's min_p (in the body's extras): at 1 only the likeliest token is kept, so a hot,
    seeded request answers as temperature 0 does, on every model."""
    client = served.client()
    greedy = _chat(client, name, False, max_tokens=12, temperature=0)[0]
    kept = _chat(client, name, False, max_tokens=12, temperature=1.5, seed=5, extra_body={"min_p": 1.0})[0]
    hot = _chat(client, name, False, max_tokens=12, temperature=1.5, seed=5)[0]
    assert kept == greedy != hot



def _choices(client, stream, **kw) -> tuple[list[str], object]:
    """(each choice's text by index, usage) of one completions request, streamed or not."""
    if not stream:
        r = client.completions.create(**kw)
        assert [c.index for c in r.choices] == list(range(len(r.choices)))
        return [c.text for c in r.choices], r.usage
    texts, finished, usage = {}, [], None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finished.append(choice.index)
    assert sorted(finished) == sorted(texts) == list(range(len(texts)))  # each choice ends once
    return [texts[i] for i in range(len(texts))], usage


@pytest.mark.parametrize("name", ALL_MODELS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n_choices_and_several_prompts_answer_like_single_requests(served, name, stream):
    """Choice j of a seeded request equals a single request with seed + j; at
    temperature 0 every choice of a prompt is that prompt's greedy answer."""
    model, client = _model(served, name), served.client()
    other = "A river is"
    single = {(p, seed): _choices(client, False, model=model, prompt=p, max_tokens=10, temperature=1.0, seed=seed,
                                  extra_body={"min_tokens": 10})[0][0]
              for p in (PROMPT, other) for seed in (21, 22, 23)}
    texts, usage = _choices(client, stream, model=model, prompt=[PROMPT, other], n=3, max_tokens=10,
                            temperature=1.0, seed=21, extra_body={"min_tokens": 10})
    assert texts == [single[(p, seed)] for p in (PROMPT, other) for seed in (21, 22, 23)]
    assert len(set(texts[:3])) > 1  # the choices differ
    assert usage.completion_tokens == 60
    greedy, _ = _choices(client, stream, model=model, prompt=PROMPT, n=2, max_tokens=10, temperature=0)
    assert greedy == [_complete(client, model, False, max_tokens=10, temperature=0)[0]] * 2


def test_echo_with_logprobs_scores_the_prompt_as_generation_would(served, tokenizer):
    """The distribution after the prompt's last-but-one token, scored with echo and
    logprobs, is the one a generation from there draws its first token from."""
    client = served.client()
    ids = tokenizer.encode(PROMPT)
    scored = client.completions.create(model="speculative_decoding", prompt=ids, max_tokens=0, echo=True, logprobs=2)
    choice, lp = scored.choices[0], scored.choices[0].logprobs
    assert choice.text == tokenizer.decode(ids, skip_special_tokens=True) and choice.finish_reason == "length"
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens) == (len(ids), 0)
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) == 2 for t in lp.top_logprobs[1:])
    after = client.completions.create(model="speculative_decoding", prompt=ids[:-1], max_tokens=1, temperature=0,
                                      logprobs=2).choices[0].logprobs.top_logprobs[0]
    assert after.keys() == lp.top_logprobs[-1].keys()
    assert all(abs(after[t] - lp.top_logprobs[-1][t]) < 1e-4 for t in after)


def test_more_choices_than_the_engine_queue_holds(served):
    """80 choices (the engine queues 64 besides its one slot): the front door keeps only
    a batch of them in flight, and all are answered."""
    r = served.client().completions.create(model="speculative_decoding", prompt=PROMPT, n=80, max_tokens=2,
                                           temperature=1.0, seed=4, extra_body={"min_tokens": 2})
    assert len(r.choices) == 80 and r.usage.completion_tokens == 160


def test_token_id_prompts_and_echo(served, tokenizer):
    client = served.client()
    ids = tokenizer.encode(PROMPT)  # as the front door encodes the text prompt
    by_text = _complete(client, "speculative_decoding", False, max_tokens=10, temperature=0)[0]
    r = client.completions.create(model="speculative_decoding", prompt=ids, max_tokens=10, temperature=0, echo=True)
    echoed = tokenizer.decode(ids, skip_special_tokens=True)
    assert r.choices[0].text == echoed + by_text and r.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError) as e:  # text models take text
        client.completions.create(model="ensemble", prompt=ids, max_tokens=4)
    assert e.value.param == "prompt"

@pytest.mark.parametrize("name", CANCELLABLE)
def test_a_client_that_drops_its_stream_frees_the_engine_slot(served, name):
    model, client = _model(served, name), served.client()
    before = served.emitted()
    stream = client.chat.completions.create(model=model, messages=MESSAGES, stream=True, max_tokens=LONG,
                                            temperature=0, extra_body={"min_tokens": LONG})
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    stream.close()
    # The engine has one slot: this request runs only once the dropped one is gone.
    t0 = time.monotonic()
    text, _, usage = _complete(client, model, False, max_tokens=4, temperature=0, extra_body={"min_tokens": 4})
    waited = time.monotonic() - t0
    assert usage.completion_tokens >= 1
    deadline = time.monotonic() + 30
    settled = served.emitted()
    while time.monotonic() < deadline:  # the metrics port lags the engine by up to a second
        time.sleep(1.5)
        now = served.emitted()
        if now == settled:
            break
        settled = now
    assert settled - before < LONG / 2, (settled - before, waited)


BAD = [  # (endpoint, request fields, the field the 400 names)
    ("chat", {"n": 200}, "n"),
    ("chat", {"temperature": -1}, "temperature"),
    ("chat", {"top_p": 0}, "top_p"),
    ("chat", {"max_tokens": 0}, "max_tokens"),
    ("chat", {"max_completion_tokens": -1}, "max_completion_tokens"),
    ("chat", {"seed": -5}, "seed"),
    ("chat", {"stop": [""]}, "stop"),
    ("chat", {"logprobs": "yes"}, "logprobs"),
    ("chat", {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("chat", {"extra_body": {"speculative_method": "warp"}}, "speculative_method"),
    ("chat", {"extra_body": {"eagle_total_tokens": 0}}, "eagle_total_tokens"),
    ("chat", {"extra_body": {"top_k": "many"}}, "top_k"),
    ("completions", {"n": 0}, "n"),
    ("completions", {"prompt": [PROMPT] * 50, "n": 3}, "n"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": [[1, -2, 3]]}, "prompt"),
    ("completions", {"prompt": [[10 ** 9]]}, "prompt"),
    ("completions", {"max_tokens": "many"}, "max_tokens"),
]


@pytest.mark.parametrize("endpoint, fields, param", BAD, ids=[f"{e}-{p}" for e, _, p in BAD])
def test_every_bad_field_gets_a_400_naming_it(served, endpoint, fields, param):
    client = served.client()
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "chat":
            client.chat.completions.create(**{"model": "speculative_decoding", "messages": MESSAGES, **fields})
        else:
            client.completions.create(**{"model": "speculative_decoding", "prompt": PROMPT, **fields})
    assert e.value.status_code == 400 and e.value.param == param and param in e.value.message


@pytest.mark.parametrize("name", ALL_MODELS)
def test_what_the_engine_refuses_is_a_400_naming_it(served, name):
    model, client = _model(served, name), served.client()
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            _chat(client, model, stream, max_tokens=LONG + 1)
        assert "max_tokens" in e.value.message


def test_an_unknown_model_is_a_404(served):
    with pytest.raises(openai.NotFoundError) as e:
        served.client().chat.completions.create(model="gpt-4", messages=MESSAGES)
    assert e.value.code == "model_not_found"
