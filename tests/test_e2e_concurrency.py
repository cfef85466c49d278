"""Concurrency through a real tritonserver: many streaming gRPC clients at once, with
mixed speculative methods, lengths, greedy and sampled requests and stop words; client
cancellation, slot reuse, a full queue, and the acceptance metrics on the metrics port.

Two servers for the module:
- `family`: the whole model family (base + every drafter, float64 so that batching
  cannot flip a near-tie argmax), engine batch 8 with room to queue;
- `small`: the base model only, engine batch 2 and queue 1, so that two long requests
  fill it; plus a non-decoupled copy (`speculative_decoding_sync`) whose Triton batcher
  holds requests 0.3 s, where a refusal shows as HTTP 503.

Triton 2.51 facts the tests pin down: the `generate` endpoints answer every model
error with HTTP 400 (only `/infer`, i.e. non-decoupled models, maps UNAVAILABLE to
503), and an ensemble does not pass a client's cancellation on to a composing request
already running, so cancellation is tested on `speculative_decoding` itself.
"""
from __future__ import annotations

import queue
import re
import shutil
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
import requests

from conftest import TOKENIZER_DIR, e2e_skip_reason, family_drafters, serve_repository

METHODS = ("none", "eagle2", "eagle3", "medusa", "draft_model", "eagle")
PROMPTS = ("def fibonacci(n):\n", "The capital of France is", "Once upon a time, in a land far away,")
N_CLIENTS = 18
LONG = 1000  # max_tokens of requests that must outlive the test step that watches them
SYNC_DELAY_US = 300_000  # the sync copy's batching window: concurrent requests meet in one execute
_DTYPES = {np.int32: "INT32", np.bool_: "BOOL", np.float32: "FP32", np.uint64: "UINT64"}


# -- servers ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def family(tmp_path_factory, e2e_family):
    reason = e2e_skip_reason()
    if reason:
        pytest.skip(reason)
    # Adaptive speculation off: every speculative request drafts, so every method's
    # draft counters move even where the (untrained) drafters are rarely right.
    values = {"dtype": "float64", "max_batch_size": "8", "eagle_total_tokens": "16",
              "adaptive_speculation": "false"}
    with serve_repository(tmp_path_factory.mktemp("family"), e2e_family / "base", values,
                          drafters=family_drafters(e2e_family), tokenizer_dir=e2e_family / "base") as server:
        yield server


def _add_sync_copy(repo):
    """`speculative_decoding_sync`: a non-decoupled copy whose batcher waits SYNC_DELAY_US."""
    shutil.copytree(repo / "speculative_decoding", repo / "speculative_decoding_sync")
    config = repo / "speculative_decoding_sync" / "config.pbtxt"
    text = config.read_text().replace('name: "speculative_decoding"', 'name: "speculative_decoding_sync"')
    text = text.replace("decoupled: true", "decoupled: false")
    text, n = re.subn(r"max_queue_delay_microseconds: \d+", f"max_queue_delay_microseconds: {SYNC_DELAY_US}", text)
    assert n == 1
    config.write_text(text)


@pytest.fixture(scope="module")
def small(tmp_path_factory, e2e_family):
    reason = e2e_skip_reason()
    if reason:
        pytest.skip(reason)
    values = {"max_batch_size": "2", "engine_max_queue_size": "1", "max_tokens_limit": str(LONG),
              "max_seq_len": str(LONG + 64)}
    no_drafters = {key: None for key in family_drafters(e2e_family)}
    with serve_repository(tmp_path_factory.mktemp("small"), e2e_family / "base", values, edit=_add_sync_copy,
                          drafters=no_drafters, tokenizer_dir=e2e_family / "base") as server:
        yield server


# -- clients ---------------------------------------------------------------------------------
def _grpc_inputs(named: dict):
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, value in named.items():
        array = np.asarray(value)
        dtype = "BYTES" if array.dtype == object else _DTYPES[array.dtype.type]
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def text_request(text: str, max_tokens: int, stream: bool = True, **extra) -> dict:
    """Ensemble inputs, batch dim 1 (the prompt is excluded from the answer)."""
    named = {"text_input": np.array([[text.encode()]], dtype=object),
             "max_tokens": np.array([[max_tokens]], np.int32),
             "stream": np.array([[stream]]), "exclude_input_in_output": np.array([[True]])}
    for name, value in extra.items():
        if isinstance(value, str):
            named[name] = np.array([[value.encode()]], dtype=object)
        elif isinstance(value, float):
            named[name] = np.array([[value]], np.float32)
        elif isinstance(value, bool):
            named[name] = np.array([[value]])
        else:
            named[name] = np.array([[value]], np.uint64 if name == "seed" else np.int32)
    return named


