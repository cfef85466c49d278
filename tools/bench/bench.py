"""Offline benchmark of the engine, shaped like trtllm-bench: throughput and latency.

Owns timing requests through `specdec.engine.Engine` (no server, no Triton), running
Hugging Face `transformers` `generate()` on the same weights as a reference, and
reporting: trtllm-bench's "ENGINE DETAILS" / "PERFORMANCE OVERVIEW" blocks, the mean
acceptance length τ, a side-by-side comparison table, a JSON export and a PNG. It
reads datasets with `prepare_dataset.read_samples` and question sets with
`dataset_converter`; it draws with `plots.py`. It does not prepare datasets.

Modes (as trtllm-bench's subcommands):
- `throughput`: every request is submitted at once; the engine's in-flight batching
  decodes up to `--max-batch-size` of them together.
- `latency`: one request at a time (batch 1).

Requests come from a trtllm-bench dataset (`--dataset`, written by
`tools/data/prepare_dataset.py`; `input_ids` or `prompt`, and `output_tokens`) or an EAGLE
question set (`--question-set`, first turn of each question, `--output-tokens`).
Every request generates exactly its `output_tokens` (end-of-sequence ignored, as
trtllm-bench does) unless `--stop-at-eos`. By default adaptive speculation is off (the
full tree at every step: what each method does); `--adaptive on` runs the engine as
served by default, the policy shrinking or skipping trees when they do not pay.

`plot-speedups REPORT.json...` reads `--compare` reports of several question sets
and prints the speedup table (methods x sets; PNG with `--plot`).
`plot-concurrency REPORT.json...` reads throughput reports taken at several
`--max-batch-size` and prints a markdown table (plus a PNG with `--plot`).

`--compare none,eagle2,hf,...` runs several configurations on the same requests in one
process (one engine holding every drafter) and prints their table; ratios are against
the first entry. Entries: the engine methods (none, medusa, eagle, eagle2, eagle3,
draft_model), trees of N nodes (`eagle3@3`: EAGLE-2/3 drafted as adaptive speculation
drafts that size, `policy.smaller_tree_shape`; `eagle3@8/4`: drafted to depth 4 instead,
the same top-k, to compare drafting depths side by side; `medusa@3`: the first N - 1 paths of the
Medusa tree, which Medusa's trees list best first; `draft_model@3`: a chain of N - 1
drafted tokens), with or without prompt lookup grafted onto EAGLE and Medusa trees
(`eagle3+nolookup@3`: none; `eagle3+lookup`: up to 10 tokens; neither: the engine's
default, docs/DESIGN.md "Prompt lookup"), and three `transformers`
references on the base weights, one request at a time in either mode: `hf` (greedy
`generate()`), `hf-assisted` (`assistant_model` = the family's draft model),
`hf-prompt-lookup` (`prompt_lookup_num_tokens=10`). In latency mode the configurations
take turns request by request; `--repeats R` passes over the requests R times so, and
each speedup is then also given over the R paired passes: median, range and, from 6
passes on, the median's distribution-free 95 % confidence interval (`repeats.py`),
since one run's ratio on a shared 2-core VM moves by 10-20 %.
`--env-variant NAME=VALUE` also runs every engine configuration with the environment
variable NAME set to VALUE, as `<entry> [NAME=VALUE]`, taking turns with the others in the
same process: an A/B of a switch the engine reads at each call (`SPECDEC_CPU_AMX=0`,
`SPECDEC_CPU_ATTENTION=0`) that a VM's drift between two runs would drown.
"same as none": greedy outputs must equal plain decoding token for token (below
float64 a near-tie between two logits may flip an argmax between the tree and the
plain forward, which sum in different orders; a mismatch is reported, not fatal).

Metrics. latency = submit → last token; TTFT = submit → first token (the prefill's);
token throughput = output tokens / wall time of the run; τ = tokens emitted per
target forward (`AcceptanceStats`; prefill not counted); acceptance rate = accepted
draft tokens / draft tokens sent to verification.

    python tools/bench/bench.py throughput --dataset ds.jsonl --method eagle2
    python tools/bench/bench.py latency --question-set ../shared/data/eagle_humaneval_question.jsonl \\
        --num-requests 20 --output-tokens 128 --compare none,eagle2,eagle3,medusa,draft_model,eagle,hf \\
        --report-json bench.json --plot bench.png
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "backend_src"))
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO / "tools" / "data"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from dataset_converter import DatasetError, first_turns, read_question_set  # noqa: E402
from family import FAMILY_DIR  # noqa: E402
from prepare_dataset import read_samples  # noqa: E402
from repeats import format_ratio, ratio_summary  # noqa: E402
from triton_env import usable_cores  # noqa: E402
from specdec.config import DRAFTER_PARAMETERS, DTYPES, EngineConfig  # noqa: E402
from specdec.drafters.choices import parse_choices  # noqa: E402
from specdec.drafters.lookup import GRAFTED_METHODS as LOOKUP_METHODS  # noqa: E402
from specdec.engine import Engine  # noqa: E402
from specdec.errors import ConfigError, InputError  # noqa: E402
from specdec.policy import MAX_DEPTH, MAX_TREE, smaller_tree_shape  # noqa: E402
from specdec.request import METHODS, AcceptanceStats, GenerationRequest, SamplingParams, SpecParams  # noqa: E402

HF_ENTRIES = ("hf", "hf-assisted", "hf-prompt-lookup")
ENTRIES = METHODS + HF_ENTRIES
SIZED = ("eagle2", "eagle3", "medusa", "draft_model")  # methods whose entries may name a tree size: eagle3@3
DRAFTER_DIRS = {"eagle": "eagle", "eagle2": "eagle", "eagle3": "eagle3", "medusa": "medusa",
                "draft_model": "draft", "hf-assisted": "draft"}
PROMPT_LOOKUP_TOKENS = 10
RULE = "=" * 64


class BenchError(RuntimeError):
    """A benchmark that cannot run as asked (bad argument, file, or checkpoint)."""


def _validate_that(cond: bool, msg: str) -> None:
    if not cond:
        raise BenchError(msg)


# ---------------------------------------------------------------- requests


@dataclass(frozen=True)
class BenchRequest:
    task_id: int
    input_ids: tuple[int, ...]
    output_tokens: int


def encode_question(tokenizer, text: str, chat_template: str) -> list[int]:
    """A question's prompt ids: in the tokenizer's chat template as a user turn
    (`chat_template` "auto" when it has one, or "on"), else the raw text."""
    if chat_template == "on" or (chat_template == "auto" and tokenizer.chat_template):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                  add_generation_prompt=True, return_dict=False))
    return tokenizer.encode(text)


def load_requests(args: argparse.Namespace, tokenizer) -> list[BenchRequest]:
    """The first `--num-requests` requests of the dataset or question set."""
    _validate_that((args.dataset is None) != (args.question_set is None),
                   "give exactly one of --dataset and --question-set")
    out = []
    try:
        if args.dataset is not None:
            for s in read_samples(args.dataset):
                ids = s.input_ids if s.input_ids is not None else tokenizer.encode(s.prompt)
                out.append(BenchRequest(s.task_id, tuple(ids), s.output_tokens))
        else:
            _validate_that(args.output_tokens >= 1, f"--output-tokens must be >= 1, got {args.output_tokens}")
            for i, text in enumerate(first_turns(read_question_set(args.question_set))):
                out.append(BenchRequest(i, tuple(encode_question(tokenizer, text, args.chat_template)),
                                        args.output_tokens))
    except (DatasetError, FileNotFoundError) as e:
        raise BenchError(str(e)) from None
    if args.num_requests:
        out = out[: args.num_requests]
    _validate_that(len(out) > 0, "no requests to run")
    return out


# ---------------------------------------------------------------- measurement


@dataclass
class RequestResult:
    task_id: int
    input_len: int
    submit_s: float
    first_token_s: Optional[float] = None
    end_s: Optional[float] = None
    output_ids: list[int] = field(default_factory=list)
    stats: Optional[AcceptanceStats] = None  # engine entries only
    error: Optional[str] = None
    step_taus: collections.Counter = field(default_factory=collections.Counter)  # τ -> verify steps

    @property
    def latency_ms(self) -> float:
        return 1e3 * (self.end_s - self.submit_s)

    @property
    def ttft_ms(self) -> float:
        return 1e3 * (self.first_token_s - self.submit_s)

    def to_json(self) -> dict:
        row = dict(task_id=self.task_id, input_len=self.input_len, output_len=len(self.output_ids),
                   latency_ms=round(self.latency_ms, 3), ttft_ms=round(self.ttft_ms, 3))
        if self.stats is not None:
            row.update(tau=round(self.stats.tau, 4), draft_tokens=self.stats.total_draft_tokens,
                       accepted_tokens=self.stats.total_accepted_draft_tokens,
                       target_forwards=self.stats.target_forwards)
        return row


@dataclass
class Run:
    """One configuration over all requests."""

    label: str
    tree: str
    results: list[RequestResult]
    wall_s: float
    # CUDA graphs captured while this configuration was timed (--cuda-graphs) and their
    # seconds: a capture is paid once per bucket, in the first step that needs it
    graph_captures: Optional[tuple[int, float]] = None
    # The engine's verify steps while timed, by the label the engine counted them under
    # (docs/DESIGN.md, "Metrics"): the request's method where a tree was drafted, "none"
    # where its tree was off, "prompt_lookup" where a copy was verified alone
    verify_steps: Optional[dict[str, int]] = None
    # Output tokens/s of each pass over the requests (latency --repeats): the entry's share
    # of every paired repeat, for each ratio's median and its confidence interval
    pass_throughputs: Optional[list[float]] = None

    def summary(self) -> dict:
        res = self.results
        lat = sorted(r.latency_ms for r in res)
        ttft = sorted(r.ttft_ms for r in res)
        out_tokens = sum(len(r.output_ids) for r in res)
        in_tokens = sum(r.input_len for r in res)
        s = dict(
            num_requests=len(res),
            avg_input_len=in_tokens / len(res),
            avg_output_len=out_tokens / len(res),
            total_output_tokens=out_tokens,
            token_throughput=out_tokens / self.wall_s,
            total_token_throughput=(in_tokens + out_tokens) / self.wall_s,
            request_throughput=len(res) / self.wall_s,
            total_latency_ms=1e3 * self.wall_s,
            avg_latency_ms=statistics.fmean(lat),
            p50_latency_ms=percentile(lat, 50), p90_latency_ms=percentile(lat, 90),
            p99_latency_ms=percentile(lat, 99),
            avg_ttft_ms=statistics.fmean(ttft), p50_ttft_ms=percentile(ttft, 50), p99_ttft_ms=percentile(ttft, 99),
            tau=None, acceptance_rate=None,
        )
        stats = [r.stats for r in res if r.stats is not None]
        if stats:
            forwards = sum(st.target_forwards for st in stats)
            drafted = sum(st.total_draft_tokens for st in stats)
            s["tau"] = sum(st.emitted_tokens for st in stats) / forwards if forwards else None
            s["acceptance_rate"] = sum(st.total_accepted_draft_tokens for st in stats) / drafted if drafted else None
        return s

    def step_taus(self) -> collections.Counter:
        total: collections.Counter = collections.Counter()
        for r in self.results:
            total.update(r.step_taus)
        return total


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = (len(sorted_values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def sampling_for(args: argparse.Namespace, task_id: int) -> SamplingParams:
    # A per-request seed: every configuration draws the same random stream per request
    # (a seeded sampled request keeps one tree); --unseeded: as clients that send no seed,
    # whose trees adaptive speculation sizes.
    seeded = args.temperature > 0 and not args.unseeded
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=task_id if seeded else None)


def entry_method(entry: str) -> str:
    """The engine method or `transformers` reference an entry runs (`eagle3+lookup@3`: eagle3)."""
    return entry.split("@", 1)[0].partition("+")[0]


def entry_option(entry: str) -> str:
    """What follows `+` in an entry's name (`eagle3+lookup@3`: lookup), else ""."""
    return entry.split("@", 1)[0].partition("+")[2]


