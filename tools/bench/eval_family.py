"""The model family's report: what the target answers, and what more training data buys.

Owns two measurements of the SmolLM2 family (`tools/family.py`), written to a JSON and
to the model card's results section (between its `eval_family` markers), never typed by
hand:
- sample answers: the target's greedy answer (chat template, stop at end of turn) to
  the first question of each EAGLE question set, so anyone can read that it works;
- the learning curve: τ (tokens per target forward) of the EAGLE-1 head (as EAGLE-2,
  dynamic tree) and the EAGLE-3 head at each snapshot `train_heads.py --snapshots`
  saved, against the answer tokens trained on, at temperature 0 with adaptive
  speculation off, on the first `--questions` questions of MT-bench and HumanEval
  (first turn, chat template; `--curve-sets` names other sets or question files, such as
  the held-out ones in docs/bench/), batched together. Greedy outputs are checked against
  plain decoding. `--earlier` keeps the points of a previous report whose snapshots are
  gone (an earlier round, trained on another machine) in front of the new ones. The
  last point is the family's own heads or `--heads` (a round's `train_heads.py --out`
  folder); heads from two rounds (the shipped family, once a round shipped one head)
  are refused, since one point cannot stand at two token counts. A point of this run
  says which committed heads it holds ("shipped", or one head's name when a round
  shipped one head and kept the other's earlier one).
The speed of every method, against plain decoding and `transformers`, is
`tools/bench/bench.py`'s job (docs/benchmarks.md).

    python tools/bench/eval_family.py --snapshots .cache/train/round10_work/snapshots \\
        --heads .cache/train/round10 --earlier docs/bench/family.json \\
        --json docs/bench/family.json --model-card checkpoints/smollm2-135m-instruct/MODEL_CARD.md
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "backend_src"))
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import encode_question, machine_info  # noqa: E402
from dataset_converter import first_turns, question_set_path, read_question_set  # noqa: E402
from family import COMMITTED_DIR, FAMILY_DIR  # noqa: E402
from specdec.config import EngineConfig  # noqa: E402
from specdec.engine import Engine  # noqa: E402
from specdec.request import GenerationRequest, SpecParams  # noqa: E402

CARD_BEGIN, CARD_END = "<!-- eval_family:begin -->", "<!-- eval_family:end -->"
SETS = ("humaneval", "mt_bench", "gsm8k", "alpaca")
CURVE_SETS = ("mt_bench", "humaneval")
SET_LABELS = {"mt_bench": "MT-bench", "humaneval": "HumanEval", "gsm8k": "GSM8K", "alpaca": "Alpaca"}


def curve_set(spec: str) -> tuple[str, Path]:
    """(column name, question file) of a `--curve-sets` entry: an EAGLE set's name, or a
    question file in the EAGLE format (named by its stem)."""
    return (Path(spec).stem, Path(spec)) if spec.endswith(".jsonl") else (spec, question_set_path(spec))


def run(engine: Engine, prompts: list[list[int]], new_tokens: int, method: str, end_id: int):
    """Generates for all prompts at once; returns (outputs, tau)."""
    outs = {i: [] for i in range(len(prompts))}
    stats = {}

    def emitter(i):
        def emit(o):
            outs[i].extend(o.token_ids)
            if o.finished:
                stats[i] = o.stats
        return emit

    for i, p in enumerate(prompts):
        engine.submit(GenerationRequest(f"{method}-{i}", p, new_tokens, end_id=end_id,
                                        spec=SpecParams(method=method)), emitter(i))
    while len(stats) < len(prompts):
        engine.step()
    emitted = sum(s.total_accepted_draft_tokens + s.target_forwards for s in stats.values())
    forwards = sum(s.target_forwards for s in stats.values())
    return [outs[i] for i in range(len(prompts))], emitted / max(forwards, 1)


def engine_for(family: Path, eagle: Path, eagle3: Path, batch: int, max_seq_len: int) -> Engine:
    return Engine(EngineConfig(base_model_dir=str(family / "base"), eagle_dir=str(eagle), eagle3_dir=str(eagle3),
                               speculative_method="eagle2", eagle_total_tokens=16, adaptive_speculation=False,
                               max_batch_size=batch, max_seq_len=max_seq_len, max_tokens_limit=512,
                               prompt_lookup_tokens=0))  # the heads' own acceptance, nothing copied from the text


def earlier_points(report: Path) -> list[dict]:
    """A previous report's learning-curve points, none of them the shipped heads any more
    (its shipped point becomes an earlier one: measured then, labelled with its date)."""
    previous = json.loads(report.read_text())
    return [{**row, "final": False, "measured": row.get("measured", previous["date"])}
            for row in previous["learning_curve"]]


def recorded_tokens(head: Path) -> int | None:
    """The answer tokens a head's folder records in its `training.json`, None without one."""
    record = head / "training.json"
    return json.loads(record.read_text()).get("answer_tokens_seen") if record.is_file() else None


