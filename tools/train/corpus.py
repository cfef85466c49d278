"""The training corpus: the running interpreter's standard library, minus held-out modules.

Every machine that runs Python has this corpus, so the model family can be retrained
anywhere without a download. A fixed list of top-level modules (and their tests) is held
out for evaluation (perplexity and acceptance on unseen code). The EAGLE question sets
in ``shared/data`` are never read here.
"""
from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import numpy as np

# Top-level stdlib modules kept out of training; their source (and test_<name>*) is the
# held-out evaluation set. Chosen as plain, self-contained, typical Python.
HELD_OUT_MODULES = (
    "argparse", "bisect", "calendar", "csv", "difflib", "fnmatch", "fractions",
    "glob", "heapq", "json", "pprint", "shlex", "statistics", "string", "textwrap",
)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _top_module(rel: Path) -> str:
    parts = rel.parts
    if parts[0] in ("test", "tests") and len(parts) > 1:
        name = parts[1]
        name = name[len("test_"):] if name.startswith("test_") else name
    else:
        name = parts[0]
    return name[:-3] if name.endswith(".py") else name


def list_sources() -> tuple[list[Path], list[Path]]:
    """Returns (train_files, heldout_files), each sorted, from the stdlib."""
    root = stdlib_root()
    train, heldout = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if "site-packages" in rel.parts or "dist-packages" in rel.parts:
            continue
        top = _top_module(rel)
        (heldout if top in HELD_OUT_MODULES else train).append(path)
    return train, heldout


def read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def encode_files(tokenizer, files: list[Path], bos_id: int, eos_id: int) -> np.ndarray:
    """Concatenates `<s> file </s>` for every file into one uint16 token stream."""
    chunks = []
    for path in files:
        ids = tokenizer.encode(read_text(path), add_special_tokens=False)
        chunks.append(np.asarray([bos_id] + ids + [eos_id], dtype=np.uint16))
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint16)


def cached_stream(tokenizer, files: list[Path], cache_dir: Path, tag: str) -> np.ndarray:
    """Token stream for `files`, cached under `cache_dir` keyed by the tokenizer and file list."""
    key = hashlib.sha256()
    key.update(tokenizer.backend_tokenizer.to_str().encode())
    for f in files:
        key.update(str(f).encode())
        key.update(str(f.stat().st_size).encode())
    path = cache_dir / f"{tag}-{key.hexdigest()[:16]}.npy"
    if path.exists():
        return np.load(path)
    cache_dir.mkdir(parents=True, exist_ok=True)
    stream = encode_files(tokenizer, files, tokenizer.bos_token_id, tokenizer.eos_token_id)
    np.save(path, stream)
    return stream


class BatchSampler:
    """Seeded random windows of `seq_len + 1` tokens from a token stream."""

    def __init__(self, stream: np.ndarray, seq_len: int, batch_size: int, seed: int):
        self.stream = stream
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.rng = np.random.default_rng(seed)

    def next(self) -> np.ndarray:
        """Returns int64 [batch_size, seq_len + 1]."""
        starts = self.rng.integers(0, len(self.stream) - self.seq_len - 1, size=self.batch_size)
        return np.stack([self.stream[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)


def eval_windows(stream: np.ndarray, seq_len: int, max_windows: int) -> np.ndarray:
    """Non-overlapping windows from the start of `stream`: int64 [n, seq_len + 1]."""
    n = min(max_windows, (len(stream) - 1) // seq_len)
    return np.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)]).astype(np.int64)