def entry_lookup(entry: str) -> Optional[int]:
    """The prompt lookup an entry asks for: `+lookup` a branch of up to
    PROMPT_LOOKUP_TOKENS tokens, `+nolookup` none, else None (the engine's default)."""
    return {"lookup": PROMPT_LOOKUP_TOKENS, "nolookup": 0}.get(entry_option(entry))


def entry_tree(entry: str) -> tuple[str, str]:
    """The tree size and drafting depth an entry names, as written (`eagle3@8/4`: "8", "4";
    `eagle3@3`: "3", ""; `eagle3`: "", "")."""
    size, _, depth = entry.partition("@")[2].partition("/")
    return size, depth


def entry_nodes(entry: str) -> Optional[int]:
    """The tree size an entry names (`eagle3@3`, `eagle3@8/4`: 3, 8), else None."""
    size = entry_tree(entry)[0]
    return int(size) if size else None


def entry_depth(entry: str) -> Optional[int]:
    """The drafting depth an entry names (`eagle3@8/4`: 4), else None."""
    depth = entry_tree(entry)[1]
    return int(depth) if depth else None


def spec_for(args: argparse.Namespace, entry: str) -> SpecParams:
    """Per-request tree overrides from the command line (None: the engine's default); an
    entry that names a tree size gets that size, drafted with the depth and top-k that
    adaptive speculation gives a tree of that size cut from the command line's (or the
    engine's default) depth and top-k."""
    method, nodes = entry_method(entry), entry_nodes(entry)
    depth, top_k, total = args.eagle_depth, args.eagle_top_k, args.eagle_total_tokens or None  # 0: calibrated size
    choices = args.choices if method in ("eagle", "medusa") else None
    num_draft_tokens = args.num_draft_tokens
    if nodes is not None and method == "medusa":  # the best N - 1 paths of the command line's or default tree
        choices = json.dumps(parse_choices(args.choices or EngineConfig.medusa_choices)[: nodes - 1])
    elif nodes is not None and method == "draft_model":
        num_draft_tokens = nodes - 1
    elif nodes is not None:  # cut from the command line's depth and top-k, else EngineConfig's defaults
        depth, top_k = smaller_tree_shape(depth or EngineConfig.eagle_depth, top_k or EngineConfig.eagle_top_k, nodes)
        depth, total = entry_depth(entry) or depth, nodes
    return SpecParams(method=method, choices=choices, depth=depth, top_k=top_k, total_tokens=total,
                      num_draft_tokens=num_draft_tokens, prompt_lookup_tokens=entry_lookup(entry))


