"""The drafters' training data: self-distilled conversations, their split and batches.

Reads `tools/data/self_distill.py` output, drops every conversation that overlaps the
evaluation question sets (`tools/data/overlap.py`), holds out every `HOLDOUT_EVERY`-th
conversation for validation, and serves seeded, length-grouped batches of
conversation indexes (padded on the right to their longest member).
"""
from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from overlap import OverlapReport, filter_conversations, read_records  # noqa: E402

HOLDOUT_EVERY = 50


@dataclass
class Dataset:
    conversations: list[list[int]]  # token ids: prompt (chat template) + the target's answer
    prompt_lens: list[int]
    train: list[int]  # conversation indexes
    holdout: list[int]
    overlap: OverlapReport


def load_dataset(paths: list[Path], max_len: int) -> Dataset:
    records = [r for p in paths for r in read_records(p)]
    records, report = filter_conversations(records)
    records.sort(key=lambda r: r["index"])
    conversations = [r["input_ids"][:max_len] for r in records]
    prompt_lens = [min(r["prompt_len"], max_len) for r in records]
    keep = [i for i, (c, p) in enumerate(zip(conversations, prompt_lens)) if len(c) - p >= 2]
    train = [i for i in keep if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
    holdout = [i for i in keep if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
    return Dataset(conversations, prompt_lens, train, holdout, report)


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


def frequent_tokens(ds: Dataset, indexes: list[int], count: int) -> torch.Tensor:
    """The `count` most frequent answer tokens (ties by id), sorted by id. Greedy answers
    are the target's argmax continuations, so these are the tokens drafting must get right."""
    counts = np.zeros(max(max(c) for c in ds.conversations) + 1, dtype=np.int64)
    for c in indexes:
        answer = ds.conversations[c][ds.prompt_lens[c]:]
        np.add.at(counts, np.asarray(answer, dtype=np.int64), 1)
    top = np.argsort(-counts, kind="stable")[:count]
    return torch.from_numpy(np.sort(top))


def coverage(ds: Dataset, indexes: list[int], tokens: torch.Tensor) -> float:
    """Share of answer tokens in `indexes` that are among `tokens`."""
    keep = set(tokens.tolist())
    total = hit = 0
    for c in indexes:
        answer = ds.conversations[c][ds.prompt_lens[c]:]
        total += len(answer)
        hit += sum(t in keep for t in answer)
    return hit / max(total, 1)
