"""Chunked prefill (TensorRT-LLM's `enable_chunked_context`): which pieces of which
prompts a step takes; that a prompt prefilled in pieces generates what it generates
whole, for every method; that running requests decode between the pieces of a long
prompt, while short prompts arriving together are prefilled whole; and that a request
cancelled mid-prompt frees its slot and leaves nothing behind for the next one."""
from __future__ import annotations

import random

import pytest

from engine_helpers import FAMILY, code_prompts, make_engine, request, run_outputs
from specdec.config import EngineConfig
from specdec.errors import ConfigError
from specdec.prefill import prefill_chunks


def test_a_step_takes_a_piece_of_each_long_prompt_and_each_short_one_whole():
    rng = random.Random(0)
    for _ in range(500):
        pending = []
        for _ in range(rng.randint(0, 6)):
            prompt_len = rng.randint(1, 90)
            pending.append((rng.randint(0, prompt_len - 1), prompt_len))
        piece = rng.choice([None, 1, 7, 64, 512])
        chunks = prefill_chunks(pending, piece)
        assert [c.index for c in chunks] == list(range(len(pending)))  # every request, oldest first
        for c, (cached, prompt_len) in zip(chunks, pending):
            assert (c.start, c.prompt_len) == (cached, prompt_len)
            rest = prompt_len - cached
            assert c.length == (rest if piece is None else min(rest, piece)) and c.length >= 1
            assert c.last == (c.length == rest) and c.whole == (cached == 0 and c.last)


def test_the_docstring_example():
    steps, pending = [], [(0, 5), (0, 12), (0, 3)]
    names = [0, 1, 2]
    while pending:
        chunks = prefill_chunks(pending, 8)
        steps.append([(names[c.index], c.start, c.start + c.length) for c in chunks])
        kept = [(c.start + c.length, c.prompt_len, names[c.index]) for c in chunks if not c.last]
        pending, names = [(a, b) for a, b, _ in kept], [n for _, _, n in kept]
    assert steps == [[(0, 0, 5), (1, 0, 8), (2, 0, 3)], [(1, 8, 12)]]


@pytest.fixture(scope="module")
def prompts():
    code = code_prompts(6, max_tokens=160)
    return [p for p in code if len(p) >= 40][:3] + [(code[0] + code[1] + code[2])[:100]]


@pytest.fixture(scope="module")
def engines():
    return (make_engine(dtype="float64", enable_chunked_context=False),
            make_engine(dtype="float64", prefill_chunk_tokens=7))


def _collect(outs: dict, rid: str):
    outs[rid] = []
    return outs[rid].append


def _beside(engine, reqs: list, outs: dict) -> int:
    """Submits `reqs` while a plain request is decoding, as served requests arrive,
    steps until they are done and cancels it; returns the step count."""
    engine.submit(request([1, 2, 3], 400, "none", rid="beside"), _collect(outs, "beside"))
    engine.step()
    for r in reqs:
        engine.submit(r, _collect(outs, r.request_id))
    steps = 0
    while any(not (outs[r.request_id] and outs[r.request_id][-1].finished) for r in reqs):
        engine.step()
        steps += 1
    engine.cancel("beside")
    engine.step()
    assert engine.num_active == 0
    return steps


@pytest.mark.parametrize("method", ["none", "eagle", "eagle2", "eagle3", "medusa", "draft_model"])
def test_a_prompt_prefilled_in_pieces_generates_what_it_generates_whole(engines, prompts, method):
    """float64: every output token, its log-prob and alternatives, and the prompt's own
    log-probs with theirs, of a prompt prefilled whole and in 7-token pieces (beside a
    decoding request); greedy, then a seeded sampled request."""
    whole, chunked = engines
    for i, kw in enumerate([{}, dict(temperature=0.8, top_p=0.9, seed=11)]):
        r = request(prompts[i], 20, method, rid=f"{method}-{i}", return_log_probs=True,
                    return_prompt_log_probs=True, top_log_probs=2, **kw)
        outs: dict = {}
        assert _beside(chunked, [r], outs) >= len(prompts[i]) // 7  # in pieces
        a, b = run_outputs(whole, [r])[r.request_id], outs[r.request_id]
        assert [t for o in b for t in o.token_ids] == [t for o in a for t in o.token_ids]
        assert [p for o in b for p in o.log_probs] == pytest.approx([p for o in a for p in o.log_probs], abs=1e-9)
        assert len(a[0].prompt_log_probs) == len(prompts[i]) - 1
        assert b[0].prompt_log_probs == pytest.approx(a[0].prompt_log_probs, abs=1e-9)
        assert [[t for t, _ in top] for top in b[0].prompt_top_log_probs] == \
            [[t for t, _ in top] for top in a[0].prompt_top_log_probs]