def token_request(ids: list[int], max_tokens: int) -> dict:
    """`speculative_decoding` inputs (token ids), streamed."""
    return {"input_ids": np.array([ids], np.int32), "input_lengths": np.array([[len(ids)]], np.int32),
            "request_output_len": np.array([[max_tokens]], np.int32), "streaming": np.array([[True]])}


@dataclass
class Answer:
    pieces: list = field(default_factory=list)  # text pieces or token-id lists, per response
    final: bool = False  # a response carried Triton's final flag
    error: str | None = None
    perf: dict = field(default_factory=dict)  # the last response's acceptance counters

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class Stream:
    """One gRPC stream with its own client, carrying one request."""

    def __init__(self, server, model: str, named: dict, request_id: str = ""):
        import tritonclient.grpc as grpcclient

        self.model = model
        self.results: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.client.start_stream(callback=lambda result, error: self.results.put((result, error)))
        self.client.async_stream_infer(model, _grpc_inputs(named), request_id=request_id,
                                       enable_empty_final_response=True)
        self.answer = Answer()

    def read(self, responses: int | None = None, timeout_s: float = 60.0) -> Answer:
        """Reads until the final response (or `responses` responses with tokens)."""
        got = 0
        while not self.answer.final and self.answer.error is None and (responses is None or got < responses):
            result, error = self.results.get(timeout=timeout_s)
            if error is not None:
                self.answer.error = str(error)
                break
            out = result.as_numpy("text_output" if self.model.startswith("ensemble") else "output_ids")
            if out is not None and out.size:
                got += 1
                if out.dtype == object:
                    self.answer.pieces.extend(t.decode("utf-8") for t in out.reshape(-1))
                else:
                    self.answer.pieces.append(out.reshape(-1).tolist())
            for name in ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens"):
                value = result.as_numpy(name)
                if value is not None:
                    self.answer.perf[name] = value.reshape(-1)[0].item()
            self.answer.final = result.get_response().parameters["triton_final_response"].bool_param
        return self.answer

    def cancel(self) -> None:
        self.client.stop_stream(cancel_requests=True)

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def generate(server, body: dict, model: str = "ensemble") -> tuple[int, dict]:
    r = requests.post(f"http://{server.http_url}/v2/models/{model}/generate", json=body, timeout=120)
    return r.status_code, r.json()


def solo_text(server, text: str, max_tokens: int, **extra) -> str:
    status, out = generate(server, {"text_input": text, "max_tokens": max_tokens,
                                    "exclude_input_in_output": True, **extra})
    assert status == 200, out
    return out["text_output"]


def scrape(server) -> dict[tuple[str, str], float]:
    """The `specdec_*` counters on the metrics port: {(name, method): value}."""
    text = requests.get(f"http://localhost:{server.metrics_port}/metrics", timeout=10).text
    out = {}
    for name, labels, value in re.findall(r"^(specdec_\w+)\{([^}]*)\} (\S+)$", text, re.M):
        method = re.search(r'method="([^"]*)"', labels).group(1)
        out[(name, method)] = float(value)
    return out


def load_gauges(server) -> dict[tuple[str, str], float]:
    """speculative_decoding's load gauges, TensorRT-LLM's: {(family, label value): value}."""
    text = requests.get(f"http://localhost:{server.metrics_port}/metrics", timeout=10).text
    out = {}
    for name, labels, value in re.findall(r"^(nv_trt_llm_\w+)\{([^}]*)\} (\S+)$", text, re.M):
        if 'model="speculative_decoding"' in labels:
            kind = re.search(r'(?:request_type|kv_cache_block_type|inflight_batcher_specific_metric|general_type)'
                             r'="([^"]*)"', labels).group(1)
            out[(name, kind)] = float(value)
    return out


def until_gauges(server, want: dict, timeout_s: float = 5.0) -> dict:
    """The gauges once they show `want` (they are set every half second), or the last read."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = load_gauges(server)
        if all(got.get(k) == v for k, v in want.items()) or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


class ReadyWatch:
    """Polls the server's readiness in the background; `failures` counts non-ready answers."""

    def __init__(self, server):
        self.server, self.failures, self.polls = server, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.2):
            self.polls += 1
            self.failures += not self.server.is_ready()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


