#!/usr/bin/env python3
"""The load-time calibration's drafting calls one by one, on the served configuration.

    python tools/bench/calibration_timeline.py --device cuda --dtype bfloat16 \\
        --report-json docs/bench/gpu_calibration_timeline.json

Why: on an H200 (docs/benchmarks.md 3.7) the calibration priced EAGLE-2's drafting at
57.6-206 ms a call and EAGLE-1's at 268 ms, 5-20x what an eager EAGLE-2 call took in
the step profile (3.5), while EAGLE-3's, timed after them, were in line. The medians
it logs cannot say whether every call was slow, or only the early ones, or why.

What it does: builds the engine as the served default is built (every drafter of the
family, adaptive speculation, EAGLE-2/3 trees of 16 nodes, batch 1, no calibration
cache, so the calibration runs), recording every drafting call of the calibration:
when it ran (seconds since the engine began loading), its method, tree size and batch,
its host time (what the policy learns), the time a `torch.cuda.synchronize()` then
waited (device work still queued when the call returned), and the CUDA allocator's
cudaMalloc calls and retries during the call. Then it calibrates `--repeats` more
times on the loaded engine: if those calls are fast, the first calibration paid a
process's first-use costs. Last, one EAGLE-2 generation as calibration runs it, under
`torch.profiler`: the operators with the most host time.

On the H200, before the engine took cuDNN out of its attention
(`attention_without_per_shape_plans`), the first calibration's EAGLE-1/2 drafting calls
took 45-210 ms in steps of ~50 ms and the repeat's 2-9 ms; the profile showed
`_cudnn_attention_forward` (docs/bench/gpu_calibration_timeline.json).
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "backend_src"))
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench import DRAFTER_DIRS, drafter_dirs, machine_info, portable  # noqa: E402
from family import FAMILY_DIR  # noqa: E402
from specdec.config import EngineConfig  # noqa: E402
from specdec.engine import Engine  # noqa: E402
from specdec.policy import MAX_TREE, SpeculationPolicy, _run_together  # noqa: E402
from specdec.request import GenerationRequest, SpecParams  # noqa: E402


class DraftCallRecorder:
    """Wraps SpeculationPolicy.record_draft_time: while the policy calibrates, appends
    one row per drafting call to `calls` (the repeat it belongs to is `repeat`)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.repeat = 0
        self.t0 = time.perf_counter()
        self.calls: list[dict] = []
        self._mallocs = self._retries = 0
        self._original = SpeculationPolicy.record_draft_time
        recorder = self

        def record(policy, settings, seconds, states):
            if policy._recording is not None:
                recorder.add(policy, settings, seconds, len(states))
            recorder._original(policy, settings, seconds, states)
            recorder._mark_allocator()
        SpeculationPolicy.record_draft_time = record
        self._mark_allocator()

    def close(self) -> None:
        SpeculationPolicy.record_draft_time = self._original

    def _allocator(self) -> tuple[int, int]:
        if not self.cuda:
            return 0, 0
        stats = torch.cuda.memory_stats()
        return stats.get("segment.all.allocated", 0), stats.get("num_alloc_retries", 0)

    def _mark_allocator(self) -> None:
        self._mallocs, self._retries = self._allocator()

    def add(self, policy, settings, seconds: float, batch: int) -> None:
        mallocs, retries = self._allocator()  # before the sync: the call's own allocations
        t = time.perf_counter()
        if self.cuda:
            torch.cuda.synchronize()
        waited = time.perf_counter() - t
        nodes = policy.draft_nodes(settings, policy.full_nodes(settings))
        self.calls.append(dict(repeat=self.repeat, at_s=round(t - self.t0, 3), method=settings.method,
                               nodes=nodes, batch=batch, host_ms=round(seconds * 1e3, 3),
                               sync_wait_ms=round(waited * 1e3, 3), cuda_mallocs=mallocs - self._mallocs,
                               alloc_retries=retries - self._retries))


