"""The drafters' training data: self-distilled conversations, their split and batches.

Reads `tools/data/self_distill.py` output, drops every conversation that overlaps the
evaluation question sets (`tools/data/overlap.py`), holds out every `HOLDOUT_EVERY`-th
conversation for validation, and serves seeded, length-grouped batches of
conversation indexes (padded on the right to their longest member); and what the
trainers share: their step schedule, learning rate and resumable state.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backend_src"))
from overlap import OverlapReport, filter_conversations, read_records  # noqa: E402
from specdec.drafters.loader import DRAFT_VOCAB_FILE  # noqa: E402

HOLDOUT_EVERY = 50


@dataclass
class Dataset:
    conversations: list[list[int]]  # token ids: prompt (chat template) + the target's answer
    prompt_lens: list[int]
    train: list[int]  # conversation indexes
    holdout: list[int]
    overlap: OverlapReport
    kinds: list[str]  # per conversation: "magpie" or "code" (the target's answers), "fixed" (text it read)

    def self_distilled(self, indexes: list[int]) -> list[int]:
        """Those of `indexes` whose answers the target wrote itself."""
        return [c for c in indexes if self.kinds[c] != "fixed"]


def load_dataset(paths: list[Path], max_len: int) -> Dataset:
    records = [r for p in paths for r in read_records(p)]
    records, report = filter_conversations(records)
    records.sort(key=lambda r: r["index"])
    conversations = [r["input_ids"][:max_len] for r in records]
    prompt_lens = [min(r["prompt_len"], max_len) for r in records]
    keep = [i for i, (c, p) in enumerate(zip(conversations, prompt_lens)) if len(c) - p >= 2]
    train = [i for i in keep if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
    holdout = [i for i in keep if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
    return Dataset(conversations, prompt_lens, train, holdout, report, [r.get("kind", "magpie") for r in records])


def batches(ds: Dataset, indexes: list[int], max_tokens: int, seed: int) -> list[list[int]]:
    """Groups of conversations of similar length whose padded size stays under `max_tokens`,
    in a seeded random order (shuffle, sort by length in chunks, then shuffle the groups)."""
    rng = random.Random(seed)
    order = list(indexes)
    rng.shuffle(order)
    groups: list[list[int]] = []
    chunk = 256
    for start in range(0, len(order), chunk):
        part = sorted(order[start: start + chunk], key=lambda c: len(ds.conversations[c]))
        group: list[int] = []
        for c in part:
            longest = max([len(ds.conversations[c])] + [len(ds.conversations[g]) for g in group])
            if group and longest * (len(group) + 1) > max_tokens:
                groups.append(group)
                group = []
            group.append(c)
        if group:
            groups.append(group)
    rng.shuffle(groups)
    return groups


def tokens_by_frequency(ds: Dataset, indexes: list[int]) -> np.ndarray:
    """Every token id, the most frequent answer tokens of `indexes` first (ties by id)."""
    counts = np.zeros(max(max(c) for c in ds.conversations) + 1, dtype=np.int64)
    for c in indexes:
        answer = ds.conversations[c][ds.prompt_lens[c]:]
        np.add.at(counts, np.asarray(answer, dtype=np.int64), 1)
    return np.argsort(-counts, kind="stable")


def frequent_tokens(ds: Dataset, indexes: list[int], count: int) -> torch.Tensor:
    """The `count` most frequent answer tokens (ties by id), sorted by id. Greedy answers
    are the target's argmax continuations, so these are the tokens drafting must get right."""
    return torch.from_numpy(np.sort(tokens_by_frequency(ds, indexes)[:count]))


def widened_vocabulary(ds: Dataset, indexes: list[int], tokens: torch.Tensor, count: int) -> torch.Tensor:
    """`tokens` and, after them, the most frequent answer tokens of `indexes` they lack:
    `count` in all (at least `tokens`), sorted by id."""
    have = set(tokens.tolist())
    more = [t for t in tokens_by_frequency(ds, indexes)[:count + len(have)].tolist() if t not in have]
    return torch.tensor(sorted(have | set(more[:max(count - len(have), 0)])), dtype=torch.long)


def save_draft_vocab(drafter_dir: Path, tokens: torch.Tensor) -> None:
    """A drafter's drafting vocabulary (`draft_vocab.safetensors`, `token_ids`): the tokens
    its training ranked over, which serving's drafting then scores alone
    (`specdec.drafters.loader.draft_vocab`). int32: half of int64's bytes, and every
    vocabulary's ids fit."""
    from safetensors.torch import save_file

    drafter_dir.mkdir(parents=True, exist_ok=True)
    save_file({"token_ids": tokens.to(torch.int32).contiguous()}, str(drafter_dir / DRAFT_VOCAB_FILE),
              metadata={"format": "pt"})


def coverage(ds: Dataset, indexes: list[int], tokens: torch.Tensor) -> float:
    """Share of answer tokens in `indexes` that are among `tokens`."""
    keep = set(tokens.tolist())
    total = hit = 0
    for c in indexes:
        answer = ds.conversations[c][ds.prompt_lens[c]:]
        total += len(answer)
        hit += sum(t in keep for t in answer)
    return hit / max(total, 1)


def epoch_schedule(ds: Dataset, batch_tokens: int, epochs: float, seed: int) -> list[list[int]]:
    """The batches of `epochs` passes over the training conversations (a fractional last
    pass is cut short), each pass in its own seeded order."""
    per_epoch = [batches(ds, ds.train, batch_tokens, seed + e) for e in range(math.ceil(epochs))]
    return [g for e in per_epoch for g in e][: int(round(epochs * len(per_epoch[0])))]


def learning_rate(step: int, total: int, peak: float) -> float:
    """Linear warm-up over the first 5 % of the steps, then cosine down to a tenth of `peak`."""
    warmup = max(1, total // 20)
    return peak * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / total)))


def run_key(ds: Dataset, schedule: list[list[int]], settings: dict) -> str:
    """What a saved training state belongs to: the conversations, their batch order and the
    run's settings. Resuming with other data or settings would silently mix two runs."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    digest.update(json.dumps(schedule).encode())
    for c in sorted({c for group in schedule for c in group}):
        digest.update(np.asarray(ds.conversations[c], dtype=np.int32).tobytes())
        digest.update(str(ds.prompt_lens[c]).encode() + b"|")
    return digest.hexdigest()


def load_state(path: Path, key: str) -> dict | None:
    """The state saved at `path` by this same run (`run_key`), or None when there is none;
    a state of another run is an error that says what to do, not a silent resume."""
    if not path.is_file():
        return None
    state = torch.load(path, weights_only=False)
    if state.get("run_key") != key:
        raise SystemExit(f"{path} holds the state of another training run (other data or settings); "
                         f"delete it to start this one, or use another --work folder")
    return state