# -- the family server -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def stop_words(family) -> dict[str, str]:
    """Per prompt, a word of its greedy continuation that stops it early, when one is found
    among its words and characters (a stop word must tokenize as the output did)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    words = {}
    for prompt in PROMPTS:
        whole = solo_text(family, prompt, 24)
        tail = whole[len(whole) // 3:]
        # the tail's own tokens first: a word that is one token of the output matches it
        pieces = [tok.decode([t]) for t in tok.encode(tail, add_special_tokens=False)]
        candidates = [p for p in pieces if p.strip()] + [w for w in re.findall(r"\S+", tail) if len(w) <= 8] + \
            [c for c in tail if not c.isspace()]
        for word in list(dict.fromkeys(candidates))[:10]:
            if len(solo_text(family, prompt, 24, stop_words=word)) < len(whole):
                words[prompt] = word
                break
    return words


def mixed_requests(stop_words: dict[str, str]) -> list[dict]:
    """N_CLIENTS requests cycling through methods, prompts, lengths; every fifth sampled,
    every fourth with a stop word (when its prompt has one)."""
    out = []
    for i in range(N_CLIENTS):
        prompt = PROMPTS[i % len(PROMPTS)]
        extra = {"speculative_method": METHODS[i % len(METHODS)]}
        if i % 5 == 4:
            extra.update(temperature=0.8, top_p=0.95, seed=i)
        if i % 4 == 1 and prompt in stop_words:
            extra["stop_words"] = stop_words[prompt]
        out.append(dict(text=prompt, max_tokens=(8, 16, 24)[i % 3], extra=extra))
    return out


def test_concurrent_streams_equal_their_solo_answers(family, stop_words):
    before = scrape(family)
    reqs = mixed_requests(stop_words)
    answers: list[Answer | None] = [None] * len(reqs)
    start = threading.Barrier(len(reqs))

    def client(i):
        start.wait()
        stream = Stream(family, "ensemble", text_request(reqs[i]["text"], reqs[i]["max_tokens"], **reqs[i]["extra"]),
                        request_id=f"c{i}")
        try:
            answers[i] = stream.read(timeout_s=120)
        finally:
            stream.close()

    with ReadyWatch(family) as watch:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(reqs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
    assert watch.polls > 0 and watch.failures == 0
    for i, answer in enumerate(answers):
        assert answer is not None and answer.error is None and answer.final, (i, answer)
    assert any("stop_words" in r["extra"] for r in reqs), "no prompt had a stopping word"

    # Each greedy stream equals the same request sent alone, not streamed, afterwards.
    for i, r in enumerate(reqs):
        if "temperature" in r["extra"]:
            continue
        alone = solo_text(family, r["text"], r["max_tokens"], **r["extra"])
        assert answers[i].text == alone, (i, r)

    # Every method left its mark on the metrics port (counters only grow).
    after = scrape(family)
    grew = {k: after[k] - before.get(k, 0.0) for k in after}
    sent = Counter(r["extra"]["speculative_method"] for r in reqs)
    for method, n in sent.items():
        assert grew[("specdec_requests_total", method)] >= n, method
        if method != "none":
            assert grew[("specdec_draft_tokens_total", method)] > 0, method
    assert grew[("specdec_verify_steps_total", "none")] > 0
    for method in METHODS:  # τ >= 1: every verify step emits its bonus token
        steps = grew[("specdec_verify_steps_total", method)]
        assert grew[("specdec_emitted_tokens_total", method)] >= steps
        assert grew[("specdec_accepted_draft_tokens_total", method)] <= grew[("specdec_draft_tokens_total", method)]
    assert family.is_ready()


@pytest.mark.parametrize("method", ["eagle2", "medusa", "none"])
def test_perf_metrics_reach_the_client_through_the_ensemble(family, method):
    status, out = generate(family, {"text_input": PROMPTS[0], "max_tokens": 16, "speculative_method": method,
                                    "return_perf_metrics": True, "end_id": -1})
    assert status == 200, out
    drafted, accepted = out["total_draft_tokens"], out["total_accepted_draft_tokens"]
    if method == "none":
        assert drafted == accepted == 0 and out["acceptance_rate"] == 0.0
    else:
        assert drafted > 0 and 0 <= accepted <= drafted
        assert out["acceptance_rate"] == pytest.approx(accepted / drafted, rel=1e-6)
    # Streamed, the last response carries the same totals (greedy: the same steps).
    stream = Stream(family, "ensemble", text_request(PROMPTS[0], 16, speculative_method=method,
                                                     return_perf_metrics=True, end_id=-1))
    try:
        answer = stream.read()
    finally:
        stream.close()
    assert answer.final and answer.error is None
    assert (answer.perf["total_draft_tokens"], answer.perf["total_accepted_draft_tokens"]) == (drafted, accepted)


def test_metrics_describe_tau_and_acceptance(family):
    text = requests.get(f"http://localhost:{family.metrics_port}/metrics", timeout=10).text
    assert re.search(r"# HELP specdec_verify_steps_total .*τ = emitted_tokens / verify_steps", text)
    assert re.search(r"# HELP specdec_draft_tokens_total .*accepted_draft_tokens / draft_tokens", text)
    assert re.search(r"# TYPE specdec_emitted_tokens_total counter", text)


# -- the small server ------------------------------------------------------------------------
def _fill_slots(server, n: int = 2) -> list[Stream]:
    """`n` long streamed requests on `speculative_decoding`, each seen running (first tokens in)."""
    streams = [Stream(server, "speculative_decoding", token_request([1, 5 + i, 6, 7], LONG), request_id=f"long{i}")
               for i in range(n)]
    for s in streams:
        answer = s.read(responses=2)
        assert answer.error is None and not answer.final, answer
    return streams


def test_full_queue_answers_an_error_at_once(small):
    long = _fill_slots(small)  # both engine slots busy
    queued = Stream(small, "ensemble", text_request("queued", 4))
    try:
        time.sleep(0.5)  # let it reach the engine's queue (its one place)
        # TensorRT-LLM's load gauges say so: 2 of 2 slots (its "blocks") used, one waiting
        requests_, blocks = "nv_trt_llm_request_metrics", "nv_trt_llm_kv_cache_block_metrics"
        busy = {(requests_, "active"): 2, (requests_, "waiting"): 1, (requests_, "max"): 2,
                (blocks, "used"): 2, (blocks, "free"): 0, (blocks, "fraction"): 1.0}
        got = until_gauges(small, busy)
        assert {k: got.get(k) for k in busy} == busy, got
        assert got[(blocks, "tokens_per")] >= LONG and got[("nv_trt_llm_general_metrics", "iteration_counter")] > 0
        t0 = time.monotonic()
        stream = Stream(small, "ensemble", text_request("refused", 4))
        refused = stream.read(timeout_s=10)
        stream.close()
        assert refused.error is not None and "queue is full" in refused.error, refused
        status, out = generate(small, {"text_input": "refused too", "max_tokens": 4})
        assert status == 400 and "queue is full" in out["error"]  # generate: 400 for any model error
        assert time.monotonic() - t0 < 5.0  # answered, not parked until a slot frees
        assert small.is_ready()
    finally:
        for s in long:
            s.cancel()
    answer = queued.read(timeout_s=60)  # the cancelled requests' slots take the queued one
    assert answer.final and answer.error is None
    queued.close()
    idle = {("nv_trt_llm_request_metrics", "active"): 0, ("nv_trt_llm_request_metrics", "waiting"): 0,
            ("nv_trt_llm_kv_cache_block_metrics", "free"): 2}
    got = until_gauges(small, idle)
    assert {k: got.get(k) for k in idle} == idle, got


def test_cancelled_streams_free_their_slots(small):
    before = scrape(small)
    for s in _fill_slots(small):
        s.cancel()
    # A full batch of new requests (every slot) completes, and the cancelled requests
    # stopped early: far fewer tokens were generated than they asked for. The server
    # notices a cancellation within a poll and a step; until then a client that finds the
    # queue full retries, as it should.
    deadline = time.monotonic() + 30
    answers: list[Answer | None] = [None, None]

    def client(i):
        while True:
            stream = Stream(small, "speculative_decoding", token_request([1, 9, 10 + i], 8), request_id=f"new{i}")
            answers[i] = stream.read(timeout_s=60)
            stream.close()
            if answers[i].error is None or "queue is full" not in answers[i].error or time.monotonic() > deadline:
                return
            time.sleep(0.1)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for answer in answers:
        assert answer.final and answer.error is None and sum(len(p) for p in answer.pieces) >= 8, answer
    grew = scrape(small)[("specdec_emitted_tokens_total", "none")] - before.get(
        ("specdec_emitted_tokens_total", "none"), 0.0)
    assert grew < LONG / 2
    assert small.is_ready()


def test_full_queue_is_unavailable_on_infer(small):
    """On the non-decoupled copy four requests meet in one execute; its engine has 2 slots
    and 1 queue place, so at least one is refused: UNAVAILABLE, which `/infer` shows as 503."""
    body = {"inputs": [{"name": "input_ids", "shape": [1, 4], "datatype": "INT32", "data": [1, 5, 6, 7]},
                       {"name": "input_lengths", "shape": [1, 1], "datatype": "INT32", "data": [4]},
                       {"name": "request_output_len", "shape": [1, 1], "datatype": "INT32", "data": [16]}]}
    url = f"http://{small.http_url}/v2/models/speculative_decoding_sync/infer"
    results = [None] * 4

    def post(i):
        r = requests.post(url, json=body, timeout=120)
        results[i] = (r.status_code, r.json())

    threads = [threading.Thread(target=post, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = sorted(status for status, _ in results)
    assert 200 in statuses and 503 in statuses, results
    assert all("queue is full" in out["error"] for status, out in results if status == 503)
    assert small.is_ready()
