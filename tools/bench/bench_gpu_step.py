#!/usr/bin/env python3
"""Step times of a Llama-2-7B-shaped target on one GPU, against the memory-bandwidth
bound, and of an EAGLE-2 step (draft + verify) per tree size, with the speedup they
imply at the τ measured on the shipped model family.

Random weights (normal, std 0.02, seeded), batch 1, `--context` tokens already in the
KV cache; the engine's own modules and ops (`LlamaModel`, `EagleDrafter`,
`build_tree`, `verify_greedy`), built from a config dict by
`specdec.models.random_init`. No checkpoint file, no Triton. What is timed (median
over `--iters` calls after `--warmup`; on a GPU synchronised before and after each):

- copy bandwidth: one `--copy-mib` device-to-device copy; bytes read + bytes written
  over its time.
- bandwidth bound: weight bytes (every weight once: the separate q/k/v and gate/up
  modules are views into the fused ones the serving path reads) / copy bandwidth:
  the time a decode step needs just to read the weights once.
- plain step: one token through the target at position `--context` + lm_head + argmax.
- draft: `EagleDrafter.propose` with an EAGLE-1/2 head of the target's shape (one
  decoder layer, fc 2H -> H): a catch-up forward over round(τ) accepted pairs, then
  `depth - 1` forwards over the `top_k` frontier tokens, each through the target's
  lm_head, then the rerank to the tree size: `depth` head forwards in all.
- verify: a random tree of N tokens (parents[i] uniform in [0, i)): `build_tree`, the
  target forward over the N tokens, lm_head, greedy acceptance. The KV compaction of
  the accepted path is not timed.
- with CUDA graphs (`specdec.graphs.DecodeGraphs`, what `cuda_graph_mode` serves
  with): the plain step and the verify forward again, replayed from a graph (the tree
  padded to the next power of two: 60 -> 64 tokens). The draft is not graphed. On CPU
  the same padded static forward runs without capture.
- implied speedup = τ × plain step / (draft + verify), τ = the EAGLE-2 τ of
  `--family-report` (bench.py latency reports) at the total_tokens closest to N (averaged over the sets),
  or `--tau` when given.

Targets: plain step <= 1.3 × the bandwidth bound; EAGLE-2 step (60 tokens) <= 1.6 ×
plain step.

    python tools/bench/bench_gpu_step.py --shape llama2-7b --device cuda --dtype bfloat16 \\
        --iters 50 --report-json docs/bench/gpu_step_7b.json
    OMP_NUM_THREADS=1 python tools/bench/bench_gpu_step.py --shape tiny --device cpu --dtype float32 --iters 2
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "backend_src"))
sys.path.insert(0, str(REPO / "tools"))

from bench import machine_info  # noqa: E402
from specdec.graphs import DecodeGraphs, width_bucket  # noqa: E402
from specdec.kv_cache import AttentionBatch  # noqa: E402
from specdec.models.random_init import random_eagle_head, random_llama  # noqa: E402
from specdec.ops import build_tree, verify_greedy  # noqa: E402
from specdec.drafters.base import TreeSettings  # noqa: E402
from specdec.drafters.eagle import EagleDrafter, EagleState  # noqa: E402

SHAPES = {
    "llama2-7b": dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                      rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
                      tie_word_embeddings=False),
    # CPU smoke runs: every code path of the 7B run (GQA included), a few ms per step.
    "tiny": dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=176,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048,
                 tie_word_embeddings=False),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
PLAIN_LIMIT = 1.3  # plain step / bandwidth bound
EAGLE_LIMIT = 1.6  # EAGLE-2 step (60 tokens) / plain step
EAGLE_LIMIT_TOKENS = 60
DEFAULT_REPORTS = [REPO / "docs" / "bench" / f"latency_{name}.json" for name in ("humaneval", "mt_bench", "gsm8k", "alpaca")]


# ---------------------------------------------------------------- timing


def median_ms(fn: Callable[[], object], iters: int, warmup: int, sync: Callable[[], None],
              setup: Optional[Callable[[], None]] = None) -> float:
    """Median wall time of `fn` in ms; `setup` runs before each call, untimed."""
    times = []
    for i in range(warmup + iters):
        if setup is not None:
            setup()
        sync()
        begin = time.perf_counter()
        fn()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - begin)
    return statistics.median(times) * 1e3


def copy_bandwidth(device: torch.device, mib: int, iters: int, warmup: int, sync) -> dict:
    """One `mib` MiB device-to-device copy; bandwidth counts bytes read + bytes written."""
    n = mib * 2**20
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), iters, warmup, sync)
    return dict(bytes_copied=n, bytes_moved=2 * n, counts="read + write", ms=ms,
                gb_per_s=2 * n / (ms * 1e-3) / 1e9)


# ---------------------------------------------------------------- sizes


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of every weight once: parameters sharing storage (the separate q/k/v and
    gate/up modules are views into the fused ones) count once."""
    storages: dict[int, int] = {}
    for p in module.parameters():
        storage = p.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def kv_read_bytes(config: dict, keys: int, dtype: torch.dtype) -> int:
    """K and V bytes one token's forward reads over `keys` cached positions."""
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_key = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim
    return per_key * keys * torch.empty((), dtype=dtype).element_size()


