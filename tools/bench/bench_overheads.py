#!/usr/bin/env python3
"""Small costs of the engine that a throughput run cannot resolve, measured in place.

    OMP_NUM_THREADS=2 python tools/bench/bench_overheads.py --report-json docs/bench/overheads.json
    OMP_NUM_THREADS=2 python tools/bench/bench_overheads.py --measure level --batch 32 --report-json level.json

Seven measurements on the shipped family (float32), each side by side in one process
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

- level: one level of the concurrency benchmark stepped in place: `--batch` requests (the
  first turns of `--level-set`, chat template) submitted together, request i generating
  its seeded `--level-tokens` length (bench_concurrency.py's lengths), the engine stepped
  until all have finished, once per method of `--level-methods` (`none`: plain decoding;
  the others adaptive), taking turns `--repeats` times. Per method: the wall time and
  its phases (prefill, planning, drafting, verify; each step's remainder is "other"),
  steps, steps that verified a tree (drafted or a copy) and their drafted and accepted
  tokens; and, for those steps, what their verify forwards cost above plain decoding's
  at the same batch size (the median plain verify of that batch, from the plain runs),
  against the target forwards their accepted tokens saved (their accepted drafts times
  the plain step's median time at that batch). Where adaptive speculation loses under
  load, this says in which phase.

- single-query: plain decode steps (one query per request) of 1, 8 and `--batch` requests
  (HumanEval prompts), the CPU's grouped single-query attention
  (`layers.single_query_attention`) on and off in turns, `--steps` steps each time,
  `--repeats` times: median ms per step.

- packing: the level above with plain decoding only, the running requests kept in the
  lowest KV slots (`Engine._pack_slots`) and not (each request keeping the slot it was
  admitted to, so that the batch's slots scatter as requests finish and attention
  gathers their keys and values), in turns `--repeats` times: the level's wall time and
  its decode steps' time, medians.

- mixed-prefill: `--batch` - 1 requests decoding (plain decoding, HumanEval prompts), and
  a new request (a `--level-set` first turn, chat template, one token) arriving every
  other step into the last slot, `--steps` arrivals, with mixed prefill on (its prompt
  rides in the step's verify forward) and off (prefilled in a forward of its own first),
  in turns `--repeats` times: median ms of the steps with an arrival and of those without.

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
from bench_concurrency import output_lengths, request_lengths  # noqa: E402
from dataset_converter import first_turns, question_set_path, read_question_set  # noqa: E402
from family import FAMILY_DIR  # noqa: E402
from specdec import engine as engine_module, policy as policy_module, sampling as sampling_module  # noqa: E402
from specdec.config import EngineConfig  # noqa: E402
from specdec.engine import Engine  # noqa: E402
from specdec.kv_cache import AttentionBatch  # noqa: E402
from specdec.models.layers import causal_mask  # noqa: E402
from specdec.request import GenerationRequest, SpecParams  # noqa: E402
from specdec.drafters import eagle as eagle_module  # noqa: E402
from specdec.models import layers as layers_module  # noqa: E402


def _timed(spent: dict, cls, name: str, key: str):
    """Wraps cls.name so that its calls add their wall time to spent[key]; returns the original."""
    original = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - t0
    setattr(cls, name, wrapper)
    return original


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
    _timed(spent, policy_module.SpeculationPolicy, "plan", "plan")
    _timed(spent, eagle_module.EagleDrafter, "commit", "commit")
    _timed(spent, engine_module.Engine, "step", "step")
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


def single_query(engine: Engine, prompts: list[list[int]], batches: list[int], steps: int, repeats: int) -> dict:
    engine_module.freeze_loaded_objects()
    try:
        return {B: _single_query_steps(engine, prompts[:B], steps, repeats) for B in batches}
    finally:
        layers_module.GROUP_SINGLE_QUERIES = True
        gc.unfreeze()


def _single_query_steps(engine: Engine, prompts: list[list[int]], steps: int, repeats: int) -> dict:
    for i, ids in enumerate(prompts):
        req = GenerationRequest(f"single-query-{len(prompts)}-{i}", ids, 2 * steps * repeats + 8,
                                spec=SpecParams(method="none"))
        engine.submit(req, lambda o: None)
    for _ in range(3):  # admission and prefill
        engine.step()
    times: dict[str, list[float]] = {"grouped": [], "enable_gqa": []}
    for r in range(repeats):
        for name in (("grouped", "enable_gqa") if r % 2 == 0 else ("enable_gqa", "grouped")):
            layers_module.GROUP_SINGLE_QUERIES = name == "grouped"
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            times[name].append(1e3 * (time.perf_counter() - t0) / steps)
    for state in list(engine._running):
        engine._finish(state, [], "cancelled")
    med = {name: statistics.median(v) for name, v in times.items()}
    return dict(requests=len(prompts), steps=steps, repeats=repeats, per_repeat_ms=times, median_ms=med,
                grouped_vs_enable_gqa=med["grouped"] / med["enable_gqa"])


def _in_turns(repeats: int, first: str, second: str):
    """(round, setting) of two settings measured in turns: round -1 untimed (`first`
    leads it), then `repeats` rounds, the order alternating."""
    for r in range(-1, repeats):
        for setting in ((first, second) if r % 2 else (second, first)):
            yield r, setting


def _turns_summary(times: dict[str, dict[str, list[float]]], first: str, second: str) -> dict:
    """What `_in_turns`' timings (setting -> metric -> one value per round) report: them,
    each one's median, and `<first>_vs_<second>`, the ratio of the medians per metric."""
    med = {k: {m: statistics.median(v) for m, v in rows.items()} for k, rows in times.items()}
    return {"per_repeat": times, "median": med,
            f"{first}_vs_{second}": {m: med[first][m] / med[second][m] for m in med[first]}}


