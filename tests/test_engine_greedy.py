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
