"""Tensor parallelism (Megatron-LM): ``comm`` (the conjugate collectives f/g and the sequence-parallel pair),
``layers`` (column/row-parallel linear, vocabulary-parallel embedding), ``loss`` (cross-entropy of sharded
logits), ``plan`` (shard a model by ``{module: style}``, gather it whole). Knows no model: TinyGPT's plan is
:mod:`fourfold.models.gpt_plan`.
"""

from __future__ import annotations

from fourfold.parallel.tensor.comm import Group
from fourfold.parallel.tensor.layers import (
    REPLICATED,
    ColumnParallelLinear,
    Layout,
    RowParallelLinear,
    Style,
    VocabParallelEmbedding,
    shard,
    unshard,
)
from fourfold.parallel.tensor.loss import vocab_parallel_cross_entropy
from fourfold.parallel.tensor.plan import (
    ParameterBytes,
    gather_full,
    gather_state_dict,
    load_full_state_dict,
    parameter_bytes,
    shard_layouts,
    sum_partial_grads,
    sync_replicated_grads,
    tensor_parallel,
)

__all__ = [
    "REPLICATED",
    "ColumnParallelLinear",
    "Group",
    "Layout",
    "ParameterBytes",
    "RowParallelLinear",
    "Style",
    "VocabParallelEmbedding",
    "gather_full",
    "gather_state_dict",
    "load_full_state_dict",
    "parameter_bytes",
    "shard",
    "shard_layouts",
    "sum_partial_grads",
    "sync_replicated_grads",
    "tensor_parallel",
    "unshard",
    "vocab_parallel_cross_entropy",
]
