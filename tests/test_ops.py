"""The ops' torch twins (the CPU path) against slow references over random trees of odd
sizes, the in-place hazard of kv_compact, and the losslessness of verify_sampling."""
from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from specdec.ops import (build_tree, build_tree_torch, kv_compact, kv_compact_torch,
                         verify_greedy, verify_greedy_torch, verify_sampling,
                         verify_sampling_torch)
from tree_refs import (SIZES_B, SIZES_N, lossless_pvalues, random_sampling_inputs,
                       random_trees, ref_build_tree, ref_kv_compact, ref_verify_greedy,
                       ref_verify_sampling)

# The module itself (`specdec.ops.verify_sampling` the attribute is the function).
SAMPLING_MODULE = importlib.import_module("specdec.ops.verify_sampling")


def _seed(*parts: int) -> np.random.Generator:
    return np.random.default_rng([2024, *parts])


# --- build_tree -----------------------------------------------------------------------

def test_build_tree_worked_example():
    tb = build_tree(torch.tensor([[-1, 0, 0, 1]]), torch.tensor([4]), torch.tensor([7]))
    assert tb.tree_mask.int().tolist() == [[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]]
    assert tb.positions.tolist() == [[7, 8, 8, 9]]
    assert tb.depth.tolist() == [[0, 1, 1, 2]]
    assert tb.first_child.tolist() == [[1, 3, -1, -1]]
    assert tb.next_sibling.tolist() == [[-1, 2, -1, -1]]


@pytest.mark.parametrize("nodes", SIZES_N)
@pytest.mark.parametrize("batch", SIZES_B)
def test_build_tree_matches_reference(batch, nodes):
    rng = _seed(1, batch, nodes)
    parents, num_nodes = random_trees(rng, batch, nodes)
    prefix_len = torch.from_numpy(rng.integers(0, 1000, size=batch))
    tb = build_tree_torch(parents, num_nodes, prefix_len)
    mask, positions, depth, first_child, next_sibling = ref_build_tree(parents, num_nodes,
                                                                       prefix_len)
    assert tb.tree_mask.dtype == torch.bool and tb.depth.dtype == torch.int64
    np.testing.assert_array_equal(tb.tree_mask.numpy(), mask)
    np.testing.assert_array_equal(tb.positions.numpy(), positions)
    np.testing.assert_array_equal(tb.depth.numpy(), depth)
    np.testing.assert_array_equal(tb.first_child.numpy(), first_child)
    np.testing.assert_array_equal(tb.next_sibling.numpy(), next_sibling)


def test_build_tree_padding_rows_attend_to_themselves_only():
    parents = torch.tensor([[-1, 0, -1, -1]])
    tb = build_tree_torch(parents, torch.tensor([2]), torch.tensor([5]))
    assert tb.tree_mask[0, 2:].int().tolist() == [[0, 0, 1, 0], [0, 0, 0, 1]]
    assert tb.positions.tolist() == [[5, 6, 5, 5]]
    assert tb.first_child.tolist() == [[1, -1, -1, -1]]


@pytest.mark.parametrize("build", (build_tree_torch, build_tree))  # the dispatcher: the CPU kernel's way
def test_build_tree_rejects_bad_inputs(build):
    zero2 = torch.tensor([0, 0])
    with pytest.raises(ValueError, match="parents must be torch.int64"):
        build(torch.zeros(1, 3, dtype=torch.int32), torch.tensor([3]), zero2[:1])
    with pytest.raises(ValueError, match=r"num_nodes must have shape \[2\]"):
        build(torch.zeros(2, 3, dtype=torch.int64), torch.tensor([3]), zero2)
    with pytest.raises(ValueError, match="at least one node"):
        build(torch.zeros(2, 0, dtype=torch.int64), zero2, zero2)
    with pytest.raises(ValueError, match=r"prefix_len must have shape \[2\]"):
        build(torch.zeros(2, 3, dtype=torch.int64), zero2, zero2[:1])