def test_running_requests_decode_between_the_pieces_of_a_long_prompt(prompts):
    long = prompts[-1]
    assert len(long) == 100
    for chunked, mixed in [(True, True), (True, False), (False, True), (False, False)]:
        engine = make_engine(prefill_chunk_tokens=16, enable_chunked_context=chunked, mixed_prefill=mixed)
        outs: dict = {}
        engine.submit(request(prompts[0][:10], 64, "none", rid="running"), _collect(outs, "running"))
        engine.step()
        engine.submit(request(long, 4, "eagle3", rid="long"), _collect(outs, "long"))
        loads = []
        while not outs["long"]:
            seen = len(outs["running"])
            engine.step()
            loads.append(engine.last_step)
            assert len(outs["running"]) == seen + 1  # one plain step each: never held up
        # Prefilled alone, the long request's last piece comes before the step's verify
        # forward, which decodes it too; riding in that forward (mixed), it decodes from
        # the next step.
        decoded = 1 if mixed else 2
        if chunked:  # ceil(100 / 16) steps
            assert [s.context_tokens for s in loads] == [16] * 6 + [4]
            assert [s.generation_requests for s in loads] == [1] * 6 + [decoded]
        else:
            assert [(s.context_tokens, s.generation_requests) for s in loads] == [(100, decoded)]


def test_prompts_arriving_together_match_their_runs_alone(prompts):
    """The module docstring's example of `prefill.py`: prompts of 5, 12 and 3 tokens
    with pieces of 8 get their first tokens at steps 1, 2 and 1, whether a request is
    decoding beside them or not, and generate what they generate alone."""
    engine = make_engine(prefill_chunk_tokens=8)
    reqs = [request(prompts[0][:n], 6, m, rid=f"r{n}") for n, m in [(5, "eagle2"), (12, "eagle3"), (3, "medusa")]]
    alone = {r.request_id: [t for o in run_outputs(engine, [r])[r.request_id] for t in o.token_ids] for r in reqs}
    for busy in (True, False):
        outs: dict = {}
        if busy:
            engine.submit(request([1, 2, 3], 400, "none", rid="beside"), _collect(outs, "beside"))
            engine.step()
        for r in reqs:
            engine.submit(r, _collect(outs, r.request_id))
        first, start = {}, engine.iterations
        while any(not (outs[r.request_id] and outs[r.request_id][-1].finished) for r in reqs):
            engine.step()
            for r in reqs:
                if outs[r.request_id] and r.request_id not in first:
                    first[r.request_id] = engine.iterations - start
        assert first == {"r5": 1, "r12": 2, "r3": 1}
        assert {r.request_id: [t for o in outs[r.request_id] for t in o.token_ids] for r in reqs} == alone
        engine.cancel("beside")
        engine.step()


def test_a_request_cancelled_mid_prompt_frees_its_slot_and_leaves_nothing_behind(prompts):
    engine = make_engine(prefill_chunk_tokens=16, max_batch_size=2)
    r = request(prompts[-1], 12, "eagle3", rid="r", return_prompt_log_probs=True)
    expected = [t for o in run_outputs(engine, [r])["r"] for t in o.token_ids]
    outs: dict = {}
    engine.submit(request([1, 2, 3], 400, "none", rid="beside"), _collect(outs, "beside"))
    engine.step()
    engine.submit(r, _collect(outs, "r"))
    engine.step()
    engine.step()
    assert not outs["r"] and engine.slots.available == 0  # two pieces of seven in
    engine.cancel("r")
    engine.step()
    [last] = outs["r"]
    assert last.finished and last.finish_reason == "cancelled" and not last.token_ids
    assert last.prompt_log_probs == []  # a part of the prompt's scores is not sent
    assert engine.slots.available == 1 and engine.num_active == 1
    engine.cancel("beside")
    engine.step()
    assert engine.slots.available == 2 and engine.num_active == 0
    # The slot's stale cache and features (two pieces' worth) do not leak into the next request.
    assert [t for o in run_outputs(engine, [r])["r"] for t in o.token_ids] == expected


def test_the_parameters():
    base = {"base_model_dir": str(FAMILY / "base")}
    config = EngineConfig.from_params(base)
    assert config.enable_chunked_context and config.prefill_chunk_tokens == 256
    config = EngineConfig.from_params({**base, "enable_chunked_context": "false", "prefill_chunk_tokens": "64"})
    assert not config.enable_chunked_context and config.prefill_chunk_tokens == 64
    with pytest.raises(ConfigError, match="'prefill_chunk_tokens' must be >= 1"):
        EngineConfig.from_params({**base, "prefill_chunk_tokens": "0"})
    with pytest.raises(ConfigError, match="'enable_chunked_context' must be a bool"):
        EngineConfig.from_params({**base, "enable_chunked_context": "sometimes"})
