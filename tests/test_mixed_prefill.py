"""Mixed prefill: a step's prompt pieces ride in its verify forward.

`LlamaModel.forward_parts` runs several blocks of tokens (a decode step's trees, prompts
being prefilled) as one forward: each part gets exactly what `forward` gives it alone,
and leaves the same keys and values in its slots. The engine puts the prompts it
prefills beside running requests into the verify forward (`mixed_prefill`); what every
request generates, and what its drafter drafts and the target accepts, is what it is
with each prefill forward run alone."""
from __future__ import annotations

import random

import pytest
import torch

from engine_helpers import code_prompts, make_engine, request
from specdec.kv_cache import AttentionBatch
from specdec.models.random_init import random_llama

CONFIG = dict(vocab_size=64, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0)


def tree_mask(parents: list[int]) -> torch.Tensor:
    """[T, T] bool: node i sees itself and its ancestors (`parents[0] == -1`)."""
    T = len(parents)
    mask = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def random_part(rng: random.Random, slots: list[int], max_len: int):
    """A block over `slots`: one token each (a plain decode step), a tree each (a verify
    step) or a chain each (prompts), after random cached prefixes."""
    kind = rng.choice(["decode", "tree", "prompt"])
    B = len(slots)
    T = 1 if kind == "decode" else rng.randint(2, 9)
    if kind == "tree":
        local = torch.stack([tree_mask([-1] + [rng.randrange(i) for i in range(1, T)]) for _ in range(B)])
    else:
        local = torch.ones(T, T, dtype=torch.bool).tril()[None].expand(B, T, T)
    prefix = torch.tensor([rng.randint(0, max_len - T) for _ in range(B)])
    positions = prefix[:, None] + torch.arange(T)[None]
    if kind == "tree":  # a node's position is its depth after the prefix
        positions = prefix[:, None] + local.sum(-1) - 1
    batch = AttentionBatch.build(torch.tensor(slots), prefix, local, host_slots=slots)
    ids = torch.randint(0, CONFIG["vocab_size"], (B, T))
    return ids, positions, batch


