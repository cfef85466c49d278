"""Batched prefill: which newly admitted requests share one target forward.

Prompts of one forward are padded to the longest, so a group is only formed where
padding stays a small share of the forward's tokens, and the forward's padded size
stays bounded (activation memory grows with it; the attention mask with its square).
A prompt longer than the bound is prefilled alone. Each group is then one forward
instead of one per request: on a GPU a prefill of a short prompt is launch-bound, so
requests that arrive together get their first token about as fast as one alone.
"""
from __future__ import annotations

PREFILL_TOKENS = 4096  # padded tokens per batched prefill forward (B x longest prompt)
PREFILL_PADDING = 0.25  # at most this share of a batched forward's tokens is padding


def prefill_groups(lengths: list[int], max_tokens: int = PREFILL_TOKENS,
                   max_padding: float = PREFILL_PADDING) -> list[list[int]]:
    """Indices of `lengths` grouped for prefill, longest first: each index exactly once;
    a group of several has `len(group) x longest <= max_tokens` and padding at most
    `max_padding` of that."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    real = 0
    for i in order:
        if groups:
            group = groups[-1]
            padded = lengths[group[0]] * (len(group) + 1)  # group[0] is its longest
            if padded <= max_tokens and padded - (real + lengths[i]) <= max_padding * padded:
                group.append(i)
                real += lengths[i]
                continue
        groups.append([i])
        real = lengths[i]
    return groups
