"""The model family's report: held-out perplexity and each drafter's acceptance length.

Owns measuring a family directory (`base/`, `draft/`, `eagle/`, `eagle3/`, `medusa/`)
and writing what it measured: `docs/model_family_report.md` (tables, the exact
command, machine and date), a JSON with every number, and optionally the results
section of `checkpoints/MODEL_CARD.md` (between its `eval_family` markers). Nothing
in those files is typed by hand; rerun this script to refresh them. It trains
nothing and reads the corpus only through `tools/train/corpus.py`.

Measured:
- perplexity of base and draft (`transformers` `LlamaForCausalLM`, float32) on the
  held-out stdlib modules (`corpus.HELD_OUT_MODULES`): non-overlapping windows from
  the start of the held-out token stream, computed as training does
  (`train_lm.perplexity`), so the numbers compare with `training.json`;
- τ (mean acceptance length: tokens emitted per target forward, prefill excluded)
  and the acceptance rate of each drafter at temperature 0, with adaptive speculation
  off (every step verifies the full tree), on (a) held-out code: the first
  `--prompt-tokens` tokens (`<s>` + file start) of `--code-prompts` held-out files
  spread evenly over the sorted list, and (b) HumanEval: the first turn of the first
  `--humaneval-prompts` questions with the leading "Complete the code I provided."
  line removed (the family is a code model, not a chat model). Each run generates
  up to `--new-tokens` tokens and stops at `</s>`; its outputs are checked against
  plain greedy decoding.

    python tools/bench/eval_family.py --family checkpoints --model-card checkpoints/MODEL_CARD.md
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "backend_src"))
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO / "tools" / "train"))

import torch  # noqa: E402

from bench import machine_info  # noqa: E402
from corpus import HELD_OUT_MODULES, cached_stream, eval_windows, list_sources, read_text, stdlib_root  # noqa: E402
from dataset_converter import first_turns, question_set_path, read_question_set  # noqa: E402
from specdec.config import EngineConfig  # noqa: E402
from specdec.engine import Engine  # noqa: E402
from specdec.policy import MAX_TREE  # noqa: E402
from specdec.request import AcceptanceStats, GenerationRequest, SamplingParams, SpecParams  # noqa: E402

HUMANEVAL = question_set_path("humaneval")  # $SPECDEC_DATA_DIR, else ../shared/data
INSTRUCTION = "Complete the code I provided."
CARD_BEGIN, CARD_END = "<!-- eval_family:begin -->", "<!-- eval_family:end -->"
MODEL_DIRS = ("base", "draft", "eagle", "eagle3", "medusa")


class EvalError(RuntimeError):
    """A family or input the report cannot be made from."""


@dataclass(frozen=True)
class Drafter:
    name: str  # row label
    method: str  # engine method
    spec: SpecParams

    def tree(self, engine: Engine) -> str:
        st = engine.policy.resolve(GenerationRequest("describe", [1], 1, spec=self.spec))
        if self.method in ("eagle", "medusa"):
            return f"static `{self.spec.choices}` ({st.choices.num_nodes} nodes incl. root)"
        if self.method == "draft_model":
            return f"chain of {st.num_draft_tokens} draft tokens"
        return f"dynamic: depth {st.depth}, top_k {st.top_k}, total_tokens {st.total_tokens} (incl. root)"


def drafters(args: argparse.Namespace) -> list[Drafter]:
    dyn = dict(depth=args.eagle_depth, top_k=args.eagle_top_k, total_tokens=args.eagle_total_tokens)
    return [
        Drafter("eagle (EAGLE-1)", "eagle", SpecParams(method="eagle", choices="eagle_default_25")),
        Drafter("eagle2 (EAGLE-2)", "eagle2", SpecParams(method="eagle2", **dyn)),
        Drafter("eagle3 (EAGLE-3)", "eagle3", SpecParams(method="eagle3", **dyn)),
        Drafter("medusa", "medusa", SpecParams(method="medusa", choices="mc_sim_7b_63")),
        Drafter("draft_model", "draft_model", SpecParams(method="draft_model", num_draft_tokens=4)),
    ]


# ---------------------------------------------------------------- prompts


def code_prompts(tokenizer, n: int, prompt_tokens: int) -> tuple[list[list[int]], list[str]]:
    """`<s>` + the first tokens of `n` held-out files spread evenly over the sorted list
    (files too short for a full prompt are skipped)."""
    _, heldout = list_sources()
    if n <= 0:
        return [], []
    root = stdlib_root()
    prompts, names = [], []  # names relative to the stdlib (no machine paths in the report)
    step = max(1, len(heldout) // n)
    for path in heldout[::step] + heldout:  # the spread first, then any file to fill up
        if len(prompts) == n:
            break
        name = path.relative_to(root).as_posix()
        if name in names:
            continue
        # A prefix of the text is enough: tokens far from the cut do not depend on it.
        ids = tokenizer.encode(read_text(path)[: 16 * prompt_tokens], add_special_tokens=False)
        if len(ids) < prompt_tokens:
            continue
        prompts.append([tokenizer.bos_token_id] + ids[: prompt_tokens - 1])
        names.append(name)
    return prompts, names


def humaneval_prompts(tokenizer, path: Path, n: int) -> list[list[int]]:
    out = []
    for text in first_turns(read_question_set(path))[:n]:
        if text.startswith(INSTRUCTION):
            text = text[len(INSTRUCTION):].lstrip("\n")
        out.append(tokenizer.encode(text))
    return out


# ---------------------------------------------------------------- measurements


def parameter_count(directory: Path) -> Optional[int]:
    """Parameters stored in the directory's safetensors files (shapes only, no loading)."""
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                total += math.prod(st.get_slice(key).get_shape())
    return total