def heads_answer_tokens(heads: Path) -> int | None:
    """The answer tokens the EAGLE heads under `heads` (eagle/, eagle3/) were trained on
    (their `training.json`; the assembled family's heads have none, and the committed
    ones stand for them), None where no head records it. Exits where the two heads record
    different counts (the shipped family, once a round shipped one head): one
    learning-curve point cannot stand at both."""
    seen = {}
    for head in ("eagle", "eagle3"):
        tokens = recorded_tokens(heads / head)
        if tokens is None and heads.resolve() == FAMILY_DIR.resolve():
            tokens = recorded_tokens(COMMITTED_DIR / head)
        if tokens is not None:
            seen[head] = tokens
    if len(set(seen.values())) > 1:
        raise SystemExit(f"eval_family: the EAGLE-1 head under {heads} was trained on {seen['eagle']:,} answer "
                         f"tokens and its EAGLE-3 head on {seen['eagle3']:,}; one learning-curve point cannot stand "
                         "at both. "
                         "Pass --heads one round's train_heads.py --out folder (e.g. .cache/train/round10).")
    return next(iter(seen.values()), None)


def learning_curve(family: Path, snapshots: list[Path], prompts: dict, new_tokens: int, end_id: int,
                   max_seq_len: int, final_heads: Path, final_tokens: int | None) -> list[dict]:
    """One row per snapshot (by answer tokens), then `final_heads` (at `final_tokens`): the
    family's heads, or a round's output."""
    points = sorted((int(p.name), p) for folder in snapshots if folder.is_dir()
                    for p in folder.iterdir() if p.name.isdigit())
    points.append((final_tokens, final_heads))
    rows, reference = [], {}
    batch = max(len(p) for p in prompts.values())
    for tokens, where in points:
        engine = engine_for(family, where / "eagle", where / "eagle3", batch, max_seq_len)
        row = {"answer_tokens": tokens, "final": where == final_heads}
        for name, ps in prompts.items():
            if name not in reference:
                reference[name], _ = run(engine, ps, new_tokens, "none", end_id)
            for method in ("eagle2", "eagle3"):
                outs, tau = run(engine, ps, new_tokens, method, end_id)
                row[f"{method}_{name}"] = round(tau, 3)
                row.setdefault("equal_to_plain", True)
                row["equal_to_plain"] &= outs == reference[name]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def shipped_tokens(committed: Path = COMMITTED_DIR) -> dict:
    """The answer tokens each committed head was trained on ({"eagle2": EAGLE-1's head,
    "eagle3": EAGLE-3's}): a round may ship one head and keep the other's earlier round."""
    heads = {"eagle2": "eagle", "eagle3": "eagle3"}
    recorded = {method: recorded_tokens(committed / head) for method, head in heads.items()}
    return {method: tokens for method, tokens in recorded.items() if tokens is not None}


def shipped_label(row: dict, shipped: dict | None) -> str:
    """" (shipped)" where this run's point holds every committed head, " (EAGLE-3's
    shipped)" where only one; points of earlier reports and reports without
    `shipped_tokens` keep their `final` flag."""
    if shipped is None or "measured" in row:
        return " (shipped)" if row["final"] else ""
    heads = [m for m in ("eagle2", "eagle3") if shipped.get(m) == row["answer_tokens"]]
    if not heads:
        return ""
    return " (shipped)" if len(heads) == len(shipped) else f" ({heads[0].replace('eagle', 'EAGLE-')}'s shipped)"


