"""Chat-shaped training conversations from text every machine with this environment has.

EAGLE learns to predict the target's features and distributions, and those are the
training targets whatever text the target reads (EAGLE-1 trained on fixed ShareGPT
answers, not on the target's own). Text the target did not write is far cheaper than
text it writes (one forward instead of a decode per token), so it tops up the
self-distilled conversations (`self_distill.py`). Sources, both English prose with code:
- Python's own documentation topics (`pydoc_data.topics`: the language reference);
- the long descriptions of the installed Python packages (their READMEs).
Each text is cut at paragraph boundaries into answers of at most `--answer-tokens`
tokens, its first `PIECES_PER_DOCUMENT` kept; the user turn asks about the topic or package. Written in `self_distill.py`'s
JSONL format (kind `fixed`), seeded, so training reads both alike.

    python tools/data/local_text.py --tokenizer .cache/smollm2/base --out .cache/data/local_text.jsonl
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import random
import sys
from pathlib import Path

PIECES_PER_DOCUMENT = 3

def documents() -> list[tuple[str, str]]:
    """(user request, text) pairs, sorted for determinism."""
    import pydoc_data.topics

    docs = [(f"Explain the Python documentation topic '{name}'.", text)
            for name, text in sorted(pydoc_data.topics.topics.items())]
    seen = set()
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata["Name"] or ""):
        name = dist.metadata["Name"]
        if not name or name.lower() in seen:
            continue
        seen.add(name.lower())
        body = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        if len(body) >= 1500:
            docs.append((f"Tell me about the Python package {name}.", body))
    return docs


def fixed_record(tokenizer, index: int, user: str, answer: str) -> dict:
    """A conversation the target did not write, in `self_distill.py`'s JSONL format: the
    user turn in the chat template, then `answer` and the end of the turn."""
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=True,
                                                add_generation_prompt=True, return_dict=False))
    answer_ids = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    return {"index": index, "kind": "fixed", "user": user, "answer": answer, "input_ids": prompt + answer_ids,
            "prompt_len": len(prompt), "finish_reason": "fixed"}


def chunks(text: str, tokenizer, limit: int) -> list[str]:
    """Paragraph-aligned pieces of at most `limit` tokens (a longer paragraph is skipped)."""
    out, current, size = [], [], 0
    for para in text.replace("\r\n", "\n").split("\n\n"):
        para = para.strip("\n")
        if not para.strip():
            continue
        n = len(tokenizer.encode(para, add_special_tokens=False))
        if n > limit:
            continue
        if current and size + n > limit:
            out.append("\n\n".join(current))
            current, size = [], 0
        current.append(para)
        size += n
    if current:
        out.append("\n\n".join(current))
    return [c for c in out if len(c) >= 200]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--answer-tokens", type=int, default=384)
    ap.add_argument("--max-tokens", type=int, default=100_000, help="answer tokens in all")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    # a README's first pieces describe the package; later ones are mostly changelogs
    pieces = [(user, chunk) for user, text in documents()
              for chunk in chunks(text, tokenizer, args.answer_tokens)[:PIECES_PER_DOCUMENT]]
    random.Random(args.seed).shuffle(pieces)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    total = 0
    with args.out.open("w") as f:
        for i, (user, answer) in enumerate(pieces):
            record = fixed_record(tokenizer, 1_000_000 + i, user, answer)
            f.write(json.dumps(record) + "\n")
            total += len(record["input_ids"]) - record["prompt_len"]
            if total >= args.max_tokens:
                break
    print(f"wrote {i + 1} conversations, {total} answer tokens, from {len(pieces)} pieces", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
