"""A completion's text as its tokens arrive, ended before the first of the client's stop strings.

It is fed on the scheduler thread (from the request's sink), so a stop string found in a token's
text cancels the request before its next step: no token is generated past it. `add` hands out the
text that may be sent now: none of a tail that a later token could make part of a stop string,
nor a character still missing some of its bytes (decoded as U+FFFD until it is whole).

Tokens are decoded incrementally, as vLLM's and `tokenizers`' DecodeStream do: each token decodes
with the few tokens before it as context and only the text past the context's is new, so a token
costs the same at the end of a long completion as at its start (decoding the whole text at every
token was quadratic), and tokenizers that decode a token differently at the start of a text
(SentencePiece's leading space) or split a character across tokens decode as on the whole text.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

MAX_STOPS = 4        # OpenAI's limit
MAX_STOP_CHARS = 256  # ours: holding back a tail costs up to its length squared per token, on the scheduler thread
INCOMPLETE = "\ufffd"
MAX_OPEN_TOKENS = 8   # text still ending in U+FFFD after this many tokens is garbage, not a character in the making
CHAR_TAIL_TOKENS = 3  # a character still incomplete has at most 3 of its UTF-8 bytes, so lies in the last 3 tokens


class CompletionText:
    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str] = ()) -> None:
        self._decode, self.stops = decode, tuple(stops)
        self._longest = max(map(len, self.stops), default=0)
        self._ids: list[int] = []       # the context (ids[:_read], already final) and the tokens after it
        self._read = 0
        self._context = ""              # the context's text: what the text of _ids extends
        self._held = ""                 # final text not sent: it may begin a stop string
        self._open = ""                 # text after the final text: its last character may be incomplete
        self.stopped = False            # a stop string was generated; the text ended before it

    def add(self, token: int) -> str:
        """Take one token; returns the text that may be sent now ("" once stopped)."""
        if self.stopped:
            return ""                   # generated before the stop took effect: not part of the answer
        final, self._open = self._take(token)
        text = self._held + final
        found = [i for s in self.stops if (i := (text + self._open).find(s)) >= 0]
        if found:
            self.stopped = True
            return (text + self._open)[:min(found)]
        sendable = len(text) - self._tail_of_a_stop(text)
        self._held = text[sendable:]
        return text[:sendable]

    def finish(self) -> str:
        """The rest of the answer once the request is over ("" after a stop): the held text, and an
        incomplete last character as U+FFFD."""
        return "" if self.stopped else self._held + self._open

    def _take(self, token: int) -> tuple[str, str]:
        """Decode one more token: (the text it made final, the open text after that)."""
        self._ids.append(token)
        text = self._decode(self._ids)
        if len(text) > len(self._context) and not text.endswith(INCOMPLETE):
            return self._finalize(len(self._ids), text), ""
        if len(self._ids) - self._read > MAX_OPEN_TOKENS:  # keep it short: its U+FFFDs are final but the last few
            upto = len(self._ids) - CHAR_TAIL_TOKENS
            final = self._finalize(upto, self._decode(self._ids[:upto]))
            return final, self._decode(self._ids)[len(self._context):]
        return "", text[len(self._context):]

    def _finalize(self, upto: int, text: str) -> str:
        """Make `text`, the text of ids[:upto], final; ids[_read:upto] become the next context."""
        final = text[len(self._context):]
        self._ids, self._read = self._ids[self._read:], upto - self._read
        self._context = self._decode(self._ids[:self._read])
        return final

    def _tail_of_a_stop(self, text: str) -> int:
        """The length of the longest tail of text that some stop string begins with."""
        for n in range(min(self._longest - 1, len(text)), 0, -1):
            tail = text[len(text) - n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