def run_engine(engine: Engine, entry: str, reqs: list[BenchRequest], args: argparse.Namespace,
               end_id: Optional[int], progress: Callable[[], None]) -> tuple[list[RequestResult], float]:
    """Throughput: submit all, step until all finish. Latency: one request at a time.
    Steps run in this thread, so the timestamps taken in `emit` are the host's view."""
    results: list[RequestResult] = []
    pending: set[int] = set()

    def emitter(res: RequestResult):
        def emit(o):
            now = time.perf_counter()
            if o.finish_reason == "error":  # raised after the step: the engine is mid-step here
                res.error = o.error
            if res.first_token_s is None and o.token_ids:
                res.first_token_s = now
            res.output_ids += o.token_ids
            if o.stats is not None:
                # The stats object keeps counting; its growth since the last output is
                # this step's verification (one target forward per output after prefill).
                prev = res.stats or AcceptanceStats()
                if o.stats.target_forwards > prev.target_forwards:
                    res.step_taus[o.stats.emitted_tokens - prev.emitted_tokens] += 1
                res.stats = dataclasses.replace(o.stats)
            if o.finished:
                res.end_s = now
                pending.discard(res.task_id)
                progress()
        return emit

    def submit(i: int, r: BenchRequest) -> None:
        req = GenerationRequest(request_id=f"{entry}-{i}", input_ids=list(r.input_ids), max_tokens=r.output_tokens,
                                end_id=end_id, sampling=sampling_for(args, r.task_id), spec=spec_for(args, entry))
        res = RequestResult(r.task_id, len(r.input_ids), time.perf_counter())
        results.append(res)
        pending.add(r.task_id)
        engine.submit(req, emitter(res))

    t0 = time.perf_counter()
    if args.mode == "throughput":
        for i, r in enumerate(reqs):
            submit(i, r)
        while pending:
            engine.step()
    else:
        for i, r in enumerate(reqs):
            submit(i, r)
            while pending:
                engine.step()
    wall = time.perf_counter() - t0
    for res in results:
        _validate_that(res.error is None, f"{entry}: request {res.task_id} failed: {res.error}")
    return results, wall


class _FirstTokenStreamer:
    """A `transformers` streamer that only notes when the first new token arrives
    (`generate` puts the prompt first, then new tokens)."""

    def __init__(self):
        self.calls = 0
        self.first_token_s: Optional[float] = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first_token_s is None:
            self.first_token_s = time.perf_counter()

    def end(self) -> None:
        pass


@contextlib.contextmanager
def torch_attention():
    """torch's default attention kernels, cuDNN's included, which an engine on a GPU
    takes out for the whole process (`attention_without_per_shape_plans`)."""
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn)


