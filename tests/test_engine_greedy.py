"""The central promise: speculative greedy output equals plain greedy output, token
for token, for every method and tree, alone and batched; and plain greedy equals
Hugging Face `transformers` greedy on the same checkpoint.

The exact-equality tests run the engine in float64, so that a near-tie between two
logits cannot flip an argmax between the plain and the tree forward (they sum in
different orders); the transformers comparison runs in float32 as users would.
"""
from __future__ import annotations

import pytest
import torch

from engine_helpers import code_prompts, make_engine, request, run_batch

NEW_TOKENS = 64
PROMPTS = 6

TREES = [
    ("eagle", dict(choices="eagle_default_25")),
    ("eagle", dict(choices="{0},{1},{0,0},{0,1},{0,0,0},{0,0,0,0}")),
    ("eagle2", dict(depth=5, tree_top_k=8, total_tokens=16)),
    ("eagle2", dict(depth=3, tree_top_k=4, total_tokens=6)),
    ("eagle2", dict(depth=7, tree_top_k=10, total_tokens=60)),
    ("eagle3", dict(depth=5, tree_top_k=8, total_tokens=24)),
    ("eagle3", dict(depth=2, tree_top_k=2, total_tokens=3)),
    ("medusa", dict(choices="mc_sim_7b_63")),
    ("medusa", dict(choices="[[0],[0,0],[0,0,0],[1],[0,1]]")),
    ("draft_model", dict(num_draft_tokens=1)),
    ("draft_model", dict(num_draft_tokens=4)),
    ("draft_model", dict(num_draft_tokens=7)),
    # a branch copied from the text grafted onto the tree (drafters/lookup.py)
    ("eagle", dict(choices="{0},{1},{0,0},{0,1},{0,0,0},{0,0,0,0}", prompt_lookup_tokens=10)),
    ("eagle2", dict(depth=3, tree_top_k=4, total_tokens=6, prompt_lookup_tokens=10)),
    ("eagle3", dict(depth=2, tree_top_k=2, total_tokens=3, prompt_lookup_tokens=3)),
    ("medusa", dict(choices="[[0],[0,0],[0,0,0],[1],[0,1]]", prompt_lookup_tokens=10)),
]


@pytest.fixture(scope="module")
def engine():
    return make_engine(dtype="float64")


@pytest.fixture(scope="module")
def plain(engine):
    return [engine.generate(request(p, NEW_TOKENS))[0] for p in code_prompts(PROMPTS)]


def test_plain_greedy_matches_transformers():
    from transformers import LlamaForCausalLM

    from engine_helpers import FAMILY
    engine = make_engine(speculative_method="none")
    hf = LlamaForCausalLM.from_pretrained(str(FAMILY / "base"), dtype=torch.float32).eval()
    for ids in code_prompts(3):
        ours = engine.generate(request(ids, 40))[0]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(ids):].tolist()
        assert ours == ref


@pytest.mark.parametrize("method,tree", TREES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(TREES)])
def test_speculative_greedy_equals_plain(engine, plain, method, tree):
    taus = []
    for ids, ref in zip(code_prompts(PROMPTS), plain):
        out, _, last = engine.generate(request(ids, NEW_TOKENS, method, **tree))
        assert out == ref, f"{method} {tree}: first difference at {next(i for i, (a, b) in enumerate(zip(out, ref)) if a != b)}"
        taus.append(last.stats.tau)
        if last.stats.total_draft_tokens:
            assert last.stats.target_forwards < NEW_TOKENS  # speculation actually ran
    assert sum(taus) / len(taus) > 1.0


def test_batched_mixed_methods_equal_plain(engine, plain):
    """Requests of different methods and trees verified together in one forward."""
    methods = [("eagle2", {}), ("medusa", {}), ("draft_model", {}), ("eagle3", {}), ("eagle", {}), ("none", {})]
    reqs = [request(ids, NEW_TOKENS, m, rid=f"r{i}", **kw)
            for i, (ids, (m, kw)) in enumerate(zip(code_prompts(PROMPTS), methods))]
    outs = run_batch(engine, reqs)
    for i, ref in enumerate(plain):
        assert outs[f"r{i}"] == ref, methods[i]
    assert engine.slots.available == engine.config.max_batch_size  # every slot came back


