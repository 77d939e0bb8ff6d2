"""What a run trains on, as one stream of token ids with a name and a fingerprint.

* the built-in corpus (no ``--data``): the Python standard library's own source, read in a fixed order;
* ``--data FILE``: a text file; ``--data FOLDER``: every file in it (sorted by path, hidden ones skipped), each a
  document; ``--data FILE.jsonl``: one JSON object per line, its ``"text"`` a document;
* ``--data FILE.npy`` / ``FILE.bin``: token ids already made (a 1-D integer array; raw ``--data-dtype``
  values), memory-mapped: pages are read as batches need them, so a corpus larger than memory trains.

Text is encoded by the run's tokenizer (:mod:`fourfold.data.tokenizers`); documents are joined by a newline.
The fingerprint is the SHA-256 of the bytes read, so ``run.json`` records exactly which data a run saw.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fourfold.data.tokenizers import ByteTokenizer, FileTokenizer, as_uint8

__all__ = ["DEFAULT_MAX_BYTES", "TOKEN_DTYPES", "Corpus", "is_token_file", "load_corpus", "open_data", "read_texts",
           "token_range"]

TOKEN_DTYPES = ("uint8", "uint16", "int32", "uint32", "int64")
"""What a ``.bin`` file of raw token ids may hold (``--data-dtype``)."""

DEFAULT_MAX_BYTES = 2 * 1024 * 1024
"""Bytes of standard-library source taken by :func:`load_corpus` unless told otherwise (2 MiB)."""

_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True, eq=False)
class Corpus:
    """A stream of token ids (bytes for the built-in corpus), with the name and SHA-256 fingerprint a run
    records, and the tokenizer that made it."""

    tokens: torch.Tensor  # (N,) integer; uint8 for bytes; memory-mapped for .npy / .bin
    name: str
    digest: str | Path  # the SHA-256, or the file to hash when it is first asked for (only rank 0 records it)
    tokenizer: str = "bytes"

    @functools.cached_property
    def sha256(self) -> str:
        return self.digest if isinstance(self.digest, str) else _sha256_file(self.digest)

    @classmethod
    def from_bytes(cls, data: bytes, name: str) -> Corpus:
        """Wrap raw bytes; the fingerprint is sha256(data)."""
        return cls(as_uint8(data), name, hashlib.sha256(data).hexdigest())

    def __len__(self) -> int:
        return self.tokens.numel()

    def __repr__(self) -> str:
        return f"Corpus(name={self.name!r}, tokens={len(self)}, sha256={self.sha256[:12]}...)"


def _stdlib_files() -> list[Path]:
    """Every .py file under the stdlib directory, test and site-packages folders skipped, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_corpus(path: str | os.PathLike[str] | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> Corpus:
    """The first ``max_bytes`` bytes of a file, or of the concatenated stdlib sources when ``path`` is None."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(
            f"max_bytes must be a positive integer, got max_bytes={max_bytes!r}. Pass e.g. 2**21"
        )
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ValueError(f"corpus path must be a readable file, got {str(file)!r}. Check the path")
        with file.open("rb") as f:
            data = f.read(max_bytes)
        name = file.name
    else:
        chunks, size = [], 0
        for file in _stdlib_files():
            if size >= max_bytes:
                break
            chunk = file.read_bytes() + b"\n"  # raw UTF-8 bytes; the newline keeps files apart
            chunks.append(chunk)
            size += len(chunk)
        data = b"".join(chunks)[:max_bytes]
        name = f"python{sys.version_info.major}.{sys.version_info.minor}-stdlib"
    if not data:
        raise ValueError(
            f"corpus must hold at least one byte, got 0 bytes from {name!r}. Pass a non-empty file"
        )
    return Corpus.from_bytes(data, name)




def is_token_file(path: str | os.PathLike[str]) -> bool:
    """Token ids already made (``.npy`` / ``.bin``), which no tokenizer reads."""
    return Path(path).suffix in (".npy", ".bin")


def read_texts(path: str | os.PathLike[str] | None, text_key: str = "text") -> tuple[list[str], bytes, str]:
    """The documents at ``path`` (a text file, a folder of them, or JSON Lines; None: the built-in corpus), the
    bytes read, and a name; refused when they hold no text at all."""
    texts, raw, name = _read_texts(path, text_key)
    if not any(texts):
        raise ValueError(f"corpus must hold at least one byte, got 0 bytes from {name!r}. Pass a non-empty file")
    return texts, raw, name


def _read_texts(path: str | os.PathLike[str] | None, text_key: str) -> tuple[list[str], bytes, str]:
    if path is None:
        builtin = load_corpus()
        raw = builtin.tokens.numpy().tobytes()
        return [raw.decode("utf-8", "replace")], raw, builtin.name
    root = Path(path)
    if root.is_dir():
        files = sorted((p for p in root.rglob("*") if p.is_file() and not any(
            part.startswith(".") for part in p.relative_to(root).parts)), key=lambda p: p.as_posix())
        if not files:
            raise ValueError(f"data folder must hold text files, got none in {str(root)!r}. Pass a folder of .txt "
                             "files, or a file")
        raws = [f.read_bytes() for f in files]
        texts = [_utf8(raw, f, "or leave binary files out of the folder") for raw, f in zip(raws, files, strict=True)]
        return texts, b"\n".join(raws), root.name + "/"
    if not root.is_file():
        raise ValueError(f"data must be a readable file or folder, got {str(root)!r}. Check the path, or leave "
                         "--data out to use the built-in corpus")
    if root.suffix == ".json":  # as text its brackets, keys and quotes would be trained on
        raise ValueError(f"data {root.name} is a .json file, which fourfold would read as plain text, its brackets, "
                         "keys and quotes included. Write one {\"text\": \"...\"} object per line in a .jsonl file "
                         "(JSON Lines), or rename it .txt to train on it as text")
    raw = root.read_bytes()
    if root.suffix == ".jsonl":
        texts = []
        for i, line in enumerate(_utf8(raw, root).splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"data {root.name} line {i} must be one JSON object, got {line[:60]!r}: {e}. Fix "
                                 "that line (JSON Lines: one object per line)") from None
            if not isinstance(row, dict) or not isinstance(row.get(text_key), str):
                keys = f" (its keys: {', '.join(map(str, list(row)[:8]))})" if isinstance(row, dict) else ""
                raise ValueError(f"data {root.name} line {i} must be an object with a {json.dumps(text_key)} string, "
                                 f"got {line[:60]!r}{keys}. Write each document as {{\"{text_key}\": \"...\"}}, or "
                                 "pass --text-key KEY, the key your records keep their text under")
            texts.append(row[text_key])
        return texts, raw, root.name
    return [_utf8(raw, root)], raw, root.name


def _utf8(raw: bytes, path: Path, other: str = "") -> str:
    """``raw`` as UTF-8 text, a byte-order mark (which Windows tools write) left out."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"data must be UTF-8 text, got {path} with a bad byte at offset {e.start}. Convert it "
                         f"to UTF-8{', ' + other if other else ''}") from None


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _token_file(path: Path, dtype: str) -> Corpus:
    """A memory-mapped ``.npy`` (its own dtype) or ``.bin`` (``dtype``) of token ids; copy-on-write, so the
    file is never written."""
    if not path.is_file():
        raise ValueError(f"data must be a readable file, got {str(path)!r}. Check the path")
    if path.stat().st_size == 0:
        raise ValueError(f"data {path.name} must hold at least one token, got an empty file. Pass a non-empty file")
    if path.suffix == ".npy":
        try:
            array = np.load(path, mmap_mode="c")
        except ValueError as e:
            raise ValueError(f"data {path.name} must be a .npy array of token ids: {e}") from None
    else:
        itemsize = np.dtype(dtype).itemsize
        if path.stat().st_size % itemsize:
            raise ValueError(f"data {path.name} must hold whole {dtype} token ids, got {path.stat().st_size} bytes "
                             f"(not a multiple of {itemsize}). Pass the --data-dtype it was written with")
        array = np.memmap(path, dtype=dtype, mode="c")
    if array.ndim != 1 or array.dtype.kind not in "iu" or array.dtype.name not in TOKEN_DTYPES:
        raise ValueError(f"data {path.name} must be a 1-D array of integer token ids ({', '.join(TOKEN_DTYPES)}), "
                         f"got shape {array.shape} of {array.dtype}. Save it with np.save(path, ids.ravel())")
    if array.size == 0:
        raise ValueError(f"data {path.name} must hold at least one token, got 0. Pass a non-empty file")
    return Corpus(torch.from_numpy(array), path.name, path, tokenizer="(token ids)")