def packing(engine: Engine, prompts: list[list[int]], lengths: list[int], repeats: int) -> dict:
    engine_module.freeze_loaded_objects()
    times: dict[str, dict[str, list[float]]] = {k: {"wall_ms": [], "decode_ms": []} for k in ("packed", "scattered")}
    spent: dict[str, float] = collections.defaultdict(float)
    decode = _timed(spent, engine_module.Engine, "_decode", "decode")
    try:
        for r, setting in _in_turns(repeats, "packed", "scattered"):
            if setting == "scattered":
                engine._pack_slots = lambda: None  # (the instance's: the class's own packs)
            else:
                engine.__dict__.pop("_pack_slots", None)
            spent.clear()
            wall = _run_level(engine, prompts, lengths, "none", f"packing-{setting}-{r}")
            if r >= 0:
                times[setting]["wall_ms"].append(1e3 * wall)
                times[setting]["decode_ms"].append(1e3 * spent["decode"])
    finally:
        engine_module.Engine._decode = decode
        engine.__dict__.pop("_pack_slots", None)
        gc.unfreeze()
    return dict(batch=len(prompts), repeats=repeats, **_turns_summary(times, "packed", "scattered"))


def mixed_prefill(engine: Engine, prompts: list[list[int]], arrivals: list[list[int]], steps: int,
                  repeats: int) -> dict:
    engine_module.freeze_loaded_objects()
    loaded = engine.mixed_prefill
    times: dict[str, dict[str, list[float]]] = {k: {"arrival_ms": [], "plain_ms": []} for k in ("mixed", "apart")}
    plain_decoding = SpecParams(method="none")  # (the engine's default is adaptive EAGLE-2)
    try:
        for r, setting in _in_turns(repeats, "mixed", "apart"):
            engine.mixed_prefill = setting == "mixed"
            for i, ids in enumerate(prompts[:-1]):  # (the last slot is the arrivals')
                engine.submit(GenerationRequest(f"mixed-{setting}-{r}-{i}", ids, 2 * steps + 8,
                                                spec=plain_decoding), lambda o: None)
            engine.step()  # their prefill
            engine.step()
            arrival, plain = [], []
            for k in range(steps):
                engine.submit(GenerationRequest(f"arrival-{setting}-{r}-{k}", arrivals[k % len(arrivals)], 1,
                                                spec=plain_decoding), lambda o: None)
                for timed in (arrival, plain):
                    t0 = time.perf_counter()
                    engine.step()
                    timed.append(1e3 * (time.perf_counter() - t0))
            for state in list(engine._running):
                engine.cancel(state.req.request_id)
            engine.step()
            if r >= 0:
                times[setting]["arrival_ms"].append(statistics.median(arrival))
                times[setting]["plain_ms"].append(statistics.median(plain))
    finally:
        engine.mixed_prefill = loaded
        gc.unfreeze()
    return dict(decoding=len(prompts) - 1, arrival_tokens=[len(a) for a in arrivals[:steps]], steps=steps,
                repeats=repeats, **_turns_summary(times, "mixed", "apart"))


def _run_level(engine: Engine, prompts: list[list[int]], lengths: list[int], method: str, tag: str) -> float:
    """Submits request i (prompts[i], lengths[i] tokens, `method`) for every i at once and
    steps the engine until all have finished: the seconds it took."""
    for i, (ids, n) in enumerate(zip(prompts, lengths)):
        engine.submit(GenerationRequest(f"{tag}-{i}", ids, n, spec=SpecParams(method=method)), lambda o: None)
    t0 = time.perf_counter()
    while engine._waiting or engine._running:
        engine.step()
    return time.perf_counter() - t0


