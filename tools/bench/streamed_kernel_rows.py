#!/usr/bin/env python3
"""The streamed CPU kernel alone, by row count, on the target's own weights: this tree's
kernel against another revision's, output by output and in time.

    python tools/bench/streamed_kernel_rows.py --against 7403a95 \\
        --markdown docs/bench/streamed_kernel_rows.md --report-json docs/bench/streamed_kernel_rows.json

Every decoder layer's matmuls of the family's target (fused q/k/v, o, fused gate/up and
down: 210 matrices for SmolLM2-135M), as the engine gives them to the kernel
(`cpu_streamed.compact_weight`: the 4-bit blocks of GGUF Q4_1 weights), then the LM head
(its int8 blocks), called in forward order with `rows`-row random inputs, the fastest of
`--repeats` passes; where the AMX kernel is available (`cpu_amx.py`), also the layers and
the LM head through it on their tile layouts (the AMX columns, whatever the row count). Both kernels are built here from their sources (`-march=native`, the
engine's flags) and called on the same inputs; `mismatches` counts outputs that differ
in any bit (0 when a change to the kernel keeps its results). What it leaves out: the
rest of the forward, and the caches a real step leaves cold (the engine's own timings:
`profile_step.py`, `bench.py`).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "backend_src"))
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench import machine_info, portable  # noqa: E402
from cpu_linear_layouts import best_ms  # noqa: E402
from family import FAMILY_DIR  # noqa: E402
from specdec.models import cpu_amx, cpu_extensions, cpu_streamed  # noqa: E402
from specdec.models.llama import LlamaModel  # noqa: E402

ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 24, 32)
SOURCE = REPO / "kernels" / cpu_streamed.SOURCE_NAME


def build(source: bytes, label: str) -> Any:
    """The kernel built from `source` as the engine builds its own (`cpu_extensions.load`,
    under a name that hashes the source), or an exit when it does not build."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / cpu_streamed.SOURCE_NAME
        path.write_bytes(source)
        print(f"building {label} ...", flush=True)
        module = cpu_extensions.load(path, "streamed_rows", f"{label}'s streamed kernel", "nothing to time")
    if module is None:
        raise SystemExit(f"streamed_kernel_rows: {label}'s kernel did not build (the warning above says why)")
    return module


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", type=Path, default=FAMILY_DIR)
    p.add_argument("--against", default=None, help="a git revision whose kernel source to compare with")
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--markdown", type=Path, default=None)
    p.add_argument("--report-json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernels = {"this tree": build(SOURCE.read_bytes(), "this tree's kernel")}
    if args.against:
        old = subprocess.run(["git", "show", f"{args.against}:kernels/{cpu_streamed.SOURCE_NAME}"], cwd=REPO,
                             check=True, capture_output=True).stdout
        kernels[args.against] = build(old, f"{args.against}'s kernel")
    model = LlamaModel.from_pretrained(args.family / "base")
    layers = [cpu_streamed.compact_weight(lin.weight.detach()) for layer in model.model.layers
              for lin in (layer.self_attn.qkv, layer.self_attn.o_proj, layer.mlp.gate_up, layer.mlp.down_proj)]
    head = cpu_streamed.compact_weight(model.lm_head.weight.detach())
    forms = sorted({str(w.values.dtype).replace("torch.", "") for w in layers})
    amx = cpu_amx.amx_kernel() if all(w.tiles is not None for w in layers + [head]) else None

    weights = sum(w.out_features * w.in_features for w in layers)
    results = []
    generator = torch.Generator().manual_seed(0)
    for rows in [int(r) for r in args.rows.split(",")]:
        inputs = {k: torch.randn(rows, k, generator=generator) for k in {w.in_features for w in layers + [head]}}
        row: dict[str, Any] = {"rows": rows}
        outputs = {}
        for label, kernel in kernels.items():
            def layers_pass(kernel=kernel):
                return [kernel.streamed_linear(inputs[w.in_features], w.values, None, w.scales, w.offsets)
                        for w in layers]

            def head_pass(kernel=kernel):
                return kernel.streamed_linear(inputs[head.in_features], head.values, None, head.scales, head.offsets)
            outputs[label] = layers_pass() + [head_pass()]
            row[label] = {"layers_ms": best_ms(layers_pass, args.repeats),
                          "lm_head_ms": best_ms(head_pass, args.repeats)}
            row[label]["layers_gflops"] = 2 * weights * rows / row[label]["layers_ms"] / 1e6
        if amx is not None:
            row["amx_layers_ms"] = best_ms(lambda: [cpu_amx.amx_linear(amx, inputs[w.in_features], w.tiles, None)
                                                    for w in layers], args.repeats)
            row["amx_lm_head_ms"] = best_ms(lambda: cpu_amx.amx_linear(amx, inputs[head.in_features], head.tiles, None),
                                            args.repeats)
        if args.against:
            new, old = outputs["this tree"], outputs[args.against]
            row["mismatches"] = sum(int((a != b).sum()) for a, b in zip(new, old))
            row["layers_ratio"] = row["this tree"]["layers_ms"] / row[args.against]["layers_ms"]
            row["lm_head_ratio"] = row["this tree"]["lm_head_ms"] / row[args.against]["lm_head_ms"]
        results.append(row)
        print(json.dumps(row), flush=True)
    report = dict(tool="tools/bench/streamed_kernel_rows.py", command=portable(" ".join(sys.argv)),
                  machine=machine_info("cpu"), against=args.against, amx=None if amx is None else amx.__name__,
                  layer_matrices=len(layers), layer_forms=forms,
                  lm_head_form=str(head.values.dtype).replace("torch.", ""), weights=weights, results=results)
    lines = [f"The target's {len(layers)} layer matrices ({', '.join(forms)}) and LM head "
             f"({report['lm_head_form']}) through the streamed kernel, ms (fastest of {args.repeats} passes), "
             f"{args.threads} threads", ""]
    if args.against:
        lines += [f"| rows | layers, {args.against} | layers, this tree | ratio | LM head, {args.against} | "
                  "LM head, this tree | ratio | outputs that differ |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in results:
            o, n = r[args.against], r["this tree"]
            lines.append(f"| {r['rows']} | {o['layers_ms']:.2f} | {n['layers_ms']:.2f} | {r['layers_ratio']:.2f}x | "
                         f"{o['lm_head_ms']:.2f} | {n['lm_head_ms']:.2f} | {r['lm_head_ratio']:.2f}x | "
                         f"{r['mismatches']} |")
    else:
        amx_head = ["| rows | layers | GFLOP/s | layers, AMX kernel | LM head | LM head, AMX kernel |",
                    "| ---: | ---: | ---: | ---: | ---: | ---: |"]
        lines += amx_head if amx is not None else ["| rows | layers | GFLOP/s | LM head |", "| ---: | ---: | ---: | ---: |"]
        for r in results:
            n = r["this tree"]
            amx_cell = f" {r['amx_layers_ms']:.2f} |" if amx is not None else ""
            amx_head_cell = f" {r['amx_lm_head_ms']:.2f} |" if amx is not None else ""
            lines.append(f"| {r['rows']} | {n['layers_ms']:.2f} | {n['layers_gflops']:.1f} |{amx_cell} "
                         f"{n['lm_head_ms']:.2f} |{amx_head_cell}")
    machine = report["machine"]
    lines += ["", f"Command: `{report['command']}`  ",
              f"Machine: {machine['cpu']} ({machine['cpu_cores_usable']} usable cores); torch {machine['torch']}, "
              f"commit {machine['git_commit']}  ", f"Date: {machine['date']}"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.report_json:
        args.report_json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
