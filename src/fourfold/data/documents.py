"""Documents: what packing arranges. A run's text cut at its natural boundaries, kept as one stream of ids.

* the built-in set (no ``--data``): every function and method of the Python standard library, one document each,
  read in a fixed order. Their lengths are naturally skewed: most are short, a few are long;
* ``--data FILE.jsonl``: one document per record (its ``"text"``); ``--data FOLDER``: one per file;
  ``--data FILE``: the file is one document (split at row boundaries when longer than a row);
* :func:`skewed_documents`: random ids with a chosen length mix (``short_fraction`` of the documents at most
  ``longest * short_ratio`` tokens), for benchmarks: the seed's "80 % of your sequences are short".

``.npy`` / ``.bin`` token files carry no document boundaries and are refused for packing.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from fourfold.data.corpus import Corpus, _stdlib_files, is_token_file, open_data, read_texts
from fourfold.data.tokenizers import ByteTokenizer, FileTokenizer, as_uint8, load_tokenizer, train_bpe

__all__ = ["Documents", "builtin_documents", "open_documents", "run_corpus", "skewed_documents"]


@dataclass(frozen=True, eq=False)
class Documents:
    """``n`` documents as one id stream: document k is ``tokens[offsets[k]:offsets[k+1]]``, each >= 2 ids (one
    input predicting one target, at least)."""

    tokens: torch.Tensor   # (N,) integer ids
    offsets: torch.Tensor  # (n + 1,) int64, offsets[0] = 0, offsets[n] = N
    name: str
    sha256: str
    tokenizer: str = "bytes"

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    @property
    def lengths(self) -> torch.Tensor:
        """(n,) int64: ids per document."""
        return self.offsets[1:] - self.offsets[:-1]

    def __getitem__(self, k: int) -> torch.Tensor:
        return self.tokens[int(self.offsets[k]):int(self.offsets[k + 1])]

    @classmethod
    def from_list(cls, docs: list[torch.Tensor], name: str, sha256: str = "", tokenizer: str = "bytes"
                  ) -> Documents:
        """Documents from a list of 1-D id tensors; those under 2 ids (no target to predict) are dropped."""
        kept = [d.reshape(-1) for d in docs if d.numel() >= 2]
        if not kept:
            raise ValueError(f"documents must hold at least one document of 2 or more tokens, got none of "
                             f"{len(docs)} in {name!r}. Pass longer documents")
        lengths = torch.tensor([d.numel() for d in kept], dtype=torch.int64)
        offsets = torch.zeros(len(kept) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        dtype = torch.uint8 if all(d.dtype == torch.uint8 for d in kept) else torch.int64  # bytes stay bytes
        tokens = torch.cat([d.to(dtype) for d in kept])
        digest = sha256 or hashlib.sha256(tokens.numpy().tobytes()).hexdigest()
        return cls(tokens, offsets, name, digest, tokenizer)

    def __repr__(self) -> str:
        n = self.lengths
        return (f"Documents(name={self.name!r}, documents={len(self)}, tokens={self.tokens.numel()}, "
                f"median length={int(n.median())}, longest={int(n.max())})")


@functools.cache  # parsed once per process: a run, its --verify re-run and the demo share it (never mutated)
def builtin_documents(max_bytes: int = 2 * 1024 * 1024) -> Documents:
    """Every function and method of the standard library's sources (tests skipped), in path order, as bytes, up
    to ``max_bytes``: a real, skewed mix of lengths (most a few hundred bytes, some many thousands)."""
    docs: list[bytes] = []
    size = 0
    for file in _stdlib_files():
        if size >= max_bytes:
            break
        raw = file.read_bytes()
        try:
            tree = ast.parse(raw)
        except (SyntaxError, ValueError):
            continue  # a file this Python cannot parse: not a document
        lines = raw.splitlines(keepends=True)  # ast's columns count UTF-8 bytes: cut the bytes
        for node in _functions(tree.body):
            first, last = node.lineno - 1, (node.end_lineno or node.lineno) - 1
            text = b"".join(lines[first:last + 1])
            text = text[node.col_offset:len(text) - len(lines[last]) + (node.end_col_offset or len(lines[last]))]
            docs.append(text)
            size += len(text)
    name = f"python{sys.version_info.major}.{sys.version_info.minor}-stdlib-functions"
    return Documents.from_list([as_uint8(d) for d in docs], name, hashlib.sha256(b"\0".join(docs)).hexdigest())


def _functions(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Module-level functions and the methods of classes (at any depth of classes), in source order."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node.body)


def skewed_documents(count: int, longest: int, *, short_fraction: float = 0.8, short_ratio: float = 0.125,
                     vocab_size: int = 256, seed: int = 0) -> Documents:
    """``count`` documents of random ids: ``short_fraction`` of them 2..``longest*short_ratio`` ids long, the
    rest ``longest*short_ratio``..``longest`` (uniform within each class), from a generator of their own."""
    if not 0.0 <= short_fraction <= 1.0 or not 0.0 < short_ratio <= 1.0:
        raise ValueError(f"short_fraction must be in [0, 1] and short_ratio in (0, 1], got {short_fraction} and "
                         f"{short_ratio}. Pass e.g. short_fraction=0.8, short_ratio=0.125")
    if count < 1 or longest < 2:
        raise ValueError(f"count must be >= 1 and longest >= 2, got count={count}, longest={longest}.")
    gen = torch.Generator().manual_seed(seed)
    cut = max(2, int(longest * short_ratio))
    short = torch.rand(count, generator=gen) < short_fraction
    low = torch.where(short, 2, cut)
    high = torch.where(short, cut, longest)
    lengths = low + (torch.rand(count, generator=gen) * (high - low + 1)).long().clamp(max=high - low)
    docs = [torch.randint(vocab_size, (int(n),), generator=gen) for n in lengths]
    name = f"skewed({count} docs, {short_fraction:.0%} <= {cut} of {longest} tokens, seed {seed})"
    return Documents.from_list(docs, name)


def open_documents(path: str | None, tokenizer: ByteTokenizer | FileTokenizer, *, text_key: str = "text") -> Documents:
    """The documents of a run: the built-in set (``path`` None), or a JSON Lines file (each record's
    ``text_key``) / folder / text file read and encoded by ``tokenizer``."""
    if path is not None and is_token_file(path):
        raise ValueError(f"--pack needs document boundaries, got the token file {path!r}, which has none. Pass "
                         "JSON Lines (one document per record), a folder (one per file), or --pack none")
    if path is None:
        builtin = builtin_documents()
        if isinstance(tokenizer, ByteTokenizer):
            return builtin
        texts = [builtin[k].numpy().tobytes().decode("utf-8") for k in range(len(builtin))]
        digest, name = builtin.sha256, builtin.name
    else:
        texts, raw, name = read_texts(path, text_key)
        digest = hashlib.sha256(raw).hexdigest()
    if isinstance(tokenizer, ByteTokenizer):
        return Documents.from_list([tokenizer.encode(t) for t in texts], name, digest)
    ids = tokenizer.encode_all(texts)
    return Documents.from_list([torch.tensor(d, dtype=torch.int64) for d in ids], name, digest, tokenizer.name)


def run_corpus(data: str | None, tokenizer: str, out: Path, *, data_dtype: str = "uint16", is_main: bool = True,
               wait: Callable[[str], None] | None = None, documents: bool = False,
               text_key: str = "text") -> Corpus | Documents:
    """The corpus of a run (``--data``, ``--tokenizer``, ``--data-dtype``) writing to ``out``; with
    ``documents``, its :class:`~fourfold.data.documents.Documents` instead (for packing). A ``bpe:N`` tokenizer
    is trained by the main rank into ``out/tokenizer.json`` (kept when a run continues there); the others
    ``wait`` for it, then every rank encodes with that one file."""
    def read(tok: ByteTokenizer | FileTokenizer) -> Corpus | Documents:
        return (open_documents(data, tok, text_key=text_key) if documents else
                open_data(data, tok, data_dtype=data_dtype, text_key=text_key))

    if tokenizer.startswith("bpe:") and not (data is not None and is_token_file(data)):
        path = out / "tokenizer.json"
        if is_main and not path.is_file():
            from fourfold.files import atomic_path

            asked = int(tokenizer.partition(":")[2])
            with atomic_path(path) as tmp:
                got = train_bpe(read_texts(data, text_key)[0], asked, tmp).vocab_size
            if got < asked:  # a small corpus has fewer merges to learn: the model's vocabulary is sized as given
                print(f"fourfold train: note: {tokenizer} learned only {got} ids from this corpus (it has fewer "
                      f"merges to make); the model keeps its --vocab-size, whose ids past {got - 1} are never "
                      f"used. Pass --tokenizer bpe:{got} --vocab-size {got} to size it to what was learned.",
                      file=sys.stderr, flush=True)
        if wait is not None:
            wait("train the tokenizer")
        return read(FileTokenizer(path, name=f"{tokenizer} ({path})"))
    return read(load_tokenizer(tokenizer))