# --- verify_greedy ----------------------------------------------------------------------

@pytest.mark.parametrize("nodes", SIZES_N)
@pytest.mark.parametrize("batch", SIZES_B)
@pytest.mark.parametrize("vocab", (2, 3))  # small vocabularies: long accepted paths
def test_verify_greedy_matches_reference(batch, nodes, vocab):
    rng = _seed(2, batch, nodes, vocab)
    parents, num_nodes = random_trees(rng, batch, nodes)
    candidates = torch.from_numpy(rng.integers(0, vocab, size=(batch, nodes)))
    target_argmax = torch.from_numpy(rng.integers(0, vocab, size=(batch, nodes)))
    res = verify_greedy_torch(candidates, parents, num_nodes, target_argmax)
    accept_len, accepted_nodes, bonus = ref_verify_greedy(candidates, parents, num_nodes,
                                                          target_argmax)
    np.testing.assert_array_equal(res.accept_len.numpy(), accept_len)
    np.testing.assert_array_equal(res.accepted_nodes.numpy(), accepted_nodes)
    np.testing.assert_array_equal(res.bonus_token.numpy(), bonus)


def test_verify_greedy_picks_the_deepest_accepted_path():
    #        0
    #   1(a)    2(b)         argmax after 0: b  -> node 1 rejected, node 2 accepted
    #   3(c)    4(c) 5(d)    argmax after 2: d  -> node 5 accepted (depth 2)
    #           6(e)         node 6 under 4 (rejected): never accepted
    #   7(f) under 5         argmax after 5: f  -> node 7 accepted (depth 3): the winner
    a, b, c, d, e, f, z = range(10, 17)
    parents = torch.tensor([[-1, 0, 0, 1, 2, 2, 4, 5]])
    candidates = torch.tensor([[99, a, b, c, c, d, e, f]])
    target_argmax = torch.tensor([[b, c, d, z, e, f, z, 42]])
    res = verify_greedy(candidates, parents, torch.tensor([8]), target_argmax)
    assert res.accept_len.tolist() == [3]
    assert res.accepted_nodes.tolist() == [[0, 2, 5, 7, -1, -1, -1, -1]]
    assert res.bonus_token.tolist() == [42]


def test_verify_greedy_ties_go_to_the_lowest_index_and_padding_is_ignored():
    parents = torch.tensor([[-1, 0, 0, 1, 2, -1], [-1, 0, 0, 0, -1, -1]])
    candidates = torch.tensor([[0, 5, 5, 6, 6, 5], [0, 1, 2, 3, 7, 7]])
    target_argmax = torch.tensor([[5, 6, 6, 8, 9, 7], [7, 1, 1, 1, 1, 1]])
    res = verify_greedy(candidates, parents, torch.tensor([5, 4]), target_argmax)
    # Request 0: nodes 3 and 4 both accepted at depth 2; node 3 wins.
    # Request 1: no child matches (7 only in padding): root only, bonus = argmax[0].
    assert res.accept_len.tolist() == [2, 0]
    assert res.accepted_nodes.tolist() == [[0, 1, 3, -1, -1, -1], [0, -1, -1, -1, -1, -1]]
    assert res.bonus_token.tolist() == [8, 7]


# --- verify_sampling -------------------------------------------------------------------

@pytest.mark.parametrize("nodes", SIZES_N)
@pytest.mark.parametrize("batch", SIZES_B)
@pytest.mark.parametrize("with_draft", (False, True))
def test_verify_sampling_matches_reference(batch, nodes, with_draft):
    rng = _seed(3, batch, nodes, with_draft)
    inputs = random_sampling_inputs(rng, batch, nodes, vocab=11, with_draft=with_draft)
    res = verify_sampling_torch(**inputs)
    accept_len, accepted_nodes, bonus = ref_verify_sampling(**inputs)
    np.testing.assert_array_equal(res.accept_len.numpy(), accept_len)
    np.testing.assert_array_equal(res.accepted_nodes.numpy(), accepted_nodes)
    np.testing.assert_array_equal(res.bonus_token.numpy(), bonus)


