"""Request semantics through the engine, with and without speculation: stop words
matched across multi-token steps, end_id, min_tokens, max_tokens, bad words,
penalties, log-probs and their top alternatives, cancellation, the queue bound, and a
KV cache that never grows."""
from __future__ import annotations

import math

import pytest

import torch

from engine_helpers import code_prompts, make_engine, prefill_logits, request, run_batch
from specdec.errors import BusyError, InputError

METHODS = ["none", "eagle2", "eagle3", "medusa", "draft_model", "eagle"]
N = 48


@pytest.fixture(scope="module")
def engine():
    return make_engine(dtype="float64", max_queue_size=3)


@pytest.fixture(scope="module")
def prompt():
    return code_prompts(3, max_tokens=64)[2]


@pytest.fixture(scope="module")
def greedy(engine, prompt):
    return engine.generate(request(prompt, N))[0]


@pytest.mark.parametrize("method", METHODS)
def test_stop_word_inside_a_multi_token_step(engine, prompt, greedy, method):
    # A two-token stop word from the middle of the greedy output: speculative steps
    # usually emit it inside a step, and nothing after it may be returned.
    at = 20
    word = greedy[at : at + 2]
    first = next(i for i in range(len(greedy) - 1) if greedy[i : i + 2] == word)
    out, _, last = engine.generate(request(prompt, N, method, stop_words=[word]))
    assert out == greedy[: first + 2]
    assert last.finish_reason == "stop"


@pytest.mark.parametrize("method", METHODS)
def test_end_id_and_min_tokens(engine, prompt, greedy, method):
    end = greedy[10]
    first = greedy.index(end)
    out, _, last = engine.generate(request(prompt, N, method, end_id=end))
    assert out == greedy[:first] and last.finish_reason == "end_id"
    # min_tokens suppresses end_id before it: the output must run past `first`.
    out, _, _ = engine.generate(request(prompt, N, method, end_id=end, min_tokens=first + 5))
    assert len(out) >= first + 5 and end not in out[: first + 5]


@pytest.mark.parametrize("method", METHODS)
def test_max_tokens_exact(engine, prompt, greedy, method):
    for n in (1, 2, 7):
        out, _, last = engine.generate(request(prompt, n, method))
        assert out == greedy[:n] and last.finish_reason == "length"


@pytest.mark.parametrize("method", ["eagle2", "medusa"])
def test_bad_words_and_penalties_equal_plain(engine, prompt, greedy, method):
    banned = [[greedy[5]], greedy[12:14]]
    for kw in (dict(bad_words=banned[:1]), dict(bad_words=banned), dict(repetition_penalty=1.3),
               dict(presence_penalty=0.5, frequency_penalty=0.3)):
        ref = engine.generate(request(prompt, N, "none", **kw))[0]
        out = engine.generate(request(prompt, N, method, **kw))[0]
        assert out == ref, kw
        assert ref != greedy, kw  # the knob changed something
    out = engine.generate(request(prompt, N, method, bad_words=banned))[0]
    assert greedy[5] not in out


@pytest.mark.parametrize("method", METHODS)
def test_logit_bias_is_lossless_and_acts(engine, prompt, greedy, method):
    """A bias that bans the greedy answer's 6th token and one that favours another
    token: every method's output equals plain decoding's with the same bias."""
    for bias in ({greedy[5]: -100.0}, {greedy[5]: -100.0, greedy[0]: 2.5}):
        ref = engine.generate(request(prompt, N, "none", logit_bias=bias))[0]
        assert engine.generate(request(prompt, N, method, logit_bias=bias))[0] == ref, bias
        assert ref[:5] == greedy[:5] and ref[5] != greedy[5] and greedy[5] not in ref
    forced = engine.generate(request(prompt, 8, method, logit_bias={7: 100.0}))[0]
    assert forced == [7] * 8
    with pytest.raises(InputError, match="logit_bias"):
        engine.submit(request(prompt, 4, logit_bias={10 ** 7: 1.0}), lambda o: None)


def test_log_probs_are_the_targets(engine, prompt):
    out, lps, last = engine.generate(request(prompt, 16, "eagle2", return_log_probs=True))
    ref, ref_lps, _ = engine.generate(request(prompt, 16, "none", return_log_probs=True))
    assert out == ref and len(lps) == 16
    assert all(math.isclose(a, b, abs_tol=1e-6) for a, b in zip(lps, ref_lps))
    assert all(lp <= 0 for lp in lps)


def collect_steps(engine, requests) -> dict[str, list]:
    """Every `StepOutput` of each request, run together (in-flight batching)."""
    steps = {r.request_id: [] for r in requests}
    for r in requests:
        engine.submit(r, steps[r.request_id].append)
    while not all(s and s[-1].finished for s in steps.values()):
        engine.step()
    return steps


