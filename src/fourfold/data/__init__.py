"""Data: the corpus (built-in, text, JSON Lines, or token ids memory-mapped), tokenizers, documents and their
packing, and the loaders that give every data-parallel rank its shard of the same global batch. See
:mod:`fourfold.data.corpus`, :mod:`fourfold.data.tokenizers`, :mod:`fourfold.data.loader` (windows of a stream),
:mod:`fourfold.data.documents` and :mod:`fourfold.data.packing` (whole documents, packed)."""

from fourfold.data.corpus import (
    DEFAULT_MAX_BYTES,
    TOKEN_DTYPES,
    Corpus,
    is_token_file,
    load_corpus,
    open_data,
    read_texts,
    token_range,
)
from fourfold.data.documents import Documents, builtin_documents, open_documents, run_corpus, skewed_documents
from fourfold.data.loader import Batch, BatchLoader
from fourfold.data.packing import PACKINGS, DocumentLoader, current_layout, document_layout
from fourfold.data.tokenizers import ByteTokenizer, FileTokenizer, load_tokenizer, train_bpe, vocab_of

__all__ = ["DEFAULT_MAX_BYTES", "PACKINGS", "TOKEN_DTYPES", "Batch", "BatchLoader", "ByteTokenizer", "Corpus",
           "DocumentLoader", "Documents", "FileTokenizer", "builtin_documents", "current_layout", "document_layout",
           "is_token_file", "load_corpus", "load_tokenizer", "open_data", "open_documents", "read_texts",
           "run_corpus", "skewed_documents", "token_range", "train_bpe", "vocab_of"]
