"""The data of a ``fourfold train`` run, from its flags: the loader each dp rank reads (windows of a corpus, or
its documents packed), with the held-out batches ``--eval-every`` evaluates kept out of training. ``train``,
``--verify``'s one-process re-run and the demo all build it here, so they read the same batches.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from fourfold.data.documents import Documents, run_corpus
from fourfold.data.loader import BatchLoader
from fourfold.data.packing import DocumentLoader

if TYPE_CHECKING:
    from fourfold.config import Config

__all__ = ["held_batches", "make_loader"]


def make_loader(cfg: Config, out: Path, *, dp_rank: int = 0, dp_size: int = 1, vocab_size: int | None = None,
                is_main: bool = True, wait: Any = None) -> tuple[BatchLoader | DocumentLoader, dict[str, Any]]:
    """The run's loader (windows of the corpus, or with ``--pack`` its documents packed) for one dp rank, and
    what run.json records of the data."""
    t = cfg.train
    p = cfg.parallel
    corpus = run_corpus(cfg.data.data, cfg.data.tokenizer, out, data_dtype=cfg.data.data_dtype, is_main=is_main, wait=wait,
                        documents=cfg.data.pack != "none", text_key=cfg.data.text_key)
    if isinstance(corpus, Documents):
        budget = {"tokens_per_step": cfg.data.tokens_per_step} if cfg.data.tokens_per_step else {"docs_per_step": t.batch_size}
        loader: BatchLoader | DocumentLoader = DocumentLoader(
            corpus, cfg.model.seq_len, t.seed, dp_rank, dp_size, packing=cfg.data.pack,  # type: ignore[arg-type]
            row_multiple=p.microbatches if p.pp > 1 else p.grad_accum, width_multiple=p.tp if p.sequence_parallel else 1,
            truncate=cfg.data.truncate_documents, vocab_size=vocab_size, eval_batches=held_batches(t.eval_every, t.eval_batches),
            eval_docs=t.batch_size, **budget)
        size = {"documents": len(corpus), "tokens": corpus.tokens.numel(), "packing": cfg.data.pack}
    else:
        loader = BatchLoader(corpus, t.batch_size, cfg.model.seq_len, t.seed, dp_rank=dp_rank, dp_size=dp_size,
                             vocab_size=vocab_size, eval_batches=held_batches(t.eval_every, t.eval_batches))
        size = {"tokens": len(corpus)}
    return loader, {"name": corpus.name, "sha256": corpus.sha256, **size, "tokenizer": corpus.tokenizer}


def held_batches(eval_every: int, eval_batches: int) -> int:
    """The held-out batches the data keeps from training: --eval-batches when --eval-every evaluates."""
    return eval_batches if eval_every else 0
