"""Tokens to text for responses: incremental decoding that never splits a character, and stop
strings cut from the output (held back while they might still be forming)."""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"


class TextStream:
    """Feed tokens with ``push``; each returns the text that is now final. ``stopped`` turns true
    when a stop string appeared (the text ends just before it)."""

    def __init__(
        self, decode: Callable[[list[int]], str], stops: list[str], prefix: list[int] = ()
    ):
        self.decode, self.stops = decode, stops
        self.tokens: list[int] = list(prefix)
        self.skip = len(decode(self.tokens)) if self.tokens else 0  # text of the prefix
        self.emitted = 0
        self.stopped = False
        self.hold = max((len(s) for s in stops), default=1) - 1

    def push(self, token: int) -> str:
        self.tokens.append(token)
        return self._advance(final=False)

    def finish(self) -> str:
        """Whatever is still held back, at the end of the sequence."""
        return "" if self.stopped else self._advance(final=True)

    def _advance(self, final: bool) -> str:
        text = self.decode(self.tokens)[self.skip :]
        for stop in self.stops:
            at = text.find(stop, max(0, self.emitted - len(stop) + 1))
            if at >= 0:
                self.stopped = True
                text = text[:at]
        end = len(text)
        if not (final or self.stopped):
            end = max(self.emitted, end - self.hold)
            while end > self.emitted and text[end - 1] == REPLACEMENT:  # a character in progress
                end -= 1
        delta = text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return delta


def token_text(decode: Callable[[list[int]], str], token: int, byte_level: bool) -> str:
    """A token's text for logprobs; a byte that is part of a character is ``bytes:\\xNN``."""
    text = decode([token])
    if byte_level and REPLACEMENT in text:
        return f"bytes:\\x{token:02x}"
    return text
