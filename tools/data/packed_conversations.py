"""Self-distilled conversations as committed: xz-compressed JSONL without what the tokenizer rebuilds.

`self_distill.py` records each answer twice: as token ids (`input_ids` after
`prompt_len`, what training reads) and as text (`answer`, what the overlap check reads),
the text being exactly `tokenizer.decode(answer ids, skip_special_tokens=True)`; and the
prompt's ids are the chat template around the `user` text. The committed copies
(`checkpoints/.../training_data/*.jsonl.xz`) drop the text, which is a third of their
compressed size, and the prompt's ids (`answer_ids` stands for `input_ids` and
`prompt_len`), a sixth of the rest; `unpack` rebuilds both: the unpacked file is byte
for byte what `self_distill.py` wrote. `pack` refuses a record whose text is not its ids'
decoding, and keeps the ids of a prompt that the template does not rebuild, so nothing is
lost. Files packed with their prompts' ids unpack as well.

    python tools/data/packed_conversations.py pack --tokenizer DIR FILE.jsonl FILE.jsonl.xz
    python tools/data/packed_conversations.py unpack --tokenizer DIR FILE.jsonl.xz FILE.jsonl
"""
from __future__ import annotations

import argparse
import json
import lzma
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from self_distill import template_parts  # noqa: E402


def _answer_ids(record: dict) -> list[int]:
    return record["answer_ids"] if "answer_ids" in record else record["input_ids"][record["prompt_len"]:]


def _answer_text(tokenizer, record: dict) -> str:
    return tokenizer.decode(_answer_ids(record), skip_special_tokens=True)


def _without_prompt(record: dict) -> dict:
    """The record with `answer_ids` where `input_ids` was, and no `prompt_len` (key order kept)."""
    out = {}
    for key, value in record.items():
        if key == "input_ids":
            out["answer_ids"] = _answer_ids(record)
        elif key != "prompt_len":
            out[key] = value
    return out


def pack_lines(lines: list[str], tokenizer) -> list[str]:
    """JSONL lines as self_distill.py wrote them -> the same records without `answer`, and
    with `answer_ids` for `input_ids` and `prompt_len` where the template rebuilds the prompt."""
    answer_prompt = template_parts(tokenizer)[1]
    packed = []
    for number, line in enumerate(lines, 1):
        record = json.loads(line)
        if "answer" in record:
            if record["answer"] != _answer_text(tokenizer, record):
                raise ValueError(f"line {number}: the answer text is not its token ids' decoding")
            del record["answer"]
        if "input_ids" in record and answer_prompt(record["user"]) == record["input_ids"][:record["prompt_len"]]:
            record = _without_prompt(record)
        packed.append(json.dumps(record))
    return packed


def unpack_lines(lines: list[str], tokenizer) -> list[str]:
    """Packed lines -> what self_distill.py wrote: `answer` back after `user`, and the
    prompt's ids in front of `answer_ids` (as `input_ids`, then `prompt_len`)."""
    answer_prompt = template_parts(tokenizer)[1]
    unpacked = []
    for line in lines:
        record = json.loads(line)
        if "input_ids" in record or "answer_ids" in record:  # answered (skipped ones carry no ids)
            ordered = {}
            for key, value in record.items():
                if key == "answer_ids":
                    prompt = answer_prompt(record["user"])
                    ordered["input_ids"], ordered["prompt_len"] = prompt + value, len(prompt)
                else:
                    ordered[key] = value
                if key == "user":
                    ordered["answer"] = _answer_text(tokenizer, record)
            record = ordered
        unpacked.append(json.dumps(record))
    return unpacked


def pack(src: Path, dst: Path, tokenizer) -> None:
    lines = [line for line in src.read_text().splitlines() if line.strip()]
    dst.write_bytes(lzma.compress(("\n".join(pack_lines(lines, tokenizer)) + "\n").encode(),
                                  preset=9 | lzma.PRESET_EXTREME))


def unpack(src: Path, dst: Path, tokenizer) -> None:
    lines = [line for line in lzma.decompress(src.read_bytes()).decode().splitlines() if line.strip()]
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text("\n".join(unpack_lines(lines, tokenizer)) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("pack", "unpack"))
    ap.add_argument("--tokenizer", required=True, type=Path, help="the target's tokenizer (its checkpoint folder)")
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    (pack if args.action == "pack" else unpack)(args.src, args.dst, tokenizer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