def test_requests_that_move_down_into_freed_slots_run_as_they_would_alone():
    """Requests of every method ending at different steps, 6 through 4 slots, prompts
    prefilled in 16-token pieces: whoever holds a slot above the running ones moves into
    the freed one (`Engine._pack_slots`), mid-prompt or decoding, with its drafter's
    cache; every step starts with the running requests in the lowest slots. Each
    request's output equals its run alone, and so do its drafted and accepted counts;
    and what a moved request had in its slot is in its new one (outputs equal plain
    decoding's whatever the drafts, and the tiny family's random drafters hardly read
    their context: a drafter that lost its state would still pass the rest)."""
    engine = make_engine(dtype="float64", prefill_chunk_tokens=16)
    prompts = sorted(code_prompts(PROMPTS), key=len)
    # Slots 0-3 take r0-r3. r0 ends first: r3 (draft model, decoding) moves to 0 and r4
    # (EAGLE-3, a 10-piece prompt) takes 3; r1 ends while r4's prompt is prefilled: r4
    # moves to 1 and r5 (EAGLE-1) takes 3; r3 ends before r5: r5 moves, decoding, to 0.
    plan = [("none", 4, 24), ("eagle2", 14, 24), ("medusa", 64, 24), ("draft_model", 40, 24), ("eagle3", 40, None),
            ("eagle", 64, 24)]
    reqs = [request(ids[:cut], n, m, rid=f"r{i}") for i, (ids, (m, n, cut)) in enumerate(zip(prompts, plan))]
    moved = {"prefilling": set(), "decoding": set()}
    packed, pack = [], engine._pack_slots

    def pack_noted():
        before = {id(s): (s.slot, slot_contents(engine, s)) for s in engine._running}
        pack()
        for s in engine._running:
            slot, contents = before[id(s)]
            if s.slot != slot:
                assert s.slot < slot
                moved["prefilling" if s.prefilling else "decoding"].add(s.settings.method)
                assert all(torch.equal(a, b) for a, b in zip(slot_contents(engine, s), contents)), s.settings.method
        packed.append(sorted(s.slot for s in engine._running) == list(range(len(engine._running))))
    engine._pack_slots = pack_noted
    finals: dict = {}
    outs = run_batch(engine, reqs, finals)
    engine._pack_slots = pack
    assert all(packed) and len(packed) > 10 and engine.slots.free == [0, 1, 2, 3]
    assert {"draft_model", "eagle"} <= moved["decoding"] and "eagle3" in moved["prefilling"], moved
    for r in reqs:
        ids, _, last = engine.generate(r)
        got = finals[r.request_id].stats
        assert outs[r.request_id] == ids, r.spec.method
        assert (got.total_draft_tokens, got.total_accepted_draft_tokens) == \
               (last.stats.total_draft_tokens, last.stats.total_accepted_draft_tokens), r.spec.method


def slot_contents(engine, s) -> list:
    """What request state `s` keeps in its slot: the target's cached keys and values,
    and its drafter's (EAGLE: the head's cache and the committed features)."""
    from specdec.drafters.draft_model import DraftModelDrafter
    from specdec.drafters.eagle import EagleDrafter

    held = [engine.cache.kv[:, :, s.slot, :, : s.cached_len]]
    drafter = engine.drafters.get(s.settings.method)
    if isinstance(drafter, EagleDrafter) and s.draft is not None:
        held += [drafter.cache.kv[:, :, s.slot, :, : s.draft.head_len], drafter.feats[s.slot, : s.cached_len]]
    if isinstance(drafter, DraftModelDrafter) and s.draft is not None:
        held.append(drafter.cache.kv[:, :, s.slot, :, : s.draft.draft_len])
    return [t.clone() for t in held]
