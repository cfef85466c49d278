#!/usr/bin/env python3
"""Small costs of the engine that a throughput run cannot resolve, measured in place.

    OMP_NUM_THREADS=2 python tools/bench/bench_overheads.py --report-json docs/bench/overheads.json

Three measurements on the shipped family (float32), each side by side in one process
(`--measure` picks some):
- catch-up: the EAGLE-2 and EAGLE-3 heads over a `--pairs`-pair catch-up (a prompt),
  the full forward against the output at the last position only (`queries`), median of
  `--iters` calls each; the two outputs are compared too.
- off-state: `--batch` requests stepped as plain decoding and as adaptive speculation
  with each of `--off-methods` (EAGLE-2 by default), every tree turned down
  (verification of any tree priced 100x), `--steps` steps each, taking turns `--repeats`
  times (the loaded objects frozen out of the garbage collector first, as
  `Engine.launch` does); per step: the whole step, the policy's planning and the EAGLE
  features' commit. What adaptive speculation costs when it speculates nothing (the run
  stops if a tree is drafted in a timed step).
- sampling: `sampling.probabilities` on the target's own next-token distributions (the
  last positions of HumanEval and MT-bench prompts), batches of B requests x N tree
  nodes, temperature 0.8 with top-p, top-k or both: the tokens they can keep ranked
  (the CPU's way) against the whole vocabulary ranked (a GPU's way, and the engine's
  before), median of `--sampling-iters` calls each, the share of rows whose nucleus
  reached past the candidates, and the two results compared.

Not owned here: throughput under load (tools/bench/bench_concurrency.py).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "backend_src"))
sys.path.insert(0, str(REPO / "tools"))

import torch  # noqa: E402

from bench import encode_question, machine_info  # noqa: E402
from dataset_converter import first_turns, question_set_path, read_question_set  # noqa: E402
from family import FAMILY_DIR  # noqa: E402
from specdec import engine as engine_module, policy as policy_module, sampling as sampling_module  # noqa: E402
from specdec.config import EngineConfig  # noqa: E402
from specdec.engine import Engine  # noqa: E402
from specdec.kv_cache import AttentionBatch  # noqa: E402
from specdec.models.layers import causal_mask  # noqa: E402
from specdec.request import GenerationRequest, SpecParams  # noqa: E402
from specdec.drafters import eagle as eagle_module  # noqa: E402


def _engine(family: Path, batch: int) -> Engine:
    return Engine(EngineConfig(
        base_model_dir=str(family / "base"), eagle_dir=str(family / "eagle"), eagle3_dir=str(family / "eagle3"),
        speculative_method="eagle2", eagle_total_tokens=16, max_seq_len=1024, max_batch_size=batch,
        max_queue_size=4 * batch, adaptive_speculation=True))


def catch_up(engine: Engine, pairs: int, iters: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    out = {}
    for method in ("eagle2", "eagle3"):
        drafter = engine.drafters[method]
        tokens = torch.randint(0, engine.vocab_size, (1, pairs), generator=gen)
        positions = torch.arange(pairs)[None]
        features = torch.randn(1, pairs, drafter.feats.shape[-1], generator=gen)
        batch = AttentionBatch.build(torch.tensor([0]), torch.tensor([0]), causal_mask(1, pairs, "cpu"),
                                     host_slots=[0], max_prefix=0)
        last = torch.tensor([pairs - 1])
        times = {"full": [], "queries": []}
        with torch.inference_mode():
            x = drafter.head.fc(features) if drafter.eagle3 else features

            def run(queries: Optional[torch.Tensor]) -> torch.Tensor:
                return drafter.head(tokens, x, positions, batch.mask, drafter.cache, batch, queries=queries)

            diff = (run(None)[:, -1] - run(last)[:, 0]).abs().max().item()
            for _ in range(iters):
                for name, queries in (("full", None), ("queries", last)):
                    t0 = time.perf_counter()
                    run(queries)
                    times[name].append(time.perf_counter() - t0)
        out[method] = dict(pairs=pairs, full_ms=1e3 * statistics.median(times["full"]),
                           queries_ms=1e3 * statistics.median(times["queries"]), max_abs_diff=diff)
    return out


def off_state(engine: Engine, prompts: list[list[int]], steps: int, repeats: int,
              methods: tuple[str, ...] = ("eagle2",)) -> dict:
    engine_module.freeze_loaded_objects()
    try:
        return _off_state(engine, prompts, steps, repeats, methods)
    finally:
        gc.unfreeze()


def _off_state(engine: Engine, prompts: list[list[int]], steps: int, repeats: int, methods: tuple[str, ...]) -> dict:
    spent: dict[str, float] = collections.defaultdict(float)

    def timed(cls, name: str, key: str) -> None:
        original = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t0
        setattr(cls, name, wrapper)

    timed(policy_module.SpeculationPolicy, "plan", "plan")
    timed(eagle_module.EagleDrafter, "commit", "commit")
    timed(engine_module.Engine, "step", "step")
    cost = engine.policy.cost
    for (B, N), seconds in list(cost.verify.items()):  # no tree ever pays: adaptive requests stay plain
        if N > 1:
            cost.set_verify(B, N, 100 * seconds)
    order = ("none",) + tuple(methods)
    per_step: dict[str, list[dict]] = {m: [] for m in order}
    for r in range(repeats):
        for method in order[r % len(order):] + order[: r % len(order)]:
            for i, ids in enumerate(prompts):
                req = GenerationRequest(f"{method}-{r}-{i}", ids, steps + 8, spec=SpecParams(method=method))
                engine.submit(req, lambda o: None)
            for _ in range(3):  # admission and prefill
                engine.step()
            spent.clear()
            drafted = sum(engine.metrics.draft_tokens.values())
            for _ in range(steps):
                engine.step()
            if sum(engine.metrics.draft_tokens.values()) != drafted:  # the comparison would be void
                raise SystemExit("off-state: a tree was drafted in the timed steps (is the cost model pinned?)")
            per_step[method].append({k: 1e3 * v / steps for k, v in spent.items()})
            for state in list(engine._running):
                engine._finish(state, [], "cancelled")
    summary = {m: {k: statistics.median(x.get(k, 0.0) for x in rows) for k in ("step", "plan", "commit")}
               for m, rows in per_step.items()}
    overheads = {m: summary[m]["step"] / summary["none"]["step"] - 1 for m in methods}
    summary["overhead"] = overheads[methods[0]]  # (the key of reports written before --off-methods)
    return dict(batch=len(prompts), steps=steps, repeats=repeats, per_repeat_ms=per_step, median_ms=summary,
                overheads=overheads)


SAMPLING_SHAPES = ((1, 3), (1, 16), (16, 16))  # (requests, tree nodes) per probabilities() call
SAMPLING_SETTINGS = {"top_p 0.95": (0, 0.95), "top_k 50": (50, 1.0), "top_k 50, top_p 0.9": (50, 0.9)}


def sampling(engine: Engine, prompts: list[list[int]], iters: int) -> dict:
    rows = []
    for ids in prompts:  # the target's distributions at each prompt's last 32 positions
        T = len(ids)
        cache = engine.target.new_cache(1, T)
        batch = AttentionBatch.build(torch.tensor([0]), torch.tensor([0]), causal_mask(1, T, "cpu"))
        with torch.inference_mode():
            hidden, _ = engine.target(torch.tensor([ids]), torch.arange(T)[None], cache, batch)
            rows.append(engine.target.logits(hidden[:, -32:])[0].float())
    pool = torch.cat(rows)  # [R, V]
    if len(pool) < max(B * N for B, N in SAMPLING_SHAPES):
        raise SystemExit(f"sampling: {len(pool)} distributions, fewer than the largest shape needs")
    out = {}
    for B, N in SAMPLING_SHAPES:
        logits = pool[: B * N].reshape(B, N, -1)
        for name, (top_k, top_p) in SAMPLING_SETTINGS.items():
            params = sampling_module.SamplingTensors(torch.full((B,), 0.8), torch.full((B,), top_k),
                                                     torch.full((B,), top_p), truncate=True, top_k_bound=top_k)
            everything = dataclasses.replace(params, top_k_bound=0)
            ms = {}
            reads_are_free = sampling_module.reads_are_free
            try:  # "everything": the whole vocabulary ranked, as where reading the device is not free
                for label, p, reads in (("ranked", params, reads_are_free),
                                        ("everything", everything, lambda device: False)):
                    sampling_module.reads_are_free = reads
                    probs = sampling_module.probabilities(logits, p)  # (untimed first call)
                    times = []
                    for _ in range(iters):
                        t0 = time.perf_counter()
                        sampling_module.probabilities(logits, p)
                        times.append(time.perf_counter() - t0)
                    ms[label] = (1e3 * statistics.median(times), probs)
            finally:
                sampling_module.reads_are_free = reads_are_free
            k = torch.where(params.top_k > 0, params.top_k, logits.shape[-1])
            cut = sampling_module.Cut(k, params.top_p, params.log_min_p())
            spilled = sampling_module._truncated(logits / 0.8, cut, sampling_module.TOP_P_CANDIDATES)[1]
            out[f"{B}x{N}, {name}"] = dict(
                requests=B, nodes=N, top_k=top_k, top_p=top_p, ranked_ms=round(ms["ranked"][0], 3),
                everything_ms=round(ms["everything"][0], 3), speedup=round(ms["everything"][0] / ms["ranked"][0], 2),
                spilled_rows=round(float(spilled.float().mean()), 3) if not top_k else 0.0,
                max_abs_diff=float((ms["ranked"][1] - ms["everything"][1]).abs().max()))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", type=Path, default=FAMILY_DIR)
    p.add_argument("--pairs", type=int, default=300, help="catch-up length (default 300)")
    p.add_argument("--iters", type=int, default=20, help="catch-up calls per variant (default 20)")
    p.add_argument("--batch", type=int, default=32, help="requests stepped together (default 32)")
    p.add_argument("--steps", type=int, default=40, help="timed steps per repeat (default 40)")
    p.add_argument("--repeats", type=int, default=5, help="plain/adaptive alternations (default 5)")
    p.add_argument("--off-methods", default="eagle2", help="off-state: adaptive methods against plain (eagle2,eagle3)")
    p.add_argument("--sampling-iters", type=int, default=10, help="probabilities() calls per variant (default 10)")
    p.add_argument("--measure", default="catch-up,off-state,sampling",
                   help="comma-separated: catch-up, off-state, sampling (default all three)")
    p.add_argument("--report-json", type=Path, default=None)
    args = p.parse_args(argv)
    measure = set(args.measure.split(","))
    if not measure <= {"catch-up", "off-state", "sampling"}:
        p.error(f"--measure: unknown {', '.join(sorted(measure - {'catch-up', 'off-state', 'sampling'}))}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.family / "base"), local_files_only=True)
    texts = first_turns(read_question_set(question_set_path("humaneval")))
    prompts = [encode_question(tokenizer, t, "auto")[:200] for t in texts]
    prompts = (prompts * (args.batch // len(prompts) + 1))[: args.batch]
    engine = _engine(args.family, args.batch)
    report = dict(tool="tools/bench/bench_overheads.py", command=" ".join(["python", "tools/bench/bench_overheads.py",
                                                                      *(argv or sys.argv[1:])]),
                  machine=machine_info("cpu"))
    if "catch-up" in measure:
        report["catch_up"] = catch_up(engine, args.pairs, args.iters)
        for method, row in report["catch_up"].items():
            print(f"catch-up {method}, {row['pairs']} pairs: full {row['full_ms']:.2f} ms, last position only "
                  f"{row['queries_ms']:.2f} ms (max |diff| {row['max_abs_diff']:.1e})")
    if "off-state" in measure:
        methods = tuple(args.off_methods.split(","))
        report["off_state"] = off_state(engine, prompts, args.steps, args.repeats, methods)
        m = report["off_state"]["median_ms"]
        for method in methods:
            print(f"off-state, batch {args.batch}: plain {m['none']['step']:.2f} ms/step, adaptive {method} with "
                  f"every tree off {m[method]['step']:.2f} ms/step "
                  f"({100 * report['off_state']['overheads'][method]:+.1f} %); planning "
                  f"{m[method]['plan']:.3f} ms, EAGLE commit {m[method]['commit']:.3f} ms")
    if "sampling" in measure:
        chat = first_turns(read_question_set(question_set_path("mt_bench")))
        pool = [encode_question(tokenizer, t, "auto")[:200] for pair in zip(texts, chat) for t in pair]
        report["sampling"] = sampling(engine, pool[:12], args.sampling_iters)
        for name, row in report["sampling"].items():
            print(f"sampling {name}: ranked {row['ranked_ms']:.2f} ms, everything {row['everything_ms']:.2f} ms "
                  f"({row['speedup']:.2f}x; rows past the candidates {row['spilled_rows']:.3f}; "
                  f"max |diff| {row['max_abs_diff']:.1e})")
    if args.report_json:
        args.report_json.parent.mkdir(parents=True, exist_ok=True)
        args.report_json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
