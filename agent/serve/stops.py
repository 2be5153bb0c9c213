"""A completion's text as its tokens arrive, ended before the first of the client's stop strings.

It is fed on the scheduler thread (from the request's sink), so a stop string found in a token's
text cancels the request before its next step: no token is generated past it. `add` says how much
of the text may be sent already: none of a tail that a later token could make part of a stop
string, nor a character still missing some of its bytes (decoded as U+FFFD until it is whole).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

MAX_STOPS = 4        # OpenAI's limit
MAX_STOP_CHARS = 256  # ours: holding back a tail costs up to its length squared per token, on the scheduler thread
INCOMPLETE = "\ufffd"


class CompletionText:
    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str] = ()) -> None:
        self._decode, self.stops = decode, tuple(stops)
        self._longest = max(map(len, self.stops), default=0)
        self._tokens: list[int] = []
        self._from = 0                  # no stop string starts before this character
        self.text = ""
        self.cut: int | None = None     # where the first stop string starts, once found

    def add(self, token: int) -> int:
        """Take one token; returns the end of the text that may be sent (the cut once stopped)."""
        if self.cut is not None:
            return self.cut             # generated before the stop took effect: not part of the answer
        self._tokens.append(token)
        self.text = self._decode(self._tokens)
        whole = len(self.text.rstrip(INCOMPLETE))
        found = [i for s in self.stops if (i := self.text.find(s, self._from)) >= 0]
        if found:
            self.cut = min(found)
            return self.cut
        self._from = max(0, whole - self._longest + 1)
        return whole - self._held(whole)

    def end(self) -> int:
        """The end of the answer once the request is over: all of its text, or up to the stop string."""
        return len(self.text) if self.cut is None else self.cut

    def _held(self, whole: int) -> int:
        """The length of the longest tail of text[:whole] that some stop string begins with."""
        for n in range(min(self._longest - 1, whole), 0, -1):
            tail = self.text[whole - n:whole]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
