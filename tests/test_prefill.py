"""Batched prefill: the grouping rule, and that requests prefilled together (padded to
the longest prompt) generate exactly what they generate alone, for every method."""
from __future__ import annotations

import random

import pytest

from engine_helpers import code_prompts, make_engine, request, run_batch
from specdec.prefill import prefill_groups


def test_groups_cover_every_request_once_within_the_limits():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.choice([rng.randint(1, 40), rng.randint(100, 700)]) for _ in range(rng.randint(0, 24))]
        max_tokens, max_padding = rng.choice([256, 1024, 4096]), rng.choice([0.0, 0.1, 0.25, 0.5])
        groups = prefill_groups(lengths, max_tokens, max_padding)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        for g in groups:
            longest = max(lengths[i] for i in g)
            assert lengths[g[0]] == longest
            if len(g) > 1:
                padded = longest * len(g)
                assert padded <= max_tokens and padded - sum(lengths[i] for i in g) <= max_padding * padded + 1e-9


def test_equal_prompts_share_a_forward_and_outliers_do_not():
    assert prefill_groups([100] * 8, max_tokens=400) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert prefill_groups([100, 10, 100], max_padding=0.25) == [[0, 2], [1]]
    assert prefill_groups([5000, 10], max_tokens=4096) == [[0], [1]]  # too long to share: alone
    assert prefill_groups([]) == []


@pytest.fixture(scope="module")
def prompts():
    return code_prompts(6, max_tokens=48)


def test_requests_prefilled_together_match_their_runs_alone(prompts):
    """Every method's drafter starts from a batched prefill (EAGLE-3 takes the padded
    forward's auxiliary features), plus a seeded sampled request; float64, so the
    padded forward must reproduce each output token for token."""
    engine = make_engine(dtype="float64", max_batch_size=6)
    lengths = [40, 40, 38, 37, 10, 9]
    methods = ["eagle2", "eagle3", "medusa", "draft_model", "none", "eagle"]
    reqs = [request(prompts[i][: lengths[i]], 24, methods[i], rid=f"r{i}") for i in range(6)]
    sampled = request(prompts[0][:40], 24, "eagle2", rid="sampled", temperature=0.8, top_p=0.9, seed=7)
    alone = {r.request_id: engine.generate(r)[0] for r in reqs + [sampled]}

    forwards = []
    real_forward = engine.target.forward

    def counting(ids, *args, **kwargs):
        forwards.append(tuple(ids.shape))
        return real_forward(ids, *args, **kwargs)

    engine.target.forward = counting
    outs = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.submit(r, lambda o: outs[o.request_id].extend(o.token_ids))
    engine.step()  # admits all six: prefill forwards, then one verify forward
    groups = prefill_groups(lengths)
    assert forwards[:-1] == [(len(g), max(lengths[i] for i in g)) for g in groups]
    assert len(groups) == 2 and sorted(map(len, groups)) == [1, 5]
    while engine.num_active:
        engine.step()
    assert outs == {r.request_id: alone[r.request_id] for r in reqs}
    # A seeded sampled request prefilled beside others draws the same tokens.
    assert run_batch(engine, [sampled, reqs[1], reqs[2]])["sampled"] == alone["sampled"]