def test_verify_sampling_reduces_to_greedy_on_one_hot_targets():
    # With one-hot target rows and distinct sibling tokens every decision is forced and
    # at most one child matches: the accepted path is greedy's.
    rng = _seed(4)
    batch, nodes, vocab = 17, 64, 64
    parents, num_nodes = random_trees(rng, batch, nodes)
    # Token = rank among siblings (distinct); argmax mostly 0 or 1: long paths.
    candidates = torch.zeros(batch, nodes, dtype=torch.int64)
    for b in range(batch):
        for i in range(1, nodes):
            candidates[b, i] = int((parents[b, 1:i] == parents[b, i]).sum())
    target_argmax = torch.from_numpy(rng.integers(0, 2, size=(batch, nodes)))
    target_probs = torch.nn.functional.one_hot(target_argmax, vocab).float()
    uniforms = torch.from_numpy(rng.random((batch, nodes), dtype=np.float32))
    res = verify_sampling(candidates, parents, num_nodes, target_probs, None, uniforms,
                          torch.from_numpy(rng.random(batch, dtype=np.float32)))
    greedy = verify_greedy(candidates, parents, num_nodes, target_argmax)
    assert torch.equal(res.accept_len, greedy.accept_len)
    assert torch.equal(res.accepted_nodes, greedy.accepted_nodes)
    assert torch.equal(res.bonus_token, greedy.bonus_token)


def test_verify_sampling_rejects_bad_inputs():
    inputs = random_sampling_inputs(_seed(5), 2, 4, vocab=5, with_draft=True)
    with pytest.raises(ValueError, match=r"draft_probs must have shape \[2, 4, 5\]"):
        verify_sampling_torch(**{**inputs, "draft_probs": inputs["draft_probs"][:, :, :4]})
    with pytest.raises(ValueError, match="uniforms must be torch.float32"):
        verify_sampling_torch(**{**inputs, "uniforms": inputs["uniforms"].double()})


TRIALS = 40_000
P_OK = 1e-3  # fixed seeds: deterministic; a correct sampler fails this 0.1% of seeds
P_BROKEN = 1e-6


def _broken_residual(p, q):
    """A classic bug: subtract q but forget to renormalise the residual."""
    return (p - q).clamp_min(0.0)


@pytest.mark.parametrize("with_draft", (False, True))
def test_verify_sampling_is_lossless(with_draft):
    """The first emitted token is distributed as the target's P0 and the second as the
    target's distribution after the first (chi-square), whether the children were drawn
    from the drafter (draft_probs) or are its top-k tokens (draft_probs None)."""
    p_first, p_second = lossless_pvalues(verify_sampling, TRIALS, with_draft, seed=7)
    assert p_first > P_OK, f"first token: chi-square p = {p_first:.2e}"
    assert p_second > P_OK, f"second token: chi-square p = {p_second:.2e}"


@pytest.mark.parametrize("with_draft", (False, True))
def test_lossless_test_rejects_a_broken_sampler(with_draft, monkeypatch):
    """Negative control: the same test fails a sampler that does not renormalise the
    residual (it under-accepts later siblings), so the test above can fail."""
    monkeypatch.setattr(SAMPLING_MODULE, "residual", _broken_residual)
    p_first, _ = lossless_pvalues(verify_sampling_torch, TRIALS, with_draft, seed=7)
    assert p_first < P_BROKEN, f"broken sampler passed: chi-square p = {p_first:.2e}"


def test_verify_sampling_never_emits_zero_probability_tokens():
    # All drafts propose token 2, which the target never emits; the bonus must avoid it.
    batch = 200
    parents = torch.tensor([[-1, 0, 0]]).repeat(batch, 1)
    target = torch.tensor([0.5, 0.5, 0.0, 0.0]).repeat(batch, 3, 1)
    draft = torch.tensor([0.0, 0.0, 1.0, 0.0]).repeat(batch, 3, 1)
    gen = torch.Generator().manual_seed(0)
    res = verify_sampling(torch.full((batch, 3), 2), parents, torch.full((batch,), 3), target,
                          draft, torch.rand(batch, 3, generator=gen),
                          torch.rand(batch, generator=gen))
    assert res.accept_len.eq(0).all()
    assert set(res.bonus_token.tolist()) == {0, 1}


