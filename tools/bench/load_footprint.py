#!/usr/bin/env python3
"""What loading Medusa costs, with and without its drafting vocabulary, side by side.

    OMP_NUM_THREADS=2 python tools/bench/load_footprint.py --repeats 2 --markdown docs/bench/load_footprint.md

An engine of the family's base and Medusa heads alone (float32, CPU, one slot, adaptive
speculation off, the row routing measured at every load: `calibration_cache_dir` off)
is built in a fresh process per measurement, so that each peak resident size is its own.
The two configurations take turns `--repeats` times: the shipped Medusa folder, and the
same folder without `draft_vocab.safetensors` (the heads then keep their full-vocabulary
projections). Per load: seconds to build the engine, the process's peak resident memory,
and the Medusa heads' parameter count.

With `--heads-only`, each process loads the shipped Medusa heads alone (no engine), the
two ways `MedusaHeads` can take its drafting vocabulary: cut as each projection is read
(`from_pretrained(rows=)`, what the engine does) and loaded whole then cut
(`keep_rows`, what it did before 2026-11-27); per load: seconds and the peak resident
memory the load added to the process's.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "backend_src"))
sys.path.insert(0, str(REPO / "tools"))
from family import FAMILY_DIR  # noqa: E402
from specdec.drafters.loader import DRAFT_VOCAB_FILE  # noqa: E402


def measure(base: Path, medusa: Path) -> dict:
    """One load, in this process: {seconds, peak_rss_mib, medusa_parameters}."""
    from specdec.config import EngineConfig
    from specdec.engine import Engine

    start = time.perf_counter()
    engine = Engine(EngineConfig(base_model_dir=str(base), medusa_dir=str(medusa), speculative_method="medusa",
                                 max_batch_size=1, max_seq_len=1024, adaptive_speculation=False,
                                 calibration_cache_dir="off"))
    seconds = time.perf_counter() - start
    params = sum(p.numel() for p in engine.drafters["medusa"].heads.parameters())
    peak_mib = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return {"seconds": round(seconds, 2), "peak_rss_mib": peak_mib, "medusa_parameters": params}


def measure_heads(medusa: Path, cut_at_load: bool) -> dict:
    """One load of the Medusa heads alone, in this process: {seconds, peak_rss_mib, medusa_parameters}."""
    import torch

    from specdec.drafters.loader import draft_vocab
    from specdec.models.medusa import MedusaHeads
    from specdec.models.checkpoint import read_config

    base = read_config(medusa.parent / "base")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    vocab = draft_vocab(medusa, "medusa_dir", base["vocab_size"])
    shape = (base["hidden_size"], base["vocab_size"], torch.float32, "cpu")
    if cut_at_load:
        heads = MedusaHeads.from_pretrained(medusa, *shape, rows=vocab)
    else:
        heads = MedusaHeads.from_pretrained(medusa, *shape)
        heads.keep_rows(vocab)
    seconds = time.perf_counter() - start
    return {"seconds": round(seconds, 2),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before),
            "medusa_parameters": sum(p.numel() for p in heads.parameters())}


def without_vocab(medusa: Path, where: Path) -> Path:
    """A folder of links to `medusa`'s files, less its drafting vocabulary."""
    out = where / "medusa_full_vocabulary"
    out.mkdir()
    for f in medusa.iterdir():
        if f.name != DRAFT_VOCAB_FILE:
            (out / f.name).symlink_to(f.resolve())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", type=Path, default=FAMILY_DIR)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--markdown", type=Path)
    p.add_argument("--heads-only", action="store_true",
                   help="the heads alone: cut as they load against loaded whole, then cut")
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # one load of this Medusa folder
    p.add_argument("--child-heads", choices=("cut", "whole"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    base = args.family / "base"
    if args.child:
        print(json.dumps(measure_heads(args.child, args.child_heads == "cut") if args.child_heads
                         else measure(base, args.child)))
        return 0
    medusa = args.family / "medusa"
    if not (medusa / DRAFT_VOCAB_FILE).is_file():
        print(f"error: {medusa} has no {DRAFT_VOCAB_FILE}", file=sys.stderr)
        return 2
    if args.heads_only:
        rows = {"heads alone, cut as they load": [], "heads alone, loaded whole, then cut": []}
        runs = {name: ["--child", str(medusa), "--child-heads", mode] for name, mode in zip(rows, ("cut", "whole"))}
    else:
        rows = {"with draft_vocab.safetensors": [], "without (full projections)": []}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.heads_only:
            runs = {name: ["--child", str(folder)]
                    for name, folder in zip(rows, (medusa, without_vocab(medusa, Path(tmp))))}
        for _ in range(args.repeats):
            for name, child in runs.items():
                done = subprocess.run([sys.executable, __file__, "--family", str(args.family), *child],
                                      capture_output=True, text=True, env=os.environ, check=True)
                rows[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    peak = "peak RSS MiB added" if args.heads_only else "peak RSS MiB"
    lines = [f"| Medusa | load s | {peak} | Medusa parameters |", "| --- | --- | --- | --- |"]
    for name, runs in rows.items():
        lines.append(f"| {name} | {' / '.join(str(r['seconds']) for r in runs)} | "
                     f"{' / '.join(str(r['peak_rss_mib']) for r in runs)} | {runs[0]['medusa_parameters']:,} |")
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        command = f"python tools/bench/load_footprint.py --repeats {args.repeats}" + \
            (" --heads-only" if args.heads_only else "")
        args.markdown.write_text(f"{table}\n\nCommand: `{command}`  \nDate: {time.strftime('%Y-%m-%dT%H:%M:%S%z')}, "
                                 f"torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
