"""How a tree's accepted drafts divide among the smaller trees within it
(`specdec.tree_shares`): the load-time curve, what served steps teach, and the node
numbering that lets a step say what its smaller trees would have accepted."""
from __future__ import annotations

import random

import pytest

from engine_helpers import code_prompts, make_engine, request
from specdec.tree_shares import (SHARE_PRIOR_WEIGHT, ServedShares, accepted_within, fitted_shares,
                                 share_curve)


def test_accepted_within_counts_the_paths_nodes_below_the_size():
    path = [1, 3, 9]  # node numbers of an accepted path past the root (increasing)
    assert [accepted_within(path, n) for n in (1, 2, 3, 4, 9, 10, 16)] == [0, 1, 1, 2, 2, 3, 3]
    assert accepted_within([], 16) == 0


def test_share_curve_is_a_chains_acceptance():
    """A chain whose drafts are each accepted with probability q: the first n nodes keep
    q + ... + q ** (n - 1) accepted drafts a step."""
    q = 0.6
    accepted = {n: sum(q ** k for k in range(1, n)) for n in (2, 3, 4, 8, 16)}
    for n, a in accepted.items():
        assert share_curve(q, n, 16) == pytest.approx(a / accepted[16])
    assert share_curve(q, 16, 16) == 1.0 and share_curve(q, 32, 16) == 1.0


def test_fitted_shares_stay_below_one_and_grow_with_the_tree():
    rng = random.Random(3)
    for _ in range(200):
        accepted = {n: rng.uniform(0.0, 2.0) for n in (16, 8, 4, 3, 2) if n == 16 or rng.random() < 0.8}
        shares = fitted_shares(accepted, 16)
        if accepted[16] == 0.0:
            assert shares == {}
            continue
        assert set(shares) == set(accepted) and shares[16] == 1.0
        sizes = sorted(shares)
        assert all(shares[a] <= shares[b] for a, b in zip(sizes, sizes[1:]))
        assert all(0.0 < shares[n] <= 1.0 for n in sizes)
    assert fitted_shares({16: 0.0, 2: 0.4}, 16) == {}
    assert fitted_shares({16: 1.5}, 16) == {16: 1.0}


def test_fitted_shares_follow_one_curve_through_every_measured_size():
    """A chain whose drafts are each accepted with probability 0.6 comes back as
    measured; a lucky size (the 4-node tree of one calibration: 0.88 of the full tree,
    3 nodes 0.61) is pulled to the curve the other sizes follow, so 4 nodes no longer
    look 44 % better than 3."""
    chain = {n: sum(0.6 ** k for k in range(1, n)) for n in (16, 8, 4, 3, 2)}  # accepted drafts per step
    fitted = fitted_shares(chain, 16)
    assert fitted == pytest.approx({n: a / chain[16] for n, a in chain.items()})
    lucky = fitted_shares({16: 1.75, 8: 1.75, 4: 1.54, 3: 1.06, 2: 0.68}, 16)
    assert 1.1 < lucky[4] / lucky[3] < 1.3 and 0.35 < lucky[2] < 0.45 and lucky[8] < 1.0


def chain_path(rng: random.Random, q: float, nodes: int) -> list[int]:
    """The accepted path of a chain of `nodes` nodes whose drafts are each accepted with
    probability q (node k at depth k)."""
    path = []
    while len(path) < nodes - 1 and rng.random() < q:
        path.append(len(path) + 1)
    return path


def test_served_steps_move_the_shares_from_the_prior_to_the_served_texts():
    """The load-time shares say each further node adds 0.9 of the one before (a 4-node
    tree accepts 2.7x a 2-node one); served 4-node chains accept each draft with
    probability 0.45 (1.65x). A few steps barely move the fit; a few hundred bring it to
    the served text, and the curve extends to sizes no step drafted (8 and 16 nodes)."""
    prior = {n: share_curve(0.9, n, 16) for n in (2, 3, 4, 8)}
    sizes = [16, 8, 4, 3, 2]
    served = ServedShares()
    assert served.refit(prior.get, sizes, 16) is None  # nothing served yet
    rng = random.Random(5)
    for _ in range(2):
        served.add([2, 3], 4, chain_path(rng, 0.45, 4))
    early = served.refit(prior.get, sizes, 16)
    assert early is None or early >= 0.7  # at most a couple of accepted drafts against SHARE_PRIOR_WEIGHT
    for _ in range(400):
        served.add([2, 3], 4, chain_path(rng, 0.45, 4))
    q = served.refit(prior.get, sizes, 16)
    assert 0.35 <= q <= 0.6, q  # (the prior still pulls a little)
    assert share_curve(q, 4, 16) / share_curve(q, 2, 16) == pytest.approx(1 + 0.45 + 0.45 ** 2, rel=0.15)


def test_served_evidence_outweighs_the_prior_by_its_accepted_drafts():
    """One step that accepted its one draft within a 2-node tree of a 4-node one is
    weighed as one accepted draft against SHARE_PRIOR_WEIGHT: the fit stays near the
    prior; steps that accepted nothing within the reference say nothing."""
    prior = {n: share_curve(0.8, n, 16) for n in (2, 4, 8)}
    served = ServedShares()
    for _ in range(50):
        served.add([2], 4, [])  # nothing accepted: no evidence
    assert served.refit(prior.get, [16, 8, 4, 2], 16) is None
    served = ServedShares()
    served.add([2], 4, [1])  # 2 nodes held everything the 4-node tree accepted (q -> 0 alone)
    assert SHARE_PRIOR_WEIGHT >= 8 and served.refit(prior.get, [16, 8, 4, 2], 16) >= 0.6


@pytest.mark.parametrize("method", ["eagle2", "eagle3"])
def test_a_dynamic_trees_first_nodes_are_the_tree_a_smaller_budget_keeps(method):
    """EAGLE-2/3 number a tree's nodes best first: a tree of n nodes drafted with the
    same depth and top-k is the first n nodes of a larger one, token for token and
    parent for parent (what adaptive speculation reads a step's smaller trees from, and
    what prompt lookup's graft and the context's end cut)."""
    engine = make_engine(dtype="float64", max_batch_size=3)
    prompts = code_prompts(3)
    drafter = engine.drafters[method]
    first_trees: dict[int, list] = {}  # size -> each prompt's first tree (drafted right after prefill)
    propose = drafter.propose
    calls = []

    def recording(states, settings):
        trees = propose(states, settings)
        calls.append([(t.tokens[1:].tolist(), t.parents.tolist()) for t in trees])
        return trees
    drafter.propose = recording
    try:
        for n in (16, 10, 6, 3, 2):
            first_trees[n] = []
            for p in prompts:
                calls.clear()
                engine.generate(request(p, 2, method=method, total_tokens=n, depth=5, tree_top_k=4))
                first_trees[n].append(calls[0][0])
    finally:
        drafter.propose = propose
    for n, trees in first_trees.items():
        for (tokens, parents), (big_tokens, big_parents) in zip(trees, first_trees[16]):
            assert len(tokens) == n - 1
            assert tokens == big_tokens[: n - 1] and parents == big_parents[:n]
    assert any(len(set(p)) > 2 for _, p in first_trees[16]), "the test's trees must branch"