# --- kv_compact --------------------------------------------------------------------------

def _kv(dtype, layers=2, slots=6, heads=3, positions=48, head_dim=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layers, 2, slots, heads, positions, head_dim, generator=gen).to(dtype)


@pytest.mark.parametrize("nodes", SIZES_N)
@pytest.mark.parametrize("batch", (1, 3, 6))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16))
def test_kv_compact_matches_reference(batch, nodes, dtype):
    rng = _seed(6, batch, nodes)
    # Accepted paths from greedy verification of random trees: real, increasing paths.
    parents, num_nodes = random_trees(rng, batch, nodes)
    candidates = torch.from_numpy(rng.integers(0, 2, size=(batch, nodes)))
    argmax = torch.from_numpy(rng.integers(0, 2, size=(batch, nodes)))
    res = verify_greedy(candidates, parents, num_nodes, argmax)
    kv = _kv(dtype, slots=6, positions=140 + nodes)
    slots = torch.from_numpy(rng.permutation(6)[:batch])
    prefix_len = torch.from_numpy(rng.integers(0, 140, size=batch))
    expected = ref_kv_compact(kv, slots, prefix_len, res.accepted_nodes, res.accept_len)
    kv_compact_torch(kv, slots, prefix_len, res.accepted_nodes, res.accept_len)
    assert torch.equal(kv, expected)


@pytest.mark.parametrize("path", ([0, 2, 3], [0, 1, 3, 4], [0, 3, 4, 5, 9], [0, 1, 2]))
def test_kv_compact_never_reads_an_overwritten_source(path):
    """Paths where copy j + 1 writes the position copy j reads ([0, 2, 3]: 9 -> 8 reads
    what 10 -> 9 writes). Every destination must hold its source's original value."""
    nodes, prefix, slot = 10, 7, 1
    kv = _kv(torch.float32, slots=3, positions=prefix + nodes)
    original = kv.clone()
    accepted = torch.full((1, nodes), -1)
    accepted[0, :len(path)] = torch.tensor(path)
    args = (torch.tensor([slot]), torch.tensor([prefix]), accepted, torch.tensor([len(path) - 1]))
    kv_compact(kv, *args)
    for j, node in enumerate(path):
        assert torch.equal(kv[:, :, slot, :, prefix + j], original[:, :, slot, :, prefix + node])
    untouched = torch.ones(kv.shape[2], kv.shape[4], dtype=torch.bool)
    untouched[slot, prefix + 1:prefix + len(path)] = False
    assert torch.equal(kv.permute(2, 4, 0, 1, 3, 5)[untouched],
                       original.permute(2, 4, 0, 1, 3, 5)[untouched])
    if path != [0, 1, 2]:
        # Negative control: copying in decreasing j corrupts these paths.
        wrong = original.clone()
        for j in reversed(range(1, len(path))):
            wrong[:, :, slot, :, prefix + j] = wrong[:, :, slot, :, prefix + path[j]]
        assert not torch.equal(wrong, kv)


def test_kv_compact_rejects_bad_inputs():
    kv = _kv(torch.float32)
    good = (torch.tensor([0]), torch.tensor([0]), torch.tensor([[0, 1]]), torch.tensor([1]))
    with pytest.raises(ValueError, match=r"kv must have shape \[L, 2, S, H, T, D\]"):
        kv_compact_torch(kv[0], *good)
    with pytest.raises(ValueError, match=r"accept_len must have shape \[1\]"):
        kv_compact_torch(kv, *good[:3], torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="slots must be torch.int64"):
        kv_compact_torch(kv, good[0].int(), *good[1:])
