"""Prefill: how much of which admitted prompts a step prefills, and in which forwards.

Chunks (`prefill_chunks`). With chunked prefill on (TensorRT-LLM's
`enable_chunked_context`) and requests decoding, a step prefills at most a budget of
prompt tokens, taking the admitted requests oldest first, each from where its cache
ends (with none decoding, nobody waits, and every prompt is prefilled whole): a 2,048-token prompt
with a budget of 256 is prefilled over eight steps, and the requests already running
decode one step between each two, instead of waiting for all of it. A request whose
prompt is not yet all cached is not decoded; its first token comes with its last chunk.

Groups (`prefill_groups`). Whole prompts prefilled in one step share one target
forward where their lengths allow: prompts of one forward are padded to the longest, so
a group is only formed where padding stays a small share of the forward's tokens, and
the forward's padded size stays bounded (activation memory grows with it; the
attention mask with its square). A prompt longer than the bound, and every piece of a
chunked prompt, is prefilled alone. On a GPU a prefill of a short prompt is
launch-bound, so requests that arrive together get their first token about as fast as
one alone.

    budget 8, prompts of 5, 12 and 3 tokens, nothing cached:
      step 1: [0, 5) of the first (whole: its first token), [0, 3) of the second
      step 2: [3, 11) of the second
      step 3: [11, 12) of the second (its first token), [0, 3) of the third (whole)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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


@dataclass(frozen=True)
class PrefillChunk:
    """One request's piece of prompt in this step's prefill: prompt positions
    `[start, start + length)`; `start` tokens are already cached."""

    index: int  # the request's place in the pending list
    start: int
    length: int
    prompt_len: int

    @property
    def whole(self) -> bool:
        """The whole prompt at once (batched with others by `prefill_groups`)."""
        return self.start == 0 and self.length == self.prompt_len

    @property
    def last(self) -> bool:
        """It ends the prompt: the request's first token comes from its last position."""
        return self.start + self.length == self.prompt_len


def prefill_chunks(pending: list[tuple[int, int]], budget: Optional[int]) -> list[PrefillChunk]:
    """The chunks one step prefills. `pending` holds `(cached, prompt_len)` of each
    admitted request whose prompt is not all cached, oldest first; each takes its next
    piece in order until `budget` tokens are taken (None: no budget, every prompt whole).
    Every returned chunk has `length >= 1`; with a budget their lengths sum to at most it."""
    chunks: list[PrefillChunk] = []
    left = budget
    for i, (cached, prompt_len) in enumerate(pending):
        length = prompt_len - cached if left is None else min(prompt_len - cached, left)
        if length < 1:
            break
        chunks.append(PrefillChunk(i, cached, length, prompt_len))
        if left is not None:
            left -= length
    return chunks
