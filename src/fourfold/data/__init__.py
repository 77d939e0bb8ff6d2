"""Data: the corpus (built-in, text, JSON Lines, or token ids memory-mapped), tokenizers, and the loader that
gives every data-parallel rank its shard of the same global batch. See :mod:`fourfold.data.corpus`,
:mod:`fourfold.data.tokenizers` and :mod:`fourfold.data.loader`."""

from fourfold.data.corpus import (
    DEFAULT_MAX_BYTES,
    TOKEN_DTYPES,
    Corpus,
    is_token_file,
    load_corpus,
    open_data,
    read_texts,
    run_corpus,
    token_range,
)
from fourfold.data.loader import BatchLoader
from fourfold.data.tokenizers import ByteTokenizer, FileTokenizer, load_tokenizer, train_bpe, vocab_of

__all__ = ["DEFAULT_MAX_BYTES", "TOKEN_DTYPES", "BatchLoader", "ByteTokenizer", "Corpus", "FileTokenizer",
           "is_token_file", "load_corpus", "load_tokenizer", "open_data", "read_texts", "run_corpus", "token_range",
           "train_bpe", "vocab_of"]
