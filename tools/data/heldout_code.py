"""Held-out code requests: functions no drafter trained on, asked for as training asked.

The drafters trained on the standard library's functions (`local_code.py`,
`self_distill.py`'s code requests), so code requests made from it are not held out.
This writes requests in the same two shapes as `self_distill.py`'s ("Write a Python
function ... that does the following: ..." and "Complete the following Python
function"), from the documented module-level functions of pure-Python packages the
environment installs and no training source reads. Like the held-out chat requests
(`docs/bench/heldout_chat_questions.jsonl`), they are what the adaptive policy's
constants may be tuned on; the EAGLE question sets are only reported. Output: an EAGLE
question file (first turn only), seeded; the package versions it read go to stdout.

    python tools/data/heldout_code.py --out docs/bench/heldout_code_questions.jsonl
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from self_distill import CODE_TEMPLATES, documented_functions  # noqa: E402

PACKAGES = ("click", "jinja2", "attr", "dateutil", "idna", "h11", "markdown_it", "yaml", "fsspec", "filelock")
DISTRIBUTIONS = {"attr": "attrs", "dateutil": "python-dateutil", "yaml": "PyYAML", "markdown_it": "markdown-it-py"}
FIRST_ID = 70_000


def package_functions(name: str) -> list[dict]:
    root = Path(importlib.import_module(name).__file__).parent
    return documented_functions(sorted(p for p in root.rglob("*.py") if "tests" not in p.parts))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--requests", type=int, default=14)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    functions = []
    for name in PACKAGES:
        found = package_functions(name)
        version = importlib.metadata.version(DISTRIBUTIONS.get(name, name))
        print(f"{name} {version}: {len(found)} documented functions")
        functions += found
    rng = random.Random(args.seed)
    picked = rng.sample(functions, args.requests)
    with args.out.open("w") as f:
        for i, fn in enumerate(picked):
            turn = CODE_TEMPLATES[i % 2].format(**fn)  # write it, complete it (not explain it)
            f.write(json.dumps({"question_id": FIRST_ID + i, "category": "code-heldout", "turns": [turn]}) + "\n")
    print(f"{len(picked)} requests of {len(functions)} functions -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
