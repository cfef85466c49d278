"""The CPU tree kernel (kernels/cpu_tree.cpp, ops/cpu_tree.py): `build_tree` and
`verify_greedy` equal their torch twins output for output, over random trees of odd sizes,
malformed ones and inputs the twins' checks refuse; the dispatchers take it for CPU tensors
and keep to the twins where it is off or failed to build."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cpu_kernels import built_or_skip, fail_the_build
from specdec.ops import build_tree, build_tree_torch, cpu_tree, verify_greedy, verify_greedy_torch
from tree_refs import malformed_trees, random_trees


@pytest.fixture(scope="module")
def kernel():
    return built_or_skip(cpu_tree.tree_kernel(), cpu_tree.wanted(), "CPU tree kernel")


def tree_inputs(batch: int, nodes: int, malformed: bool, vocab: int, seed: int):
    rng = np.random.default_rng([11, batch, nodes, malformed, vocab, seed])
    parents, num_nodes = random_trees(rng, batch, nodes)
    if malformed:
        parents, num_nodes = malformed_trees(rng, parents, num_nodes)
    prefix_len = torch.from_numpy(rng.integers(0, 1000, size=batch))
    candidates = torch.from_numpy(rng.integers(0, vocab, size=(batch, nodes)))
    target_argmax = torch.from_numpy(rng.integers(0, vocab, size=(batch, nodes)))
    return parents, num_nodes, prefix_len, candidates, target_argmax


@pytest.mark.parametrize("batch, nodes", [(1, 1), (1, 2), (1, 9), (3, 17), (17, 64), (32, 9), (3, 128)])
@pytest.mark.parametrize("malformed", (False, True))
@pytest.mark.parametrize("vocab", (2, 3))  # small vocabularies: long accepted paths, ties between them
def test_equals_the_twins(kernel, batch, nodes, malformed, vocab):
    for seed in range(3):
        parents, num_nodes, prefix_len, candidates, target_argmax = tree_inputs(batch, nodes, malformed, vocab, seed)
        got, want = build_tree(parents, num_nodes, prefix_len), build_tree_torch(parents, num_nodes, prefix_len)
        for name in ("tree_mask", "positions", "depth", "first_child", "next_sibling"):
            g, w = getattr(got, name), getattr(want, name)
            assert g.dtype == w.dtype and torch.equal(g, w), name
        got = verify_greedy(candidates, parents, num_nodes, target_argmax)
        want = verify_greedy_torch(candidates, parents, num_nodes, target_argmax)
        for name in ("accept_len", "accepted_nodes", "bonus_token"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_the_dispatchers_take_it_for_cpu_tensors(kernel, monkeypatch):
    calls = []
    for name in ("build_tree", "verify_greedy"):
        original = getattr(kernel, name)
        monkeypatch.setattr(kernel, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a), raising=False)
    monkeypatch.setattr(cpu_tree, "tree_kernel", lambda: kernel)
    parents, num_nodes, prefix_len, candidates, target_argmax = tree_inputs(2, 5, False, 2, 0)
    build_tree(parents, num_nodes, prefix_len)
    verify_greedy(candidates, parents, num_nodes, target_argmax)
    assert calls == ["build_tree", "verify_greedy"]
    # Strided inputs (a column slice) go in contiguous, with the same results
    wide = torch.cat((parents, parents), dim=1)[:, :5]
    assert torch.equal(build_tree(wide, num_nodes, prefix_len).tree_mask,
                       build_tree_torch(parents, num_nodes, prefix_len).tree_mask)


def test_bad_inputs_get_the_twins_errors(kernel):
    """build_tree's: test_ops.test_build_tree_rejects_bad_inputs, through the dispatcher too."""
    parents = torch.tensor([[-1, 0, 0]])
    with pytest.raises(ValueError, match=r"target_argmax must have shape \[1, 3\]"):
        verify_greedy(torch.zeros(1, 3, dtype=torch.int64), parents, torch.tensor([3]),
                      torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="candidates must be torch.int64"):
        verify_greedy(torch.zeros(1, 3), parents, torch.tensor([3]), torch.zeros(1, 3, dtype=torch.int64))


def test_off_or_unbuilt_the_twins_run(monkeypatch, tmp_path, caplog):
    parents, num_nodes, prefix_len, candidates, target_argmax = tree_inputs(3, 17, False, 2, 0)
    want = build_tree_torch(parents, num_nodes, prefix_len)
    monkeypatch.setenv("SPECDEC_CPU_TREE", "0")
    assert cpu_tree.tree_kernel() is None
    assert torch.equal(build_tree(parents, num_nodes, prefix_len).tree_mask, want.tree_mask)
    monkeypatch.delenv("SPECDEC_CPU_TREE")
    fail_the_build(cpu_tree, monkeypatch, tmp_path)
    with caplog.at_level("WARNING", logger="specdec"):
        assert cpu_tree.tree_kernel() is None and cpu_tree.tree_kernel() is None
        assert torch.equal(build_tree(parents, num_nodes, prefix_len).depth, want.depth)
        got = verify_greedy(candidates, parents, num_nodes, target_argmax)
    want_path = verify_greedy_torch(candidates, parents, num_nodes, target_argmax).accepted_nodes
    assert torch.equal(got.accepted_nodes, want_path)
    assert caplog.text.count("CPU tree kernel unavailable") == 1
