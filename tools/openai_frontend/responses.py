"""OpenAI's response JSON: whole answers, stream chunks, usage and log-probs.

Owns the shapes only (field names and nesting, per endpoint); the values come from
`service.py`. Streams follow OpenAI's order: for chat a first chunk with the role,
then content deltas, then a chunk with `finish_reason`; with
`stream_options.include_usage` every chunk carries `"usage": null` and a last chunk
with no choices carries the usage. The `data: [DONE]` line is the web layer's.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Optional, Sequence

from .protocol import CHAT


# vLLM's stop_reason: the stop token id or stop string that ended a choice, None otherwise
StopReason = Optional[int | str]

# JSON has no -inf: a token the sampling filters ruled out (log-prob -inf) gets vLLM's floor.
LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class TokenLogProb:
    token: str  # the token's own text
    logprob: Optional[float]  # None: a prompt's first token (nothing before it to score it)
    offset: int  # where the token starts in the generated text (completions' text_offset)
    top: tuple[tuple[str, float], ...] = ()  # the most likely tokens there (text, log-prob), when asked


def _finite(logprob: Optional[float]) -> Optional[float]:
    return None if logprob is None else max(logprob, LOGPROB_FLOOR)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def logprobs_json(endpoint: str, entries: Sequence[TokenLogProb], top: bool = False) -> dict:
    """OpenAI's `logprobs` object; `top`: the client asked for alternatives."""
    if endpoint == CHAT:
        return {"content": [{"token": e.token, "logprob": _finite(e.logprob), "bytes": list(e.token.encode("utf-8")),
                             "top_logprobs": [{"token": t, "logprob": _finite(lp), "bytes": list(t.encode("utf-8"))}
                                              for t, lp in e.top]} for e in entries]}
    return {"tokens": [e.token for e in entries], "token_logprobs": [_finite(e.logprob) for e in entries],
            "top_logprobs": [None if e.logprob is None else {t: _finite(lp) for t, lp in e.top} for e in entries]
            if top else None,
            "text_offset": [e.offset for e in entries]}


@dataclass
class Shapes:
    """The envelope shared by one request's answer or chunks (id, object, created, model)."""

    endpoint: str
    model: str
    logprobs: bool = False  # the client asked for them: the field is an object, else null
    top_logprobs: int = 0  # alternatives per token the client asked for
    include_usage: bool = False
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        if not self.id:
            self.id = ("chatcmpl-" if self.endpoint == CHAT else "cmpl-") + uuid.uuid4().hex

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _logprobs(self, entries: Sequence[TokenLogProb]):
        return logprobs_json(self.endpoint, entries, self.top_logprobs > 0) if self.logprobs else None

    def choice(self, index: int, text: str, finish_reason: str, entries: Sequence[TokenLogProb] = (),
               stop_reason: StopReason = None) -> dict:
        """One choice of a whole (non-streamed) answer."""
        if self.endpoint == CHAT:
            return {"index": index, "message": {"role": "assistant", "content": text},
                    "logprobs": self._logprobs(entries), "finish_reason": finish_reason, "stop_reason": stop_reason}
        return {"index": index, "text": text, "logprobs": self._logprobs(entries), "finish_reason": finish_reason,
                "stop_reason": stop_reason}

    def answer(self, choices: list[dict], use: dict) -> dict:
        """The whole (non-streamed) answer, its `choices` from `choice()`."""
        body = self._envelope("chat.completion" if self.endpoint == CHAT else "text_completion", choices)
        body["usage"] = use
        return body

    def chunk(self, index: int, text: str, entries: Sequence[TokenLogProb] = (), finish_reason: Optional[str] = None,
              first: bool = False, stop_reason: StopReason = None) -> dict:
        """One stream chunk of choice `index`; `first` (chat) opens the assistant's message."""
        if self.endpoint == CHAT:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": self._logprobs(entries) if entries else None,
                      "finish_reason": finish_reason, "stop_reason": stop_reason}
            body = self._envelope("chat.completion.chunk", [choice])
        else:
            choice = {"index": index, "text": text, "logprobs": self._logprobs(entries) if entries else None,
                      "finish_reason": finish_reason, "stop_reason": stop_reason}
            body = self._envelope("text_completion", [choice])
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, use: dict) -> dict:
        body = self._envelope("chat.completion.chunk" if self.endpoint == CHAT else "text_completion", [])
        body["usage"] = use
        return body
