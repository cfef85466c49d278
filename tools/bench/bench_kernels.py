#!/usr/bin/env python3
"""Benchmark each tree op's CUDA kernel against its torch twin: time per call (CUDA
events; the CPU twin with a wall clock) on realistic shapes, printed as a table headed
by the device name. Needs a CUDA GPU and CuPy; exits with a message otherwise.

    python tools/bench/bench_kernels.py                      # B = 1, 16, 64; N = 64; V = 32000
    python tools/bench/bench_kernels.py --batch 8 --nodes 128 --vocab 128256 --no-cpu
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backend_src"))

from specdec.ops import (build_tree_cuda, build_tree_torch, kv_compact_cuda,  # noqa: E402
                         kv_compact_torch, verify_greedy_cuda, verify_greedy_torch,
                         verify_sampling_cuda, verify_sampling_torch)
from specdec.ops import _cupy  # noqa: E402


def cuda_time_us(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters


def cpu_time_us(fn: Callable[[], object], iters: int) -> float:
    fn()
    begin = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - begin) * 1e6 / iters


def random_trees(batch: int, nodes: int, gen: torch.Generator):
    """Full random trees: parents[i] uniform in [0, i) (siblings stay in index order)."""
    i = torch.arange(nodes)
    parents = (torch.rand(batch, nodes, generator=gen) * i).long()
    parents[:, 0] = -1
    return parents, torch.full((batch,), nodes, dtype=torch.int64)


def cases(batch: int, nodes: int, vocab: int, gen: torch.Generator):
    """(op, shape, args on CPU, kernel, twin) per op; args move to the GPU when timed."""
    parents, num_nodes = random_trees(batch, nodes, gen)
    prefix = torch.randint(0, 256, (batch,), generator=gen)
    # Tokens from 2 values: greedy accepts long paths, as a well-trained drafter would.
    candidates = torch.randint(0, 2, (batch, nodes), generator=gen)
    argmax = torch.randint(0, 2, (batch, nodes), generator=gen)
    target = torch.softmax(torch.randn(batch, nodes, vocab, generator=gen) * 3, dim=-1)
    draft = torch.softmax(torch.randn(batch, nodes, vocab, generator=gen) * 3, dim=-1)
    sampled = target.argmax(-1).gather(1, parents.clamp(min=0))  # likely-accepted tokens
    uniforms = torch.rand(batch, nodes, generator=gen)
    bonus = torch.rand(batch, generator=gen)
    path = verify_greedy_torch(candidates, parents, num_nodes, argmax)
    layers, heads, positions, head_dim = 32, 8, 256 + nodes, 128
    kv = torch.zeros(layers, 2, batch, heads, positions, head_dim, dtype=torch.bfloat16)
    slots = torch.arange(batch)
    return [
        ("build_tree", f"N={nodes}", (parents, num_nodes, prefix), build_tree_cuda,
         build_tree_torch),
        ("verify_greedy", f"N={nodes}", (candidates, parents, num_nodes, argmax),
         verify_greedy_cuda, verify_greedy_torch),
        ("verify_sampling", f"N={nodes} V={vocab} one-hot",
         (sampled, parents, num_nodes, target, None, uniforms, bonus), verify_sampling_cuda,
         verify_sampling_torch),
        ("verify_sampling", f"N={nodes} V={vocab} draft",
         (sampled, parents, num_nodes, target, draft, uniforms, bonus), verify_sampling_cuda,
         verify_sampling_torch),
        ("kv_compact", f"L={layers} H={heads} D={head_dim} bf16, mean a "
                       f"{path.accept_len.float().mean():.1f}",
         (kv, slots, prefix, path.accepted_nodes, path.accept_len), kv_compact_cuda,
         kv_compact_torch),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--cpu-iters", type=int, default=3)
    parser.add_argument("--no-cpu", action="store_true", help="skip timing the twins on CPU")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA GPU visible to torch; nothing to benchmark.", file=sys.stderr)
        return 2
    if not _cupy.cupy_available():
        print("bench_kernels: CuPy is missing or sees no GPU (pip install cupy-cuda12x or "
              "cupy-cuda13x).", file=sys.stderr)
        return 2

    device = torch.device("cuda", torch.cuda.current_device())
    print(f"device: {torch.cuda.get_device_name(device)}  torch {torch.__version__}  "
          f"cupy {_cupy.cupy.__version__}")
    header = (f"{'op':<16} {'B':>4}  {'shape':<34} {'kernel us':>10} {'twin gpu us':>12} "
              f"{'twin cpu us':>12} {'gpu x':>7}")
    print(header)
    print("-" * len(header))
    gen = torch.Generator().manual_seed(0)
    for batch in args.batch:
        for op, shape, cpu_args, kernel, twin in cases(batch, args.nodes, args.vocab, gen):
            gpu_args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in cpu_args]
            t_kernel = cuda_time_us(lambda: kernel(*gpu_args), args.iters)
            t_twin = cuda_time_us(lambda: twin(*gpu_args), max(3, args.iters // 5))
            t_cpu = (float("nan") if args.no_cpu
                     else cpu_time_us(lambda: twin(*cpu_args), args.cpu_iters))
            print(f"{op:<16} {batch:>4}  {shape:<34} {t_kernel:>10.1f} {t_twin:>12.1f} "
                  f"{t_cpu:>12.1f} {t_twin / t_kernel:>7.1f}")
            del gpu_args
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
