"""Stop/bad word lists in TensorRT-LLM's `[2, L]` ids+offsets format.

Owns: splitting the user's comma-separated word strings, turning words into token
sequences through a caller-given `encode`, packing them as TensorRT-LLM does and
unpacking (with validation) on the engine side. Never imports Triton or a tokenizer.

Format of one request's list (TensorRT-LLM's `_to_word_list_format`):

    words "foo" -> [7, 8], "bar" -> [9]
    row 0  ids      [7, 8, 9]      flat token ids, padded with 0
    row 1  offsets  [2, 3, -1]     cumulative end of each word, padded with -1
    no words:       [[0], [-1]]    (L is at least 1)

A batch stacks requests padded to one L: `[B, 2, L]`.
"""
from __future__ import annotations

import csv
from typing import Callable, Iterable, Sequence, Union

import numpy as np

from .errors import InputError, validate_that


def split_words(items: Iterable[Union[str, bytes]]) -> list[str]:
    """Each item is a CSV line of words (`"foo,bar"`; quote a word holding a comma:
    `'"a,b",c'`). Empty items and empty words are dropped."""
    words: list[str] = []
    for item in items:
        if isinstance(item, bytes):
            item = item.decode("utf-8")
        if not item:
            continue
        for row in csv.reader([item]):
            words.extend(w for w in row if w)
    return words


def encode_words(words: Sequence[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """Token sequences of `words`; a word that encodes to nothing is dropped (as TensorRT-LLM)."""
    return [ids for ids in (list(encode(w)) for w in words) if ids]


def to_word_list(token_words: Sequence[Sequence[int]], pad_to: int = 0) -> np.ndarray:
    """Token sequences → int32 `[2, L]`, L = max(1, total ids, pad_to)."""
    flat = [t for word in token_words for t in word]
    offsets = np.cumsum([len(word) for word in token_words], dtype=np.int64)
    length = max(1, len(flat), pad_to)
    out = np.zeros((2, length), dtype=np.int32)
    out[1, :] = -1
    out[0, :len(flat)] = flat
    out[1, :len(offsets)] = offsets
    return out


def stack_word_lists(lists: Sequence[np.ndarray]) -> np.ndarray:
    """Several `[2, L_i]` lists → `[B, 2, max L_i]` with the same padding."""
    length = max((a.shape[1] for a in lists), default=1)
    out = np.zeros((len(lists), 2, length), dtype=np.int32)
    out[:, 1, :] = -1
    for i, a in enumerate(lists):
        out[i, :, :a.shape[1]] = a
    return out


def from_word_list(array: np.ndarray, field: str = "stop_words_list") -> list[list[int]]:
    """Inverse of `to_word_list`, validating; a leading batch dim of 1 is accepted.

    Raises `InputError` naming `field` when the array is not a well-formed `[2, L]` list.
    """
    array = np.asarray(array)
    if array.ndim == 3 and array.shape[0] == 1:
        array = array[0]
    validate_that(array.ndim == 2 and array.shape[0] == 2,
                  f"{field} must have shape [2, L] (ids, offsets), got {list(array.shape)}")
    validate_that(np.issubdtype(array.dtype, np.integer),
                  f"{field} must be an integer tensor, got {array.dtype}")
    ids, offsets = array[0].tolist(), array[1].tolist()
    words, start = [], 0
    for end in offsets:
        if end == -1:
            break
        if not start < end <= len(ids):
            raise InputError(f"{field} offsets must increase strictly within [1, {len(ids)}], "
                             f"got {offsets}")
        words.append(ids[start:end])
        start = end
    return words
