#!/usr/bin/env python3
"""Throughput and latency against client concurrency: plain decoding vs EAGLE-2 with
adaptive speculation on and off, measured side by side in one run.

    python tools/bench/bench_concurrency.py --report-json conc.json --plot conc.png
    python tools/bench/bench_concurrency.py --concurrency 1,4 --num-requests 8 --output-tokens 16   # a quick look
    python tools/bench/bench_concurrency.py --url localhost:8001 --eagle-total-tokens 16             # a running server
    python tools/bench/bench_concurrency.py --output-tokens 16-48                                      # varied lengths

Owns closed-loop load generation: at concurrency C, C client threads take requests
from one shared list and submit them back to back (each waits for its request's last
token before sending the next), `--num-requests` per concurrency level, so every level
and configuration generates the same tokens from the same prompts: the first turns of
an EAGLE question set (HumanEval by default), tokenized by the family's tokenizer and
cut to `--max-prompt-tokens`, each generating exactly `--output-tokens` (no end token):
one length for all, or `LO-HI`, each request its own length drawn from that range
(seeded: request i has the same length in every configuration, level and repeat).
Equal lengths favour plain decoding a little: its concurrent requests stay in step,
finish in the same step and have their next prompts prefilled in one forward, while
accepted drafts put them out of step, and each prompt is then prefilled alone between
the others' decode steps, the level's last requests running in a part-filled batch (a
few percent at 4 requests on a 2-core CPU, docs/benchmarks.md 2.1). Served traffic has
varied lengths, which puts plain decoding out of step too.
Levels run in increasing order; within a level the configurations take turns, so a
drifting machine does not favour one of them. `--repeats R` runs each level R times
(the configurations' order rotating each time); the table then gives each
configuration's median tok/s and each ratio's median over the repeats, with its
range, because one run's ratio on a shared machine moves by tens of percent; from 6
repeats on, also a 95 % confidence interval of that median (order statistics, which
assume nothing of the machine's noise but that repeats are independent).

Configurations (`--configs`): `plain` (method none), a method name (`eagle2`: the
engine with adaptive speculation on), and `<eagle2|eagle3>-fixed`: adaptive
speculation off for those requests; `-whole` (in-process only): chunked prefill off
while the configuration runs (`plain-whole`); `-apart` (in-process only): mixed prefill
off, every prefill forward run alone before the step's verify forward (`plain-apart`).
In-process, one engine (`Engine.launch`: loaded and looping in its own thread) serves
every configuration; "-fixed" requests pin
`total_tokens` to the engine's tree size, which the policy treats exactly as `adaptive_speculation: false`
(a pinned request always verifies its full tree). With `--url` the requests go over
gRPC streams to a running tritonserver's `speculative_decoding` model (token ids in and
out, so counts are exact); "-fixed" then needs the server's `--eagle-total-tokens`.

Per (configuration, concurrency): output tokens/s = output tokens / wall time of the
level (first submit → last token); request latency = submit → last token (avg, p50,
p90); TTFT = submit → first token; τ = emitted tokens / verify steps and acceptance
rate = accepted / drafted, summed over the level's requests. Prints a table, writes
`--report-json` and PNGs (`--plot`: throughput; `<plot>_latency.png`: p50 latency).
Not owned here: datasets (tools/dataset_converter.py), drawing (tools/bench/plots.py).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "backend_src"))
sys.path.insert(0, str(REPO / "tools"))

from bench import BenchError, _validate_that, drafter_dirs, encode_question, machine_info, portable  # noqa: E402
from dataset_converter import DatasetError, first_turns, question_set_path, read_question_set  # noqa: E402
from family import FAMILY_DIR  # noqa: E402
from repeats import format_ratio, ratio_summary  # noqa: E402

HUMANEVAL = question_set_path("humaneval")  # $SPECDEC_DATA_DIR, else ../shared/data
DEFAULT_CONFIGS = "plain,eagle2,eagle2-fixed"
FIXABLE = ("eagle2", "eagle3")  # methods whose tree size a request can pin


@dataclass(frozen=True)
class BenchConfig:
    label: str  # as given on the command line
    method: str  # the engine's speculative_method
    fixed: bool  # adaptive speculation off for these requests
    lookup: bool = True  # prompt lookup as the engine is configured (False: prompt_lookup_tokens 0)
    whole_prefill: bool = False  # in-process: chunked prefill off while this configuration runs
    apart_prefill: bool = False  # in-process: mixed prefill off while this configuration runs


def parse_configs(text: str) -> list[BenchConfig]:
    from specdec.request import METHODS

    out = []
    for label in (s.strip() for s in text.split(",") if s.strip()):
        base, fixed = (label[: -len("-fixed")], True) if label.endswith("-fixed") else (label, False)
        base, apart = (base[: -len("-apart")], True) if base.endswith("-apart") else (base, False)
        base, whole = (base[: -len("-whole")], True) if base.endswith("-whole") else (base, False)
        base, lookup = (base[: -len("-nolookup")], False) if base.endswith("-nolookup") else (base, True)
        method = "none" if base == "plain" else base
        methods = ", ".join(m for m in METHODS if m != "none")
        _validate_that(method in METHODS, f"--configs: unknown configuration {label!r} "
                                          f"(plain, {methods}, <method>[-nolookup][-whole][-apart][-fixed])")
        _validate_that(not fixed or method in FIXABLE, f"--configs: {label!r}: only {', '.join(FIXABLE)} "
                                                       f"can be fixed")
        out.append(BenchConfig(label, method, fixed, lookup, whole, apart))
    _validate_that(len(out) > 0, "--configs is empty")
    _validate_that(len({c.label for c in out}) == len(out), "--configs names a configuration twice")
    return out


def parse_levels(text: str) -> list[int]:
    try:
        levels = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise BenchError(f"--concurrency must be integers separated by commas, got {text!r}") from None
    _validate_that(len(levels) > 0 and levels[0] >= 1, f"--concurrency must be >= 1, got {text!r}")
    return levels


def load_prompts(question_set: Path, tokenizer, max_tokens: int) -> list[list[int]]:
    try:
        texts = first_turns(read_question_set(question_set))
    except DatasetError as e:
        raise BenchError(str(e)) from None
    _validate_that(len(texts) > 0, f"{question_set}: no questions")
    return [encode_question(tokenizer, t, "auto")[:max_tokens] for t in texts]  # the chat template when it has one


# ---------------------------------------------------------------- one request


@dataclass
class Sample:
    """One request as its client saw it."""

    latency_s: float
    ttft_s: float
    output_tokens: int
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    emitted: int = 0


Runner = Callable[[BenchConfig, list[int], int, str], Sample]  # blocking: submit, wait for the last token


class InProcess:
    """The engine in this process, its loop in its own thread."""

    def __init__(self, engine):
        self.engine = engine
        self.config = engine.config
        self.mixed_prefill = engine.mixed_prefill  # as loaded (CUDA graphs keep it off)

    def __call__(self, config: BenchConfig, ids: list[int], output_tokens: int, request_id: str) -> Sample:
        from dataclasses import replace
        from specdec.request import GenerationRequest, SpecParams

        # Configurations never overlap in time, so the engine's prefill setting is this one's.
        if self.engine.config.enable_chunked_context == config.whole_prefill:
            self.engine.config = replace(self.config, enable_chunked_context=not config.whole_prefill)
        self.engine.mixed_prefill = self.mixed_prefill and not config.apart_prefill
        total = self.engine.policy.total_tokens if config.fixed else None
        req = GenerationRequest(request_id=request_id, input_ids=ids, max_tokens=output_tokens,
                                spec=SpecParams(method=config.method, total_tokens=total,
                                                prompt_lookup_tokens=None if config.lookup else 0))
        done, first, last, count = threading.Event(), [], [], [0]

        def emit(out):
            now = time.perf_counter()
            if out.token_ids and not first:
                first.append(now)
            count[0] += len(out.token_ids)
            if out.finished:
                last.append(out)
                done.set()

        t0 = time.perf_counter()
        self.engine.submit(req, emit)
        done.wait()
        end = time.perf_counter()
        out = last[0]
        _validate_that(out.finish_reason == "length", f"{config.label}: request {request_id} ended with "
                                                      f"{out.finish_reason}: {out.error}")
        st = out.stats
        return Sample(end - t0, (first[0] if first else end) - t0, count[0], st.total_draft_tokens,
                      st.total_accepted_draft_tokens, st.target_forwards, st.emitted_tokens)


class OverGrpc:
    """A running tritonserver's `speculative_decoding` model, one gRPC stream per client thread."""

    def __init__(self, url: str, model: str, fixed_total_tokens: int, timeout_s: float):
        import tritonclient.grpc  # noqa: F401  (fail early when the client is missing)

        self.url, self.model = url, model
        self.fixed_total_tokens, self.timeout_s = fixed_total_tokens, timeout_s
        self._local = threading.local()

    def _stream(self):
        if not hasattr(self._local, "client"):
            import tritonclient.grpc as grpcclient

            results: queue.Queue = queue.Queue()
            client = grpcclient.InferenceServerClient(self.url)
            client.start_stream(callback=lambda result, error: results.put((time.perf_counter(), result, error)))
            self._local.client, self._local.results = client, results
        return self._local.client, self._local.results

    def close(self) -> None:
        if hasattr(self._local, "client"):
            self._local.client.stop_stream()
            self._local.client.close()

    def _inputs(self, config: BenchConfig, ids: list[int], output_tokens: int):
        import numpy as np
        import tritonclient.grpc as grpcclient

        named = {"input_ids": (np.array([ids], np.int32), "INT32"),
                 "input_lengths": (np.array([[len(ids)]], np.int32), "INT32"),
                 "request_output_len": (np.array([[output_tokens]], np.int32), "INT32"),
                 "streaming": (np.array([[True]]), "BOOL"),
                 "exclude_input_in_output": (np.array([[True]]), "BOOL"),
                 "return_perf_metrics": (np.array([[True]]), "BOOL"),
                 "speculative_method": (np.array([[config.method.encode()]], dtype=object), "BYTES")}
        if config.fixed:
            named["eagle_total_tokens"] = (np.array([[self.fixed_total_tokens]], np.int32), "INT32")
        if not config.lookup:
            named["prompt_lookup_tokens"] = (np.array([[0]], np.int32), "INT32")
        inputs = []
        for name, (array, dtype) in named.items():
            tensor = grpcclient.InferInput(name, list(array.shape), dtype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        return inputs

    def __call__(self, config: BenchConfig, ids: list[int], output_tokens: int, request_id: str) -> Sample:
        client, results = self._stream()
        t0 = time.perf_counter()
        client.async_stream_infer(self.model, self._inputs(config, ids, output_tokens), request_id=request_id,
                                  enable_empty_final_response=True)
        first, count, perf = None, 0, {}
        while True:
            now, result, error = results.get(timeout=self.timeout_s)
            _validate_that(error is None, f"{config.label}: request {request_id}: {error}")
            tokens = result.as_numpy("output_ids")
            if tokens is not None and tokens.size:
                first = first or now
                count += tokens.size
            for name in ("total_draft_tokens", "total_accepted_draft_tokens"):
                value = result.as_numpy(name)
                if value is not None:
                    perf[name] = int(value.reshape(-1)[0])
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        # Over the wire only the acceptance counters come back: verify steps are the
        # output tokens minus the prefill's one, less the accepted drafts.
        accepted = perf.get("total_accepted_draft_tokens", 0)
        return Sample(now - t0, (first or now) - t0, count, perf.get("total_draft_tokens", 0), accepted,
                      max(0, count - 1 - accepted), max(0, count - 1))


# ---------------------------------------------------------------- one level


@dataclass
class Point:
    """One configuration at one concurrency."""

    config: str
    concurrency: int
    requests: int
    wall_s: float
    output_tokens: int
    tokens_per_s: float
    latency_avg_s: float
    latency_p50_s: float
    latency_p90_s: float
    ttft_avg_s: float
    tau: float
    acceptance_rate: float
    latencies_s: list = field(default_factory=list)
    repeat: int = 0  # which of --repeats
    # CUDA graphs captured while this point was timed (in process, --cuda-graphs), and their seconds
    graph_captures: Optional[int] = None
    capture_s: Optional[float] = None


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def output_lengths(text: str) -> tuple[int, int]:
    """`--output-tokens`: "N" (every request N tokens) or "LO-HI" -> (LO, HI)."""
    m = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", text)
    lo, hi = (int(m[1]), int(m[2] or m[1])) if m else (0, 0)
    _validate_that(1 <= lo <= hi, f"--output-tokens must be N or LO-HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def request_lengths(lo: int, hi: int, count: int, seed: int = 0) -> list[int]:
    """Output tokens of requests 0..count-1: uniform in [lo, hi], the same list for a seed."""
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(count)]


def run_level(run: Runner, config: BenchConfig, prompts: list[list[int]], lengths: list[int], concurrency: int,
              num_requests: int, tag: str = "") -> Point:
    """`concurrency` clients take the level's `num_requests` requests in order, back to
    back; request i has prompt i and `lengths[i]` output tokens (both cycled)."""
    jobs: queue.Queue = queue.Queue()
    for i in range(num_requests):
        jobs.put(i)
    samples: list[Optional[Sample]] = [None] * num_requests
    errors: list[BaseException] = []

    def client():
        while not errors:
            try:
                i = jobs.get_nowait()
            except queue.Empty:
                return
            try:
                samples[i] = run(config, prompts[i % len(prompts)], lengths[i % len(lengths)],
                                 f"{tag}{config.label}-c{concurrency}-{i}")
            except BaseException as e:  # reported by the caller; the other clients stop
                errors.append(e)

    threads = [threading.Thread(target=client, name=f"bench-client-{k}") for k in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return summarize(config.label, concurrency, samples, wall)


def summarize(label: str, concurrency: int, samples: list[Sample], wall_s: float) -> Point:
    lat = [s.latency_s for s in samples]
    tokens = sum(s.output_tokens for s in samples)
    drafted, accepted = sum(s.drafted for s in samples), sum(s.accepted for s in samples)
    steps, emitted = sum(s.verify_steps for s in samples), sum(s.emitted for s in samples)
    return Point(config=label, concurrency=concurrency, requests=len(samples), wall_s=wall_s, output_tokens=tokens,
                 tokens_per_s=tokens / wall_s, latency_avg_s=statistics.fmean(lat),
                 latency_p50_s=percentile(lat, 50), latency_p90_s=percentile(lat, 90),
                 ttft_avg_s=statistics.fmean(s.ttft_s for s in samples),
                 tau=emitted / steps if steps else 0.0, acceptance_rate=accepted / drafted if drafted else 0.0,
                 latencies_s=[round(x, 6) for x in lat])


# ---------------------------------------------------------------- report


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def level_summary(points: list[Point], configs: list[BenchConfig], level: int) -> dict:
    """At one concurrency, over the repeats: each configuration's median tok/s, pooled
    latencies and τ, and each ratio to the first configuration within the same repeat
    (median, min, max, and a 95 % confidence interval of the median from 6 repeats on:
    `median_interval`)."""
    out: dict = {}
    ref = configs[0].label
    for c in configs:
        mine = [p for p in points if p.concurrency == level and p.config == c.label]
        if not mine:
            continue
        lat = [x for p in mine for x in p.latencies_s]
        steps = sum(p.output_tokens / p.tau for p in mine if p.tau)
        row = dict(tokens_per_s=_median([p.tokens_per_s for p in mine]), repeats=len(mine),
                   latency_avg_s=statistics.fmean(lat) if lat else 0.0,
                   latency_p50_s=percentile(lat, 50) if lat else 0.0, latency_p90_s=percentile(lat, 90) if lat else 0.0,
                   tau=sum(p.output_tokens for p in mine) / steps if steps else 0.0)
        if c.label != ref:
            base = {p.repeat: p.tokens_per_s for p in points if p.concurrency == level and p.config == ref}
            row.update(ratio_summary([p.tokens_per_s / base[p.repeat] for p in mine if p.repeat in base]))
        out[c.label] = row
    return out


def format_table(points: list[Point], configs: list[BenchConfig]) -> str:
    """One row per concurrency; per configuration tok/s and latency, plus speedups over
    the first (medians over repeats, with their range when there are several and the
    median's 95 % confidence interval from 6 on)."""
    header = ["conc"]
    for c in configs:
        header += [f"{c.label} tok/s", "lat avg/p50/p90 s", "τ"]
    if len(configs) > 1:
        header += [f"{c.label}/{configs[0].label}" for c in configs[1:]]
    rows = []
    for level in sorted({p.concurrency for p in points}):
        by = level_summary(points, configs, level)
        row = [str(level)]
        for c in configs:
            p = by.get(c.label)
            if p is None:
                row += ["-", "-", "-"]
            else:
                latency = "/".join(f"{p[k]:.2f}" for k in ("latency_avg_s", "latency_p50_s", "latency_p90_s"))
                row += [f"{p['tokens_per_s']:.1f}", latency, f"{p['tau']:.2f}"]
        for c in configs[1:]:
            p = by.get(c.label) or {}
            if "ratio" not in p:
                row.append("-")
            elif p["repeats"] > 1:
                row.append(format_ratio(p))
            else:
                row.append(f"{p['ratio']:.2f}x")
        rows.append(row)
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def write_plots(path: Path, points: list[Point], configs: list[BenchConfig]) -> list[Path]:
    from plots import throughput_vs_concurrency

    levels = sorted({p.concurrency for p in points})
    summary = {level: level_summary(points, configs, level) for level in levels}

    def series(key):
        return {c.label: [(n, summary[n][c.label][key]) for n in levels if c.label in summary[n]] for c in configs}

    latency = path.with_name(path.stem + "_latency" + path.suffix)
    return [throughput_vs_concurrency(series("tokens_per_s"), path),
            throughput_vs_concurrency(series("latency_p50_s"), latency,
                                      title="Request latency (p50) vs concurrency", ylabel="p50 latency (s)")]


# ---------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", type=Path, default=FAMILY_DIR,
                   help=f"folder with base/ and the drafters' folders (default {FAMILY_DIR})")
    p.add_argument("--tokenizer", type=Path, default=None, help="default: <family>/base")
    p.add_argument("--question-set", type=Path, default=HUMANEVAL, help=f"EAGLE question set (default {HUMANEVAL})")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"comma-separated (default {DEFAULT_CONFIGS})")
    p.add_argument("--concurrency", default="1,2,4,8,16,32", help="levels (default 1,2,4,8,16,32)")
    p.add_argument("--num-requests", type=int, default=64,
                   help="requests per configuration and level (at least the level's concurrency; default 64)")
    p.add_argument("--output-tokens", default="64",
                   help="tokens each request generates: N, or LO-HI for a seeded length per request (default 64)")
    p.add_argument("--max-prompt-tokens", type=int, default=384, help="prompts are cut to this (default 384)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of every level, configurations rotating (medians reported; default 1)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed requests per configuration first (default 2); with --cuda-graphs also one "
                        "untimed round of every configuration at each level")
    p.add_argument("--device", default="cpu", help="in-process engine: cpu | cuda[:N]")
    p.add_argument("--dtype", default="float32", help="in-process engine dtype (default float32)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="in-process engine: cuda_graph_mode (decode-time forwards replay CUDA graphs; GPU)")
    p.add_argument("--eagle-total-tokens", type=int, default=0,
                   help="EAGLE-2/3 tree size; 0: the engine calibrates it (in-process only; "
                        "with --url the server's size, needed by -fixed configurations)")
    p.add_argument("--url", default=None, help="gRPC address of a running tritonserver instead of an engine here")
    p.add_argument("--model", default="speculative_decoding", help="--url: the model to call")
    p.add_argument("--timeout", type=float, default=600.0, help="--url: seconds to wait for a response")
    p.add_argument("--report-json", type=Path, default=None, help="write every point and the setup here")
    p.add_argument("--plot", type=Path, default=None,
                   help="throughput PNG (default: --report-json with .png); latency goes to <plot>_latency.png")
    return p


def build_engine(args, configs: list[BenchConfig], levels: list[int], prompts: list[list[int]], most_tokens: int):
    from specdec.config import EngineConfig
    from specdec.engine import Engine
    from specdec.errors import ConfigError

    drafters = drafter_dirs(args.family, [c.method for c in configs])
    method = next((c.method for c in configs if c.method in FIXABLE), "none")
    longest = max(len(p) for p in prompts)
    room = 128  # KV positions past the output for the last step's tree (and the policy's calibration)
    try:
        return Engine.launch(EngineConfig(
            base_model_dir=str(args.family / "base"), device=args.device, dtype=args.dtype,
            max_batch_size=max(levels), max_queue_size=max(levels) + 1,
            max_seq_len=longest + most_tokens + room, max_tokens_limit=most_tokens,
            speculative_method=method, eagle_total_tokens=args.eagle_total_tokens,
            adaptive_speculation=True, cuda_graph_mode=args.cuda_graphs, **drafters))
    except ConfigError as e:
        raise BenchError(str(e)) from None


def run_benchmark(args) -> dict:
    configs, levels = parse_configs(args.configs), parse_levels(args.concurrency)
    lo, hi = output_lengths(args.output_tokens)
    _validate_that(args.max_prompt_tokens >= 1, f"--max-prompt-tokens must be >= 1, got {args.max_prompt_tokens}")
    _validate_that(args.num_requests >= 1, f"--num-requests must be >= 1, got {args.num_requests}")
    _validate_that(args.repeats >= 1, f"--repeats must be >= 1, got {args.repeats}")
    _validate_that(not args.url or args.eagle_total_tokens > 0 or not any(c.fixed for c in configs),
                   "--url with a -fixed configuration needs --eagle-total-tokens (the server's tree size)")
    _validate_that(not args.url or not any(c.whole_prefill or c.apart_prefill for c in configs),
                   "--url: a -whole or -apart configuration needs the engine in this process "
                   "(the server's prefill is its own)")
    from transformers import AutoTokenizer

    tokenizer_dir = args.tokenizer or args.family / "base"
    _validate_that(tokenizer_dir.is_dir(), f"tokenizer folder {tokenizer_dir} does not exist")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    prompts = load_prompts(args.question_set, tokenizer, args.max_prompt_tokens)
    lengths = request_lengths(lo, hi, max(args.num_requests, max(levels)))  # request i's output tokens

    setup = dict(configs=[asdict(c) for c in configs], concurrency=levels, num_requests=args.num_requests,
                 output_tokens=lo if lo == hi else [lo, hi], max_prompt_tokens=args.max_prompt_tokens,
                 question_set=os.path.relpath(args.question_set, REPO), prompts=len(prompts), warmup=args.warmup,
                 repeats=args.repeats)
    engine = None
    if args.url:
        run = OverGrpc(args.url, args.model, args.eagle_total_tokens, args.timeout)
        setup.update(url=args.url, model=args.model, eagle_total_tokens=args.eagle_total_tokens)
    else:
        engine = build_engine(args, configs, levels, prompts, hi)  # loaded and looping in its own thread
        run = InProcess(engine)
        setup.update(family=portable(args.family), device=args.device, dtype=args.dtype, cuda_graphs=args.cuda_graphs,
                     eagle_total_tokens=engine.policy.total_tokens, max_batch_size=engine.config.max_batch_size,
                     engine_at_load=portable(getattr(engine, "load_note", None)))  # calibration's timings, as printed
    points: list[Point] = []
    try:
        for c in configs:
            if args.warmup:
                run_level(run, c, prompts, lengths, 1, args.warmup, tag="warmup-")
        for level in levels:
            if args.warmup and (args.cuda_graphs or args.device.startswith("cuda")):
                # A graph is captured the first time its (batch, width, key length) bucket is
                # needed, and all configurations share the engine's graphs: unwarmed, the first
                # configuration timed at a level would pay every capture for the others (on an
                # H100 it made plain decoding look 1.2-1.7x slower than adaptive EAGLE-2 at τ 1.00).
                # Eager on a GPU, too: plain decoding, timed first at each level, ran the same
                # plain steps as adaptive EAGLE-3 at τ 1.00 at half its speed on an H200, 4 and 16
                # requests (docs/benchmarks.md 3.7), as if it paid first-use costs for the others.
                for c in configs:
                    run_level(run, c, prompts, lengths, level, level, tag="warmup-")
            for r in range(args.repeats):
                for c in configs[r % len(configs):] + configs[: r % len(configs)]:
                    before = engine.graph_captures() if engine is not None and args.cuda_graphs else None
                    point = run_level(run, c, prompts, lengths, level, max(args.num_requests, level))
                    point.repeat = r
                    captured = ""
                    if before is not None:
                        after = engine.graph_captures()
                        point.graph_captures, point.capture_s = after[0] - before[0], round(after[1] - before[1], 4)
                        captured = f"  {point.graph_captures} graphs captured ({point.capture_s:.2f} s)"
                    points.append(point)
                    print(f"  {c.label:>14} x{level:<3} #{r} {point.tokens_per_s:9.1f} tok/s  "
                          f"p50 {point.latency_p50_s:.3f} s  τ {point.tau:.2f}{captured}", file=sys.stderr, flush=True)
    finally:
        if engine is not None:
            engine.shutdown()
    print(format_table(points, configs))
    # where and at which commit it ran (with --url: the clients' machine)
    report = dict(setup=setup, machine=machine_info("cpu" if args.url else args.device),
                  points=[asdict(p) for p in points],
                  summary={str(n): level_summary(points, configs, n) for n in levels})
    plot = args.plot or (args.report_json.with_suffix(".png") if args.report_json else None)
    if plot:
        report["plots"] = [str(p) for p in write_plots(plot, points, configs)]
    if args.report_json:
        args.report_json.parent.mkdir(parents=True, exist_ok=True)
        args.report_json.write_text(json.dumps(report, separators=(",", ":")))
    return report


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run_benchmark(args)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