def perplexities(family: Path, tokenizer, args: argparse.Namespace) -> dict:
    from train_lm import perplexity
    from transformers import LlamaForCausalLM

    _, heldout = list_sources()
    stream = cached_stream(tokenizer, heldout, args.cache, "heldout")
    windows = eval_windows(stream, args.seq_len, args.ppl_windows)
    out = dict(heldout_files=len(heldout), heldout_tokens=int(len(stream)), windows=int(len(windows)),
               seq_len=args.seq_len, models={})
    for name in ("base", "draft"):
        model = LlamaForCausalLM.from_pretrained(str(family / name), dtype=torch.float32)
        with torch.inference_mode():
            out["models"][name] = perplexity(model, windows)
    return out


def run_set(engine: Engine, prompts: list[list[int]], new_tokens: int, spec: SpecParams,
            end_id: int) -> tuple[dict[int, list[int]], AcceptanceStats]:
    """All prompts at once (in-flight batching); outputs per prompt and summed counters."""
    outs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    stats: dict[int, AcceptanceStats] = {}
    done: set[int] = set()
    errors: list[str] = []

    def emitter(i: int):
        def emit(o):
            outs[i].extend(o.token_ids)
            if o.finished:
                if o.finish_reason == "error":
                    errors.append(f"prompt {i}: {o.error}")
                stats[i] = o.stats or AcceptanceStats()
                done.add(i)
        return emit

    for i, ids in enumerate(prompts):
        engine.submit(GenerationRequest(request_id=f"{spec.method}-{i}", input_ids=ids, max_tokens=new_tokens,
                                        end_id=end_id, sampling=SamplingParams(), spec=spec), emitter(i))
    while len(done) < len(prompts):
        engine.step()
    if errors:
        raise EvalError(f"{spec.method}: " + "; ".join(errors))
    total = AcceptanceStats()
    for st in stats.values():
        total.total_draft_tokens += st.total_draft_tokens
        total.total_accepted_draft_tokens += st.total_accepted_draft_tokens
        total.target_forwards += st.target_forwards
        total.emitted_tokens += st.emitted_tokens
    return outs, total


def acceptance(family: Path, tokenizer, sets: dict[str, list[list[int]]], args: argparse.Namespace) -> dict:
    longest = max((len(p) for ps in sets.values() for p in ps), default=1) + args.new_tokens
    engine = Engine(EngineConfig(
        base_model_dir=str(family / "base"), eagle_dir=str(family / "eagle"), eagle3_dir=str(family / "eagle3"),
        medusa_dir=str(family / "medusa"), draft_model_dir=str(family / "draft"), device=args.device,
        dtype=args.dtype, max_batch_size=args.max_batch_size, max_seq_len=longest + MAX_TREE,
        max_tokens_limit=args.new_tokens, max_queue_size=max(64, *(len(p) for p in sets.values())),
        eagle_total_tokens=args.eagle_total_tokens, adaptive_speculation=False,
    ))
    end_id = tokenizer.eos_token_id
    rows = []
    plain = {name: run_set(engine, ps, args.new_tokens, SpecParams(method="none"), end_id)[0]
             for name, ps in sets.items() if ps}
    for d in drafters(args):
        row = dict(drafter=d.name, method=d.method, tree=d.tree(engine), sets={})
        for name, ps in sets.items():
            if not ps:
                continue
            t0 = time.perf_counter()
            outs, st = run_set(engine, ps, args.new_tokens, d.spec, end_id)
            row["sets"][name] = dict(
                tau=st.tau, acceptance_rate=st.acceptance_rate, target_forwards=st.target_forwards,
                emitted_tokens=st.emitted_tokens, draft_tokens=st.total_draft_tokens,
                accepted_tokens=st.total_accepted_draft_tokens, seconds=time.perf_counter() - t0,
                same_as_plain=sum(outs[i] == plain[name][i] for i in outs), prompts=len(ps))
        rows.append(row)
    return dict(rows=rows, dtype=args.dtype, device=args.device, new_tokens=args.new_tokens)


