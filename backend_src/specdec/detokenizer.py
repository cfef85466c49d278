"""Exact incremental detokenization: streamed text pieces that concatenate to the
one-shot decode, byte for byte.

Owns: the rule that turns "tokens already emitted + new tokens" into the next text
piece. Never imports Triton; the tokenizer is passed in as a `decode` function, so
the engine side and the stateless Triton `postprocessing` model use the same code.

Rule (a window version of the "decode prefix, decode prefix+new, diff" method):

    stable(t) = t minus one trailing U+FFFD       # an incomplete UTF-8 char at the end
    piece     = decode(ctx + new)[len(stable(decode(ctx))):]
                with the result's trailing U+FFFD held back too unless `final`

`ctx` is the last `CONTEXT_TOKENS` tokens already emitted (any earlier tokens do not
change the tail of the text), `new` the tokens of this step. Pieces telescope:
their concatenation is decode(all tokens) once the last piece is taken with
`final=True`. Why it is exact for byte-level BPE (and SentencePiece):
- decoding is byte concatenation then lossy UTF-8; an incomplete character at the
  end decodes to exactly one U+FFFD that the next bytes may complete, so that one
  character is held back (never more, so a run of genuinely invalid bytes is not
  lost); everything before it is final;
- an incomplete character spans at most 3 bytes, i.e. at most 3 byte-carrying tokens,
  so a window of 8 tokens always holds it (leaving room for zero-width special tokens);
- text that depends on the window start (leading U+FFFD for a character cut by the
  window, a stripped leading space) is identical in both decodes and cancels.
"""
from __future__ import annotations

from typing import Callable, Sequence

CONTEXT_TOKENS = 8  # tokens of already-emitted context sent with each streamed step
REPLACEMENT = "\ufffd"

Decode = Callable[[list[int]], str]


def _stable(text: str) -> str:
    return text[:-1] if text.endswith(REPLACEMENT) else text


def decode_delta(decode: Decode, context_ids: Sequence[int], new_ids: Sequence[int],
                 final: bool) -> str:
    """The text that `new_ids` add after `context_ids` (the stateless helper).

    context_ids: the last up-to-`CONTEXT_TOKENS` tokens emitted before `new_ids`
    (empty for the first step); final: this is the request's last step (flush).
    """
    context_ids, new_ids = list(context_ids), list(new_ids)
    before = _stable(decode(context_ids)) if context_ids else ""
    after = decode(context_ids + new_ids) if (context_ids or new_ids) else ""
    if not final:
        after = _stable(after)
    # `before` is a prefix of `after` for any tokenizer whose decode is local at token
    # boundaries; if one is not, we still never emit text twice.
    return after[len(before):] if len(after) >= len(before) else ""


class IncrementalDetokenizer:
    """Stateful twin of `decode_delta` for one request.

        detok = IncrementalDetokenizer(lambda ids: tok.decode(ids, skip_special_tokens=True))
        pieces = [detok.add(step_ids) for step_ids in steps] + [detok.finish()]
        "".join(pieces) == tok.decode(all_ids, skip_special_tokens=True)
    """

    def __init__(self, decode: Decode, context_tokens: int = CONTEXT_TOKENS):
        assert context_tokens >= 3, "an incomplete UTF-8 character may span 3 tokens"
        self._decode = decode
        self._context_tokens = context_tokens
        self.token_ids: list[int] = []
        self.text = ""  # everything returned so far
        self.finished = False

    @classmethod
    def from_tokenizer(cls, tokenizer, skip_special_tokens: bool = True, **kwargs) -> "IncrementalDetokenizer":
        return cls(lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens), **kwargs)

    def context(self) -> list[int]:
        """The context `decode_delta` needs before the next step's tokens."""
        return self.token_ids[max(0, len(self.token_ids) - self._context_tokens):]

    def add(self, new_ids: Sequence[int], final: bool = False) -> str:
        """Adds one step's tokens; returns the text they complete (may be "")."""
        assert not self.finished, "add() after the final step"
        piece = decode_delta(self._decode, self.context(), new_ids, final)
        self.token_ids.extend(int(t) for t in new_ids)
        self.text += piece
        self.finished = final
        return piece

    def finish(self) -> str:
        """Flushes what was held back (a trailing invalid or cut character)."""
        return self.add([], final=True)