@pytest.mark.parametrize("method", METHODS)
def test_top_log_probs_are_the_targets_most_likely_tokens(engine, prompt, method):
    """Greedy: each token's K alternatives are the K largest of the target's own
    log-softmax at that position (a separate forward over prompt + output; the LM head
    returns float32, hence the tolerance), the first being the token itself, whatever
    the method and a batch neighbour's K."""
    n = 12
    steps = collect_steps(engine, [request(prompt, n, method, rid="five", return_log_probs=True, top_log_probs=5),
                                   request(code_prompts(3, 64)[0], n, "eagle3", rid="two", top_log_probs=2),
                                   request(code_prompts(3, 64)[1], n, "eagle2", rid="none")])
    for rid, k in (("five", 5), ("two", 2), ("none", 0)):
        tops = [t for o in steps[rid] for t in o.top_log_probs]
        assert len(tops) == (n if k else 0) and all(len(t) == k for t in tops)
    tokens = [t for o in steps["five"] for t in o.token_ids]
    lps = [p for o in steps["five"] for p in o.log_probs]
    tops = [t for o in steps["five"] for t in o.top_log_probs]
    logits = prefill_logits(engine.target, torch.tensor([prompt + tokens[:-1]]))[0, len(prompt) - 1:]  # [n, V]
    ref = torch.log_softmax(logits.double(), -1).topk(5)
    for j in range(n):
        assert [i for i, _ in tops[j]] == ref.indices[j].tolist()
        assert all(math.isclose(v, r, abs_tol=1e-4) for (_, v), r in zip(tops[j], ref.values[j].tolist()))
        assert tops[j][0] == (tokens[j], lps[j])
    assert not engine.generate(request(prompt, 4, method))[2].top_log_probs  # none asked, none sent


def test_prompt_log_probs_score_the_prompt_as_decoding_scored_the_answer(engine, prompt, monkeypatch):
    """A greedy answer, sent back as part of a prompt with return_prompt_log_probs:
    each of its tokens is the most likely one there, with the log-prob decoding gave
    it; the prompt's own tokens get the target's log-softmax at the position before
    (the LM head in chunks of 7 positions here)."""
    import specdec.engine
    monkeypatch.setattr(specdec.engine, "SCORE_CHUNK", 7)
    n = 10
    answer, lps, _ = engine.generate(request(prompt, n, "eagle2", return_log_probs=True))
    steps = collect_steps(engine, [request(prompt + answer, 2, "eagle3", rid="p", return_prompt_log_probs=True,
                                           top_log_probs=3)])["p"]
    first, rest = steps[0], steps[1:]
    assert len(first.prompt_log_probs) == len(first.prompt_top_log_probs) == len(prompt) + n - 1
    assert not any(o.prompt_log_probs for o in rest)
    for j in range(n):
        top = first.prompt_top_log_probs[len(prompt) - 1 + j]
        assert top[0][0] == answer[j] and math.isclose(top[0][1], lps[j], abs_tol=1e-4)
        assert math.isclose(first.prompt_log_probs[len(prompt) - 1 + j], lps[j], abs_tol=1e-4)
    logits = prefill_logits(engine.target, torch.tensor([prompt]))[0, :-1]  # [L - 1, V]
    ref = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(first.prompt_log_probs, ref.tolist()))
    assert not engine.generate(request(prompt, 2))[2].prompt_log_probs  # none asked, none sent


@pytest.mark.parametrize("method", ["eagle2", "draft_model"])  # drafts proposed by top-k, and sampled (q)
def test_top_log_probs_of_a_sampled_token_come_from_its_distribution(engine, prompt, method):
    """Sampling with top_k 8: the alternatives are the filtered distribution's, which
    the 8 hold whole, and the drawn token is among them with its own log-prob."""
    steps = collect_steps(engine, [request(prompt, 16, method, rid="s", temperature=0.8, top_k=8, seed=3,
                                           return_log_probs=True, top_log_probs=8)])["s"]
    tokens = [t for o in steps for t in o.token_ids]
    lps = [p for o in steps for p in o.log_probs]
    tops = [t for o in steps for t in o.top_log_probs]
    assert len(tops) == len(tokens) == 16
    for token, lp, top in zip(tokens, lps, tops):
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        assert (token, lp) in top
        assert sum(math.exp(v) for v in values) == pytest.approx(1.0, abs=1e-5)  # float32 log-probs
    with pytest.raises(InputError, match="top_log_probs"):
        engine.submit(request(prompt, 4, top_log_probs=21), lambda o: None)


def test_cancel_frees_the_slot_within_a_step(engine, prompt):
    outs = []
    engine.submit(request(prompt, 400, "eagle2", rid="c"), outs.append)
    engine.step()
    engine.cancel("c")
    engine.step()
    assert outs[-1].finished and outs[-1].finish_reason == "cancelled"
    assert engine.slots.available == engine.config.max_batch_size


def test_full_queue_is_an_error_not_a_hang(engine, prompt):
    # Free slots take requests at the next step; beyond them max_queue_size may wait.
    sink = []
    room = engine.config.max_queue_size + engine.slots.available
    for i in range(room):
        engine.submit(request(prompt, 4, rid=f"q{i}"), sink.append)
    with pytest.raises(BusyError, match="queue is full"):
        engine.submit(request(prompt, 4, rid="over"), sink.append)
    while engine.num_active:
        engine.step()
    assert sum(o.finished for o in sink) == room


