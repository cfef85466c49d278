"""The CPU tree kernel (kernels/cpu_tree.cpp, ops/cpu_tree.py): `build_tree` and
`verify_greedy` equal their torch twins output for output, over random trees of odd sizes,
malformed ones and inputs the twins' checks refuse; `kv_compact` leaves the KV cache as its
twin does after every accepted path, and skips moves outside the cache as the CUDA kernel
does; the dispatchers take it for CPU tensors and keep to the twins where it is off or
failed to build."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cpu_kernels import built_or_skip, fail_the_build
from specdec.ops import (build_tree, build_tree_torch, cpu_tree, kv_compact, kv_compact_torch, verify_greedy,
                         verify_greedy_torch)
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


def compact_inputs(batch: int, nodes: int, seed: int, slots: int = 6):
    """slots, prefix_len, accepted_nodes, accept_len: greedy verification's paths through
    random trees (a 2-token vocabulary: long paths, many of them not in place)."""
    rng = np.random.default_rng([13, batch, nodes, seed])
    parents, num_nodes = random_trees(rng, batch, nodes)
    path = verify_greedy_torch(torch.from_numpy(rng.integers(0, 2, size=(batch, nodes))), parents, num_nodes,
                               torch.from_numpy(rng.integers(0, 2, size=(batch, nodes))))
    return (torch.from_numpy(rng.permutation(slots)[:batch]), torch.from_numpy(rng.integers(0, 100, size=batch)),
            path.accepted_nodes, path.accept_len)


@pytest.mark.parametrize("batch, nodes", [(1, 2), (1, 9), (3, 17), (6, 64)])
@pytest.mark.parametrize("dtype, head_dim", [(torch.float32, 64), (torch.float64, 5), (torch.bfloat16, 8),
                                             (torch.float16, 3)])
def test_kv_compact_equals_the_twin(kernel, batch, nodes, dtype, head_dim):
    moved = False
    for seed in range(3):
        args = compact_inputs(batch, nodes, seed)
        kv = torch.randn(2, 2, 6, 3, 100 + nodes, head_dim, generator=torch.Generator().manual_seed(seed)).to(dtype)
        want = kv.clone()
        kv_compact_torch(want, *args)
        moved |= not torch.equal(want, kv)
        kernel.kv_compact(kv, *args)
        assert torch.equal(kv, want), seed
    assert moved or nodes == 2  # the paths moved rows: the test compares moves, not two no-ops


def test_kv_compact_skips_moves_outside_the_cache(kernel):
    """A request whose path would read past the cache's positions (or whose slot is not in
    it) is left as it is, as kv_compact.cu leaves it; the others move."""
    kv = torch.randn(1, 2, 3, 2, 12, 4)
    accepted = torch.tensor([[0, 2, 5], [0, 2, 3], [0, 1, 2]])
    slots, prefix, accept_len = torch.tensor([0, 1, 7]), torch.tensor([3, 8, 0]), torch.tensor([2, 2, 2])
    want = kv.clone()
    kv_compact_torch(want, slots[:1], prefix[:1], accepted[:1], accept_len[:1])  # request 0 through the twin
    want[:, :, 1, :, 9] = kv[:, :, 1, :, 10]  # request 1 by hand (position 11 is the cache's last); request 2's
    want[:, :, 1, :, 10] = kv[:, :, 1, :, 11]  # slot 7 is not among the cache's 3: untouched
    got = kv.clone()
    kernel.kv_compact(got, slots, prefix, accepted, accept_len)
    assert torch.equal(got, want)
    past = torch.tensor([[0, 2, 9]])  # 8 + 9 = 17 >= 12: that move is skipped, the one before it is not
    got = kv.clone()
    kernel.kv_compact(got, torch.tensor([1]), torch.tensor([8]), past, torch.tensor([2]))
    want = kv.clone()
    want[:, :, 1, :, 9] = kv[:, :, 1, :, 10]
    assert torch.equal(got, want)


def test_kv_compact_dispatcher(kernel, monkeypatch):
    calls = []
    original = kernel.kv_compact
    monkeypatch.setattr(kernel, "kv_compact", lambda *a: calls.append(1) or original(*a), raising=False)
    monkeypatch.setattr(cpu_tree, "tree_kernel", lambda: kernel)
    args = compact_inputs(3, 17, 0)
    kv = torch.randn(2, 2, 6, 3, 117, 8)
    want = kv.clone()
    kv_compact_torch(want, *args)
    kv_compact(kv, *args)
    assert calls == [1] and torch.equal(kv, want)
    # A cache that is a strided view keeps to the twin, with the same result
    wide = torch.randn(2, 2, 6, 3, 117, 16)
    view, want = wide[..., :8], wide[..., :8].clone()
    kv_compact_torch(want, *args)
    kv_compact(view, *args)
    assert calls == [1] and torch.equal(view, want)
    # The twin's errors for its checks' inputs
    with pytest.raises(ValueError, match=r"accept_len must have shape \[3\]"):
        kv_compact(kv, *args[:3], torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"kv must have shape \[L, 2, S, H, T, D\]"):
        kv_compact(kv[0], *args)
    assert calls == [1]
    monkeypatch.setenv("SPECDEC_CPU_TREE", "0")
    monkeypatch.setattr(cpu_tree, "tree_kernel", cpu_tree.KERNEL.module)
    kv = torch.randn(2, 2, 6, 3, 117, 8)
    want = kv.clone()
    kv_compact_torch(want, *args)
    kv_compact(kv, *args)
    assert calls == [1] and torch.equal(kv, want)
