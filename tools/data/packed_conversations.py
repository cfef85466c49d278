"""Self-distilled conversations as committed: xz-compressed JSONL without the answer text.

`self_distill.py` records each answer twice: as token ids (`input_ids` after
`prompt_len`, what training reads) and as text (`answer`, what the overlap check reads),
the text being exactly `tokenizer.decode(answer ids, skip_special_tokens=True)`. The
committed copies (`checkpoints/.../training_data/*.jsonl.xz`) drop the text, which is
a third of their compressed size, and `unpack` decodes it again: the unpacked file is
byte for byte what `self_distill.py` wrote. `pack` refuses a record whose text is not
its ids' decoding, so nothing is lost.

    python tools/data/packed_conversations.py pack --tokenizer DIR FILE.jsonl FILE.jsonl.xz
    python tools/data/packed_conversations.py unpack --tokenizer DIR FILE.jsonl.xz FILE.jsonl
"""
from __future__ import annotations

import argparse
import json
import lzma
import sys
from pathlib import Path


def _answer_text(tokenizer, record: dict) -> str:
    return tokenizer.decode(record["input_ids"][record["prompt_len"]:], skip_special_tokens=True)


def pack_lines(lines: list[str], tokenizer) -> list[str]:
    """JSONL lines as self_distill.py wrote them -> the same records without `answer`."""
    packed = []
    for number, line in enumerate(lines, 1):
        record = json.loads(line)
        if "answer" in record:
            if record["answer"] != _answer_text(tokenizer, record):
                raise ValueError(f"line {number}: the answer text is not its token ids' decoding")
            del record["answer"]
        packed.append(json.dumps(record))
    return packed


def unpack_lines(lines: list[str], tokenizer) -> list[str]:
    """Packed lines -> what self_distill.py wrote: `answer` back after `user`."""
    unpacked = []
    for line in lines:
        record = json.loads(line)
        if "input_ids" in record:  # an answered conversation (skipped ones carry no ids)
            ordered = {}
            for key, value in record.items():
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