# ---------------------------------------------------------------- τ of the family


def family_tau(report_paths: list[Path], total_tokens: int) -> Optional[dict]:
    """EAGLE-2's τ in `tools/bench/bench.py` latency reports (`--report-json`, one per
    question set) at the total_tokens closest to `total_tokens` (ties: the smaller),
    averaged over the sets; None when no report has an EAGLE-2 run."""
    by_size: dict[int, dict[str, float]] = {}
    for path in report_paths:
        try:
            runs = json.loads(Path(path).read_text())["runs"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        for run in runs:
            match = re.search(r"total_tokens=(\d+)", str(run.get("tree", "")))
            tau = (run.get("summary") or {}).get("tau")
            if run.get("label") == "eagle2" and match and tau:
                by_size.setdefault(int(match.group(1)), {})[Path(path).stem] = tau
    if not by_size:
        return None
    size = min(by_size, key=lambda n: (abs(n - total_tokens), n))
    sets = by_size[size]
    return dict(tau=sum(sets.values()) / len(sets), total_tokens=size, sets=sets,
                source=", ".join(str(p) for p in report_paths))


# ---------------------------------------------------------------- the benchmark


def random_tree(nodes: int, gen: torch.Generator) -> torch.Tensor:
    """parents [N] int64: parents[0] = -1, parents[i] uniform in [0, i)."""
    parents = (torch.rand(nodes, generator=gen) * torch.arange(nodes)).long()
    parents[0] = -1
    return parents


def run(args: argparse.Namespace, taus: dict) -> dict:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def time_ms(fn, setup=None) -> float:
        return median_ms(fn, args.iters, args.warmup, sync, setup)

    config = SHAPES[args.shape]
    head_config = {**config, "num_hidden_layers": 1}
    copy = copy_bandwidth(device, args.copy_mib, args.iters, args.warmup, sync)

    target = random_llama(config, dtype, device, seed=args.seed)
    head = random_eagle_head(head_config, dtype, device, seed=args.seed + 1)
    weights = dict(target_bytes=weight_bytes(target), head_bytes=weight_bytes(head),
                   target_embedding_bytes=weight_bytes(target.model.embed_tokens),
                   kv_read_bytes_plain_step=kv_read_bytes(config, args.context + 1, dtype))
    bound_ms = weights["target_bytes"] / (copy["gb_per_s"] * 1e9) * 1e3

    gen = torch.Generator().manual_seed(args.seed)
    vocab, max_tree = config["vocab_size"], max(args.trees)
    spare = args.context + width_bucket(max_tree)  # past it: the graphs' spare positions (unused at batch 1)
    cache = target.new_cache(1, spare + width_bucket(max_tree))
    graphs = DecodeGraphs.for_model(target, cache, max_batch=1, spare_start=spare)
    slots = torch.zeros(1, dtype=torch.long, device=device)
    prefix = torch.full((1,), args.context, dtype=torch.long, device=device)

    token = torch.randint(vocab, (1, 1), generator=gen).to(device)  # [1, 1]

    def plain_step():
        batch = AttentionBatch.build(slots, prefix, torch.ones(1, 1, 1, dtype=torch.bool, device=device),
                                     max_prefix=args.context)
        hidden, _ = target(token, prefix[:, None], cache, batch)
        return target.logits(hidden).argmax(-1)

    def plain_graph_step():
        batch = AttentionBatch.build(slots, prefix, torch.ones(1, 1, 1, dtype=torch.bool, device=device),
                                     max_prefix=args.context)
        hidden, _ = graphs.forward(token, prefix[:, None], batch, aux=False)
        return target.logits(hidden).argmax(-1)

    with torch.inference_mode():
        plain_ms = time_ms(plain_step)
        plain_graph_ms = time_ms(plain_graph_step)

        # The drafter's request, as after a verify step: the target has `context` tokens
        # cached, the head has consumed all but the last `pairs` (the accepted path,
        # round(τ) long on average), and the last emitted token roots the tree.
        pairs = min(max(1, round(taus[max_tree]["tau"])), args.context)
        drafter = EagleDrafter(head, target, num_slots=1, max_seq_len=args.context + max_tree)
        tokens = torch.randint(vocab, (args.context + 1,), generator=gen).tolist()
        # The pending pairs' target features (random, like the weights).
        drafter.feats[0, args.context - pairs : args.context] = torch.randn(
            pairs, config["hidden_size"], generator=gen).to(device=device, dtype=dtype)
        request = SimpleNamespace(slot=0, tokens=tokens, draft=None, cached_len=args.context)

        def reset_request():
            request.draft = EagleState(head_len=args.context - pairs)

        trees = []
        for n in args.trees:
            settings = [TreeSettings(method="eagle2", depth=args.depth, top_k=args.top_k, total_tokens=n)]
            draft_ms = time_ms(lambda: drafter.propose([request], settings), setup=reset_request)
            parents = random_tree(n, gen).to(device)[None]  # [1, N]
            cand = torch.randint(vocab, (1, n), generator=gen).to(device)  # [1, N]
            num_nodes = torch.full((1,), n, dtype=torch.long, device=device)

            def verify_step():
                tb = build_tree(parents, num_nodes, prefix)
                batch = AttentionBatch.build(slots, prefix, tb.tree_mask, max_prefix=args.context)
                hidden, _ = target(cand, tb.positions, cache, batch)
                return verify_greedy(cand, parents, num_nodes, target.logits(hidden).argmax(-1))

            width = width_bucket(n)
            parents_w = torch.full((1, width), -1, dtype=torch.long, device=device)  # [1, W] padded as served
            parents_w[:, :n] = parents
            cand_w = torch.zeros(1, width, dtype=torch.long, device=device)
            cand_w[:, :n] = cand

            def verify_graph_step():
                tb = build_tree(parents_w, num_nodes, prefix)
                batch = AttentionBatch.build(slots, prefix, tb.tree_mask, max_prefix=args.context)
                hidden, _ = graphs.forward(cand_w, tb.positions, batch, aux=False)
                return verify_greedy(cand_w, parents_w, num_nodes, target.logits(hidden).argmax(-1))

            verify_ms = time_ms(verify_step)
            verify_graph_ms = time_ms(verify_graph_step)
            step_ms = draft_ms + verify_ms
            step_graph_ms = draft_ms + verify_graph_ms
            tau = taus[n]
            trees.append(dict(total_tokens=n, draft_ms=draft_ms, verify_ms=verify_ms, step_ms=step_ms,
                              step_over_plain=step_ms / plain_ms, tau=tau["tau"],
                              tau_total_tokens=tau["total_tokens"], tau_source=tau["source"],
                              implied_speedup=tau["tau"] * plain_ms / step_ms,
                              graph_width=width, verify_graph_ms=verify_graph_ms, step_graph_ms=step_graph_ms,
                              step_graph_over_plain_graph=step_graph_ms / plain_graph_ms,
                              implied_speedup_graph=tau["tau"] * plain_graph_ms / step_graph_ms))

    # value and met are None when --trees leaves out the 60-token tree.
    at_limit = next((t["step_over_plain"] for t in trees if t["total_tokens"] == EAGLE_LIMIT_TOKENS), None)
    at_limit_g = next((t["step_graph_over_plain_graph"] for t in trees if t["total_tokens"] == EAGLE_LIMIT_TOKENS),
                      None)
    targets = dict(
        plain_over_bound=dict(value=plain_ms / bound_ms, limit=PLAIN_LIMIT,
                              met=plain_ms / bound_ms <= PLAIN_LIMIT),
        eagle2_60_over_plain=dict(value=at_limit, limit=EAGLE_LIMIT,
                                  met=None if at_limit is None else at_limit <= EAGLE_LIMIT),
        plain_graph_over_bound=dict(value=plain_graph_ms / bound_ms, limit=PLAIN_LIMIT,
                                    met=plain_graph_ms / bound_ms <= PLAIN_LIMIT),
        eagle2_60_graph_over_plain_graph=dict(value=at_limit_g, limit=EAGLE_LIMIT,
                                              met=None if at_limit_g is None else at_limit_g <= EAGLE_LIMIT))
    machine = machine_info(str(device))
    report = dict(
        tool="tools/bench/bench_gpu_step.py", command=" ".join(["python", "tools/bench/bench_gpu_step.py", *args.argv]),
        date=machine["date"], device=machine["gpu"] or machine["cpu"], device_type=device.type,
        torch=machine["torch"], python=machine["python"], git_commit=machine["git_commit"],
        torch_threads=machine["torch_threads"],
        shape=args.shape, config=config, head_config=head_config, dtype=args.dtype, batch=1,
        context=args.context, iters=args.iters, warmup=args.warmup, seed=args.seed,
        copy=copy, weights=weights, bandwidth_bound_ms=bound_ms,
        plain=dict(step_ms=plain_ms, over_bound=plain_ms / bound_ms, graph_step_ms=plain_graph_ms,
                   graph_over_bound=plain_graph_ms / bound_ms),
        graphs=dict(captured=graphs.capture, buckets=len(graphs.graphs)),
        eagle2=dict(depth=args.depth, top_k=args.top_k, head_layers=1, catch_up_pairs=pairs, trees=trees),
        targets=targets)
    if device.type == "cuda":
        report["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    return report


# ---------------------------------------------------------------- reporting


def _bytes(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.3f} MB"


def _verdict(target: dict) -> str:
    if target["value"] is None:
        return "not measured"
    return f"{target['value']:.2f}x, limit {target['limit']}x: {'met' if target['met'] else 'NOT met'}"


def format_report(r: dict) -> str:
    c, w, t = r["copy"], r["weights"], r["targets"]
    lines = [
        f"device: {r['device']}  torch {r['torch']}  {r['date']}",
        f"shape {r['shape']} ({r['config']['num_hidden_layers']} layers, hidden {r['config']['hidden_size']}), "
        f"{r['dtype']}, batch 1, context {r['context']}, median of {r['iters']} after {r['warmup']} warm-up",
        f"copy bandwidth: {c['gb_per_s']:.1f} GB/s (bytes read + written; {c['bytes_copied'] / 2**20:.0f} MiB "
        f"device-to-device copy in {c['ms']:.3f} ms)",
        f"target weights: {_bytes(w['target_bytes'])} -> bandwidth bound {r['bandwidth_bound_ms']:.3f} ms "
        f"(KV read at this context: {_bytes(w['kv_read_bytes_plain_step'])}, not in the bound)",
        f"plain decode step: {r['plain']['step_ms']:.3f} ms = {r['plain']['over_bound']:.2f}x the bound; "
        f"from a CUDA graph{'' if r['graphs']['captured'] else ' (emulated: no capture on CPU)'}: "
        f"{r['plain']['graph_step_ms']:.3f} ms = {r['plain']['graph_over_bound']:.2f}x",
        f"EAGLE-2 draft: depth {r['eagle2']['depth']}, top_k {r['eagle2']['top_k']}, 1-layer head "
        f"({_bytes(w['head_bytes'])}), catch-up over {r['eagle2']['catch_up_pairs']} pairs",
        "",
        "| tree tokens | draft ms | verify ms | step ms | step / plain | τ (from) | implied speedup "
        "| graph verify ms (width) | graph step / graph plain | implied speedup, graphs |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in r["eagle2"]["trees"]:
        tau_from = "--tau" if row["tau_total_tokens"] is None else f"family, {row['tau_total_tokens']} tokens"
        lines.append(f"| {row['total_tokens']} | {row['draft_ms']:.3f} | {row['verify_ms']:.3f} | "
                     f"{row['step_ms']:.3f} | {row['step_over_plain']:.2f} | {row['tau']:.2f} ({tau_from}) | "
                     f"{row['implied_speedup']:.2f} | {row['verify_graph_ms']:.3f} ({row['graph_width']}) | "
                     f"{row['step_graph_over_plain_graph']:.2f} | {row['implied_speedup_graph']:.2f} |")
    lines += ["",
              f"target plain step <= {PLAIN_LIMIT}x bandwidth bound: {_verdict(t['plain_over_bound'])}",
              f"target EAGLE-2 step ({EAGLE_LIMIT_TOKENS} tokens) <= {EAGLE_LIMIT}x plain step: "
              f"{_verdict(t['eagle2_60_over_plain'])}",
              f"with CUDA graphs (verify and plain; draft eager): plain {_verdict(t['plain_graph_over_bound'])}; "
              f"EAGLE-2 {EAGLE_LIMIT_TOKENS} tokens {_verdict(t['eagle2_60_graph_over_plain_graph'])}"]
    return "\n".join(lines)


# ---------------------------------------------------------------- command line


def _tree_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 2:
        raise argparse.ArgumentTypeError(f"tree sizes must be >= 2 tokens (root + drafts), got {text!r}")
    return sorted(set(sizes))


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, dict]:
    """Arguments and the τ per tree size; bad arguments exit through `parser.error`."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    p.add_argument("--context", type=int, default=512, help="tokens already in the KV cache (default 512)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per measurement (median; default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before each measurement (default 3)")
    p.add_argument("--trees", type=_tree_sizes, default=[16, 32, 60],
                   help="EAGLE-2 tree sizes, root included (default 16,32,60)")
    p.add_argument("--depth", type=int, default=6, help="EAGLE-2 draft depth (default 6)")
    p.add_argument("--top-k", type=int, default=10, help="EAGLE-2 frontier width (default 10)")
    p.add_argument("--tau", type=float, default=None,
                   help="τ for the implied speedup (default: EAGLE-2's τ in --family-report)")
    p.add_argument("--family-report", type=Path, nargs="+", default=DEFAULT_REPORTS,
                   help="tools/bench/bench.py latency --report-json files to read τ from "
                        "(default docs/bench/latency_*.json)")
    p.add_argument("--copy-mib", type=int, default=None,
                   help="copy size for the bandwidth (default 1024 on cuda, 64 on cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report-json", type=Path, default=None, help="write every number here")
    args = p.parse_args(argv)
    args.argv = list(argv)

    try:
        device = torch.device(args.device)
    except RuntimeError:
        p.error(f"--device {args.device!r} is not a device (cuda, cuda:N or cpu)")
    if device.type not in ("cuda", "cpu"):
        p.error(f"--device {args.device!r}: only cuda and cpu are supported")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            p.error(f"--device {args.device}: torch {torch.__version__} sees no CUDA GPU "
                    f"(for a CPU smoke run: --shape tiny --device cpu --dtype float32)")
        if (device.index or 0) >= torch.cuda.device_count():
            p.error(f"--device {args.device}: only {torch.cuda.device_count()} CUDA device(s) visible")
    for name in ("context", "iters", "depth", "top_k"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    config = SHAPES[args.shape]
    if args.top_k > config["vocab_size"]:
        p.error(f"--top-k {args.top_k} exceeds the vocabulary ({config['vocab_size']})")
    candidates = 1 + args.top_k + (args.depth - 1) * args.top_k ** 2
    if max(args.trees) > candidates:
        p.error(f"--trees {max(args.trees)}: depth {args.depth} x top_k {args.top_k} drafts at most "
                f"{candidates} tokens incl. root")
    if args.context + max(args.trees) > config["max_position_embeddings"]:
        p.error(f"--context {args.context} + a {max(args.trees)}-token tree exceeds the shape's "
                f"max_position_embeddings ({config['max_position_embeddings']})")
    args.copy_mib = args.copy_mib or (1024 if device.type == "cuda" else 64)
    if args.copy_mib < 1:
        p.error(f"--copy-mib must be >= 1, got {args.copy_mib}")
    if args.tau is not None and args.tau < 1:
        p.error(f"--tau must be >= 1 (tokens per target forward), got {args.tau}")

    taus = {}
    for n in args.trees:
        found = None if args.tau is not None else family_tau(args.family_report, n)
        if found is None and args.tau is None:
            p.error(f"no EAGLE-2 τ in {[str(p) for p in args.family_report]}; give one with --tau")
        taus[n] = found or dict(tau=args.tau, total_tokens=None, sets=None, source="--tau")
    return args, taus


def main(argv: Optional[list[str]] = None) -> int:
    args, taus = parse_args(sys.argv[1:] if argv is None else argv)
    report = run(args, taus)
    print(format_report(report))
    if args.report_json is not None:
        args.report_json.parent.mkdir(parents=True, exist_ok=True)
        args.report_json.write_text(json.dumps(report, separators=(",", ":")) + "\n")
        print(f"wrote {args.report_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
