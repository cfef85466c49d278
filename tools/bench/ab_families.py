#!/usr/bin/env python3
"""Two family folders side by side in one process: the same engine code, two setups of
the drafters (a head set up in another form, another round's heads), taking turns.

    python tools/bench/ab_families.py --family-a /tmp/fam16 --label-a float16 \\
        --label-b "int8 rows" --question-sets mt_bench,humaneval --rounds 6 \\
        --markdown docs/bench/ab_eagle3_int8_rows.md --report-json docs/bench/ab_eagle3_int8_rows.json

where /tmp/fam16 holds links to `.cache/smollm2`'s base, eagle, medusa and draft folders and
an eagle3 folder unpacked in float16, as setup wrote it until 2026-12-02
(`python tools/packed_rows.py unpack --dtype float16 checkpoints/smollm2-135m-instruct/eagle3
/tmp/fam16/eagle3`).

Batch 1, the first `--num-requests` questions of each set (first turn, chat template),
temperature 0, `--output-tokens` new tokens, adaptive speculation off, EAGLE-2/3 trees of
`--eagle-total-tokens` nodes drafted at `--eagle-depth` / `--eagle-top-k`. Each round runs
every method on both families, the families in turns (A then B, then B then A), so that
a shared VM's drift lands on both alike; the ratios are paired within a round
(`repeats.ratio_summary`: their median and, from 6 rounds, a 95 % interval). Also the
drafting phase's milliseconds per decode step (the drafter's `propose`) and τ.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import profile_step  # noqa: E402
from bench import machine_info, portable  # noqa: E402
from dataset_converter import first_turns, question_set_path, read_question_set  # noqa: E402
from family import FAMILY_DIR  # noqa: E402
from repeats import ratio_summary  # noqa: E402


def measure_set(engines: dict, methods: list[str], prompts: list[list[int]], rounds: int) -> dict:
    """{label: {method: {tok_s: [per round], draft_ms: [...], tau}}} over `rounds` rounds."""
    out = {label: {m: {"tok_s": [], "draft_ms": [], "tau": None} for m in methods} for label in engines}
    order = list(engines)
    with profile_step.PhaseTimer(torch.device("cpu")) as timer:
        for label, (engine, args) in engines.items():  # once untimed: first-use copies, caches
            for m in methods:
                profile_step.run_requests(engine, m, prompts, args, "warm")
        for r in range(rounds):
            for label in (order if r % 2 == 0 else order[::-1]):
                engine, args = engines[label]
                for m in methods:
                    timer.reset(synced=False)
                    timer.active = True
                    try:
                        run = profile_step.run_requests(engine, m, prompts, args, f"round{r}")
                    finally:
                        timer.active = False
                    cell = out[label][m]
                    cell["tok_s"].append(run["tokens"] / run["seconds"])
                    steps = max(1, timer.calls.get("decode step", 0))
                    cell["draft_ms"].append(1e3 * timer.seconds.get("draft", 0.0) / steps)
                    cell["tau"] = (run["tokens"] - len(prompts)) / max(1, run["target_forwards"])
    return out


def summarize(result: dict, methods: list[str]) -> dict:
    labels = list(result)
    a, b = labels
    summary: dict = {}
    for label in labels:
        for m in methods:
            cell = result[label][m]
            row = {"tok_s": statistics.median(cell["tok_s"]), "draft_ms": statistics.median(cell["draft_ms"]),
                   "tau": cell["tau"]}
            if m != "none" and "none" in methods:
                row.update(ratio_summary([x / p for x, p in zip(cell["tok_s"], result[label]["none"]["tok_s"])],
                                         "speedup"))
            summary[f"{label}/{m}"] = row
    for m in methods:
        summary[f"{b}/{a}/{m}"] = ratio_summary([y / x for x, y in zip(result[a][m]["tok_s"], result[b][m]["tok_s"])],
                                                "ratio")
    return summary


def markdown(report: dict) -> str:
    labels, methods = report["labels"], report["methods"]
    a, b = labels
    lines = ["| set | family | method | tok/s | speedup over its plain decoding (95 % CI) | drafting ms / step | τ |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for qs, s in report["sets"].items():
        for label in labels:
            for m in methods:
                row = s[f"{label}/{m}"]
                ci = (f" ({row['speedup_ci95_low']:.2f}-{row['speedup_ci95_high']:.2f})"
                      if "speedup_ci95_low" in row else "")
                speed = f"{row['speedup']:.2f}x{ci}" if "speedup" in row else "-"
                draft = f"{row['draft_ms']:.2f}" if row["draft_ms"] else "-"
                lines.append(f"| {qs} | {label} | {m} | {row['tok_s']:.1f} | {speed} | {draft} | {row['tau']:.2f} |")
    lines += ["", f"| set | method | {b} / {a} tok/s (95 % CI) |", "| --- | --- | --- |"]
    for qs, s in report["sets"].items():
        for m in methods:
            r = s[f"{b}/{a}/{m}"]
            ci = f" ({r['ratio_ci95_low']:.3f}-{r['ratio_ci95_high']:.3f})" if "ratio_ci95_low" in r else ""
            lines.append(f"| {qs} | {m} | {r['ratio']:.3f}{ci} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family-a", type=Path, required=True)
    p.add_argument("--family-b", type=Path, default=FAMILY_DIR)
    p.add_argument("--label-a", default="A")
    p.add_argument("--label-b", default="B")
    p.add_argument("--methods", default="none,eagle3", help="comma-separated engine methods (default none,eagle3)")
    p.add_argument("--question-sets", default="mt_bench,humaneval")
    p.add_argument("--num-requests", type=int, default=3)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--eagle-total-tokens", type=int, default=8)
    p.add_argument("--eagle-depth", type=int, default=3)
    p.add_argument("--eagle-top-k", type=int, default=4)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--report-json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    args = p.parse_args(argv)
    if args.label_a == args.label_b:
        p.error("--label-a and --label-b must differ")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.family_b / "base"), local_files_only=True)
    sets = {qs: [profile_step.encode_question(tokenizer, t, "auto")
                 for t in first_turns(read_question_set(question_set_path(qs)))[: args.num_requests]]
            for qs in (s.strip() for s in args.question_sets.split(",")) if qs}
    longest = max(len(x) for prompts in sets.values() for x in prompts) + args.output_tokens
    engines = {}
    for label, family in ((args.label_a, args.family_a), (args.label_b, args.family_b)):
        run_args = argparse.Namespace(**{**vars(args), "family": family, "device": "cpu", "dtype": "float32",
                                         "cuda_graphs": False})
        engines[label] = (profile_step.build_engine(run_args, methods, longest), run_args)
    report = dict(tool="tools/bench/ab_families.py", command=portable(" ".join(sys.argv)),
                  machine=machine_info("cpu"), labels=[args.label_a, args.label_b], methods=methods,
                  config={k: portable(v) for k, v in vars(args).items() if k not in ("report_json", "markdown")},
                  sets={}, raw={})
    for qs, prompts in sets.items():
        result = measure_set(engines, methods, prompts, args.rounds)
        report["raw"][qs] = result
        report["sets"][qs] = summarize(result, methods)
        print(f"{qs}: done", flush=True)
    text = markdown(report)
    print(text)
    if args.report_json:
        args.report_json.parent.mkdir(parents=True, exist_ok=True)
        args.report_json.write_text(json.dumps(report, indent=1, default=str) + "\n")
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
