"""Logit bias in TensorRT-LLM's two forms and the engine's one.

TensorRT-LLM's ensemble takes bias words and weights (`embedding_bias_words`,
`embedding_bias_weights`); its preprocessing turns them into a dense `embedding_bias`
[vocab] that the model adds to its logits: each word is encoded and its weight is added
at every token id of the encoding. The engine keeps only the nonzero entries
(`GenerationRequest.logit_bias`, {token id: bias}), which the OpenAI front door fills
from `logit_bias` directly.

One difference from TensorRT-LLM's preprocessing: a word is encoded without special
tokens (it encodes with them, which for a tokenizer that adds a BOS biases BOS as well).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from .errors import validate_that


def embedding_bias(words: Sequence[str], weights: Sequence[float], encode: Callable[[str], list[int]],
                   vocab_size: int) -> np.ndarray:
    """[vocab_size] float32: each word's weight added at each of its tokens; [0] when no
    words are given."""
    validate_that(len(words) == len(weights), f"embedding_bias_words and embedding_bias_weights must have "
                                              f"the same length, got {len(words)} and {len(weights)}")
    if not words:
        return np.zeros(0, dtype=np.float32)
    validate_that(all(np.isfinite(w) for w in weights), "embedding_bias_weights must be finite numbers")
    bias = np.zeros(vocab_size, dtype=np.float32)
    for word, weight in zip(words, weights):
        for token in encode(word):
            validate_that(0 <= token < vocab_size, f"embedding bias word {word!r} encodes to id {token}, "
                                                   f"outside the vocabulary [0, {vocab_size})")
            bias[token] += weight
    return bias


def sparse_bias(dense: Optional[np.ndarray]) -> dict[int, float]:
    """A dense `embedding_bias` ([V] per entry; absent or empty: none) as {token id: bias},
    its nonzero entries."""
    if dense is None or dense.size == 0:
        return {}
    values = np.asarray(dense, dtype=np.float64).reshape(-1)
    validate_that(bool(np.isfinite(values).all()), "embedding_bias must hold finite numbers")
    return {int(i): float(values[i]) for i in np.flatnonzero(values)}