LEVEL_PHASES = (("prefill", engine_module.Engine, "_prefill_pending"),
                ("plan", policy_module.SpeculationPolicy, "plan"),
                ("draft", eagle_module.EagleDrafter, "propose"),
                ("verify", engine_module.Engine, "_verify"),
                ("step", engine_module.Engine, "step"))


def level(engine: Engine, prompts: list[list[int]], lengths: list[int], repeats: int, methods: tuple[str, ...]) -> dict:
    engine_module.freeze_loaded_objects()
    spent: dict[str, float] = collections.defaultdict(float)
    originals = [(cls, name, _timed(spent, cls, name, key)) for key, cls, name in LEVEL_PHASES]
    steps: list[list] = []  # this run's decode steps: [batch, tree nodes, accepted drafts, verify s, step s]
    verify, step = engine_module.Engine._verify, engine_module.Engine.step

    def verify_noted(self, states, settings, trees, riders=()):  # (a level's prompts all come at once: no riders)
        t0 = time.perf_counter()
        verify(self, states, settings, trees, riders)
        steps.append([len(states), max(t.num_nodes for t in trees), 0, time.perf_counter() - t0, 0.0])

    def step_noted(self):
        t0, before, accepted = time.perf_counter(), len(steps), sum(self.metrics.accepted_tokens.values())
        step(self)
        if len(steps) > before:
            steps[-1][2] = sum(self.metrics.accepted_tokens.values()) - accepted
            steps[-1][4] = time.perf_counter() - t0
    engine_module.Engine._verify, engine_module.Engine.step = verify_noted, step_noted
    try:
        runs = _level_runs(engine, prompts, lengths, repeats, methods, spent, steps)
    finally:  # (step and _verify are among the phases: this puts back the engine's own)
        for cls, name, original in originals:
            setattr(cls, name, original)
        gc.unfreeze()
    return _level_summary(runs, len(prompts), lengths)


def _level_runs(engine: Engine, prompts, lengths, repeats, methods, spent, steps) -> dict:
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    for r in range(-1, repeats):  # round -1: untimed, every method once
        for method in methods[r % len(methods):] + methods[: r % len(methods)]:
            spent.clear()
            steps.clear()
            wall = _run_level(engine, prompts, lengths, method, f"level-{method}-{r}")
            phases = {k: 1e3 * v for k, v in spent.items()}
            phases["other"] = phases.pop("step") - sum(phases.values())
            if r >= 0:
                runs[method].append(dict(wall_ms=1e3 * wall, phases_ms=phases, steps=[list(s) for s in steps]))
    return runs


