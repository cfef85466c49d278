"""Stop strings on text, streamed: OpenAI's rule that the output ends before the first
stop string and never contains it (or, with vLLM's `include_stop_str_in_output`, right
after it).

The engine also gets the stop strings (as token sequences) and usually stops on them,
but keeps the stop word's tokens, and a string that tokenizes differently inside the
output than alone never matches there. So the text is checked here too, and a streamed
piece is held back while it could still be the start of a stop string:

    stops ["END"], pieces "abcE", "N", "D more"
    feed("abcE")   -> "abc"   ("E" held: it may begin "END")
    feed("N")      -> ""      ("EN" held)
    feed("D more") -> ""      stopped: the text is "abc"
"""
from __future__ import annotations

from typing import Optional, Sequence


def first_stop(text: str, stops: Sequence[str]) -> int:
    """Where the earliest stop string starts in `text`, or -1."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


class StopMatcher:
    """Feeds streamed text pieces; returns what may be sent now. `stopped` turns true at the
    first stop string, after which nothing more is returned.

    A complete match ends the text only when no stop string could still start before it
    (stops "aa" and "caaa" over "...caa|a": "aa" is complete, but "caaa", which starts
    first, may still complete and wins if it does).
    """

    def __init__(self, stops: Sequence[str], include: bool = False):
        assert all(stops), "stop strings must not be empty"
        self.stops = tuple(stops)
        self.include = include  # vLLM's include_stop_str_in_output: the text ends after the stop string
        self._longest = max(len(s) for s in self.stops)
        self._held = ""  # text received but not yet returned
        self.matched: Optional[str] = None  # the stop string that ended the text (the first listed, at a tie)

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def _stop(self, text: str, at: int) -> str:
        self._held = ""
        self.matched = next(s for s in self.stops if text.startswith(s, at))
        return text[: at + len(self.matched)] if self.include else text[:at]

    def _open_start(self, text: str) -> int:
        """The first position from which `text` is a proper prefix of a stop string (a match
        that may still complete), else len(text)."""
        for p in range(max(0, len(text) - self._longest + 1), len(text)):
            tail = text[p:]
            if any(len(s) > len(tail) and s.startswith(tail) for s in self.stops):
                return p
        return len(text)

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        text = self._held + piece
        at = first_stop(text, self.stops)
        hold = self._open_start(text)
        if 0 <= at <= hold:
            return self._stop(text, at)
        self._held = text[hold:]
        return text[:hold]

    def finish(self) -> str:
        """The text held back at the end of generation, cut at a stop string it holds."""
        text, self._held = ("" if self.stopped else self._held), ""
        at = first_stop(text, self.stops)
        if at >= 0:
            return self._stop(text, at)
        return text
