"""Converts an EAGLE question set into a GenAI-Perf input file.

Owns two things: reading EAGLE's `question.jsonl` files (`read_question_set`, also
used by `prepare_dataset.py`) and writing the JSONL that `genai-perf profile
--input-file` reads. It knows nothing about tokenizers or servers.

Input, one JSON object per line (blank lines are skipped):

    {"question_id": 81, "category": "writing", "turns": ["Compose ...", "Rewrite ..."]}

Output, one JSON object per line, the question's first turn as the prompt:

    {"text": "Compose ..."}

GenAI-Perf 0.0.16 (`inputs/retrievers/file_input_retriever.py`) takes the prompt from
`text` or `text_input`, and rejects a line that has both; `--field text_input` writes
the older key. It strips each prompt and silently drops empty ones, so this tool
refuses empty turns instead of letting the request count shrink unnoticed.

Multi-turn sets (MT-bench has two turns per question): `--turns first` (default)
keeps the first turn, as the speculative-decoding tutorials do; `--turns error`
fails on the first question with more than one turn, naming its id.

Every problem with the input (unreadable file, a line that is not JSON, no `turns`,
an empty set) is reported with its line number and exit code 2; nothing is written
unless the whole file converts.

Where the question sets live (`data_dir`, `question_set_path`): `$SPECDEC_DATA_DIR` when set, else
`../shared/data` beside the repository (on a machine where that folder is absent, copy
it into the repository and point the variable at the copy; see tools/bench/gpu_session.sh).

    python tools/dataset_converter.py --input_file question.jsonl --output_file converted.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

EXIT_BAD_INPUT = 2
GENAI_PERF_FIELDS = ("text", "text_input")
DEFAULT_DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data"


class DatasetError(ValueError):
    """A question set (or a request for it) that cannot be converted."""


@dataclass(frozen=True)
class Question:
    question_id: object  # int in EAGLE's files; None when the line has none
    turns: tuple[str, ...]
    line_no: int  # 1-based line in the source file

    @property
    def name(self) -> str:
        if self.question_id is None:
            return f"the question on line {self.line_no}"
        return f"question_id {self.question_id!r} (line {self.line_no})"


def _validate_that(cond: bool, msg: str) -> None:
    if not cond:
        raise DatasetError(msg)


def data_dir() -> Path:
    """The folder of the EAGLE question sets: $SPECDEC_DATA_DIR, else ../shared/data."""
    return Path(os.environ.get("SPECDEC_DATA_DIR") or DEFAULT_DATA_DIR)


def question_set_path(name: str) -> Path:
    """`eagle_<name>_question.jsonl` (humaneval, mt_bench, gsm8k, alpaca) in `data_dir()`."""
    return data_dir() / f"eagle_{name}_question.jsonl"


def read_question_set(path: str | Path) -> list[Question]:
    """Reads an EAGLE question set; raises DatasetError naming file and line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DatasetError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path}: cannot read: {exc}") from None

    questions = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: not valid JSON ({exc.msg})") from None
        _validate_that(isinstance(row, dict), f"{where}: expected a JSON object, got {type(row).__name__}")
        _validate_that("turns" in row, f"{where}: missing 'turns' (keys: {sorted(row)})")
        turns = row["turns"]
        _validate_that(
            isinstance(turns, list) and len(turns) > 0,
            f"{where}: 'turns' must be a non-empty list of strings",
        )
        for i, turn in enumerate(turns):
            _validate_that(isinstance(turn, str), f"{where}: turns[{i}] is {type(turn).__name__}, not a string")
            _validate_that(turn.strip() != "", f"{where}: turns[{i}] is empty")
        questions.append(Question(row.get("question_id"), tuple(turns), line_no))
    _validate_that(len(questions) > 0, f"{path}: no questions (empty file)")
    return questions


def first_turns(questions: list[Question], turns: str = "first") -> list[str]:
    """The prompt for each question, in file order.

    turns="first" keeps each question's first turn; turns="error" raises on the
    first multi-turn question.
    """
    _validate_that(turns in ("first", "error"), f"--turns must be 'first' or 'error', got {turns!r}")
    if turns == "error":
        for q in questions:
            _validate_that(
                len(q.turns) == 1,
                f"{q.name} has {len(q.turns)} turns; GenAI-Perf sends one prompt per request "
                "(use --turns first to keep only the first turn)",
            )
    return [q.turns[0] for q in questions]


def to_genai_perf_lines(prompts: list[str], field: str = "text") -> list[str]:
    """One GenAI-Perf input line (JSON, no trailing newline) per prompt."""
    _validate_that(field in GENAI_PERF_FIELDS, f"field must be one of {GENAI_PERF_FIELDS}, got {field!r}")
    return [json.dumps({field: p}, ensure_ascii=False) for p in prompts]


def convert_file(input_file: str | Path, output_file: str | Path, turns: str = "first", field: str = "text") -> int:
    """Converts a whole file; returns the number of prompts written."""
    lines = to_genai_perf_lines(first_turns(read_question_set(input_file), turns), field)
    output_file = Path(output_file)
    try:
        output_file.parent.mkdir(parents=True, exist_ok=True)
        output_file.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    except OSError as exc:
        raise DatasetError(f"{output_file}: cannot write: {exc}") from None
    return len(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input_file", "--input-file", required=True, help="EAGLE question.jsonl")
    parser.add_argument("--output_file", "--output-file", required=True, help="GenAI-Perf input JSONL to write")
    parser.add_argument(
        "--turns", choices=("first", "error"), default="first",
        help="multi-turn questions: keep the first turn (default) or fail",
    )
    parser.add_argument(
        "--field", choices=GENAI_PERF_FIELDS, default="text",
        help="prompt key in the output (GenAI-Perf 0.0.16 reads either; default: text)",
    )
    args = parser.parse_args(argv)
    try:
        n = convert_file(args.input_file, args.output_file, args.turns, args.field)
    except DatasetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"wrote {n} prompts to {args.output_file}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