def token_range(path: str | os.PathLike[str], data_dtype: str = "uint16") -> tuple[int, int]:
    """The smallest and largest id in a token file, read in chunks (a pass over the file, never all of it in
    memory): checked against the model's vocabulary before any process starts."""
    tokens = _token_file(Path(path), data_dtype).tokens
    low, high = None, None
    for start in range(0, tokens.numel(), 1 << 24):
        chunk = tokens[start:start + (1 << 24)].numpy()
        lo, hi = int(chunk.min()), int(chunk.max())
        low, high = lo if low is None else min(low, lo), hi if high is None else max(high, hi)
    assert low is not None and high is not None
    return low, high


def open_data(path: str | os.PathLike[str] | None, tokenizer: ByteTokenizer | FileTokenizer, *,
              data_dtype: str = "uint16", text_key: str = "text") -> Corpus:
    """The run's corpus: the built-in one (``path`` None), token ids from a ``.npy`` / ``.bin``, or text read
    and encoded by ``tokenizer``."""
    if path is not None and is_token_file(path):
        return _token_file(Path(path), data_dtype)
    if isinstance(tokenizer, ByteTokenizer):
        if path is None:
            return load_corpus()
        texts, raw, name = read_texts(path, text_key)  # not empty: read_texts refuses that
        data = "\n".join(texts).encode("utf-8")  # the files' bytes, a byte-order mark left out
        return Corpus(as_uint8(data), name, hashlib.sha256(raw).hexdigest())  # the fingerprint of what was read
    texts, raw, name = read_texts(path, text_key)
    ids = [i for doc in tokenizer.encode_all([t + "\n" for t in texts]) for i in doc]
    if not ids:
        raise ValueError(f"corpus must hold at least one token, got 0 from {name!r}. Pass a non-empty file")
    return Corpus(torch.tensor(ids, dtype=torch.int32), name, hashlib.sha256(raw).hexdigest(),
                  tokenizer=tokenizer.name)