def summary(calls: list[dict], repeat: int) -> list[str]:
    """One line per (method, nodes, batch) of a repeat: the calls' host ms in order."""
    groups: dict[tuple, list[dict]] = collections.defaultdict(list)
    for c in calls:
        if c["repeat"] == repeat:
            groups[(c["method"], c["nodes"], c["batch"])].append(c)
    lines = []
    for (method, nodes, batch), rows in groups.items():
        host = [r["host_ms"] for r in rows]
        later = sorted(host[1:]) or host
        lines.append(f"  {method}/{nodes} B{batch} from {rows[0]['at_s']:.1f} s: median {later[len(later) // 2]:.1f} ms"
                     f" (first dropped), sync waits <= {max(r['sync_wait_ms'] for r in rows):.1f} ms, "
                     f"cudaMallocs {sum(r['cuda_mallocs'] for r in rows)}; host ms "
                     + " ".join(f"{h:.1f}" for h in host))
    return lines


def profile_eagle2(engine: Engine, top: int) -> Optional[str]:
    """One 16-node EAGLE-2 generation as calibration runs it (fixed tree), profiled."""
    if "eagle2" not in engine.policy.available:
        return None
    from torch.profiler import ProfilerActivity, profile

    prompt = engine.policy._measuring_prompt(engine, 32, 16)
    req = GenerationRequest("profile-eagle2", prompt, 32, spec=SpecParams(method="eagle2", total_tokens=16))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    engine.policy._recording = []  # calibration's mode: the plan keeps the fixed tree
    try:
        with profile(activities=activities) as prof:
            _run_together(engine, [req])
    finally:
        engine.policy._recording = None
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", type=Path, default=FAMILY_DIR)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--methods", default="eagle,eagle2,eagle3,medusa",
                   help="drafters loaded (default eagle,eagle2,eagle3,medusa: the served family's)")
    p.add_argument("--repeats", type=int, default=1, help="calibrations after the load's (default 1)")
    p.add_argument("--top", type=int, default=20, help="operators listed from the profiled generation")
    p.add_argument("--no-profile", action="store_true", help="skip the profiled EAGLE-2 generation")
    p.add_argument("--report-json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("calibration_timeline: torch sees no CUDA GPU (use --device cpu)", file=sys.stderr)
        return 2
    methods = [m.strip() for m in args.methods.split(",") if m.strip() in DRAFTER_DIRS]
    recorder = DraftCallRecorder(cuda=args.device.startswith("cuda"))
    try:
        engine = Engine(EngineConfig(
            base_model_dir=str(args.family / "base"), device=args.device, dtype=args.dtype, max_batch_size=1,
            max_seq_len=256 + MAX_TREE, max_tokens_limit=128, max_queue_size=8, eagle_total_tokens=16,
            adaptive_speculation=True, calibration_cache_dir="off", **drafter_dirs(args.family, methods)))
        notes = [engine.policy.cost.describe()]
        print(f"load: {engine.policy.calibration_note}; cuDNN attention "
              f"{'on' if torch.backends.cuda.cudnn_sdp_enabled() else 'off'}\n  {notes[0]}")
        print("\n".join(summary(recorder.calls, 0)), flush=True)
        for repeat in range(1, args.repeats + 1):
            recorder.repeat = repeat
            engine.policy.calibrate(engine)
            notes.append(engine.policy.cost.describe())
            print(f"repeat {repeat}: {engine.policy.calibration_note}\n  {notes[-1]}")
            print("\n".join(summary(recorder.calls, repeat)), flush=True)
    finally:
        recorder.close()
    table = None if args.no_profile else profile_eagle2(engine, args.top)
    if table:
        print("one 16-node EAGLE-2 generation (32 tokens) under torch.profiler, by host time:\n" + table)
    if args.report_json:
        report = dict(tool="tools/bench/calibration_timeline.py", command=portable(" ".join(sys.argv)),
                      machine=machine_info(args.device), config={k: portable(v) for k, v in vars(args).items()},
                      cudnn_attention=torch.backends.cuda.cudnn_sdp_enabled(), costs=notes, calls=recorder.calls,
                      eagle2_profile=table)
        args.report_json.parent.mkdir(parents=True, exist_ok=True)
        args.report_json.write_text(json.dumps(report, separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
