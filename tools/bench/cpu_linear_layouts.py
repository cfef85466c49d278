#!/usr/bin/env python3
"""How fast a target forward's float32 linears run on this CPU through each way of
calling them, by row count: what `specdec.models.cpu_linear` chooses among.

    python tools/bench/cpu_linear_layouts.py --markdown docs/bench/cpu_linear_layouts.md

Random weights of the target's shapes (SmolLM2-135M by default: 30 layers of fused
q/k/v, o, fused gate/up and down projections, then the LM head), called in forward
order with `rows`-row inputs, the fastest of `--repeats` passes after an untimed one:
- `F.linear`: MKL's sgemm (gemv at one row), which packs the weight at every call;
- `mkldnn_linear`: the weight as `to_mkldnn()` copies it, the input and output
  converted to and from oneDNN tensors at every call (the engine's path until 2026-11-29);
- `pointwise plain`: the same weight, called through `mkldnn._linear_pointwise` on the
  dense input;
- `pointwise for N`: the weight laid out by `mkldnn._reorder_linear_weight` for N rows,
  called the same way (the engine's path now, N = `cpu_linear.ONEDNN_PACK_ROWS`).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import machine_info  # noqa: E402

ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
LAYOUTS = (1, 2, 4, 8, 16, 64)  # row counts a weight is laid out for


def best_ms(run: Callable[[], object], repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def forward_shapes(layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int,
                   vocab: int) -> list[tuple[int, int]]:
    """(in, out) of each linear a Llama forward calls, in order."""
    qkv = hidden + 2 * hidden // heads * kv_heads
    block = [(hidden, qkv), (hidden, hidden), (hidden, 2 * intermediate), (intermediate, hidden)]
    return block * layers + [(hidden, vocab)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--markdown", type=Path, default=None)
    args = p.parse_args()
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        sys.exit("this torch build lacks oneDNN's mkldnn._reorder_linear_weight")
    torch.manual_seed(0)
    shapes = forward_shapes(args.layers, args.hidden, args.heads, args.kv_heads, args.intermediate, args.vocab)
    weights = [torch.randn(out, inp) for inp, out in shapes]  # [out, in] each
    plain = [w.to_mkldnn() for w in weights]
    laid_out = {n: [torch.ops.mkldnn._reorder_linear_weight(w, n) for w in weights] for n in LAYOUTS}

    def pointwise(packs: list[torch.Tensor], inputs: list[torch.Tensor]) -> Callable[[], object]:
        return lambda: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for x, w in zip(inputs, packs)]

    header = ["rows", "F.linear", "mkldnn_linear", "pointwise plain"] + [f"pointwise for {n}" for n in LAYOUTS]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    with torch.inference_mode():
        for rows in ROWS:
            inputs = [torch.randn(rows, inp) for inp, _ in shapes]  # [rows, in] each
            row = [best_ms(lambda: [F.linear(x, w) for x, w in zip(inputs, weights)], args.repeats),
                   best_ms(lambda: [torch._C._nn.mkldnn_linear(x.to_mkldnn(), w, None).to_dense()
                                    for x, w in zip(inputs, plain)], args.repeats),
                   best_ms(pointwise(plain, inputs), args.repeats)]
            row += [best_ms(pointwise(laid_out[n], inputs), args.repeats) for n in LAYOUTS]
            lines.append(f"| {rows} | " + " | ".join(f"{ms:.1f}" for ms in row) + " |")
            print(lines[-1], flush=True)
    info = machine_info("cpu")
    text = "\n".join([
        "# A target forward's float32 linears on the CPU, by way of calling them",
        "",
        "Command: `python tools/bench/cpu_linear_layouts.py " + " ".join(sys.argv[1:]) + "`  ",
        f"Machine: {info['cpu']} ({info['cpu_cores_usable']} usable cores, {info['torch_threads']} torch threads), "
        f"torch {info['torch']}; commit {info['git_commit']}  ",
        f"Date: {info['date'][:10]}",
        "",
        f"Milliseconds for one pass over the {len(shapes)} linears of a forward ({args.layers} layers and the "
        f"LM head, random weights of the target's shapes), fastest of {args.repeats} passes; the columns are "
        "the ways of calling them in the script's docstring.",
        "",
        *lines,
        "",
    ])
    if args.markdown:
        args.markdown.write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