def run_hf(entry: str, models: dict, reqs: list[BenchRequest], args: argparse.Namespace,
           end_id: Optional[int], progress: Callable[[], None]) -> tuple[list[RequestResult], float]:
    """`transformers` generate() on the base weights, batch 1, in either mode, with
    torch's attention kernels as a `transformers` user gets them (`torch_attention`)."""
    device = torch.device(args.device)
    results = []
    t0 = time.perf_counter()
    for r in reqs:
        kw = dict(max_new_tokens=r.output_tokens, min_new_tokens=0 if end_id is not None else r.output_tokens,
                  eos_token_id=end_id, pad_token_id=end_id if end_id is not None else 0)
        if args.temperature > 0:
            torch.manual_seed(r.task_id)
            kw.update(do_sample=True, temperature=args.temperature, top_k=0, top_p=args.top_p)
        else:
            kw.update(do_sample=False)
        if entry == "hf-assisted":
            kw["assistant_model"] = models["draft"]
        elif entry == "hf-prompt-lookup":
            kw["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
        streamer = _FirstTokenStreamer()
        ids = torch.tensor([r.input_ids], device=device)
        res = RequestResult(r.task_id, len(r.input_ids), time.perf_counter())
        with torch.inference_mode(), torch_attention():
            out = models["base"].generate(ids, attention_mask=torch.ones_like(ids), streamer=streamer, **kw)
        res.end_s = time.perf_counter()
        res.first_token_s = streamer.first_token_s or res.end_s
        res.output_ids = out[0, len(r.input_ids):].tolist()
        if end_id is not None and res.output_ids and res.output_ids[-1] == end_id:
            res.output_ids.pop()  # generate() keeps the end token; the engine does not emit it
        results.append(res)
        progress()
    return results, time.perf_counter() - t0


# ---------------------------------------------------------------- setup


def parse_entries(args: argparse.Namespace) -> list[str]:
    entries = [e.strip() for e in args.compare.split(",") if e.strip()] if args.compare else [args.method]
    for e in entries:
        _validate_that(entry_method(e) in ENTRIES,
                       f"unknown configuration {e!r}; choose from {', '.join(ENTRIES)} (and {'@N, '.join(SIZED)}@N)")
        option = entry_option(e)
        _validate_that(not option or (option in ("lookup", "nolookup") and entry_method(e) in LOOKUP_METHODS),
                       f"configuration {e!r}: +lookup and +nolookup follow one of {', '.join(LOOKUP_METHODS)}")
        if "@" in e:
            size, depth = entry_tree(e)
            _validate_that(entry_method(e) in SIZED and size.isdigit() and 2 <= int(size) <= MAX_TREE,
                           f"configuration {e!r}: a tree size is METHOD@N with METHOD one of {', '.join(SIZED)} "
                           f"and N from 2 to {MAX_TREE}")
            _validate_that(not depth or (entry_method(e) in ("eagle2", "eagle3") and depth.isdigit()
                                         and 1 <= int(depth) <= MAX_DEPTH),
                           f"configuration {e!r}: a drafting depth is eagle2@N/D or eagle3@N/D with D from 1 to "
                           f"{MAX_DEPTH}")
    _validate_that(len(set(entries)) == len(entries), f"a configuration appears twice in {entries}")
    return entries


def variant_labels(args: argparse.Namespace, entries: list[str]) -> list[str]:
    """The configurations run: `entries`, then with `--env-variant` each engine entry again
    as `<entry> [NAME=VALUE]`."""
    if not args.env_variant:
        return entries
    name, sep, value = args.env_variant.partition("=")
    _validate_that(bool(sep) and name.isidentifier(), f"--env-variant must be NAME=VALUE, got {args.env_variant!r}")
    return entries + [f"{e} [{name}={value}]" for e in entries if entry_method(e) in METHODS]


def label_entry(label: str) -> tuple[str, Optional[tuple[str, str]]]:
    """A run's entry and the environment variable it sets: `eagle3@8 [SPECDEC_CPU_AMX=0]` ->
    (`eagle3@8`, (`SPECDEC_CPU_AMX`, `0`)); a plain entry -> (entry, None)."""
    entry, sep, variant = label.partition(" [")
    if not sep:
        return label, None
    name, _, value = variant.rstrip("]").partition("=")
    return entry, (name, value)


@contextlib.contextmanager
def environment(variable: Optional[tuple[str, str]]):
    """`variable` (NAME, VALUE) set in the environment while the block runs, then put back."""
    if variable is None:
        yield
        return
    name, value = variable
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def drafter_dirs(family: Path, methods) -> dict[str, str]:
    """EngineConfig's drafter folders for `methods`: {config parameter: folder in `family`}."""
    methods = {entry_method(m) for m in methods}
    return {DRAFTER_PARAMETERS[m]: str(Path(family) / DRAFTER_DIRS[m]) for m in methods if m in DRAFTER_PARAMETERS}


def build_engine(args: argparse.Namespace, entries: list[str], reqs: list[BenchRequest]) -> Engine:
    family = Path(args.family)
    dirs = drafter_dirs(family, entries)
    longest = max(len(r.input_ids) + r.output_tokens for r in reqs)
    # Spare positions past the longest request, so that its last steps still get full trees.
    spec_methods = [m for m in map(entry_method, entries) if m in ("eagle2", "eagle3")]
    total = args.eagle_total_tokens
    config = EngineConfig(
        base_model_dir=str(family / "base"), device=args.device, dtype=args.dtype,
        max_batch_size=args.max_batch_size if args.mode == "throughput" else 1,
        # Floors: the engine's load-time calibration generates 48 tokens from a 25-token prompt.
        max_seq_len=max(longest, 128) + MAX_TREE, max_tokens_limit=max(64, max(r.output_tokens for r in reqs)),
        max_queue_size=max(64, len(reqs)),
        # EAGLE-2/3 tree size 0: the engine times candidate sizes at load and keeps the fastest.
        speculative_method=spec_methods[0] if total == 0 and spec_methods else "none",
        eagle_total_tokens=0 if total == 0 else 16, adaptive_speculation=args.adaptive == "on",
        cuda_graph_mode=args.cuda_graphs, **dirs,
    )
    try:
        config.validate()
        return Engine(config)
    except ConfigError as e:
        raise BenchError(str(e)) from None


def load_hf_models(args: argparse.Namespace, entries: list[str]) -> dict:
    from transformers import LlamaForCausalLM

    dtype = getattr(torch, args.hf_dtype)
    models = {"base": LlamaForCausalLM.from_pretrained(str(Path(args.family) / "base"), dtype=dtype)}
    if "hf-assisted" in entries:
        models["draft"] = LlamaForCausalLM.from_pretrained(str(Path(args.family) / "draft"), dtype=dtype)
    for m in models.values():
        m.to(args.device).eval()
    return models


def describe_tree(entry: str, engine: Optional[Engine], args: argparse.Namespace) -> str:
    if entry == "none":
        return "plain decoding"
    if entry == "hf":
        how = "greedy" if args.temperature == 0 else f"sampling, temperature {args.temperature}, top_p {args.top_p}"
        return f"transformers generate, {how}, {args.hf_dtype}"
    if entry == "hf-assisted":
        return "transformers assistant_model=draft (its default schedule)"
    if entry == "hf-prompt-lookup":
        return f"transformers prompt_lookup_num_tokens={PROMPT_LOOKUP_TOKENS}"
    st = engine.policy.resolve(GenerationRequest("describe", [1], 1, spec=spec_for(args, entry)))
    method = entry_method(entry)
    lookup = f", lookup {st.lookup_tokens}" if st.lookup_tokens else ""
    if method in ("eagle", "medusa"):
        name = args.choices or (engine.config.eagle_choices if method == "eagle" else engine.config.medusa_choices)
        if entry_nodes(entry) is not None:
            name = f"first {entry_nodes(entry) - 1} paths of {name}"
        if len(name) > 40:
            name = name[:37] + "..."
        return f"static {name} ({st.choices.num_nodes} nodes){lookup}"
    if method == "draft_model":
        return f"chain of {st.num_draft_tokens}"
    return f"dynamic depth={st.depth} top_k={st.top_k} total_tokens={st.total_tokens}{lookup}"


def portable(value):
    """A report's value with this checkout's root written as `.`, its folder as `..` and
    the home folder as `~` (reports are committed: they should not carry one machine's
    paths, such as the calibration cache's in the engine's load note)."""
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        root = str(Path(__file__).resolve().parents[2])
        value = value.replace(root, ".").replace(str(Path(root).parent), "..").replace(str(Path.home()) + "/", "~/")
    return value


def machine_info(device: str) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        host=platform.node(), cpu=cpu, cpu_cores=os.cpu_count(),
        cpu_cores_usable=usable_cores(),
        torch_threads=torch.get_num_threads(), omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
        gpu=torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else None,
        python=platform.python_version(), torch=torch.__version__, git_commit=_git_commit(),
    )
    for module in ("transformers", "numpy"):
        try:
            info[module] = __import__(module).__version__
        except ImportError:
            info[module] = None
    return info


