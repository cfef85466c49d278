"""Self-distilled chat data: conversations the target model writes itself.

The drafters learn to predict the target, so their training text should be what the
target says (EAGLE-3, HASS and Medusa-2 train this way). Two kinds of conversation:
- `magpie` (Magpie, Xu et al. 2024): the chat template up to the user's turn is the
  whole prompt; the model, sampling, writes a user request; then it answers that
  request greedily, in the chat template.
- `code`: a user request built from a function in this interpreter's standard library
  (its signature and docstring): write it, complete it or explain it. The model answers
  greedily.
- `steered` (`--steered`): as `magpie`, but the user's turn starts with an opener of
  `OPENERS` that the model goes on from. Unsteered, this model writes short, simple
  requests; chat users also ask for essays, role-play, reasoning, sums, extraction and
  comparisons, which its answers to must be learned too.
Answers are greedy because the benchmarks and the lossless tests decode greedily: the
drafters should learn the target's argmax continuations.

Generation runs on this repository's engine (in-flight batching, plain decoding). Each
conversation `i` has its own seed (`--seed` + i) and kind (every `--code-every`-th is
`code`); the output file is JSONL, one finished conversation a line, and a rerun skips
the conversations it already holds (resumable, e.g. `nohup ... &`). A later round's
conversations (`--first N`) go to a file of their own, so that the earlier rounds'
file stays what their heads saw. Training orders conversations by index, and these
indexes lie below the local sources' (1,000,000 and up): `tools/train/features.py` then
copies the cached rows of every earlier conversation (found by content) and computes
only the new ones. Never reads the
EAGLE question sets; `tools/data/overlap.py` checks the result against them.

    python tools/data/self_distill.py --model .cache/models/smollm2-135m-instruct \
        --out .cache/data/self_distill.jsonl --conversations 2000 --batch-size 96
"""
from __future__ import annotations

import argparse
import ast
import json
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "backend_src"))

from specdec.config import EngineConfig  # noqa: E402
from specdec.engine import Engine  # noqa: E402
from specdec.request import GenerationRequest, SamplingParams, StepOutput  # noqa: E402

USER_TURN_TOKENS = 96
USER_TEMPERATURE = 0.8
CODE_TEMPLATES = (
    "Write a Python function `{name}{args}` that does the following: {doc}",
    "Complete the following Python function.\n\n```python\ndef {name}{args}:\n    \"\"\"{doc}\"\"\"\n```",
    "Explain what this Python function does and how to use it.\n\n```python\n{source}\n```",
)
SENTINEL = "\x00USER\x00"
# The starts of user requests that `steered` conversations go on from: kinds of request
# chat users send, written here (never taken from the EAGLE question sets).
OPENERS = (
    "Write a short story about", "Write a persuasive essay", "Write a poem about", "Draft a professional email to",
    "Compose a blog post about", "Write a product description for", "Write a speech", "Write a letter",
    "Imagine you are", "Pretend to be", "Act as a", "You are a", "Role-play a conversation between",
    "Explain to a beginner how", "Explain the difference between", "What are the main causes of",
    "What are the advantages and disadvantages of", "Compare and contrast", "Describe the process of",
    "Summarize the following text:", "Extract the", "Given the following", "Rewrite the following",
    "Solve the following problem:", "A store sells", "Calculate", "How many", "Suppose that",
    "Think step by step", "Write a Python program that", "Write a function that", "How do I",
    "What is the best way to", "Give me a plan for", "Suggest five", "List ten", "Create a", "Design a",
    "Discuss the impact of", "Analyze the", "Why do", "How does", "What would happen if", "Help me",
    "Can you", "I am", "I need", "Evaluate the following",
)


@dataclass
class Conversation:
    index: int
    kind: str
    user: str = ""
    prompt_ids: list | None = None  # the answer's prompt: template + user turn + assistant prefix
    answer_ids: list | None = None


def stdlib_functions(limit_source_lines: int = 30) -> list[dict]:
    """Public functions with a docstring from the running interpreter's standard library,
    sorted by module and name (deterministic on one Python version)."""
    return documented_functions(sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")), limit_source_lines)


def documented_functions(paths: list[Path], limit_source_lines: int = 30) -> list[dict]:
    """The module-level public functions of `paths` (in their order) with a docstring of
    40 characters or more and at most `limit_source_lines` lines: name, args, the
    docstring's first paragraph on one line, source."""
    found = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError):
            continue
        lines = text.splitlines()
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 40:
                continue
            source = "\n".join(lines[node.lineno - 1: node.end_lineno])
            if node.end_lineno - node.lineno + 1 > limit_source_lines:
                continue
            found.append({"name": node.name, "args": "(" + ast.unparse(node.args) + ")",
                          "doc": doc.split("\n\n")[0].replace("\n", " "), "source": source})
    return found


def code_request(rng: random.Random, functions: list[dict]) -> str:
    fn = functions[rng.randrange(len(functions))]
    return rng.choice(CODE_TEMPLATES).format(**fn)


