"""Prefill: how much of which admitted prompts a step prefills, and in which forwards.

Chunks (`prefill_chunks`). With chunked prefill on (TensorRT-LLM's
`enable_chunked_context`), a prompt longer than the piece size is prefilled one piece
a step, from where its cache ends: a 2,048-token prompt with pieces of 256 is
prefilled over eight steps, and the requests already running decode one step between
each two of its pieces instead of waiting for all of it. Shorter prompts are prefilled
whole in the step that admits them, as many as arrive: a burst of short prompts is
prefilled together and starts decoding together (a budget over all of them made 32
requests arriving at once 1.2x slower on the 2-core CPU, docs/benchmarks.md 2.6). A
request whose prompt is not yet all cached is not decoded; its first token comes with
its last piece.

Groups (`prefill_groups`). Whole prompts prefilled in one step share one target
forward where their lengths allow: prompts of one forward are padded to the longest, so
a group is only formed where padding stays a small share of the forward's tokens, and
the forward's padded size stays bounded (activation memory grows with it; the
attention mask with its square). A prompt longer than the bound, and every piece of a
chunked prompt, is prefilled alone. On a GPU a prefill of a short prompt is
launch-bound, so requests that arrive together get their first token about as fast as
one alone.

    pieces of 8, prompts of 5, 12 and 3 tokens, nothing cached:
      step 1: [0, 5) of the first and [0, 3) of the third (whole: their first tokens,
              one forward), [0, 8) of the second (alone)
      step 2: [8, 12) of the second (its first token)
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


def prefill_chunks(pending: list[tuple[int, int]], piece: Optional[int]) -> list[PrefillChunk]:
    """The chunks one step prefills, one per request. `pending` holds `(cached,
    prompt_len)` of each admitted request whose prompt is not all cached, oldest first;
    each takes the rest of its prompt, or `piece` tokens of it where the rest is longer
    (None: every prompt whole)."""
    return [PrefillChunk(i, cached, prompt_len - cached if piece is None else min(prompt_len - cached, piece),
                         prompt_len)
            for i, (cached, prompt_len) in enumerate(pending)]