def _git_commit() -> Optional[str]:
    """HEAD (+dirty); where the tree has no git metadata (a copy on a GPU machine), $SPECDEC_COMMIT."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head = dirty = ""
    return (head + ("+dirty" if dirty else "")) or os.environ.get("SPECDEC_COMMIT") or None


# ---------------------------------------------------------------- report


def _block(title: str, rows: list[tuple[str, object]]) -> str:
    width = max(len(k) for k, _ in rows) + 2
    lines = [RULE, f"= {title}", RULE]
    lines += [f"{k + ':':<{width}}{v}" for k, v in rows]
    return "\n".join(lines) + "\n"


def _fmt(v, digits: int = 4) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def engine_details(args: argparse.Namespace, entries: list[str], trees: dict[str, str], machine: dict,
                   engine: Optional[Engine]) -> str:
    rows = [("Model", Path(args.family, "base").absolute()), ("Family", Path(args.family).absolute()),
            ("Mode", args.mode), ("Method" if len(entries) == 1 else "Compared", ", ".join(entries))]
    rows += [(f"Tree ({e})", trees[e]) for e in entries if label_entry(e)[0] != "none"]
    rows.append(("Adaptive speculation", args.adaptive))
    note = getattr(engine, "load_note", None)
    if note:
        rows.append(("Engine at load", note))
    rows += [("Dtype", args.dtype), ("Device", args.device),
             ("Max batch size", args.max_batch_size if args.mode == "throughput" else 1),
             ("Temperature", args.temperature), ("Top-p", args.top_p), ("Stop at EOS", args.stop_at_eos),
             ("Warmup requests", args.warmup),
             ("CPU", f"{machine['cpu']} ({machine['cpu_cores_usable']} usable cores, "
                     f"{machine['torch_threads']} torch threads)")]
    if machine["gpu"]:
        rows.append(("GPU", machine["gpu"]))
    rows += [("Versions", f"python {machine['python']}, torch {machine['torch']}, "
                          f"transformers {machine['transformers']}, commit {machine['git_commit']}"),
             ("Date", machine["date"])]
    return _block("ENGINE DETAILS", rows)


def performance_overview(run: Run) -> str:
    s = run.summary()
    rows = [
        ("Configuration", f"{run.label} ({run.tree})"),
        ("Number of requests", s["num_requests"]),
        ("Average Input Length (tokens)", _fmt(s["avg_input_len"])),
        ("Average Output Length (tokens)", _fmt(s["avg_output_len"])),
        ("Token Throughput (tokens/sec)", _fmt(s["token_throughput"])),
        ("Total Token Throughput (tokens/sec)", _fmt(s["total_token_throughput"])),
        ("Request Throughput (req/sec)", _fmt(s["request_throughput"])),
        ("Total Latency (ms)", _fmt(s["total_latency_ms"])),
        ("Average request latency (ms)", _fmt(s["avg_latency_ms"])),
        ("P50 request latency (ms)", _fmt(s["p50_latency_ms"])),
        ("P90 request latency (ms)", _fmt(s["p90_latency_ms"])),
        ("P99 request latency (ms)", _fmt(s["p99_latency_ms"])),
        ("Average time-to-first-token (ms)", _fmt(s["avg_ttft_ms"])),
        ("P99 time-to-first-token (ms)", _fmt(s["p99_ttft_ms"])),
        ("Mean acceptance length tau", _fmt(s["tau"])),
        ("Draft acceptance rate", _fmt(s["acceptance_rate"])),
    ]
    if run.graph_captures is not None:
        rows.append(("CUDA graphs captured while timed", f"{run.graph_captures[0]} ({run.graph_captures[1]:.2f} s)"))
    if run.verify_steps:
        rows.append(("Verify steps by drafts", ", ".join(f"{k} {v}" for k, v in sorted(run.verify_steps.items()))))
    return _block("PERFORMANCE OVERVIEW", rows)


def same_as(run: Run, reference: Optional[Run]) -> Optional[dict]:
    """How many requests' outputs equal the reference's, token for token."""
    if reference is None or run is reference:
        return None
    ref = {r.task_id: r.output_ids for r in reference.results}
    # Where each differing output first leaves the reference (token index): a late first
    # difference after identical text is a flipped near-tie, an early one is suspect.
    first = sorted(first_difference(r.output_ids, ref[r.task_id]) for r in run.results
                   if r.output_ids != ref[r.task_id])
    total = len(run.results)
    return dict(equal=total - len(first), total=total, same=not first, first_differences=first)


def first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first token where `a` and `b` differ (the shorter length if one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _differ_text(same: dict) -> str:
    """'4/5 differ, first at 37' (the earliest first difference; older reports lack it)."""
    text = f"{same['total'] - same['equal']}/{same['total']} differ"
    if same.get("first_differences"):
        text += f", first at token {same['first_differences'][0]}"
    return text


def comparison_rows(runs: list[Run], greedy: bool) -> list[dict]:
    """One row per run, its ratios against the first run's; with several passes
    (`--repeats`), also each pass's speedup against the first run's same pass and their
    median, range and the median's 95 % confidence interval (`repeats.ratio_summary`,
    keys `speedup_over_repeats*`), and the same against each `transformers` entry
    (`over_repeats_against`: its label -> `ratio*` keys)."""
    base = runs[0].summary()
    none_run = next((r for r in runs if r.label == "none"), None)
    references = [r for r in runs[1:] if r.label in HF_ENTRIES]

    def per_pass(run: Run, reference: Run) -> list[float]:
        return [mine / ref for mine, ref in zip(run.pass_throughputs, reference.pass_throughputs)]
    rows = []
    for run in runs:
        s = run.summary()
        over_repeats = {}
        if run.pass_throughputs and len(run.pass_throughputs) > 1:
            ratios = per_pass(run, runs[0])
            over_repeats = dict(speedup_repeats=ratios, **ratio_summary(ratios, "speedup_over_repeats"))
            if run is not runs[0]:
                against = {ref.label: ratio_summary(per_pass(run, ref)) for ref in references if ref is not run}
                if against:
                    over_repeats["over_repeats_against"] = against
        rows.append(dict(
            label=run.label, tree=run.tree, token_throughput=s["token_throughput"],
            speedup=s["token_throughput"] / base["token_throughput"],
            request_throughput=s["request_throughput"], avg_latency_ms=s["avg_latency_ms"],
            latency_ratio=s["avg_latency_ms"] / base["avg_latency_ms"], p99_latency_ms=s["p99_latency_ms"],
            avg_ttft_ms=s["avg_ttft_ms"], tau=s["tau"], acceptance_rate=s["acceptance_rate"],
            same_as_none=same_as(run, none_run) if greedy else None, **over_repeats,
        ))
    return rows


def repeats_lines(rows: list[dict]) -> list[str]:
    """Each entry's speedup over the repeats, one line each, against the first entry and
    each `transformers` entry (none without repeats)."""
    if "speedup_repeats" not in rows[0]:
        return []
    lines = [f"speedup per pass over {len(rows[0]['speedup_repeats'])} paired passes (the configurations taking "
             f"turns in each): median (range; from 6 passes the median's 95 % confidence interval)"]
    for r in rows[1:]:
        against = "".join(f"; {format_ratio(summary)} of {label}"
                          for label, summary in r.get("over_repeats_against", {}).items())
        lines.append(f"  {r['label']}: {format_ratio(r, 'speedup_over_repeats')} of {rows[0]['label']}{against}")
    return lines


def format_comparison(rows: list[dict], greedy: bool) -> str:
    head = ("config", "tok/s", "x tok/s", "req/s", "avg lat ms", "x lat", "p99 lat ms", "TTFT ms", "tau",
            "accept", "same as none")
    table = [head]
    for r in rows:
        same = r["same_as_none"]
        if r["label"] == "none":
            same_txt = "(reference)"
        elif not greedy:
            same_txt = "n/a (sampling)"
        elif same is None:
            same_txt = "-"
        else:
            same_txt = "true" if same["same"] else f"FALSE ({_differ_text(same)})"
        table.append((r["label"], f"{r['token_throughput']:.2f}", f"{r['speedup']:.2f}",
                      f"{r['request_throughput']:.3f}", f"{r['avg_latency_ms']:.1f}", f"{r['latency_ratio']:.2f}",
                      f"{r['p99_latency_ms']:.1f}", f"{r['avg_ttft_ms']:.1f}", _fmt(r["tau"], 2),
                      _fmt(r["acceptance_rate"], 3), same_txt))
    widths = [max(len(str(row[i])) for row in table) for i in range(len(head))]
    lines = [RULE, "= COMPARISON (ratios vs the first entry)", RULE]
    for j, row in enumerate(table):
        lines.append("  ".join(str(c).ljust(w) if i in (0, len(head) - 1) else str(c).rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines += ["", "trees:"] + [f"  {r['label']}: {r['tree']}" for r in rows]
    repeated = repeats_lines(rows)
    lines += [""] + repeated if repeated else []
    return "\n".join(lines) + "\n"


def comparison_markdown(rows: list[dict], greedy: bool, report: dict) -> str:
    """The comparison as a markdown snippet for docs/benchmarks.md: table, command, machine."""
    m = report["machine"]
    lines = ["| config | tree | output tok/s | speedup | avg latency ms | p99 latency ms | TTFT ms | τ | "
             "acceptance | same as none |", "|" + " --- |" * 10]
    for r in rows:
        same = r["same_as_none"]
        same_txt = ("reference" if r["label"] == "none" else "n/a (sampling)" if not greedy else "-" if same is None
                    else "yes" if same["same"] else f"no ({_differ_text(same)})")
        lines.append(f"| {r['label']} | {r['tree']} | {r['token_throughput']:.2f} | {r['speedup']:.2f} | "
                     f"{r['avg_latency_ms']:.1f} | {r['p99_latency_ms']:.1f} | {r['avg_ttft_ms']:.1f} | "
                     f"{_fmt(r['tau'], 2)} | {_fmt(r['acceptance_rate'], 3)} | {same_txt} |")
    gpu = f", GPU {m['gpu']}" if m.get("gpu") else ""
    repeated = repeats_lines(rows)
    lines += [""] + [line.strip() + "  " for line in repeated] if repeated else []
    lines += ["", f"Command: `{report['command']}`  ",
              f"Machine: {m['cpu']} ({m['cpu_cores_usable']} usable cores, {m['torch_threads']} torch threads){gpu}; "
              f"python {m['python']}, torch {m['torch']}, transformers {m['transformers']}, commit {m['git_commit']}  ",
              f"Date: {m['date']}"]
    return "\n".join(lines) + "\n"


def write_plot(path: Path, runs: list[Run], dataset_name: str) -> list[Path]:
    from plots import speedup_bars, tau_histogram

    base = runs[0].summary()["token_throughput"]
    speedups = {r.label: {dataset_name: r.summary()["token_throughput"] / base} for r in runs}
    written = [speedup_bars(speedups, path, title=f"Output token throughput vs {runs[0].label}")]
    taus = {r.label: [t for t, n in sorted(r.step_taus().items()) for _ in range(n)]
            for r in runs if r.summary()["acceptance_rate"] is not None}
    if taus:
        written.append(tau_histogram(taus, path.with_name(path.stem + "_tau" + path.suffix)))
    return written


def concurrency_series(reports: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """label -> [(max batch size, output tokens/s)] from throughput-mode JSON reports."""
    series: dict[str, list[tuple[int, float]]] = collections.defaultdict(list)
    for rep in reports:
        _validate_that(rep.get("config", {}).get("mode") == "throughput",
                       "plot-concurrency reads reports of the throughput mode")
        for run in rep["runs"]:
            series[run["label"]].append((rep["config"]["max_batch_size"], run["summary"]["token_throughput"]))
    return {k: sorted(v) for k, v in series.items()}


def concurrency_markdown(series: dict[str, list[tuple[int, float]]]) -> str:
    """Output tokens/s per max batch size, and each label's ratio to the first label."""
    labels = list(series)
    sizes = sorted({c for pts in series.values() for c, _ in pts})
    values = {k: dict(v) for k, v in series.items()}
    lines = ["| max batch size | " + " | ".join(f"{k} tok/s" for k in labels) + " | "
             + " | ".join(f"{k} / {labels[0]}" for k in labels[1:]) + " |"]
    lines.append("|" + " --- |" * (1 + 2 * len(labels) - 1))
    for c in sizes:
        base = values[labels[0]].get(c)
        cells = [_fmt(values[k].get(c), 2) for k in labels]
        ratios = [_fmt(values[k][c] / base, 2) if base and c in values[k] else "-" for k in labels[1:]]
        lines.append(f"| {c} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines) + "\n"


def plot_concurrency(args: argparse.Namespace) -> None:
    from plots import throughput_vs_concurrency

    try:
        reports = [json.loads(Path(p).read_text()) for p in args.reports]
    except (OSError, json.JSONDecodeError) as e:
        raise BenchError(f"cannot read a report: {e}") from None
    series = concurrency_series(reports)
    print(concurrency_markdown(series))
    if args.plot:
        print(f"wrote {throughput_vs_concurrency(series, args.plot)}", file=sys.stderr)


def speedup_table(reports: list[dict]) -> dict[str, dict[str, float]]:
    """speedup[label][requests file stem] = output tokens/s over the report's first entry."""
    table: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for rep in reports:
        name = Path(rep["requests_source"]).stem.replace("eagle_", "").replace("_question", "")
        for row in rep["comparison"]:
            table[row["label"]][name] = row["speedup"]
    return dict(table)


def plot_speedups(args: argparse.Namespace) -> None:
    from plots import speedup_bars

    try:
        reports = [json.loads(Path(p).read_text()) for p in args.reports]
    except (OSError, json.JSONDecodeError) as e:
        raise BenchError(f"cannot read a report: {e}") from None
    table = speedup_table(reports)
    sets = list(dict.fromkeys(s for per in table.values() for s in per))
    print("| config | " + " | ".join(sets) + " |")
    print("|" + " --- |" * (1 + len(sets)))
    for label, per in table.items():
        print(f"| {label} | " + " | ".join(_fmt(per.get(s), 2) for s in sets) + " |")
    if args.plot:
        print(f"wrote {speedup_bars(table, args.plot)}", file=sys.stderr)


# ---------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default=str(FAMILY_DIR),
                    help=f"model family: base/, draft/, eagle/, eagle3/, medusa/ (default: {FAMILY_DIR}, "
                         f"the SmolLM2 family tools/setup_model.py assembles)")
    sub = ap.add_subparsers(dest="mode", required=True)
    for mode, help_text in (("throughput", "all requests at once, in-flight batching"),
                            ("latency", "one request at a time")):
        p = sub.add_parser(mode, help=help_text)
        src = p.add_argument_group("requests")
        src.add_argument("--dataset", type=Path, help="trtllm-bench dataset (tools/data/prepare_dataset.py)")
        src.add_argument("--question-set", type=Path, help="EAGLE question.jsonl (first turn of each)")
        src.add_argument("--output-tokens", type=int, default=128, help="with --question-set: max_tokens")
        src.add_argument("--chat-template", choices=("auto", "on", "off"), default="auto",
                         help="with --question-set: each question as a user turn in the tokenizer's chat "
                              "template (auto: when the tokenizer has one)")
        src.add_argument("--num-requests", type=int, default=0, help="first N requests (0: all)")
        src.add_argument("--warmup", type=int, default=2, help="untimed requests per configuration first")
        src.add_argument("--stop-at-eos", action="store_true",
                         help="end a request at the tokenizer's EOS (default: generate output_tokens exactly)")
        cfg = p.add_argument_group("configuration")
        cfg.add_argument("--method", default="none", choices=METHODS)
        cfg.add_argument("--compare", help=f"comma-separated configurations, of: {', '.join(ENTRIES)}")
        cfg.add_argument("--env-variant", metavar="NAME=VALUE",
                         help="also run every engine configuration with this environment variable set, as "
                              "'<entry> [NAME=VALUE]' (a switch the engine reads at each call)")
        cfg.add_argument("--choices", help="static tree of eagle/medusa: name, '{0},{0,0}', JSON or YAML file")
        cfg.add_argument("--eagle-total-tokens", type=int, default=None,
                         help="EAGLE-2/3 tree size incl. root (default 16; 0: chosen by timing at load)")
        cfg.add_argument("--eagle-depth", type=int, default=None, help="EAGLE-2/3 depth (default 5)")
        cfg.add_argument("--eagle-top-k", type=int, default=None, help="EAGLE-2/3 top-k (default 8)")
        cfg.add_argument("--num-draft-tokens", type=int, default=None, help="draft_model chain (default 4)")
        cfg.add_argument("--adaptive", choices=("on", "off"), default="off",
                         help="the engine's adaptive speculation (off: every step uses the full tree)")
        cfg.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
        cfg.add_argument("--top-p", type=float, default=1.0, help="nucleus of sampled requests (default 1: off)")
        cfg.add_argument("--unseeded", action="store_true",
                         help="sampled requests send no seed (adaptive speculation then sizes their trees)")
        cfg.add_argument("--dtype", default="float32", choices=DTYPES)
        cfg.add_argument("--hf-dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                         help="dtype of the transformers references")
        cfg.add_argument("--device", default="cpu")
        cfg.add_argument("--cuda-graphs", action="store_true",
                         help="the engine's cuda_graph_mode: decode-time forwards replay CUDA graphs (GPU)")
        cfg.add_argument("--max-batch-size", type=int, default=8, help="throughput: requests decoded together")
        out = p.add_argument_group("output")
        out.add_argument("--report-json", type=Path, help="export config, per-request latencies and summaries")
        out.add_argument("--plot", type=Path, help="PNG of speedups (and <name>_tau.png, the τ histogram)")
        out.add_argument("--markdown", type=Path, help="the comparison as a markdown table with command and machine")
        out.add_argument("--no-progress", action="store_true", help="no tqdm bar")
        if mode == "latency":
            cfg.add_argument("--no-interleave", action="store_true",
                             help="with --compare: run each configuration over all requests in turn (default: "
                                  "request by request, every configuration in turn, so drift hits all alike)")
            cfg.add_argument("--repeats", type=int, default=1,
                             help="with --compare (interleaved): pass over the requests this many times; each "
                                  "speedup is then also given per pass, as a median with its range and, from 6 "
                                  "passes, the median's 95 %% confidence interval")
    ps = sub.add_parser("plot-speedups", help="table + PNG of --compare reports over several question sets")
    ps.add_argument("reports", nargs="+", type=Path, help="--report-json files of --compare runs")
    ps.add_argument("--plot", type=Path, help="PNG to write")
    pc = sub.add_parser("plot-concurrency", help="table + PNG of throughput reports at several --max-batch-size")
    pc.add_argument("reports", nargs="+", type=Path, help="--report-json files of the throughput mode")
    pc.add_argument("--plot", type=Path, help="PNG to write")
    return ap


def run_benchmark(args: argparse.Namespace, argv: list[str]) -> dict:
    _validate_that(args.temperature >= 0, f"--temperature must be >= 0, got {args.temperature}")
    _validate_that(0 < args.top_p <= 1, f"--top-p must be in (0, 1], got {args.top_p}")
    _validate_that(args.max_batch_size >= 1, f"--max-batch-size must be >= 1, got {args.max_batch_size}")
    _validate_that(args.warmup >= 0, f"--warmup must be >= 0, got {args.warmup}")
    family = Path(args.family)
    _validate_that((family / "base" / "config.json").is_file(), f"--family {family}: no base/config.json")
    entries = parse_entries(args)
    for e in map(entry_method, entries):
        if e in DRAFTER_DIRS:
            _validate_that((family / DRAFTER_DIRS[e] / "config.json").is_file(),
                           f"{e} needs {family / DRAFTER_DIRS[e]}/config.json")

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(family / "base"), local_files_only=True)
    reqs = load_requests(args, tokenizer)
    end_id = tokenizer.eos_token_id if args.stop_at_eos else None
    machine = machine_info(args.device)

    engine = build_engine(args, entries, reqs) if any(entry_method(e) in METHODS for e in entries) else None
    hf_models = load_hf_models(args, entries) if any(e in HF_ENTRIES for e in entries) else None
    labels = variant_labels(args, entries)
    try:
        trees = {label: describe_tree(label_entry(label)[0], engine, args) for label in labels}
    except InputError as e:
        raise BenchError(str(e)) from None
    print(engine_details(args, labels, trees, machine, engine))

    warm = [reqs[i % len(reqs)] for i in range(args.warmup)]
    captured: dict[str, tuple[int, float]] = {}  # entry -> graphs captured while timed, seconds
    steps: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)  # entry -> Run.verify_steps

    def run_entry(label: str, batch: list[BenchRequest], progress, timed: bool = True
                  ) -> tuple[list[RequestResult], float]:
        entry, variable = label_entry(label)
        try:
            if entry_method(entry) not in METHODS:
                return run_hf(entry, hf_models, batch, args, end_id, progress)
            before, steps_before = engine.graph_captures(), collections.Counter(engine.metrics.verify_steps)
            with environment(variable):
                out = run_engine(engine, entry, batch, args, end_id, progress)
            if timed:
                steps[label] += collections.Counter(engine.metrics.verify_steps) - steps_before
            if timed and args.cuda_graphs:
                after, sofar = engine.graph_captures(), captured.get(label, (0, 0.0))
                captured[label] = (sofar[0] + after[0] - before[0], sofar[1] + after[1] - before[1])
            return out
        except InputError as e:
            raise BenchError(f"{label}: {e}") from None

    entries = labels  # from here on, each configuration run (with its variant, if any)
    interleave = args.mode == "latency" and len(entries) > 1 and not args.no_interleave
    repeats = getattr(args, "repeats", 1)
    _validate_that(repeats >= 1, f"--repeats must be >= 1, got {repeats}")
    _validate_that(repeats == 1 or interleave, "--repeats needs --compare of two or more configurations, "
                                               "interleaved (without --no-interleave)")
    runs = []
    if interleave:
        # Request by request, every configuration in turn (the order rotating), so that a
        # machine that speeds up or slows down during the run weighs on all of them alike;
        # `--repeats` passes over the requests so, the rotation going on across passes.
        for entry in entries:
            run_entry(entry, warm, lambda: None, timed=False)
        collected = {e: ([], 0.0) for e in entries}
        per_pass: dict[str, list[float]] = {e: [] for e in entries}  # entry -> tok/s of each pass
        bar = tqdm(total=repeats * len(reqs) * len(entries), desc="interleaved", unit="req", file=sys.stderr,
                   disable=args.no_progress)
        for rep in range(repeats):
            this_pass = {e: (0, 0.0) for e in entries}  # entry -> (output tokens, seconds)
            for i, r in enumerate(reqs):
                turn = (rep * len(reqs) + i) % len(entries)
                for entry in entries[turn:] + entries[:turn]:
                    results, wall = run_entry(entry, [r], bar.update)
                    done, total = collected[entry]
                    collected[entry] = (done + results, total + wall)
                    tokens, seconds = this_pass[entry]
                    this_pass[entry] = (tokens + sum(len(x.output_ids) for x in results), seconds + wall)
            for entry, (tokens, seconds) in this_pass.items():
                per_pass[entry].append(tokens / seconds)
        bar.close()
        runs = [Run(e, trees[e], *collected[e], captured.get(e), dict(steps[e]) or None, per_pass[e])
                for e in entries]
        for run in runs:
            print(performance_overview(run))
    for entry in [] if interleave else entries:
        bar = tqdm(total=len(reqs), desc=entry, unit="req", file=sys.stderr, disable=args.no_progress)
        try:
            run_entry(entry, warm, lambda: None, timed=False)
            results, wall = run_entry(entry, reqs, bar.update)
        finally:
            bar.close()
        run = Run(entry, trees[entry], results, wall, captured.get(entry), dict(steps[entry]) or None)
        runs.append(run)
        print(performance_overview(run))

    greedy = args.temperature == 0
    rows = comparison_rows(runs, greedy)
    if len(runs) > 1:
        print(format_comparison(rows, greedy))
    for r in rows:
        same = r["same_as_none"]
        if same is not None and not same["same"] and entry_method(label_entry(r["label"])[0]) in METHODS:
            print(f"warning: {r['label']}: {same['total'] - same['equal']} of {same['total']} outputs differ "
                  f"from plain decoding (greedy; dtype {args.dtype}; first differing tokens at "
                  f"{same['first_differences']})", file=sys.stderr)

    config = {k: portable(v) for k, v in vars(args).items()}
    report = dict(
        tool="tools/bench/bench.py", command=" ".join(["python tools/bench/bench.py"] + argv), config=config,
        machine=machine, requests_source=str(args.dataset or args.question_set),
        engine_at_load=portable(getattr(engine, "load_note", None)),  # calibration's timings, as printed
        runs=[dict(label=r.label, tree=r.tree, summary=r.summary(), wall_s=r.wall_s, graph_captures=r.graph_captures,
                   verify_steps=r.verify_steps, pass_throughputs=r.pass_throughputs,
                   step_tau_histogram={str(k): v for k, v in sorted(r.step_taus().items())},
                   requests=[x.to_json() for x in r.results]) for r in runs],
        comparison=rows,
    )
    if args.report_json:
        args.report_json.parent.mkdir(parents=True, exist_ok=True)
        args.report_json.write_text(json.dumps(report, separators=(",", ":")) + "\n")
        print(f"wrote {args.report_json}", file=sys.stderr)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(comparison_markdown(rows, greedy, report))
        print(f"wrote {args.markdown}", file=sys.stderr)
    if args.plot:
        name = Path(args.dataset or args.question_set).stem
        for p in write_plot(args.plot, runs, name):
            print(f"wrote {p}", file=sys.stderr)
    return report


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        if args.mode == "plot-concurrency":
            plot_concurrency(args)
        elif args.mode == "plot-speedups":
            plot_speedups(args)
        else:
            run_benchmark(args, argv)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