def template_parts(tokenizer) -> tuple[list[int], callable]:
    """(the Magpie prompt: template ids up to the user's text, a function user -> answer prompt ids)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False,
                                         add_generation_prompt=True)
    prefix = text[: text.index(SENTINEL)]

    def answer_prompt(user: str) -> list[int]:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=True,
                                                  add_generation_prompt=True, return_dict=False))

    return tokenizer.encode(prefix, add_special_tokens=False), answer_prompt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--conversations", type=int, default=2000, help="writes conversations FIRST .. this - 1")
    ap.add_argument("--first", type=int, default=0,
                    help="the first conversation's index (a later round's conversations, in a file of their own)")
    ap.add_argument("--batch-size", type=int, default=96)
    ap.add_argument("--max-answer-tokens", type=int, default=320)
    ap.add_argument("--code-every", type=int, default=4, help="every N-th conversation is a code request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steered", action="store_true",
                    help="every conversation that is not code starts its user turn with an opener (OPENERS)")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    end_id = tokenizer.eos_token_id
    magpie_prompt, answer_prompt = template_parts(tokenizer)
    functions = stdlib_functions()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if args.out.is_file():
        for line in args.out.read_text().splitlines():
            if line.strip():
                done.add(json.loads(line)["index"])
    todo = [i for i in range(args.first, args.conversations) if i not in done]
    print(f"{len(done)} conversations already in {args.out}; {len(todo)} to write", flush=True)
    if not todo:
        return 0

    max_seq = 1 + max(USER_TURN_TOKENS, 512) + args.max_answer_tokens + 64
    engine = Engine(EngineConfig(base_model_dir=str(args.model), max_batch_size=args.batch_size,
                                 max_seq_len=max_seq + 256, max_tokens_limit=max(args.max_answer_tokens, USER_TURN_TOKENS),
                                 max_queue_size=4 * args.batch_size, seed=args.seed))
    sink = args.out.open("a")
    pending: dict[str, Conversation] = {}
    outputs: dict[str, list[int]] = {}
    finished: list[tuple[str, StepOutput]] = []
    queue = list(reversed(todo))
    t0, tokens, written = time.time(), 0, 0

    def emit(out: StepOutput) -> None:
        outputs.setdefault(out.request_id, []).extend(out.token_ids)
        if out.finished:
            finished.append((out.request_id, out))

    def skip(conv: Conversation, why: str) -> None:
        # recorded, so that a resumed run does not generate it again
        sink.write(json.dumps({"index": conv.index, "kind": conv.kind, "skipped": why}) + "\n")

    def submit_answer(conv: Conversation) -> None:
        conv.prompt_ids = answer_prompt(conv.user)
        if len(conv.prompt_ids) > max_seq - args.max_answer_tokens:
            skip(conv, "prompt too long")
            return
        rid = f"{conv.index}/answer"
        pending[rid] = conv
        engine.submit(GenerationRequest(rid, conv.prompt_ids, args.max_answer_tokens, end_id=end_id), emit)

    def start(index: int) -> None:
        rng = random.Random(args.seed * 1_000_003 + index)
        code = args.code_every > 0 and index % args.code_every == args.code_every - 1
        conv = Conversation(index, "code" if code else "steered" if args.steered else "magpie")
        if code:
            conv.user = code_request(rng, functions)
            submit_answer(conv)
            return
        prompt = list(magpie_prompt)
        if args.steered:
            conv.user = rng.choice(OPENERS)  # the model's user turn goes on from it
            prompt += tokenizer.encode(conv.user, add_special_tokens=False)
        rid = f"{index}/user"
        pending[rid] = conv
        engine.submit(GenerationRequest(rid, prompt, USER_TURN_TOKENS, end_id=end_id,
                                        sampling=SamplingParams(temperature=USER_TEMPERATURE,
                                                                seed=args.seed * 1_000_003 + index)), emit)

    while queue or pending:
        while queue and len(pending) < 2 * args.batch_size:
            start(queue.pop())
        engine.step()
        for rid, out in finished:
            conv = pending.pop(rid)
            ids = outputs.pop(rid)
            tokens += len(ids)
            if rid.endswith("/user"):
                user = (conv.user + tokenizer.decode(ids, skip_special_tokens=True)).strip()
                if out.finish_reason == "end_id" and len(user) >= 12:  # a whole, non-trivial request
                    conv.user = user
                    submit_answer(conv)
                else:
                    skip(conv, f"user turn {out.finish_reason}")
                continue
            conv.answer_ids = ids
            record = {"index": conv.index, "kind": conv.kind, "user": conv.user,
                      "answer": tokenizer.decode(ids, skip_special_tokens=True),
                      "input_ids": conv.prompt_ids + ids, "prompt_len": len(conv.prompt_ids),
                      "finish_reason": out.finish_reason}
            sink.write(json.dumps(record) + "\n")
            sink.flush()
            written += 1
            if written % 25 == 0:
                dt = time.time() - t0
                print(f"{len(done) + written} written, {tokens} tokens generated, {tokens / dt:.0f} tok/s, "
                      f"{dt / 60:.1f} min", flush=True)
        finished.clear()
    sink.close()
    print(f"done: {written} new conversations, {tokens} tokens in {(time.time() - t0) / 60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