def test_kv_cache_never_grows(engine, prompt):
    before = (engine.cache.kv.shape, engine.cache.kv.data_ptr())
    drafter = engine.drafters["eagle2"]
    head_before = drafter.cache.kv.data_ptr()
    run_batch(engine, [request(prompt, 64, m, rid=m) for m in ("eagle2", "medusa", "draft_model")])
    assert (engine.cache.kv.shape, engine.cache.kv.data_ptr()) == before
    assert drafter.cache.kv.data_ptr() == head_before
    assert engine.slots.available == engine.config.max_batch_size


@pytest.mark.parametrize("method", METHODS)
def test_context_end_next_to_a_full_tree(method):
    """A request one position short of max_seq_len decodes in the same step as a request
    drafting a full tree (the step pads its one-node tree to the batch's largest): both
    get their alone greedy text, and prompt + output never exceeds max_seq_len."""
    short_ctx = make_engine(dtype="float64", max_seq_len=96)
    ids = code_prompts(3, max_tokens=160)
    at_end, drafting = ids[0][:90], ids[1][:40]
    alone = {rid: short_ctx.generate(request(p, 40, rid=rid))[0] for rid, p in (("end", at_end), ("tree", drafting))}
    together = run_batch(short_ctx, [request(at_end, 40, "none", rid="end"),
                                     request(drafting, 40, method, rid="tree")])
    assert together == alone
    assert len(at_end) + len(together["end"]) == 96
    spec = run_batch(short_ctx, [request(at_end, 40, method, rid="end")])
    assert spec["end"] == alone["end"]


@pytest.mark.parametrize("kw,message", [
    (dict(method="medusa", choices="{0},{0,0,0}"), "prefix"),
    (dict(method="medusa", choices="{0},{0,0},{0,0,0},{0,0,0,0},{0,0,0,0,0}"), "depth"),
    (dict(method="eagle", choices="[[0],[1],[1]]"), "twice"),
    (dict(method="eagle", choices="{{0},{x}}"), "cannot parse"),
    (dict(method="eagle2", total_tokens=1000), "eagle_total_tokens"),
    (dict(method="fancy"), "speculative_method"),
])
def test_bad_speculative_settings_are_input_errors(engine, prompt, kw, message):
    method = kw.pop("method")
    with pytest.raises(InputError, match=message):
        engine.submit(request(prompt, 4, method, **kw), lambda o: None)


def test_unloaded_method_is_an_input_error(prompt):
    plain_only = make_engine(speculative_method="none", eagle_dir=None, eagle3_dir=None, medusa_dir=None,
                             draft_model_dir=None)
    with pytest.raises(InputError, match="not available"):
        plain_only.submit(request(prompt, 4, "eagle2"), lambda o: None)


def test_launched_engine_loads_and_steps_in_one_thread(prompt, greedy):
    """`Engine.launch`: every step runs in the thread that loaded the model (one OpenMP
    pool on CPU, one current device on GPU), never in the caller's. What the load left
    alive is frozen out of the garbage collector while it serves (`freeze_loaded_objects`)."""
    import gc
    import threading

    from specdec.config import EngineConfig
    from specdec.engine import Engine
    from engine_helpers import family_paths

    engine = Engine.launch(EngineConfig(**family_paths(), speculative_method="eagle2", eagle_total_tokens=16,
                                        max_seq_len=512, max_batch_size=4, dtype="float64",
                                        adaptive_speculation=False))
    try:
        assert engine.owner is not threading.current_thread()
        assert gc.get_freeze_count() > 0  # the loaded objects are out of the collector's full passes
        stepped_in = set()
        done = threading.Event()
        out: list[int] = []

        def emit(o):
            stepped_in.add(threading.current_thread())
            out.extend(o.token_ids)
            if o.finished:
                done.set()

        engine.submit(request(prompt, N, "eagle2"), emit)
        assert done.wait(60)
        assert stepped_in == {engine.owner} and out == greedy
    finally:
        engine.shutdown()
    assert gc.get_freeze_count() == 0  # and back in it once the engine is shut down


def test_launch_raises_the_load_error():
    from specdec.config import EngineConfig
    from specdec.engine import Engine
    from specdec.errors import ConfigError

    with pytest.raises(ConfigError, match="no config.json in ./nonexistent/base"):
        Engine.launch(EngineConfig(base_model_dir="/nonexistent/base", speculative_method="none"))


def test_attention_drops_cudnn_on_a_gpu_only():
    """torch's flag, set where the engine loads on a GPU (the CPU engine leaves it)."""
    from specdec.models.layers import attention_without_per_shape_plans

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        assert not attention_without_per_shape_plans(torch.device("cpu"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        assert attention_without_per_shape_plans(torch.device("cuda"))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