def _level_summary(runs: dict, batch: int, lengths: list[int]) -> dict:
    """Medians over the repeats per method. A tree step (any request verified drafts) is
    priced against plain decoding's median verify and step at its batch size (from
    every plain run): its verify time above plain's, against the plain step time its
    accepted drafts saved (a batch of B plain steps emits B tokens a step, so each
    accepted draft saves a B-th of a step)."""
    plain_verify, plain_step = collections.defaultdict(list), collections.defaultdict(list)
    for run in runs.get("none", []):
        for B, N, accepted, verify_s, step_s in run["steps"]:
            plain_verify[B].append(verify_s)
            plain_step[B].append(step_s)
    verify_at = {B: statistics.median(v) for B, v in plain_verify.items()}
    step_at = {B: statistics.median(v) for B, v in plain_step.items()}
    out = dict(batch=batch, output_tokens=sum(lengths), methods={},
               plain_step_ms_by_batch={B: round(1e3 * v, 2) for B, v in sorted(step_at.items())})
    for method, rows in runs.items():
        for run in rows:
            trees = [s for s in run["steps"] if s[1] > 1 and s[0] in verify_at]
            run.update(decode_steps=len(run["steps"]), tree_steps=len(trees),
                       tree_batches=sorted(collections.Counter(s[0] for s in trees).items()),
                       accepted=sum(s[2] for s in run["steps"]),
                       tree_extra_verify_ms=1e3 * sum(s[3] - verify_at[s[0]] for s in trees),
                       tree_saved_ms=1e3 * sum(s[2] * step_at[s[0]] / s[0] for s in trees))
            del run["steps"]
        medians = {k: statistics.median(run[k] for run in rows)
                   for k in ("wall_ms", "decode_steps", "tree_steps", "accepted", "tree_extra_verify_ms",
                             "tree_saved_ms")}
        medians["phases_ms"] = {k: statistics.median(run["phases_ms"].get(k, 0.0) for run in rows)
                                for k in ("prefill", "plan", "draft", "verify", "other")}
        out["methods"][method] = dict(**medians, per_repeat=rows)
    if "none" in out["methods"]:
        for row in out["methods"].values():
            row["wall_vs_plain"] = row["wall_ms"] / out["methods"]["none"]["wall_ms"]
    return out


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
    p.add_argument("--level-set", default="mt_bench", help="level: the question set (default mt_bench)")
    p.add_argument("--level-tokens", default="16-48", help="level: output tokens, N or LO-HI (default 16-48)")
    p.add_argument("--level-methods", default="none,eagle2,eagle3", help="level: methods in turns (default "
                   "none,eagle2,eagle3; none is plain decoding and prices the others' tree steps)")
    p.add_argument("--sampling-iters", type=int, default=10, help="probabilities() calls per variant (default 10)")
    p.add_argument("--measure", default="catch-up,off-state,sampling",
                   help="comma-separated: catch-up, off-state, sampling, level, single-query, packing, "
                        "mixed-prefill (default the first three)")
    p.add_argument("--report-json", type=Path, default=None)
    args = p.parse_args(argv)
    measure = set(args.measure.split(","))
    known = {"catch-up", "off-state", "sampling", "level", "single-query", "packing", "mixed-prefill"}
    if not measure <= known:
        p.error(f"--measure: unknown {', '.join(sorted(measure - known))}")
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
    if "single-query" in measure:
        batches = sorted({1, min(8, args.batch), args.batch})
        report["single_query"] = single_query(engine, prompts, batches, args.steps, args.repeats)
        for B, row in report["single_query"].items():
            m = row["median_ms"]
            print(f"single-query attention, {B} requests: grouped {m['grouped']:.2f} ms/step, enable_gqa "
                  f"{m['enable_gqa']:.2f} ms/step ({row['grouped_vs_enable_gqa']:.3f})")
    if measure & {"packing", "level", "mixed-prefill"}:
        lo, hi = output_lengths(args.level_tokens)
        asked = first_turns(read_question_set(question_set_path(args.level_set)))
        level_prompts = [encode_question(tokenizer, asked[i % len(asked)], "auto")[:384] for i in range(args.batch)]
    if "packing" in measure:
        report["packing"] = packing(engine, level_prompts, request_lengths(lo, hi, args.batch), args.repeats)
        m, ratio = report["packing"]["median"], report["packing"]["packed_vs_scattered"]
        print(f"packing, {args.batch} requests: level {m['packed']['wall_ms']:.0f} ms packed, "
              f"{m['scattered']['wall_ms']:.0f} ms scattered ({ratio['wall_ms']:.3f}); decode steps "
              f"{m['packed']['decode_ms']:.0f} against {m['scattered']['decode_ms']:.0f} ms ({ratio['decode_ms']:.3f})")
    if "mixed-prefill" in measure:
        report["mixed_prefill"] = mixed_prefill(engine, prompts, level_prompts, args.steps, args.repeats)
        m, ratio = report["mixed_prefill"]["median"], report["mixed_prefill"]["mixed_vs_apart"]
        print(f"mixed prefill, {args.batch - 1} requests decoding: a step with an arrival "
              f"{m['mixed']['arrival_ms']:.1f} ms mixed, {m['apart']['arrival_ms']:.1f} ms apart "
              f"({ratio['arrival_ms']:.3f}); without one {m['mixed']['plain_ms']:.1f} against "
              f"{m['apart']['plain_ms']:.1f} ms ({ratio['plain_ms']:.3f})")
    if "level" in measure:
        methods = tuple(args.level_methods.split(","))
        report["level"] = level(engine, level_prompts, request_lengths(lo, hi, args.batch), args.repeats, methods)
        for method, row in report["level"]["methods"].items():
            ph = row["phases_ms"]
            print(f"level {method}, {args.batch} requests: {row['wall_ms']:.0f} ms "
                  f"({row.get('wall_vs_plain', 1.0):.3f} of plain); prefill {ph['prefill']:.0f}, "
                  f"plan {ph['plan']:.0f}, draft {ph['draft']:.0f}, verify {ph['verify']:.0f}, "
                  f"other {ph['other']:.0f} ms; "
                  f"{row['decode_steps']} steps, {row['tree_steps']} with a tree, {row['accepted']} accepted; "
                  f"tree steps' verify above plain {row['tree_extra_verify_ms']:.0f} ms, "
                  f"their accepted drafts saved {row['tree_saved_ms']:.0f} ms")
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
        args.report_json.write_text(json.dumps(report, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
