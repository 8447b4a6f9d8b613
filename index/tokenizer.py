"""Tokenizers of an index: raw bytes (vocab 256) or a byte-level BPE trained on the corpus."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from teralm.errors import ConfigError
from teralm.index.format import TOKENIZER, token_dtype


class ByteTokenizer:
    """One token per UTF-8 byte."""

    name = "bytes"
    vocab_size = 256
    dtype = np.dtype("u1")

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(data, dtype=np.uint8).copy()

    def encode_batch(self, texts: list[str | bytes]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, tokens: Iterable[int]) -> str:
        return bytes(np.asarray(tokens, dtype=np.uint8)).decode("utf-8", errors="replace")


class BPETokenizer:
    """A Hugging Face ``tokenizers`` byte-level BPE model."""

    name = "bpe"

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.dtype = token_dtype(self.vocab_size)

    @classmethod
    def load(cls, path: Path) -> BPETokenizer:
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)))

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        """Train a byte-level BPE with ``vocab_size`` tokens (the 256 bytes included)."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    def to_json(self) -> str:
        return self._tok.to_str()

    def encode(self, text: str | bytes) -> np.ndarray:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return np.asarray(self._tok.encode(text).ids, dtype=self.dtype)

    def encode_batch(self, texts: list[str | bytes]) -> list[np.ndarray]:
        texts = [t.decode("utf-8") if isinstance(t, bytes) else t for t in texts]
        return [np.asarray(e.ids, dtype=self.dtype) for e in self._tok.encode_batch(texts)]

    def decode(self, tokens: Iterable[int]) -> str:
        return self._tok.decode([int(t) for t in tokens])


Tokenizer = ByteTokenizer | BPETokenizer


def parse_tokenizer_spec(spec: str) -> tuple[str, int]:
    """``bytes`` or ``bpe:VOCAB`` -> (kind, vocab size); ConfigError with a user message."""
    if spec == "bytes":
        return "bytes", 256
    kind, _, vocab = spec.partition(":")
    if kind != "bpe" or not vocab.isdigit():
        raise ConfigError(
            f"unknown tokenizer '{spec}': use 'bytes' or 'bpe:VOCAB' (e.g. bpe:32000)"
        )
    vocab_size = int(vocab)
    if not 257 <= vocab_size <= 65535:
        raise ConfigError(
            f"bpe vocabulary must be 257..65535 tokens (uint16 on disk), got {vocab_size}"
        )
    return "bpe", vocab_size


def load_tokenizer(directory: Path, kind: str) -> Tokenizer:
    """The tokenizer an index was built with."""
    if kind == "bytes":
        return ByteTokenizer()
    return BPETokenizer.load(Path(directory) / TOKENIZER)
