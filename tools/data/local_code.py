"""Chat-shaped code conversations from the Python standard library on this machine.

The third source of training text, beside the self-distilled conversations
(`self_distill.py`) and the local documentation (`local_text.py`): each function or
method of the running interpreter's standard library that has a docstring becomes a
request to write it ("Write a Python function `name(args)` that does the following:
<the docstring's first paragraph>") answered by its source in a fenced code block, the
way the target itself answers code requests. The target did not write these answers, so
they cost one forward per token instead of a decode (about six times cheaper on the
CPU), and EAGLE learns the target's features and distributions on whatever text it
reads. Test suites, IDLE, demos and vendored packages are left out; functions of 4 to
`--max-lines` lines whose answer fits in `--answer-tokens` tokens are kept. Written in
`self_distill.py`'s JSONL format (kind `fixed`, indexes from 2,000,000), seeded.

    python tools/data/local_code.py --tokenizer .cache/smollm2/base --out .cache/data/local_code.jsonl
"""
from __future__ import annotations

import argparse
import ast
import json
import random
import sys
import sysconfig
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_text import fixed_record  # noqa: E402

FIRST_INDEX = 2_000_000
SKIPPED_DIRECTORIES = {"test", "tests", "idlelib", "turtledemo", "lib2to3", "ensurepip", "site-packages",
                       "__pycache__", "pydoc_data"}
REQUEST = "Write a Python function `{name}({args})` that does the following: {doc}"


def stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in sorted(root.rglob("*.py"))
            if not SKIPPED_DIRECTORIES & set(p.relative_to(root).parts[:-1])]


def functions(path: Path, max_lines: int) -> list[tuple[str, str]]:
    """(request, answer) for each documented function or method of one module, in file order."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines = text.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("__"):
            continue
        doc = ast.get_docstring(node)
        first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        if not doc or len(doc) < 40 or not 4 <= node.end_lineno - first + 1 <= max_lines:
            continue
        source = textwrap.dedent("\n".join(lines[first - 1: node.end_lineno]))
        summary = " ".join(doc.split("\n\n")[0].split())
        request = REQUEST.format(name=node.name, args=ast.unparse(node.args), doc=summary)
        out.append((request, f"```python\n{source}\n```"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--answer-tokens", type=int, default=384)
    ap.add_argument("--max-lines", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=1_000_000, help="answer tokens in all")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    pairs = [pair for path in stdlib_sources() for pair in functions(path, args.max_lines)]
    random.Random(args.seed).shuffle(pairs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    written = total = 0
    with args.out.open("w") as f:
        for user, answer in pairs:
            record = fixed_record(tokenizer, FIRST_INDEX + written, user, answer)
            answer_tokens = len(record["input_ids"]) - record["prompt_len"]
            if answer_tokens > args.answer_tokens:
                continue
            f.write(json.dumps(record) + "\n")
            written += 1
            total += answer_tokens
            if total >= args.max_tokens:
                break
    print(f"wrote {written} conversations, {total} answer tokens, from {len(pairs)} functions", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