def card_section(report: dict) -> str:
    lines = [CARD_BEGIN, "",
             f"Measured {report['date']} by `{report['command']}` on {report['machine'].get('cpu', 'CPU')} "
             f"(float32). Written by the script; do not edit by hand.", "",
             "### What the target answers", "",
             "Greedy, chat template, the first question of each EAGLE set (first turn), up to "
             f"{report['answer_tokens']} tokens:", ""]
    for item in report["answers"]:
        question = item["question"].strip().replace("\n", " ")
        lines += [f"**{item['set']}**: {question[:300]}{'...' if len(question) > 300 else ''}", "",
                  "> " + item["answer"].strip().replace("\n", "\n> "), ""]
    names = list(dict.fromkeys(key.split("_", 1)[1] for r in report["learning_curve"] for key in r
                               if key.startswith(("eagle2_", "eagle3_"))))
    lines += ["### Learning curve", "",
              f"τ (tokens per target forward, temperature 0, adaptive speculation off, no prompt lookup, "
              f"16-token dynamic tree, "
              f"first {report['questions']} questions, {report['curve_tokens']} new tokens) against the answer "
              f"tokens the heads were trained on (epochs counted):", "",
              "| answer tokens trained | " + " | ".join(f"{m} {SET_LABELS.get(n, n)}" for m in ("EAGLE-2", "EAGLE-3")
                                                  for n in names) + " |",
              "| --- |" + " --- |" * (2 * len(names))]
    for r in report["learning_curve"]:
        label = (f"{r['answer_tokens']:,}" if r["answer_tokens"] is not None else "?") + \
            shipped_label(r, report.get("shipped_tokens")) + \
            (f" (measured {r['measured']})" if "measured" in r else "")
        cells = [f"{r[f'{m}_{n}']:.2f}" if f"{m}_{n}" in r else "-" for m in ("eagle2", "eagle3") for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    equal = all(r["equal_to_plain"] for r in report["learning_curve"])
    lines += ["", f"Every output above equalled plain greedy decoding token for token: {'yes' if equal else 'NO'}.",
              "", CARD_END]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", type=Path, default=FAMILY_DIR)
    ap.add_argument("--snapshots", type=Path, nargs="+", default=[REPO / ".cache" / "train" / "heads" / "snapshots"],
                    help="folders of train_heads.py --snapshots (several: the rounds, one after another)")
    ap.add_argument("--heads", type=Path, help="the last point's eagle/ and eagle3/ heads: a round's "
                    "train_heads.py --out folder (default: the family's own, which must come from one round)")
    ap.add_argument("--questions", type=int, default=6, help="questions per set for the learning curve")
    ap.add_argument("--curve-tokens", type=int, default=64)
    ap.add_argument("--curve-sets", nargs="+", default=list(CURVE_SETS),
                    help="the learning curve's question sets: EAGLE set names or question .jsonl files")
    ap.add_argument("--answer-tokens", type=int, default=128)
    ap.add_argument("--max-seq-len", type=int, default=1024, help="the engine's KV positions per request")
    ap.add_argument("--earlier", type=Path,
                    help="a previous --json whose learning-curve points go first (their snapshots are not here)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--model-card", type=Path)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    final_heads = args.heads or args.family
    final_tokens = heads_answer_tokens(final_heads)  # before any model loads: it may refuse them
    tok = AutoTokenizer.from_pretrained(str(args.family / "base"))
    end_id = tok.eos_token_id
    firsts = {name: first_turns(read_question_set(question_set_path(name))) for name in SETS}
    engine = engine_for(args.family, args.family / "eagle", args.family / "eagle3", len(SETS), args.max_seq_len)
    prompts = [encode_question(tok, firsts[name][0], "on") for name in SETS]
    outs, _ = run(engine, prompts, args.answer_tokens, "none", end_id)
    answers = [{"set": name, "question": firsts[name][0], "answer": tok.decode(o, skip_special_tokens=True)}
               for name, o in zip(SETS, outs)]
    del engine
    curve_prompts = {}
    for spec in args.curve_sets:
        name, path = curve_set(spec)
        questions = firsts[name] if name in firsts else first_turns(read_question_set(path))
        curve_prompts[name] = [encode_question(tok, q, "on") for q in questions[: args.questions]]
    curve = learning_curve(args.family, args.snapshots, curve_prompts, args.curve_tokens, end_id, args.max_seq_len,
                           final_heads, final_tokens)
    if args.earlier:
        curve = earlier_points(args.earlier) + curve
    report = dict(tool="tools/bench/eval_family.py",
                  command=" ".join(["python", "tools/bench/eval_family.py", *(argv if argv is not None else sys.argv[1:])]),
                  date=datetime.date.today().isoformat(), machine=machine_info("cpu"), answer_tokens=args.answer_tokens,
                  questions=args.questions, curve_tokens=args.curve_tokens, answers=answers, learning_curve=curve,
                  shipped_tokens=shipped_tokens())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, separators=(",", ":")) + "\n")
    if args.model_card:
        text = args.model_card.read_text()
        start, end = text.index(CARD_BEGIN), text.index(CARD_END) + len(CARD_END)
        args.model_card.write_text(text[:start] + card_section(report) + text[end:])
    for a in answers:
        print(f"--- {a['set']}: {a['answer'][:200]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
