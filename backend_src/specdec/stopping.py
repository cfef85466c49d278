"""Deciding where a request's output ends: end_id, stop words, max_tokens.

Matching is on token ids and sees every token of a step, so a stop word that
completes in the middle of a multi-token (speculative) step stops there: the stop
word's tokens are kept (as TensorRT-LLM does) and nothing after them is returned.
"""
from __future__ import annotations

from typing import Optional

from .request import GenerationRequest


def cut_new_tokens(req: GenerationRequest, output: list[int], new: list[int]) -> tuple[list[int], Optional[str]]:
    """Given the output so far and a step's new tokens, returns (tokens to emit,
    finish reason or None). `end_id` is not emitted; a stop word is."""
    emitted: list[int] = []
    for token in new:
        n_out = len(output) + len(emitted)
        if req.end_id is not None and token == req.end_id and n_out >= req.sampling.min_tokens:
            return emitted, "end_id"
        emitted.append(token)
        if n_out + 1 >= req.sampling.min_tokens and _ends_with_stop_word(req.stop_words, output, emitted):
            return emitted, "stop"
        if n_out + 1 >= req.max_tokens:
            return emitted, "length"
    return emitted, None


def _ends_with_stop_word(stop_words: list[list[int]], output: list[int], emitted: list[int]) -> bool:
    for word in stop_words:
        n = len(word)
        tail = (output + emitted)[-n:] if n > len(emitted) else emitted[-n:]
        if tail == word:
            return True
    return False
