"""Tokenizers: text -> token ids. Byte-level is the default (``--tokenizer bytes``: ids 0..255, nothing to
train or download); ``--tokenizer PATH/tokenizer.json`` loads a Hugging Face ``tokenizers`` file;
``--tokenizer bpe:N`` trains a byte-level BPE of N ids on the corpus at start-up (rank 0 trains it and writes
``OUT/tokenizer.json``; every rank then loads that file, so all encode alike).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

__all__ = ["ByteTokenizer", "FileTokenizer", "as_uint8", "check_tokenizer_spec", "load_tokenizer", "train_bpe",
           "vocab_of"]


def as_uint8(data: bytes) -> torch.Tensor:
    """bytes -> uint8 tensor (N,), copying (torch.frombuffer refuses empty buffers and aliases memory)."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


class ByteTokenizer:
    """Text <-> its UTF-8 bytes: token t in [0, 256) is one byte."""

    vocab_size = 256
    name = "bytes"

    def encode(self, text: str) -> torch.Tensor:
        """str -> int64 tensor (N,) of its UTF-8 bytes."""
        return as_uint8(text.encode("utf-8")).long()  # (N,)

    def decode(self, tokens: torch.Tensor) -> str:
        """int tensor (N,) of bytes -> str; invalid UTF-8 becomes U+FFFD."""
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}. Decode one row at a time")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            raise ValueError(
                f"tokens must lie in [0, 256), got min={int(tokens.min())}, max={int(tokens.max())}. "
                "Decode only byte tokens"
            )
        return bytes(tokens.tolist()).decode("utf-8", errors="replace")


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ValueError("a tokenizer.json or a trained BPE needs Hugging Face tokenizers, which is not installed. "
                         "Run pip install 'fourfold[hf]', or use --tokenizer bytes") from None
    return tokenizers


class FileTokenizer:
    """A Hugging Face ``tokenizers`` file (``tokenizer.json``); ``name``: how run.json records it."""

    def __init__(self, path: str | os.PathLike[str], name: str | None = None) -> None:
        self.path = Path(path)
        try:
            self._tok = _tokenizers().Tokenizer.from_file(str(self.path))
        except Exception as e:  # tokenizers raises its own Exception type for a bad file
            raise ValueError(f"tokenizer must be a readable tokenizer.json, got {str(self.path)!r}: {e}. Pass a "
                             "file saved by tokenizers' Tokenizer.save, or --tokenizer bytes") from None
        self.vocab_size = int(self._tok.get_vocab_size())
        self.name = name or self.path.name

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(self._tok.encode(text).ids, dtype=torch.long)

    def encode_all(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts)]

    def decode(self, tokens: torch.Tensor) -> str:
        return str(self._tok.decode(tokens.tolist()))


def train_bpe(texts: Iterable[str], vocab_size: int, path: str | os.PathLike[str]) -> FileTokenizer:
    """A byte-level BPE of ``vocab_size`` ids (the 256 bytes first, then merges) trained on ``texts``, saved
    at ``path``."""
    tk = _tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return FileTokenizer(path)


def check_tokenizer_spec(spec: str) -> None:
    """``bytes``, ``bpe:N`` (N >= 256) or a path ending in .json: refused otherwise, before anything starts."""
    if spec == "bytes" or spec.endswith(".json"):
        return
    kind, _, n = spec.partition(":")
    if kind == "bpe" and n.isdigit() and int(n) >= 256:
        return
    raise ValueError(f"tokenizer must be bytes, bpe:N (N >= 256: a byte-level BPE trained on the corpus) or a "
                     f"tokenizer.json path, got {spec!r}. Pass --tokenizer bytes, --tokenizer bpe:4096 or "
                     "--tokenizer path/to/tokenizer.json")


def absolute_spec(spec: str) -> str:
    """``spec`` as a run records and compares it: a tokenizer.json path made absolute (from wherever the run was
    started), ``bytes`` and ``bpe:N`` as they are."""
    return os.path.abspath(spec) if spec.endswith(".json") else spec


def vocab_of(spec: str) -> int:
    """The number of ids tokenizer ``spec`` makes, known before any text is read."""
    check_tokenizer_spec(spec)
    if spec == "bytes":
        return ByteTokenizer.vocab_size
    if spec.startswith("bpe:"):
        return int(spec.partition(":")[2])
    return FileTokenizer(spec).vocab_size


def load_tokenizer(spec: str) -> ByteTokenizer | FileTokenizer:
    """The tokenizer ``spec`` names: ``bytes`` or a tokenizer.json (a ``bpe:N`` is trained for a run, by
    :func:`fourfold.data.run_corpus`)."""
    check_tokenizer_spec(spec)
    if spec.startswith("bpe:"):
        raise ValueError(f"a {spec} tokenizer is trained on a run's corpus, got it to load. Use run_corpus, or pass "
                         "the tokenizer.json it was saved as")
    return ByteTokenizer() if spec == "bytes" else FileTokenizer(spec)