# ---------------------------------------------------------------- report


def models_table(family: Path) -> list[dict]:
    rows = []
    for name in MODEL_DIRS:
        d = family / name
        cfg = json.loads((d / "config.json").read_text()) if (d / "config.json").is_file() else {}
        train = json.loads((d / "training.json").read_text()) if (d / "training.json").is_file() else {}
        if "medusa_num_heads" in cfg:
            arch = "Medusa heads"
            layers = f"{cfg['medusa_num_heads']} heads x {cfg.get('medusa_num_layers', 1)} layer"
        else:
            arch = (cfg.get("architectures") or ["?"])[0]
            layers = cfg.get("num_hidden_layers")
        rows.append(dict(name=name, architecture=arch, layers=layers, hidden_size=cfg.get("hidden_size"),
                         parameters=parameter_count(d), training=train))
    return rows


def _num(v, fmt: str = "{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


def results_markdown(report: dict) -> str:
    """The measured tables (shared by the report and the model card)."""
    ppl = report["perplexity"]
    lines = [f"Held-out perplexity ({ppl['windows']} windows of {ppl['seq_len']} tokens from "
             f"{ppl['heldout_files']} held-out files, {ppl['heldout_tokens']} tokens; float32):", "",
             "| model | held-out perplexity |", "| --- | --- |"]
    lines += [f"| {k} | {v:.3f} |" for k, v in ppl["models"].items()]
    acc = report["acceptance"]
    sets = [s for s in ("heldout_code", "humaneval") if any(s in r["sets"] for r in acc["rows"])]
    titles = {"heldout_code": "held-out code", "humaneval": "HumanEval"}
    lines += ["", f"Mean acceptance length τ at temperature 0 (engine {acc['dtype']} on {acc['device']}, "
                  f"adaptive speculation off, up to {acc['new_tokens']} new tokens):", ""]
    head = "| drafter | tree |" + "".join(f" τ {titles[s]} | acc. rate {titles[s]} | same as plain {titles[s]} |"
                                         for s in sets)
    lines += [head, "|" + " --- |" * (2 + 3 * len(sets))]
    for r in acc["rows"]:
        cells = "".join(f" {_num(r['sets'][s]['tau'], '{:.2f}')} | {_num(r['sets'][s]['acceptance_rate'])} | "
                        f"{r['sets'][s]['same_as_plain']}/{r['sets'][s]['prompts']} |" for s in sets)
        lines.append(f"| {r['drafter']} | {r['tree']} |{cells}")
    return "\n".join(lines) + "\n"


def report_markdown(report: dict) -> str:
    m = report["machine"]
    gpu = f"; GPU {m['gpu']}" if m.get("gpu") else ""
    lines = [
        "# Model family report", "",
        "Generated by `tools/bench/eval_family.py`; do not edit by hand, rerun the command below.", "",
        f"- Command: `{report['command']}`",
        f"- Family: `{report['family']}`",
        f"- Machine: {m['cpu']} ({m['cpu_cores_usable']} usable cores, {m['torch_threads']} torch threads){gpu}",
        f"- Software: python {m['python']}, torch {m['torch']}, transformers {m['transformers']}, "
        f"commit {m['git_commit']}",
        f"- Date: {m['date']}", "",
        "## Models", "",
        "Parameters are those stored in each directory (the heads reuse the base model's embeddings "
        "and lm_head where their upstream layouts do).", "",
        "| model | architecture | layers / heads | hidden | parameters | training steps |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["models"]:
        params = "-" if r["parameters"] is None else f"{r['parameters'] / 1e6:.2f} M"
        lines.append(f"| {r['name']} | {r['architecture']} | {r['layers']} | {r['hidden_size']} | {params} | "
                     f"{r['training'].get('steps', '-')} |")
    lines += ["", "## Results", "", results_markdown(report).rstrip(), "",
              "## Prompts", "",
              f"- held-out code: the first {report['prompts']['prompt_tokens']} tokens (`<s>` + file start) of "
              f"{len(report['prompts']['heldout_files'])} files of the held-out modules "
              f"({', '.join(HELD_OUT_MODULES)}):",
              *[f"  - `{Path(p).name}`" for p in report["prompts"]["heldout_files"]],
              f"- HumanEval: the first turn of the first {report['prompts']['humaneval']} questions of "
              f"`{report['prompts']['humaneval_file']}`, the line \"{INSTRUCTION}\" removed.",
              "", "Definitions: τ = tokens emitted per target forward (accepted draft tokens + the bonus token; "
              "prefill not counted); acceptance rate = accepted / drafted tokens; \"same as plain\" counts "
              "prompts whose output equals plain greedy decoding token for token.", ""]
    return "\n".join(lines)


def update_card(path: Path, report: dict) -> None:
    text = path.read_text()
    if CARD_BEGIN not in text or CARD_END not in text:
        raise EvalError(f"{path}: no {CARD_BEGIN} ... {CARD_END} section to fill")
    body = (f"Measured by `{report['command']}` on {report['machine']['date']} "
            f"({report['machine']['cpu']}); details in `docs/model_family_report.md`.\n\n"
            + results_markdown(report))
    new = re.sub(re.escape(CARD_BEGIN) + ".*?" + re.escape(CARD_END), lambda _: f"{CARD_BEGIN}\n{body}{CARD_END}",
                 text, flags=re.S)
    path.write_text(new)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", type=Path, default=REPO / "checkpoints")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "model_family_report.md")
    ap.add_argument("--json", type=Path, default=REPO / "docs" / "model_family_report.json")
    ap.add_argument("--model-card", type=Path,
                    help="fill this card's eval_family section (e.g. checkpoints/MODEL_CARD.md)")
    ap.add_argument("--cache", type=Path, default=REPO / ".cache" / "train", help="token stream cache (training's)")
    ap.add_argument("--seq-len", type=int, default=512, help="perplexity window (training's: 512)")
    ap.add_argument("--ppl-windows", type=int, default=32, help="perplexity windows (training's: 32)")
    ap.add_argument("--code-prompts", type=int, default=20, help="held-out files used as prompts")
    ap.add_argument("--humaneval-prompts", type=int, default=20)
    ap.add_argument("--humaneval-file", type=Path, default=HUMANEVAL)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--eagle-depth", type=int, default=5)
    ap.add_argument("--eagle-top-k", type=int, default=8)
    ap.add_argument("--eagle-total-tokens", type=int, default=16)
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    family = args.family
    try:
        for name in MODEL_DIRS:
            if not (family / name / "config.json").is_file():
                raise EvalError(f"--family {family}: no {name}/config.json")
        for name in ("prompt_tokens", "new_tokens", "seq_len", "ppl_windows", "eagle_total_tokens"):
            if getattr(args, name) < 1:
                raise EvalError(f"--{name.replace('_', '-')} must be >= 1")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(family / "base"), local_files_only=True)
        code, code_files = code_prompts(tokenizer, args.code_prompts, args.prompt_tokens)
        humaneval = humaneval_prompts(tokenizer, args.humaneval_file, args.humaneval_prompts)
        if not code and not humaneval:
            raise EvalError("no prompts: give --code-prompts or --humaneval-prompts > 0")
        report = dict(
            tool="tools/bench/eval_family.py", command=" ".join(["python tools/bench/eval_family.py"] + argv),
            family=str(family), machine=machine_info(args.device), models=models_table(family),
            perplexity=perplexities(family, tokenizer, args),
            acceptance=acceptance(family, tokenizer, {"heldout_code": code, "humaneval": humaneval}, args),
            prompts=dict(prompt_tokens=args.prompt_tokens, heldout_files=code_files,
                         humaneval=len(humaneval), humaneval_file=str(args.humaneval_file)),
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report_markdown(report))
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        if args.model_card:
            update_card(args.model_card, report)
    except EvalError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(results_markdown(report))
    print(f"wrote {args.out} and {args.json}" + (f" and {args.model_card}" if args.model_card else ""),
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
