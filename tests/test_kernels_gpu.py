"""Each CUDA kernel equals its torch twin: exact for every index output, over batch
sizes 1..64, trees up to 128 nodes and odd sizes, outputs pre-filled with a sentinel so
unwritten elements show. verify_sampling is exact too (its float64 sums make the kernel
and the twin disagree only when a uniform falls within ~1e-15 of a decision boundary)
and is also checked for losslessness. kv_compact moves bytes: bit-exact for every dtype.

Skipped, with the reason, without a GPU, CuPy, or a kernel that compiles."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from specdec.ops import (TreeBuffers, VerifyResult, build_tree_cuda, build_tree_torch,
                         kv_compact_cuda, kv_compact_torch, verify_greedy_cuda,
                         verify_greedy_torch, verify_sampling_cuda, verify_sampling_torch)
from specdec.ops import _cupy
from tree_refs import lossless_pvalues, random_sampling_inputs, random_trees

KERNELS = [("tree_mask.cu", "build_tree"), ("verify_greedy.cu", "verify_greedy"),
           ("verify_sampling.cu", "verify_sampling"), ("kv_compact.cu", "kv_compact_f32"),
           ("kv_compact.cu", "kv_compact_f16"), ("kv_compact.cu", "kv_compact_bf16")]


def _skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    if _cupy.cupy is None:
        return "CuPy is not installed (pip install cupy-cuda12x or cupy-cuda13x)"
    missing = [f"{f}:{k}" for f, k in KERNELS
               if _cupy.get_kernel(f, k, torch.device("cuda", 0)) is None]
    return f"kernels did not load: {', '.join(missing)} (see the log)" if missing else None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))

SENTINEL = -7777
BATCHES = (1, 2, 17, 64)
NODES = (1, 2, 17, 64, 128)
DEVICE = "cuda"


def _rng(*parts):
    return np.random.default_rng([99, *parts])


def _cuda(x):
    return x.to(DEVICE) if isinstance(x, torch.Tensor) else x


def _sentinel_result(batch, nodes):
    return VerifyResult(*(torch.full(s, SENTINEL, device=DEVICE)
                          for s in ((batch,), (batch, nodes), (batch,))))


def _assert_same(got, want, what):
    for name in want.__dataclass_fields__:
        g, w = getattr(got, name).cpu(), getattr(want, name).cpu()
        assert torch.equal(g, w), f"{what}: {name} differs at {(g != w).nonzero()[:5].tolist()}"


@pytest.mark.parametrize("batch, nodes", itertools.product(BATCHES, NODES))
def test_build_tree_kernel_equals_twin(batch, nodes):
    rng = _rng(1, batch, nodes)
    parents, num_nodes = random_trees(rng, batch, nodes)
    prefix_len = torch.from_numpy(rng.integers(0, 4096, size=batch))
    want = build_tree_torch(parents, num_nodes, prefix_len)
    for fill in (True, False):  # both values: an unwritten mask element shows either way
        out = TreeBuffers(torch.full((batch, nodes, nodes), fill, device=DEVICE),
                          *(torch.full((batch, nodes), SENTINEL, device=DEVICE) for _ in range(4)))
        got = build_tree_cuda(_cuda(parents), _cuda(num_nodes), _cuda(prefix_len), out=out)
        _assert_same(got, want, f"build_tree B={batch} N={nodes}")


@pytest.mark.parametrize("batch, nodes", itertools.product(BATCHES, NODES))
@pytest.mark.parametrize("vocab", (2, 3, 32000))
def test_verify_greedy_kernel_equals_twin(batch, nodes, vocab):
    rng = _rng(2, batch, nodes, vocab)
    parents, num_nodes = random_trees(rng, batch, nodes)
    candidates = torch.from_numpy(rng.integers(0, vocab, size=(batch, nodes)))
    target_argmax = torch.from_numpy(rng.integers(0, vocab, size=(batch, nodes)))
    want = verify_greedy_torch(candidates, parents, num_nodes, target_argmax)
    got = verify_greedy_cuda(*map(_cuda, (candidates, parents, num_nodes, target_argmax)),
                             out=_sentinel_result(batch, nodes))
    _assert_same(got, want, f"verify_greedy B={batch} N={nodes} V={vocab}")


@pytest.mark.parametrize("batch, nodes, vocab", [
    (1, 1, 1), (1, 2, 7), (2, 17, 11), (17, 17, 1000), (64, 64, 11), (3, 128, 257),
    (64, 17, 4099), (4, 64, 32000), (2, 17, 128256)])
@pytest.mark.parametrize("with_draft", (False, True))
def test_verify_sampling_kernel_equals_twin(batch, nodes, vocab, with_draft):
    inputs = random_sampling_inputs(_rng(3, batch, nodes, vocab), batch, nodes, vocab,
                                    with_draft)
    want = verify_sampling_torch(**inputs)
    got = verify_sampling_cuda(**{k: _cuda(v) for k, v in inputs.items()},
                               out=_sentinel_result(batch, nodes))
    _assert_same(got, want, f"verify_sampling B={batch} N={nodes} V={vocab}")


@pytest.mark.parametrize("with_draft", (False, True))
def test_verify_sampling_kernel_is_lossless(with_draft):
    p_first, p_second = lossless_pvalues(verify_sampling_cuda, 100_000, with_draft, seed=11,
                                         device=DEVICE)
    assert p_first > 1e-3 and p_second > 1e-3, (p_first, p_second)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16))
@pytest.mark.parametrize("head_dim", (3, 8, 128))  # 8 x 2 bytes and 128: uint4 rows
@pytest.mark.parametrize("batch, nodes", [(1, 2), (3, 17), (17, 64), (64, 128)])
@pytest.mark.parametrize("misaligned", (False, True))
def test_kv_compact_kernel_equals_twin(dtype, head_dim, batch, nodes, misaligned):
    rng = _rng(4, batch, nodes, head_dim)
    parents, num_nodes = random_trees(rng, batch, nodes)
    path = verify_greedy_torch(torch.from_numpy(rng.integers(0, 2, size=(batch, nodes))),
                               parents, num_nodes,
                               torch.from_numpy(rng.integers(0, 2, size=(batch, nodes))))
    layers, slots, heads, positions = 3, batch + 2, 2, 200 + nodes
    numel = layers * 2 * slots * heads * positions * head_dim
    flat = torch.randn(numel + 1, device=DEVICE).to(dtype)
    # A contiguous view one element in: its rows are not 16-byte aligned.
    kv = (flat[1:] if misaligned else flat[:-1]).view(layers, 2, slots, heads, positions,
                                                     head_dim)
    args = (torch.from_numpy(rng.permutation(slots)[:batch]),
            torch.from_numpy(rng.integers(0, 200, size=batch)), path.accepted_nodes,
            path.accept_len)
    want = kv.cpu()
    kv_compact_torch(want, *args)
    kv_compact_cuda(kv, *map(_cuda, args))
    assert torch.equal(kv.cpu().view(torch.uint8), want.view(torch.uint8))


def test_kv_compact_kernel_hazard_paths():
    kv = torch.randn(2, 2, 3, 4, 20, 64, device=DEVICE, dtype=torch.bfloat16)
    original = kv.clone()
    accepted = torch.tensor([[0, 2, 3, -1, -1], [0, 1, 3, 4, -1]], device=DEVICE)
    kv_compact_cuda(kv, torch.tensor([0, 2], device=DEVICE), torch.tensor([7, 5], device=DEVICE),
                    accepted, torch.tensor([2, 3], device=DEVICE))
    for b, (slot, prefix) in enumerate(((0, 7), (2, 5))):
        for j, node in enumerate(accepted[b].tolist()):
            if node >= 0:
                assert torch.equal(kv[:, :, slot, :, prefix + j],
                                   original[:, :, slot, :, prefix + node])


def test_launchers_check_their_inputs():
    parents = torch.zeros(2, 4, dtype=torch.int64, device=DEVICE)
    ones, zeros = torch.ones(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="needs tensors on a GPU"):
        build_tree_cuda(parents.cpu(), ones, zeros)
    with pytest.raises(ValueError, match="parents must be contiguous"):
        build_tree_cuda(parents.t().contiguous().t(), ones.to(DEVICE), zeros.to(DEVICE))
    with pytest.raises(ValueError, match="num_nodes is on cpu"):
        build_tree_cuda(parents, ones, zeros)
    kv = torch.zeros(1, 2, 1, 1, 8, 4, dtype=torch.float64, device=DEVICE)
    one = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="kv must be float32, float16 or bfloat16"):
        kv_compact_cuda(kv, one, one, torch.zeros(1, 2, dtype=torch.int64, device=DEVICE), one)
