"""Writes benchmark datasets in trtllm-bench's format, like its prepare_dataset.py.

Owns the dataset file format and the synthetic length/token generation; it reads
question sets through `dataset_converter.read_question_set` and loads a local
tokenizer, and knows nothing about servers.

Format (what `trtllm-bench --dataset` reads, `tensorrt_llm/bench/utils/data.py`):
one JSON object per line with

    task_id        int, the request's index here
    input_ids      list[int]  (or `prompt`: str; trtllm-bench tokenizes a prompt
                   only when `input_ids` is absent)
    output_tokens  int, the output length to request

e.g. `{"task_id":0,"input_ids":[1,42,376],"output_tokens":128}`.

Subcommands, as in TensorRT-LLM's `benchmarks/cpp/prepare_dataset.py`:

    dataset          prompts from an EAGLE question set (first turn of each
                     question), a fixed --output-tokens per request
    token-norm-dist  synthetic: input and output lengths ~ Normal(mean, stdev),
                     rounded up and clamped to >= 1; token ids uniform over the
                     tokenizer's vocabulary minus its special tokens (so no
                     prompt contains EOS); everything from one --seed

    python tools/data/prepare_dataset.py --tokenizer checkpoints/base --output ds.jsonl \\
        dataset --input-file question.jsonl --output-tokens 128
    python tools/data/prepare_dataset.py --tokenizer checkpoints/base \\
        token-norm-dist --num-requests 100 --input-mean 128 --input-stdev 16 \\
        --output-mean 128 --output-stdev 0 --seed 0

Bad input exits with code 2 and a message naming the file and line.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, TextIO

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dataset_converter import EXIT_BAD_INPUT, DatasetError, first_turns, read_question_set  # noqa: E402


@dataclass(frozen=True)
class Sample:
    task_id: int
    output_tokens: int
    input_ids: tuple[int, ...] | None = None
    prompt: str | None = None

    def to_json(self) -> str:
        row: dict = {"task_id": self.task_id}
        if self.prompt is not None:
            row["prompt"] = self.prompt
        if self.input_ids is not None:
            row["input_ids"] = list(self.input_ids)
        row["output_tokens"] = self.output_tokens
        return json.dumps(row, separators=(",", ":"), ensure_ascii=False)


def _validate_that(cond: bool, msg: str) -> None:
    if not cond:
        raise DatasetError(msg)


def load_tokenizer(path: str | Path):
    """A tokenizer from a local directory only (no downloads)."""
    from transformers import AutoTokenizer  # slow import; only when a tokenizer is needed

    path = Path(path)
    _validate_that(path.is_dir(), f"--tokenizer {path}: not a directory")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise DatasetError(f"--tokenizer {path}: cannot load a tokenizer: {exc}") from None


def norm_dist_lengths(mean: float, stdev: float, n: int, rng: np.random.Generator) -> list[int]:
    """n lengths ~ Normal(mean, stdev), rounded up, at least 1 (trtllm's rule)."""
    _validate_that(mean >= 1, f"mean length must be >= 1, got {mean}")
    _validate_that(stdev >= 0, f"stdev must be >= 0, got {stdev}")
    draws = rng.normal(loc=mean, scale=stdev, size=n)
    return [max(1, math.ceil(x)) for x in draws]


def usable_token_ids(tokenizer) -> np.ndarray:
    """Ids in [0, vocab) that are not special tokens (BOS, EOS, UNK, ...)."""
    vocab = len(tokenizer)
    special = set(tokenizer.all_special_ids)
    ids = np.array([i for i in range(vocab) if i not in special], dtype=np.int64)
    _validate_that(ids.size > 0, "the tokenizer has no non-special tokens")
    return ids


def token_norm_dist(
    tokenizer, num_requests: int, input_mean: float, input_stdev: float,
    output_mean: float, output_stdev: float, seed: int = 0,
) -> list[Sample]:
    """Synthetic requests; the same arguments and seed give the same samples."""
    _validate_that(num_requests >= 1, f"--num-requests must be >= 1, got {num_requests}")
    rng = np.random.default_rng(seed)
    input_lens = norm_dist_lengths(input_mean, input_stdev, num_requests, rng)
    output_lens = norm_dist_lengths(output_mean, output_stdev, num_requests, rng)
    pool = usable_token_ids(tokenizer)
    return [
        Sample(task_id=i, output_tokens=out_len, input_ids=tuple(int(t) for t in rng.choice(pool, size=in_len)))
        for i, (in_len, out_len) in enumerate(zip(input_lens, output_lens))
    ]


def from_question_set(
    path: str | Path, output_tokens: int, tokenizer=None, turns: str = "first",
    fmt: str = "input_ids", max_input_len: int | None = None,
) -> list[Sample]:
    """One request per question (its first turn), in file order.

    fmt: "input_ids" (tokenized with the tokenizer's special tokens, as
    trtllm's prepare_dataset does), "prompt" (text only), or "both".
    max_input_len drops questions whose tokenized prompt is longer.
    """
    _validate_that(output_tokens >= 1, f"--output-tokens must be >= 1, got {output_tokens}")
    _validate_that(fmt in ("input_ids", "prompt", "both"), f"unknown --format {fmt!r}")
    needs_ids = fmt != "prompt" or max_input_len is not None
    _validate_that(not needs_ids or tokenizer is not None, "--tokenizer is required for input_ids and --max-input-len")
    samples = []
    for prompt in first_turns(read_question_set(path), turns):
        ids = tuple(tokenizer.encode(prompt)) if needs_ids else None
        if max_input_len is not None and len(ids) > max_input_len:
            continue
        samples.append(Sample(
            task_id=len(samples),
            output_tokens=output_tokens,
            input_ids=ids if fmt != "prompt" else None,
            prompt=prompt if fmt != "input_ids" else None,
        ))
    _validate_that(len(samples) > 0, f"{path}: every question is longer than --max-input-len {max_input_len}")
    return samples


def write_samples(samples: Iterable[Sample], out: TextIO) -> None:
    for s in samples:
        out.write(s.to_json() + "\n")


def read_samples(path: str | Path) -> list[Sample]:
    """Reads a file this tool wrote (or any trtllm-bench dataset)."""
    samples = []
    for line_no, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            ids = row.get("input_ids")
            samples.append(Sample(
                task_id=int(row["task_id"]), output_tokens=int(row["output_tokens"]),
                input_ids=tuple(ids) if ids is not None else None, prompt=row.get("prompt"),
            ))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise DatasetError(f"{path}:{line_no}: not a trtllm-bench dataset line ({exc!r})") from None
    return samples


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", help="local tokenizer directory (loaded offline)")
    parser.add_argument("--output", default="-", help="file to write (default: stdout)")
    parser.add_argument("--stdout", action="store_true", help="write to stdout (trtllm's spelling; the default)")
    sub = parser.add_subparsers(dest="command", required=True)

    ds = sub.add_parser("dataset", help="requests from an EAGLE question set")
    ds.add_argument("--input-file", required=True, help="EAGLE question.jsonl")
    ds.add_argument("--output-tokens", type=int, required=True, help="output length of every request")
    ds.add_argument("--turns", choices=("first", "error"), default="first")
    ds.add_argument("--format", choices=("input_ids", "prompt", "both"), default="input_ids")
    ds.add_argument("--max-input-len", type=int, default=None, help="drop longer prompts")

    tn = sub.add_parser("token-norm-dist", help="synthetic normally distributed lengths")
    tn.add_argument("--num-requests", type=int, required=True)
    tn.add_argument("--input-mean", type=float, required=True)
    tn.add_argument("--input-stdev", type=float, default=0.0)
    tn.add_argument("--output-mean", type=float, required=True)
    tn.add_argument("--output-stdev", type=float, default=0.0)
    tn.add_argument("--seed", "--random-seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "dataset":
            tokenizer = None
            if args.format != "prompt" or args.max_input_len is not None:
                _validate_that(args.tokenizer is not None, "--tokenizer is required (before the subcommand)")
                read_question_set(args.input_file)  # report a bad file before the slow tokenizer load
                tokenizer = load_tokenizer(args.tokenizer)
            samples = from_question_set(
                args.input_file, args.output_tokens, tokenizer, args.turns, args.format, args.max_input_len
            )
        else:
            _validate_that(args.tokenizer is not None, "--tokenizer is required (before the subcommand)")
            samples = token_norm_dist(
                load_tokenizer(args.tokenizer), args.num_requests, args.input_mean, args.input_stdev,
                args.output_mean, args.output_stdev, args.seed,
            )
    except DatasetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT

    if args.stdout or args.output == "-":
        write_samples(samples, sys.stdout)
    else:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w", encoding="utf-8") as f:
            write_samples(samples, f)
        print(f"wrote {len(samples)} requests to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
