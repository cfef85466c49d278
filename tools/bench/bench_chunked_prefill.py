#!/usr/bin/env python3
"""What chunked prefill buys the running requests when a long prompt arrives.

    OMP_NUM_THREADS=2 python tools/bench/bench_chunked_prefill.py --report-md docs/bench/chunked_prefill.md

One engine on the shipped family (float32), stepped by hand in this process. Per round:
`--running` requests decode (MT-bench first turns in the chat template, `--method`);
after `--warm-steps` steps a request arrives whose prompt is `--long-tokens` tokens
(HumanEval questions joined, in the chat template) and asks for `--long-output` tokens.
The round ends when the long request has finished. Each setting (chunked prefill off;
on with each of `--piece-sizes`; with `--apart` each of them also with mixed prefill off,
the prompt or its pieces prefilled in forwards of their own) runs once per repeat, in
turns, on the same engine (only its prefill settings change between rounds), so the
weights, caches and the machine's state are shared.

Recorded per round: the long request's time to its first token; the running requests'
longest gap between two of their outputs, from their last before the long request's
arrival to their first after its first token (what a streaming client of theirs sees
stall), and their tokens/s from the arrival to that first token; and the tokens/s of
all requests over the whole round. The table shows each setting's median over the
repeats. Every round's tokens are compared with the first setting's (greedy: equal, or
the run stops).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "backend_src"))
sys.path.insert(0, str(REPO / "tools"))

from transformers import AutoTokenizer  # noqa: E402

from bench import encode_question, machine_info  # noqa: E402
from dataset_converter import first_turns, question_set_path, read_question_set  # noqa: E402
from family import FAMILY_DIR  # noqa: E402
from specdec.config import EngineConfig  # noqa: E402
from specdec.engine import Engine  # noqa: E402
from specdec.request import GenerationRequest, SpecParams  # noqa: E402


@dataclasses.dataclass
class Round:
    setting: str
    ttft_s: float  # the long request's time to first token
    max_gap_s: float  # running requests' longest gap between outputs, around the long prompt's prefill
    window_tok_s: float  # running requests' tokens/s over that window
    round_tok_s: float  # all requests' tokens/s from the long one's arrival to its end
    tokens: dict  # request id -> tokens


def _setting_name(piece, mixed: bool = True) -> str:
    return ("off" if piece is None else f"on, {piece} tokens") + ("" if mixed else ", apart")


def run_round(engine: Engine, args, running_prompts: list[list[int]], long_prompt: list[int], piece,
              mixed: bool = True) -> Round:
    engine.config = dataclasses.replace(engine.config, enable_chunked_context=piece is not None,
                                        prefill_chunk_tokens=piece or engine.config.prefill_chunk_tokens)
    engine.mixed_prefill = mixed
    times: dict[str, list[tuple[float, int]]] = {}  # request id -> (when, tokens) of each output
    tokens: dict[str, list[int]] = {}
    done: set[str] = set()

    def emitter(rid):
        times[rid], tokens[rid] = [], []

        def emit(out):
            if out.token_ids:
                times[rid].append((time.perf_counter(), len(out.token_ids)))
                tokens[rid] += out.token_ids
            if out.finished:
                assert out.finish_reason != "error", out.error
                done.add(rid)
        return emit

    spec = SpecParams(method=args.method)
    for i, prompt in enumerate(running_prompts):
        rid = f"running-{i}"
        engine.submit(GenerationRequest(rid, prompt, args.running_output, spec=spec), emitter(rid))
    for _ in range(args.warm_steps):
        engine.step()
    arrival = time.perf_counter()
    engine.submit(GenerationRequest("long", long_prompt, args.long_output, spec=spec), emitter("long"))
    while "long" not in done:
        engine.step()
    end = time.perf_counter()
    first = times["long"][0][0]
    gaps, window_tokens = [], 0
    for rid, outputs in times.items():
        if rid == "long":
            continue
        inside = [(t, n) for t, n in outputs if arrival <= t <= first]
        # From the last output before the arrival to the first after the long one's first token.
        marks = ([t for t, _ in outputs if t < arrival][-1:] + [t for t, _ in inside]
                 + [t for t, _ in outputs if t > first][:1])
        gaps += [b - a for a, b in zip(marks, marks[1:])]
        window_tokens += sum(n for _, n in inside)
        assert rid not in done, f"{rid} ended inside the window: raise --running-output"
    all_tokens = sum(n for outputs in times.values() for t, n in outputs if arrival <= t <= end)
    while engine.num_active:
        engine.step()
    return Round(_setting_name(piece, mixed), first - arrival, max(gaps), window_tokens / (first - arrival),
                 all_tokens / (end - arrival), tokens)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", type=Path, default=FAMILY_DIR)
    p.add_argument("--running", type=int, default=4, help="requests decoding when the long one arrives")
    p.add_argument("--running-output", type=int, default=400)
    p.add_argument("--method", default="none", help="every request's method (none: plain decoding)")
    p.add_argument("--long-tokens", type=int, default=1536)
    p.add_argument("--long-output", type=int, default=8)
    p.add_argument("--warm-steps", type=int, default=8)
    p.add_argument("--piece-sizes", default="128,256,512",
                   help="chunked prefill's prefill_chunk_tokens, comma separated")
    p.add_argument("--apart", action="store_true", help="each setting also with mixed prefill off")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--report-md", type=Path)
    p.add_argument("--report-json", type=Path)
    args = p.parse_args(argv)

    tokenizer = AutoTokenizer.from_pretrained(str(args.family / "base"), local_files_only=True)
    questions = first_turns(read_question_set(question_set_path("mt_bench")))
    running_prompts = [encode_question(tokenizer, q, "auto") for q in questions[: args.running]]
    code = "\n\n".join(first_turns(read_question_set(question_set_path("humaneval"))))
    long_prompt = encode_question(tokenizer, code, "auto")
    assert len(long_prompt) >= args.long_tokens, "the joined questions are shorter than --long-tokens"
    long_prompt = long_prompt[: args.long_tokens]
    f = args.family
    config = EngineConfig(base_model_dir=str(f / "base"), eagle_dir=str(f / "eagle"), eagle3_dir=str(f / "eagle3"),
                          speculative_method=args.method,
                          eagle_total_tokens=16, adaptive_speculation=False, max_batch_size=args.running + 1,
                          max_seq_len=max([args.long_tokens + args.long_output]
                                          + [len(q) + args.running_output for q in running_prompts]) + 16)
    engine = Engine(config)
    settings = [(piece, mixed) for piece in [None] + [int(n) for n in args.piece_sizes.split(",")]
                for mixed in ((True, False) if args.apart else (True,))]
    rounds: list[Round] = []
    for repeat in range(args.repeats):
        for piece, mixed in settings:
            r = run_round(engine, args, running_prompts, long_prompt, piece, mixed)
            if rounds and r.tokens != rounds[0].tokens:
                raise SystemExit(f"{r.setting}: the tokens differ from {rounds[0].setting}'s (greedy)")
            rounds.append(r)
            print(f"#{repeat} {r.setting:>23}: first token of the long prompt {r.ttft_s:.2f} s, running requests' "
                  f"longest gap {r.max_gap_s:.2f} s, {r.window_tok_s:.1f} tok/s in the window, "
                  f"{r.round_tok_s:.1f} tok/s over the round", flush=True)

    names = [_setting_name(*setting) for setting in settings]
    med = {n: {k: statistics.median(getattr(r, k) for r in rounds if r.setting == n)
               for k in ("ttft_s", "max_gap_s", "window_tok_s", "round_tok_s")} for n in names}
    command = "python tools/bench/bench_chunked_prefill.py " + " ".join(sys.argv[1:] if argv is None else argv)
    info = machine_info("cpu")
    lines = [f"Measured {info['date']} on {info['cpu']} ({info['cpu_cores_usable']} cores usable), `{command}`: "
             f"{args.running} requests decoding ({args.method}), then a {args.long_tokens}-token prompt arrives "
             f"asking for {args.long_output} tokens; median of {args.repeats} rounds per setting, in turns. "
             "Every round's tokens equalled the first's.", "",
             "| chunked prefill | long prompt's first token (s) | running requests' longest gap (s) | "
             "their tok/s until it | all tok/s over the round |", "| --- | --- | --- | --- | --- |"]
    for n in names:
        m = med[n]
        lines.append(f"| {n} | {m['ttft_s']:.2f} | {m['max_gap_s']:.2f} | {m['window_tok_s']:.1f} | "
                     f"{m['round_tok_s']:.1f} |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.report_md:
        args.report_md.write_text(report)
    if args.report_json:
        args.report_json.write_text(json.dumps(
            {"machine": info, "command": command, "median": med,
             "rounds": [{k: v for k, v in dataclasses.asdict(r).items() if k != "tokens"} for r in rounds]},
            separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