@pytest.mark.parametrize("seed", range(6))
def test_forward_parts_equals_each_part_run_alone(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = random_llama(CONFIG, dtype=torch.float64, seed=seed, std=0.2)
    slots = list(range(10))
    rng.shuffle(slots)
    parts, start = [], 0
    for _ in range(rng.randint(2, 4)):  # disjoint slots, consecutive or not
        n = rng.randint(1, 3)
        taken = sorted(slots[start: start + n]) if rng.random() < 0.5 else slots[start: start + n]
        parts.append(random_part(rng, taken, 30))
        start += n
    aux_layers = rng.choice([(), (0, 2)])
    before = model.new_cache(10, 40)
    before.kv.copy_(torch.randn_like(before.kv))
    alone_cache, parts_cache = model.new_cache(10, 40), model.new_cache(10, 40)
    alone_cache.kv.copy_(before.kv)
    parts_cache.kv.copy_(before.kv)
    with torch.inference_mode():
        alone = [model(ids, positions, alone_cache, batch, aux_layers) for ids, positions, batch in parts]
        together = model.forward_parts(parts, parts_cache, aux_layers)
    assert len(together) == len(parts)
    for (hidden, aux), (got_hidden, got_aux) in zip(alone, together):
        assert got_hidden.shape == hidden.shape
        assert (got_hidden - hidden).abs().max() < 1e-12
        assert (got_aux is None) == (aux is None)
        if aux is not None:
            assert (got_aux - aux).abs().max() < 1e-12
    assert (parts_cache.kv - alone_cache.kv).abs().max() < 1e-12
    assert (parts_cache.kv != before.kv).any()


@pytest.fixture(scope="module")
def prompts():
    return code_prompts(6, max_tokens=60)


@pytest.mark.parametrize("chunk", [None, 16])
def test_prompts_riding_in_verify_forwards_generate_what_they_do_prefilled_alone(prompts, chunk):
    """Requests of every method arrive at different steps beside running ones (whole
    prompts, and with pieces of 16 tokens prompts spread over several steps): with
    mixed prefill on, their prefill rode in verify forwards and no prefill forward ran
    alone while anything decoded; outputs, drafted and accepted counts equal those with
    it off; so are the prompt log-probs and output log-probs of one that asks for them."""
    methods = ["none", "eagle3", "eagle2", "medusa", "draft_model", "eagle"]  # the first one arrives alone
    asks = dict(return_prompt_log_probs=True, return_log_probs=True, top_log_probs=2)  # (of the last one)
    results, scores = {}, {}
    for mixed in (True, False):
        engine = make_engine(dtype="float64", max_batch_size=6, mixed_prefill=mixed,
                             enable_chunked_context=chunk is not None, prefill_chunk_tokens=chunk or 256)
        parts_seen, alone_while_decoding, decoding_at_start = [], [], [False]
        forward_parts, run_prefill, step = engine.target.forward_parts, engine._run_prefill, engine.step

        def counting_parts(parts, *args, **kw):
            parts_seen.append(len(parts))
            return forward_parts(parts, *args, **kw)

        def counting_alone(forward):
            alone_while_decoding.append(decoding_at_start[0])
            return run_prefill(forward)

        def noting_step():
            decoding_at_start[0] = any(not s.prefilling for s in engine._running)
            step()

        engine.target.forward_parts, engine._run_prefill, engine.step = counting_parts, counting_alone, noting_step
        outs: dict = {}
        pending = [request(p, 12 + 3 * i, m, rid=f"{m}-{i}", **(asks if i == 5 else {}))
                   for i, (p, m) in enumerate(zip(prompts, methods))]
        for r in pending:  # one arrives every other step
            outs.update(run_outputs_async(engine, r))
            engine.step()
            engine.step()
        while any(not o or not o[-1].finished for o in outs.values()):
            engine.step()
        results[mixed] = {rid: ([t for o in o_list for t in o.token_ids],
                                o_list[-1].stats.total_draft_tokens, o_list[-1].stats.total_accepted_draft_tokens)
                          for rid, o_list in outs.items()}
        scores[mixed] = (outs["eagle-5"][0].prompt_log_probs, [lp for o in outs["eagle-5"] for lp in o.log_probs])
        if mixed:
            assert max(parts_seen) >= 2 and not any(alone_while_decoding)
        else:
            assert not parts_seen and any(alone_while_decoding)
    assert results[True] == results[False]
    assert len(scores[True][0]) == len(prompts[5]) - 1 and len(scores[True][1]) == 27
    for got, alone in zip(scores[True], scores[False]):
        assert got == pytest.approx(alone, abs=1e-9)
    assert sum(drafted for _, drafted, _ in results[True].values()) > 0


def run_outputs_async(engine, req) -> dict:
    """Submits `req`; its outputs are appended to the returned dict's list as steps run."""
    outs: list = []

    def emit(o):
        assert o.finish_reason != "error", o.error
        outs.append(o)

    engine.submit(req, emit)
    return {req.request_id: outs}


def test_a_rider_that_ends_on_its_first_token_frees_its_slot(prompts):
    """A riding prompt with max_tokens 1 ends with its first token, in the verify
    forward's step, and a request waiting for its slot takes it."""
    engine = make_engine(max_batch_size=2)
    outs = {}
    outs.update(run_outputs_async(engine, request(prompts[0], 20, "eagle3", rid="running")))
    engine.step()
    outs.update(run_outputs_async(engine, request(prompts[1], 1, "none", rid="one")))
    outs.update(run_outputs_async(engine, request(prompts[2], 3, "none", rid="next")))
    engine.step()  # "one" rides and ends; "next" waits for a slot
    assert outs["one"][-1].finished and len(outs["one"][-1].token_ids) == 1
    assert not outs["next"]
    while not outs["running"][-1].finished or not outs["next"] or not outs["next"][-1].finished:
        engine.step()
    assert sum(len(o.token_ids) for o in outs["next"]) == 3
    assert engine.slots.available == 2
