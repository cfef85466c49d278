"""The CUDA kernels' logic, run on the CPU: kernels/*.cu compiled with g++ under a small
shim (one std::thread per CUDA thread, blocks one after another, __shared__ -> static,
__syncthreads -> std::barrier, atomics under a mutex, random yields around barriers)
and compared with the torch twins, outputs pre-filled with a sentinel. Equality with
the twin carries over the twin's proven properties (verify_sampling's losslessness).

This is what CI (no GPU) can check of the kernels: indexing, barriers placement,
block-uniform control flow, the float rules of verify_sampling. It cannot see warp-level
behaviour, memory coalescing or NVRTC quirks (tools/check_kernels.sh compiles the
sources with nvcc; tests/test_kernels_gpu.py runs them for real). Kernels must
therefore avoid warp intrinsics, or this shim must learn them.

Skipped, with the reason, without g++.
"""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.ops import (build_tree_torch, kv_compact_torch, verify_greedy_torch,
                         verify_sampling_torch)
from specdec.ops import _cupy
from specdec.ops.verify_greedy import VerifyResult
from tree_refs import malformed_trees, random_sampling_inputs, random_trees

KERNELS = Path(__file__).resolve().parents[1] / "kernels"
SENTINEL = -7777

SHIM = r"""
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <random>
#include <thread>
#include <vector>
struct dim3 { unsigned x = 1, y = 1, z = 1; };
thread_local dim3 threadIdx;
static dim3 blockIdx, blockDim;
static std::mutex shim_mutex;
thread_local std::mt19937 shim_rng;
// A block barrier that gives up after 5 s (threads that disagree on control flow reach
// different barriers: a hang on a GPU) and then lets every thread run free.
struct ShimBarrier {
  std::mutex m;
  std::condition_variable cv;
  unsigned count = 0, waiting = 0, generation = 0;
  bool broken = false;
  void wait() {
    std::unique_lock<std::mutex> lock(m);
    if (broken) return;
    const unsigned g = generation;
    if (++waiting == count) { waiting = 0; ++generation; cv.notify_all(); return; }
    if (!cv.wait_for(lock, std::chrono::seconds(5), [&] { return generation != g || broken; })) {
      broken = true;
      cv.notify_all();
    }
  }
};
static ShimBarrier shim_barrier;
static inline void shim_jitter() { if (shim_rng() % 4 == 0) std::this_thread::yield(); }
static inline void __syncthreads() { shim_jitter(); shim_barrier.wait(); shim_jitter(); }
template <typename T> static inline T atomicMax(T* a, T v) {
  std::lock_guard<std::mutex> lock(shim_mutex); T old = *a; if (v > old) *a = v; return old; }
template <typename T> static inline T atomicMin(T* a, T v) {
  std::lock_guard<std::mutex> lock(shim_mutex); T old = *a; if (v < old) *a = v; return old; }
static inline float __fmul_rn(float a, float b) { return a * b; }
struct uint4 { unsigned x, y, z, w; };
#define __global__
#define __device__
#define __shared__ static
#define __restrict__ __restrict
#include "tree_mask.cu"
#include "verify_greedy.cu"
#include "verify_sampling.cu"
#include "kv_compact.cu"
// Runs the grid; returns 1 when a block's threads did not meet at their barriers.
static int run(unsigned gx, unsigned gy, unsigned threads, const std::function<void()>& body) {
  blockDim.x = threads;
  int diverged = 0;
  for (unsigned by = 0; by < gy; ++by)
    for (unsigned bx = 0; bx < gx; ++bx) {
      blockIdx.x = bx; blockIdx.y = by;
      shim_barrier.count = threads;
      shim_barrier.waiting = 0;
      shim_barrier.broken = false;
      std::vector<std::thread> pool;
      for (unsigned t = 0; t < threads; ++t)
        pool.emplace_back([&, t] { threadIdx.x = t; shim_rng.seed(t * 7919 + bx); body(); });
      for (auto& th : pool) th.join();
      diverged |= shim_barrier.broken;
    }
  return diverged;
}
typedef long long ll;
extern "C" {
int emu_build_tree(const ll* par, const ll* num, const ll* pre, bool* mask, ll* pos, ll* dep,
                    ll* fc, ll* ns, int B, int N, int threads) {
  return run(B, 1, threads, [&] { build_tree(par, num, pre, mask, pos, dep, fc, ns, N); });
}
int emu_verify_greedy(const ll* cand, const ll* par, const ll* num, const ll* amax, ll* al,
                       ll* an, ll* bt, int B, int N, int threads) {
  return run(B, 1, threads, [&] { verify_greedy(cand, par, num, amax, al, an, bt, N); });
}
int emu_verify_sampling(const ll* cand, const ll* par, const ll* num, const float* tp,
                         const float* dp, const float* u, const float* bu, float* ws, ll* al,
                         ll* an, ll* bt, int B, int N, int V, int has_draft, int threads) {
  return run(B, 1, threads, [&] {
    verify_sampling(cand, par, num, tp, dp, u, bu, ws, al, an, bt, N, V, has_draft); });
}
int emu_kv_compact(void* kv, int bytes, const ll* slots, const ll* pre, const ll* an,
                    const ll* al, int L, int B, int S, int H, int T, int D, int N, int threads) {
  return run(2 * L, B, threads, [&] {
    if (bytes == 4) kv_compact_f32((unsigned int*)kv, slots, pre, an, al, S, H, T, D, N);
    else kv_compact_bf16((unsigned short*)kv, slots, pre, an, al, S, H, T, D, N);
  });
}
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found: the kernels cannot be emulated on the CPU")
    build = tmp_path_factory.mktemp("kernels_cpu")
    (build / "shim.cpp").write_text(SHIM)
    cmd = [gxx, "-std=c++17", "-O1", "-ffp-contract=off", "-fPIC", "-shared", "-pthread",
           f"-I{KERNELS}", "-o", str(build / "libkernels.so"), str(build / "shim.cpp")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return ctypes.CDLL(str(build / "libkernels.so"))


def _p(t: torch.Tensor):
    assert t.is_contiguous()
    return ctypes.c_void_p(t.data_ptr())


_i = ctypes.c_int


def _result(batch, nodes):
    return VerifyResult(torch.full((batch,), SENTINEL), torch.full((batch, nodes), SENTINEL),
                        torch.full((batch,), SENTINEL))


def _assert_same(got: VerifyResult, want: VerifyResult, what: str):
    for name in ("accept_len", "accepted_nodes", "bonus_token"):
        assert torch.equal(getattr(got, name), getattr(want, name)), f"{what}: {name}"


@pytest.mark.parametrize("batch, nodes", [(1, 1), (2, 2), (3, 17), (17, 64), (3, 128)])
@pytest.mark.parametrize("malformed", (False, True))
def test_build_tree_and_verify_greedy_kernels(lib, batch, nodes, malformed):
    rng = np.random.default_rng([5, batch, nodes, malformed])
    parents, num_nodes = random_trees(rng, batch, nodes)
    if malformed:
        parents, num_nodes = malformed_trees(rng, parents, num_nodes)
    prefix_len = torch.from_numpy(rng.integers(0, 1000, size=batch))
    threads = _cupy.threads_for(nodes)
    want = build_tree_torch(parents, num_nodes, prefix_len)
    for fill in (True, False):
        mask = torch.full((batch, nodes, nodes), fill)
        ints = [torch.full((batch, nodes), SENTINEL) for _ in range(4)]
        assert not lib.emu_build_tree(_p(parents), _p(num_nodes), _p(prefix_len), _p(mask),
                                      *map(_p, ints), _i(batch), _i(nodes), _i(threads))
        assert torch.equal(mask, want.tree_mask)
        for got, name in zip(ints, ("positions", "depth", "first_child", "next_sibling")):
            assert torch.equal(got, getattr(want, name)), name

    candidates = torch.from_numpy(rng.integers(0, 2, size=(batch, nodes)))
    target_argmax = torch.from_numpy(rng.integers(0, 2, size=(batch, nodes)))
    got = _result(batch, nodes)
    assert not lib.emu_verify_greedy(_p(candidates), _p(parents), _p(num_nodes),
                                     _p(target_argmax), _p(got.accept_len),
                                     _p(got.accepted_nodes), _p(got.bonus_token), _i(batch),
                                     _i(nodes), _i(threads))
    _assert_same(got, verify_greedy_torch(candidates, parents, num_nodes, target_argmax),
                 "verify_greedy")


def _emulated_sampling(lib, threads=None):
    def run(candidates, parents, num_nodes, target_probs, draft_probs, uniforms,
            bonus_uniforms):
        batch, nodes, vocab = target_probs.shape
        got = _result(batch, nodes)
        workspace = torch.full((batch, vocab), float("nan"))
        has_draft = draft_probs is not None
        diverged = lib.emu_verify_sampling(
            _p(candidates), _p(parents), _p(num_nodes), _p(target_probs),
            _p(draft_probs if has_draft else target_probs), _p(uniforms), _p(bonus_uniforms),
            _p(workspace), _p(got.accept_len), _p(got.accepted_nodes), _p(got.bonus_token),
            _i(batch), _i(nodes), _i(vocab), _i(int(has_draft)),
            _i(threads or _cupy.pow2_threads_for(vocab, 1024)))
        assert not diverged, "threads of a block did not meet at their barriers"
        return got
    return run


@pytest.mark.parametrize("batch, nodes, vocab", [(1, 1, 1), (2, 9, 1), (3, 17, 11),
                                                 (17, 64, 11), (4, 128, 11), (3, 17, 1000)])
@pytest.mark.parametrize("with_draft", (False, True))
@pytest.mark.parametrize("threads", (None, 32))  # 32 < V: threads stride over V
def test_verify_sampling_kernel(lib, batch, nodes, vocab, with_draft, threads):
    rng = np.random.default_rng([6, batch, nodes, vocab, with_draft])
    inputs = random_sampling_inputs(rng, batch, nodes, vocab, with_draft)
    if nodes > 1:
        inputs["parents"], inputs["num_nodes"] = malformed_trees(rng, inputs["parents"],
                                                            inputs["num_nodes"])
    _assert_same(_emulated_sampling(lib, threads)(**inputs), verify_sampling_torch(**inputs),
                 "verify_sampling")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("head_dim", (3, 8))  # bf16 x 8 = 16 bytes: uint4 rows
@pytest.mark.parametrize("misaligned", (False, True))
@pytest.mark.parametrize("batch, nodes", [(1, 2), (3, 17), (5, 64)])
def test_kv_compact_kernel(lib, dtype, head_dim, misaligned, batch, nodes):
    rng = np.random.default_rng([7, batch, nodes, head_dim])
    parents, num_nodes = random_trees(rng, batch, nodes)
    path = verify_greedy_torch(torch.from_numpy(rng.integers(0, 2, size=(batch, nodes))),
                               parents, num_nodes,
                               torch.from_numpy(rng.integers(0, 2, size=(batch, nodes))))
    layers, slots, heads, positions = 2, 6, 3, 100 + nodes
    flat = torch.randn(layers * 2 * slots * heads * positions * head_dim + 1).to(dtype)
    kv = (flat[1:] if misaligned else flat[:-1]).view(layers, 2, slots, heads, positions,
                                                     head_dim)
    args = (torch.from_numpy(rng.permutation(slots)[:batch]),
            torch.from_numpy(rng.integers(0, 100, size=batch)), path.accepted_nodes,
            path.accept_len)
    want = kv.clone()
    kv_compact_torch(want, *args)
    assert not lib.emu_kv_compact(_p(kv), _i(kv.element_size()), *map(_p, args), _i(layers),
                                  _i(batch), _i(slots), _i(heads), _i(positions),
                                  _i(head_dim), _i(nodes),
                                  _i(_cupy.threads_for(heads * head_dim)))
    assert torch.equal(kv, want)
