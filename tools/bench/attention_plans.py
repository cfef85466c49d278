#!/usr/bin/env python3
"""What a masked attention call costs the first time its key length occurs, with
torch's default kernels and with cuDNN taken out (`attention_without_per_shape_plans`).

    python tools/bench/attention_plans.py --report-json docs/bench/gpu_attention_plans.json

SmolLM2's attention shape (9 query heads over 3 KV heads, head size 64), bfloat16, a
boolean mask, batch 1; queries of 1 token (a plain step) and of 16 (a tree's verify, an
EAGLE depth of top-k 8 is 8). Each setting walks `--lengths` key lengths, every one new
to the process, timing each call synchronized; then walks the same lengths again. The
kernel that ran is read from torch.profiler over one call.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def timed_call(q_len: int, keys: int) -> float:
    """Seconds of one synchronized attention call over `keys` keys."""
    dev = torch.device("cuda")
    q = torch.randn(1, HEADS, q_len, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, KV_HEADS, keys, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    mask = torch.ones(1, 1, q_len, keys, device=dev, dtype=torch.bool).tril(keys - q_len)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def kernel_of(q_len: int, keys: int) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        timed_call(q_len, keys)
    return sorted({e.key for e in prof.key_averages() if "attention" in e.key and "scaled_dot" not in e.key})


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, default=24, help="new key lengths per setting (default 24)")
    p.add_argument("--report-json", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_plans: torch sees no CUDA GPU", file=sys.stderr)
        return 2
    timed_call(1, 64)  # CUDA context and the allocator, outside every setting
    rows = []
    start = 200
    for cudnn in (True, False):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        for q_len in (1, 16):
            lengths = list(range(start, start + args.lengths))
            start += args.lengths  # every setting meets key lengths no other met
            first = [timed_call(q_len, n) * 1e3 for n in lengths]
            again = [timed_call(q_len, n) * 1e3 for n in lengths]
            kernels = kernel_of(q_len, lengths[0])
            row = dict(cudnn_allowed=cudnn, queries=q_len, first_ms=first, again_ms=again, kernels=kernels)
            rows.append(row)
            med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
            print(f"cuDNN {'allowed' if cudnn else 'off    '}  {q_len:2d} queries: new key length "
                  f"median {med(first):7.2f} ms (max {max(first):7.2f}), again {med(again):6.2f} ms; "
                  f"{', '.join(kernels) or '?'}", flush=True)
    torch.backends.cuda.enable_cudnn_sdp(True)
    if args.report_json:
        args.report_json.parent.mkdir(parents=True, exist_ok=True)
        args.report_json.write_text(json.dumps(dict(
            tool="tools/bench/attention_plans.py", command=" ".join(sys.argv), torch=torch.__version__,
            gpu=torch.cuda.get_device_name(0), cudnn=torch.backends.cudnn.version(), rows=rows),
            separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
