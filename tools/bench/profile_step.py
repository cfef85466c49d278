#!/usr/bin/env python3
"""Where a decode step's time goes, per phase, for each method on the shipped family.

    python tools/bench/profile_step.py --device cuda --dtype bfloat16 --cuda-graphs \\
        --methods none,eagle3,eagle2,medusa --report-json docs/bench/gpu_profile.json

Batch 1, the first `--num-requests` HumanEval questions (chat template), `--output-tokens`
new tokens each, adaptive speculation off, EAGLE-2/3 trees of `--eagle-total-tokens`.
The engine's phases are wrapped from here (nothing in `specdec` changes) and timed
inclusively, so a row contains the rows indented under it:

    decode step         Engine._decode: one speculative step
      plan              SpeculationPolicy.plan
      draft             the drafter's propose (EAGLE: catch-up, then one head forward a depth)
        catch-up        EagleDrafter._catch_up: the head over the accepted pairs
        head            EagleDrafter._head, one head forward: every catch-up and, eager,
                        each depth (graphed with --cuda-graphs)
        drafting loop   CapturedCalls: EAGLE-2/3's depths and the selection between them as
                        one CUDA graph (--cuda-graphs only)
      verify            Engine._verify, which ends with the step's one host sync
        build tree      ops.tree_mask.build_tree
        target forward  Engine.target_step (graphed with --cuda-graphs)
        LM head         LlamaModel.logits (also under draft for EAGLE-1/2's head)
        accept          ops.verify_greedy
        KV compaction   ops.kv_compact
        drafter commit  the drafter's commit (EAGLE: the accepted features)

Two passes per method, after the same requests once untimed:
- `host`: wall time around each phase as the engine runs. On a GPU most phases only
  launch work, so this is their host cost; the device work is paid at verify's sync.
- `synced`: the same with `torch.cuda.synchronize()` before and after each phase, so that
  each row holds its own device work (the sync costs add up: read the step total from
  `host`). On the CPU the two passes are the same measurement.
Then, with `--torch-profile`, one request under `torch.profiler`: the operators with the
most self time on the host and on the device, as text.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "backend_src"))
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench import drafter_dirs, encode_question, machine_info, portable  # noqa: E402
from dataset_converter import first_turns, question_set_path, read_question_set  # noqa: E402
from family import FAMILY_DIR  # noqa: E402
from specdec import engine as engine_module  # noqa: E402
from specdec.config import EngineConfig  # noqa: E402
from specdec.drafters.draft_model import DraftModelDrafter  # noqa: E402
from specdec.drafters.eagle import EagleDrafter  # noqa: E402
from specdec.drafters.medusa import MedusaDrafter  # noqa: E402
from specdec.engine import Engine  # noqa: E402
from specdec.graphs import CapturedCalls  # noqa: E402
from specdec.models.llama import LlamaModel  # noqa: E402
from specdec.policy import MAX_TREE, SpeculationPolicy  # noqa: E402
from specdec.request import GenerationRequest, SamplingParams, SpecParams  # noqa: E402

# (phase label, indent, owner, attribute): methods on classes, functions on the engine module
PHASES = [
    ("decode step", 0, Engine, "_decode"),
    ("plan", 1, SpeculationPolicy, "plan"),
    ("draft", 1, (EagleDrafter, MedusaDrafter, DraftModelDrafter), "propose"),
    ("catch-up", 2, EagleDrafter, "_catch_up"),
    ("head", 2, EagleDrafter, "_head"),
    ("drafting loop", 2, CapturedCalls, "__call__"),
    ("verify", 1, Engine, "_verify"),
    ("build tree", 2, engine_module, "build_tree"),
    ("target forward", 2, Engine, "target_step"),
    ("LM head", 2, LlamaModel, "logits"),
    ("accept", 2, engine_module, "verify_greedy"),
    ("KV compaction", 2, engine_module, "kv_compact"),
    ("drafter commit", 2, (EagleDrafter, MedusaDrafter, DraftModelDrafter), "commit"),
]


class PhaseTimer:
    """Wraps each phase of PHASES; while `active`, adds its inclusive wall time and calls."""

    def __init__(self, device: torch.device):
        self.active = False
        self.synced = False
        self.cuda = device.type == "cuda"
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self._originals: list[tuple[object, str, Callable]] = []
        for label, _, owners, name in PHASES:
            for owner in owners if isinstance(owners, tuple) else (owners,):
                original = getattr(owner, name)
                self._originals.append((owner, name, original))
                setattr(owner, name, self._wrap(label, original))

    def __enter__(self) -> "PhaseTimer":
        return self

    def __exit__(self, *exc) -> None:
        """Puts every wrapped phase back as it was."""
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals.clear()

    def _wrap(self, label: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            sync = self.synced and self.cuda and not torch.cuda.is_current_stream_capturing()
            if sync:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if sync:
                    torch.cuda.synchronize()
                self.seconds[label] += time.perf_counter() - t0
                self.calls[label] += 1
        return timed

    def reset(self, synced: bool) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.synced = synced


def build_engine(args: argparse.Namespace, methods: list[str], longest: int) -> Engine:
    return Engine(EngineConfig(
        base_model_dir=str(args.family / "base"), device=args.device, dtype=args.dtype, max_batch_size=1,
        max_seq_len=longest + MAX_TREE, max_tokens_limit=max(64, args.output_tokens), max_queue_size=8,
        eagle_total_tokens=args.eagle_total_tokens, adaptive_speculation=False,
        cuda_graph_mode=args.cuda_graphs, **drafter_dirs(args.family, methods)))


def run_requests(engine: Engine, method: str, prompts: list[list[int]], args: argparse.Namespace,
                 tag: str) -> dict:
    """Runs the prompts one at a time; returns tokens, target forwards and wall seconds."""
    tokens = forwards = 0
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        req = GenerationRequest(request_id=f"{tag}-{method}-{i}", input_ids=list(ids), max_tokens=args.output_tokens,
                                sampling=SamplingParams(),
                                spec=SpecParams(method=method, depth=args.eagle_depth, top_k=args.eagle_top_k))
        out, _, final = engine.generate(req)
        tokens += len(out)
        forwards += final.stats.target_forwards if final.stats is not None else 0
    return dict(tokens=tokens, target_forwards=forwards, seconds=time.perf_counter() - t0)


def profile_method(engine: Engine, timer: PhaseTimer, method: str, prompts: list[list[int]],
                   args: argparse.Namespace) -> dict:
    # Every prompt once untimed: with --cuda-graphs each new key length captures a graph
    # bucket the first time, which would otherwise land in the first timed pass.
    run_requests(engine, method, prompts, args, "warm")
    out: dict = {}
    for pass_name, synced in (("host", False), ("synced", True)):
        timer.reset(synced)
        timer.active = True
        try:
            totals = run_requests(engine, method, prompts, args, pass_name)
        finally:
            timer.active = False
        steps = max(1, timer.calls.get("decode step", 0))
        out[pass_name] = dict(
            **totals, decode_steps=steps, tokens_per_second=totals["tokens"] / totals["seconds"],
            ms_per_step={label: 1e3 * timer.seconds.get(label, 0.0) / steps for label, *_ in PHASES},
            calls_per_step={label: timer.calls.get(label, 0) / steps for label, *_ in PHASES})
    # τ: tokens delivered per target forward, the prefill's first token not counted (bench.py
    # counts what each forward emitted, also tokens cut at max_tokens: a little higher on
    # short outputs)
    host = out["host"]
    out["tau"] = (host["tokens"] - len(prompts)) / max(1, host["target_forwards"])
    if args.torch_profile:
        out["torch_profile"] = torch_profile(engine, method, prompts[:1], args)
    return out


def torch_profile(engine: Engine, method: str, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    try:
        with profile(activities=activities) as prof:
            run_requests(engine, method, prompts, args, "profiled")
        table = prof.key_averages()
        out = {"by_host_time": table.table(sort_by="self_cpu_time_total", row_limit=args.top)}
        if len(activities) > 1:
            out["by_device_time"] = table.table(sort_by="self_device_time_total", row_limit=args.top)
        return out
    except Exception as e:  # a profiler failure must not cost the phase tables
        return {"error": f"{type(e).__name__}: {e}"}


def markdown(report: dict) -> str:
    methods = list(report["methods"])
    head = "| phase | " + " | ".join(f"{m} host | {m} synced" for m in methods) + " |"
    lines = [head, "|" + " --- |" * (1 + 2 * len(methods))]
    for label, indent, *_ in PHASES:
        cells = []
        for m in methods:
            r = report["methods"][m]
            for p in ("host", "synced"):
                ms, calls = r[p]["ms_per_step"][label], r[p]["calls_per_step"][label]
                cells.append(f"{ms:.2f}" + (f" ({calls:.1f}x)" if calls not in (0, 1) else "") if calls else "-")
        lines.append(f"| {'&nbsp;' * 2 * indent}{label} | " + " | ".join(cells) + " |")
    lines.append("| tok/s | " + " | ".join(f"{report['methods'][m][p]['tokens_per_second']:.1f}"
                                          for m in methods for p in ("host", "synced")) + " |")
    lines.append("| τ | " + " | ".join(f"{report['methods'][m]['tau']:.2f}" for m in methods for _ in (0, 1)) + " |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", type=Path, default=FAMILY_DIR)
    p.add_argument("--methods", default="none,eagle3,eagle2,medusa",
                   help="comma-separated engine methods (default none,eagle3,eagle2,medusa)")
    p.add_argument("--question-set", default="humaneval", help="an EAGLE set's name or path (default humaneval)")
    p.add_argument("--num-requests", type=int, default=3)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--eagle-total-tokens", type=int, default=16, help="EAGLE-2/3 tree nodes (default 16)")
    p.add_argument("--eagle-depth", type=int, default=None, help="EAGLE-2/3 drafting depth (default 5)")
    p.add_argument("--eagle-top-k", type=int, default=None, help="EAGLE-2/3 top-k (default 8)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--cuda-graphs", action="store_true", help="the engine's cuda_graph_mode")
    p.add_argument("--torch-profile", action="store_true", help="also one request under torch.profiler")
    p.add_argument("--top", type=int, default=25, help="operators listed by --torch-profile (default 25)")
    p.add_argument("--report-json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("profile_step: torch sees no CUDA GPU (use --device cpu)", file=sys.stderr)
        return 2
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.family / "base"), local_files_only=True)
    path = Path(args.question_set)
    texts = first_turns(read_question_set(path if path.exists() else question_set_path(args.question_set)))
    texts = texts[: args.num_requests]
    prompts = [encode_question(tokenizer, t, "auto") for t in texts]
    engine = build_engine(args, methods, max(len(x) for x in prompts) + args.output_tokens)
    config = {k: portable(v) for k, v in vars(args).items() if k not in ("report_json", "markdown")}
    report = dict(tool="tools/bench/profile_step.py", command=portable(" ".join(sys.argv)),
                  machine=machine_info(args.device), config=config,
                  load_note=portable(getattr(engine.policy, "calibration_note", "")), methods={})
    with PhaseTimer(torch.device(args.device)) as timer:
        for m in methods:
            report["methods"][m] = profile_method(engine, timer, m, prompts, args)
            print(f"{m}: {report['methods'][m]['host']['tokens_per_second']:.1f} tok/s, "
                  f"τ {report['methods'][m]['tau']:.2f}", flush=True)
    text = markdown(report)
    print(text)
    for m in methods:
        for key, table in report["methods"][m].get("torch_profile", {}).items():
            print(f"\n-- {m}: torch.profiler, {key}\n{table}")
    if args.report_json:
        args.report_json.parent.mkdir(parents=True, exist_ok=True)
        args.report_json.write_text(json.dumps(report, separators=(",", ":"), default=str))
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
