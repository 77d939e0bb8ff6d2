"""Context parallelism: each sequence split over the cp ranks, attention across the pieces.

:mod:`.chunks` says which positions each rank holds (head-tail balanced), :mod:`.kernel` is the block attention
with its log-sum-exp, :mod:`.attention` the three algorithms (all-gather K/V, ring, Ulysses) with their bytes'
theory, :mod:`.split` what the engine holds for the sequence axis. ``docs/context-parallel.md`` explains them.
"""

from fourfold.parallel.context.attention import attend, theory
from fourfold.parallel.context.chunks import causal_work, check_length, pieces, positions
from fourfold.parallel.context.shard import (
    ALGORITHMS,
    Algorithm,
    ContextShard,
    capture_shard,
    current_shard,
    run_codes,
    using_shard,
)
from fourfold.parallel.context.split import WHOLE, ContextParallel, SequenceAxis, WholeSequence

__all__ = ["ALGORITHMS", "WHOLE", "Algorithm", "ContextParallel", "ContextShard", "SequenceAxis", "WholeSequence",
           "attend", "capture_shard", "causal_work", "check_length", "current_shard", "pieces", "positions", "run_codes",
           "theory", "using_shard"]
