"""Keeps the EAGLE evaluation question sets out of the training data.

A training conversation is dropped when its user turn or its answer shares any run of
`NGRAM` consecutive words (lowercased; punctuation and bare numbers are not words, so
that a list `1, 2, 3, ...` or a docstring's quotes do not match) with any turn of
HumanEval, MT-bench, GSM8K or Alpaca (`../shared/data`, or `$SPECDEC_DATA_DIR`). Eight
words is long enough that common phrases ("what is the difference between") do not
match by chance, and short enough that a copied question or code line does.

    python tools/data/overlap.py .cache/data/self_distill.jsonl     # prints the report
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dataset_converter import question_set_path, read_question_set  # noqa: E402

NGRAM = 8
QUESTION_SETS = ("humaneval", "mt_bench", "gsm8k", "alpaca")
_WORD = re.compile(r"[^\W\d]\w*")


def ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    words = _WORD.findall(text.lower())
    return {tuple(words[i: i + n]) for i in range(len(words) - n + 1)}


def evaluation_ngrams() -> set[tuple[str, ...]]:
    grams: set[tuple[str, ...]] = set()
    for name in QUESTION_SETS:
        for question in read_question_set(question_set_path(name)):
            for turn in question.turns:
                grams |= ngrams(turn)
    return grams


@dataclass
class OverlapReport:
    checked: int
    dropped: list[int]  # conversation indexes that overlapped
    eval_ngrams: int

    def summary(self) -> str:
        return (f"{self.checked} conversations checked against {self.eval_ngrams} {NGRAM}-word n-grams of "
                f"{', '.join(QUESTION_SETS)}: {len(self.dropped)} overlapped and were dropped")


def filter_conversations(records: list[dict]) -> tuple[list[dict], OverlapReport]:
    """The records without any that share an n-gram with the evaluation sets."""
    grams = evaluation_ngrams()
    kept, dropped = [], []
    for r in records:
        if ngrams(r["user"]) & grams or ngrams(r["answer"]) & grams:
            dropped.append(r["index"])
        else:
            kept.append(r)
    return kept, OverlapReport(len(records), dropped, len(grams))


def read_records(path: Path) -> list[dict]:
    """The finished conversations of a `self_distill.py` file (skipped ones left out)."""
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            if "skipped" not in r:
                out.append(r)
    return out


def main(argv: list[str] | None = None) -> int:
    paths = [Path(p) for p in (argv if argv is not None else sys.argv[1:])]
    for path in paths:
        _, report = filter_conversations(read_records(path))
        print(f"{path.name}: {report.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
