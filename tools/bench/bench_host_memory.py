#!/usr/bin/env python3
"""What keeping freed host memory (`keep_host_memory`, host_memory.py) buys a CPU step.

    OMP_NUM_THREADS=2 python tools/bench/bench_host_memory.py --report-md docs/bench/host_memory.md \
        --report-json docs/bench/host_memory.json

The setting changes the C allocator of the whole process, so each run is a process of
its own (this script with `--worker`), the two settings taking turns `--repeats` times
on the shipped family (float32, adaptive speculation off, `--tree`-node EAGLE trees).
A worker loads the engine in a thread of its own, as `Engine.launch` does for a server
(glibc gives each thread its own arena), then per level of `--levels` (`method:batch`; `prefill:N`
is an N-token prompt prefilled whole into an idle engine) submits `batch` MT-bench
first turns (chat template), steps `--warm-steps` steps, then times `--steps` steps:
ms per step and minor page faults per step (getrusage). Its peak resident memory is
recorded at the end. The tokens of every level are compared across all runs (greedy:
the setting must not change them, or the run stops).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "backend_src"))
sys.path.insert(0, str(REPO / "tools"))

from family import FAMILY_DIR  # noqa: E402

SETTINGS = ("kept", "returned")  # keep_host_memory true / false
DEFAULT_LEVELS = "none:1,none:16,none:32,eagle2:1,eagle2:8,eagle3:16,eagle2:32,prefill:1536"


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def worker(args) -> dict:
    """One process, one setting: every level's ms and faults per step."""
    import dataclasses

    from transformers import AutoTokenizer

    from bench import encode_question
    from dataset_converter import first_turns, question_set_path, read_question_set
    from specdec.config import EngineConfig
    from specdec.engine import Engine
    from specdec.request import GenerationRequest, SpecParams

    f = args.family
    tokenizer = AutoTokenizer.from_pretrained(str(f / "base"), local_files_only=True)
    questions = first_turns(read_question_set(question_set_path("mt_bench")))
    levels = [(m, int(n)) for m, n in (level.split(":") for level in args.levels.split(","))]
    batch = max(n for m, n in levels if m != "prefill")
    prompts = [encode_question(tokenizer, q, "auto") for q in questions[:batch]]
    code = "\n\n".join(first_turns(read_question_set(question_set_path("humaneval"))))
    long_prompt = encode_question(tokenizer, code, "auto")
    config = EngineConfig(base_model_dir=str(f / "base"), eagle_dir=str(f / "eagle"), eagle3_dir=str(f / "eagle3"),
                          eagle_total_tokens=args.tree, adaptive_speculation=False, max_batch_size=batch,
                          max_seq_len=2048, keep_host_memory=args.worker == "kept")
    engine = Engine(config)
    rows = []
    for method, n in levels:
        tokens: dict[str, list[int]] = {}

        def emitter(rid):
            tokens[rid] = []
            return lambda out: tokens[rid].extend(out.token_ids)

        if method == "prefill":
            assert len(long_prompt) >= n, "the joined HumanEval questions are shorter than the prefill level"
            engine.config = dataclasses.replace(config, enable_chunked_context=False)
            times, faults = [], []
            for i in range(args.warm_steps + args.steps):
                engine.submit(GenerationRequest(f"prefill-{i}", long_prompt[:n], 1), emitter(f"prefill-{i}"))
                f0, t0 = _faults(), time.perf_counter()
                engine.step()  # admits, prefills, emits the one token
                if i >= args.warm_steps:
                    times.append(time.perf_counter() - t0)
                    faults.append(_faults() - f0)
                assert not engine.num_active
            engine.config = config
            ms, per_step = 1e3 * sum(times) / len(times), sum(faults) / len(faults)
        else:
            for i in range(n):
                engine.submit(GenerationRequest(f"{method}-{i}", prompts[i], args.max_tokens,
                                                spec=SpecParams(method=method)), emitter(f"{method}-{i}"))
            for _ in range(args.warm_steps):
                engine.step()
            f0, t0 = _faults(), time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            ms, per_step = 1e3 * (time.perf_counter() - t0) / args.steps, (_faults() - f0) / args.steps
            assert engine.num_active == n, "a request ended inside the timed steps: raise --max-tokens"
            while engine.num_active:
                engine.step()
        digest = hashlib.sha256(json.dumps(sorted(tokens.items())).encode()).hexdigest()[:16]
        rows.append(dict(level=f"{method}:{n}", ms_per_step=round(ms, 2), faults_per_step=round(per_step, 1),
                         tokens_sha=digest))
        print(f"  {args.worker:>8} {method}:{n}: {ms:.1f} ms/step, {per_step:.0f} page faults/step", flush=True)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return dict(setting=args.worker, levels=rows, peak_rss_mib=round(peak_mib, 1), load_note=engine.load_note)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", type=Path, default=FAMILY_DIR)
    p.add_argument("--levels", default=DEFAULT_LEVELS, help="method:batch, comma separated (prefill:N tokens)")
    p.add_argument("--tree", type=int, default=16, help="EAGLE-2/3 tree size (nodes, root included)")
    p.add_argument("--warm-steps", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--report-md", type=Path)
    p.add_argument("--report-json", type=Path)
    p.add_argument("--worker", choices=SETTINGS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:  # in a thread of its own, where `Engine.launch` loads and steps a served engine
        result = {}
        thread = threading.Thread(target=lambda: result.update(worker(args)))
        thread.start()
        thread.join()
        if not result:
            raise SystemExit("the worker failed")
        print("RESULT " + json.dumps(result), flush=True)
        return

    from bench import machine_info

    forwarded = ["--family", str(args.family), "--levels", args.levels, "--tree", str(args.tree),
                 "--warm-steps", str(args.warm_steps), "--steps", str(args.steps), "--max-tokens", str(args.max_tokens)]
    runs = []
    for repeat in range(args.repeats):
        for setting in (SETTINGS if repeat % 2 == 0 else SETTINGS[::-1]):
            print(f"#{repeat} {setting}", flush=True)
            out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", setting] + forwarded,
                                 capture_output=True, text=True)
            lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
            if out.returncode or not lines:
                raise SystemExit(f"the {setting} worker failed:\n{out.stderr[-3000:]}")
            run = json.loads(lines[-1][len("RESULT "):])
            print("\n".join(line for line in out.stdout.splitlines() if not line.startswith("RESULT ")), flush=True)
            if runs:
                for a, b in zip(runs[0]["levels"], run["levels"]):
                    if a["tokens_sha"] != b["tokens_sha"]:
                        raise SystemExit(f"{b['level']}: the {setting} run's tokens differ from the first run's")
            runs.append(run)

    levels = [row["level"] for row in runs[0]["levels"]]
    median = {s: {lv: {k: statistics.median(r["levels"][i][k] for r in runs if r["setting"] == s)
                       for k in ("ms_per_step", "faults_per_step")} for i, lv in enumerate(levels)}
              for s in SETTINGS}
    peak = {s: statistics.median(r["peak_rss_mib"] for r in runs if r["setting"] == s) for s in SETTINGS}
    command = "python tools/bench/bench_host_memory.py " + " ".join(sys.argv[1:] if argv is None else argv)
    info = machine_info("cpu")
    lines = [f"Measured {info['date']} on {info['cpu']} ({info['cpu_cores_usable']} cores usable), `{command}`: "
             f"{args.steps} steps timed after {args.warm_steps} per level, {args.tree}-node EAGLE trees, "
             f"median of {args.repeats} processes per setting, in turns. Every run's tokens equalled the first's.",
             "", "| level (method:requests) | kept: ms/step | returned: ms/step | kept / returned | "
             "kept: page faults/step | returned: page faults/step |", "| --- | --- | --- | --- | --- | --- |"]
    for lv in levels:
        k, r = median["kept"][lv], median["returned"][lv]
        lines.append(f"| {lv} | {k['ms_per_step']:.1f} | {r['ms_per_step']:.1f} | "
                     f"{k['ms_per_step'] / r['ms_per_step']:.2f} | {k['faults_per_step']:.0f} | "
                     f"{r['faults_per_step']:.0f} |")
    lines += ["", f"Peak resident memory of a run: {peak['kept']:.0f} MiB kept, {peak['returned']:.0f} MiB returned."]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.report_md:
        args.report_md.write_text(report)
    if args.report_json:
        args.report_json.write_text(json.dumps({"machine": info, "command": command, "median": median,
                                                "peak_rss_mib": peak, "runs": runs}, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
