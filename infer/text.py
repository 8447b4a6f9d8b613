"""Tokens to text: every token's bytes and text in tables built once, incremental decoding that
never splits a character, and stop strings cut from the output (held back while they might still
be forming). The server's responses and ``teralm sample`` both go through ``TextStream``."""

from __future__ import annotations

import codecs
import json
import threading
from collections.abc import Callable, Iterable, Sequence
from functools import cache

from teralm.errors import InputError
from teralm.index.tokenizer import Tokenizer
from teralm.infer import engine
from teralm.infer.sampling import Sampling


@cache
def _byte_level_alphabet() -> dict[str, int]:
    """The character a byte-level BPE writes for each byte (GPT-2's ``bytes_to_unicode``)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    shifted = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(shifted)}
    return {c: b for b, c in chars.items()}


def token_bytes(tokenizer: Tokenizer) -> list[bytes]:
    """Every token's bytes: one byte each, or a byte-level BPE's pieces read off its vocabulary."""
    if tokenizer.name == "bytes":
        return [bytes([t]) for t in range(256)]
    alphabet = _byte_level_alphabet()
    table = [b""] * tokenizer.vocab_size
    for piece, token in json.loads(tokenizer.to_json())["model"]["vocab"].items():
        table[token] = bytes(alphabet[c] for c in piece)
    return table


def token_texts(pieces: Sequence[bytes]) -> list[str]:
    """Every token's text for logprobs; a token that is not whole characters is ``bytes:\\xNN``
    (its bytes, as OpenAI writes them)."""

    def text(piece: bytes) -> str:
        try:
            return piece.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)

    return [text(p) for p in pieces]


class TextStream:
    """Feed tokens with ``push``; each returns the text that is now final. Only the new token's
    bytes are decoded: a character split across tokens waits in the UTF-8 decoder for its last
    byte. ``stopped`` turns true when a stop string appeared in the generated text (the text
    ends just before it). ``prefix`` (the prompt, when it is not echoed) is decoded first and not
    returned; an echoed prompt is pushed with ``prompt=True``: returned, and never searched for
    stop strings (they apply to generated text only, as in OpenAI's API)."""

    def __init__(self, pieces: Sequence[bytes], stops: list[str], prefix: Iterable[int] = ()):
        self.pieces, self.stops = pieces, stops
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.decoder.decode(b"".join(pieces[t] for t in prefix))
        self.held = ""  # decoded, not yet returned: it may be the start of a stop string
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.stopped = False

    def push(self, token: int, prompt: bool = False) -> str:
        text = self.decoder.decode(self.pieces[token])
        return text if prompt else self._advance(text, final=False)

    def finish(self) -> str:
        """Whatever is still held back, at the end of the sequence."""
        return "" if self.stopped else self._advance(self.decoder.decode(b"", final=True), True)

    def _advance(self, new: str, final: bool) -> str:
        text = self.held + new  # what was returned already can hold no stop string's start
        cuts = [at for at in (text.find(s) for s in self.stops) if at >= 0]
        if cuts:
            self.stopped, text = True, text[: min(cuts)]
        keep = 0 if final or self.stopped else min(self.hold, len(text))
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep]


def complete(
    runner: engine.Engine,
    prompt: list[int],
    sampling: Sampling,
    stops: list[str],
    use_index: bool = True,
    on_text: Callable[[str], None] = lambda text: None,
) -> tuple[str, str]:
    """One completion's text, handed to ``on_text`` as it becomes final, and why it ended
    (``"stop"``: a stop string appeared, cut off with what follows, and generation stopped there;
    ``"length"``). InputError if the generation failed."""
    stream = TextStream(token_bytes(runner.index.tokenizer), stops, prefix=prompt)
    parts, errors, ended = [], [], threading.Event()

    def take(text: str) -> None:
        parts.append(text)
        on_text(text)

    def on_event(event: engine.TokenEvent) -> None:
        if event.error:
            errors.append(event.error)
        if event.token is not None and not event.prompt:
            take(stream.push(event.token))
        if stream.stopped:
            sequence.cancel()
            ended.set()
        elif event.finish:
            take(stream.finish())
            ended.set()

    sequence = engine.Sequence(prompt, sampling, on_event, use_index)
    runner.submit([sequence])
    ended.wait()
    if errors:
        raise InputError(errors[0])
    return "".join(parts), "stop" if stream.stopped else "length"
