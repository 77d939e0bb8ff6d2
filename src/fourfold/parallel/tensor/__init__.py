"""Tensor parallelism (Megatron-LM): ``comm`` (the conjugate collectives f/g and the sequence-parallel pair),
``layers`` (column/row-parallel linear, vocabulary-parallel embedding), ``loss`` (cross-entropy of sharded
logits), ``plan`` (shard a model by ``{module: style}``, gather it whole), ``regions`` (each column -> row module entered
once, and sequence parallelism around them). Knows no model: TinyGPT's plan is
:mod:`fourfold.models.gpt_plan`.
"""

from __future__ import annotations

from fourfold.parallel.tensor.comm import Group
from fourfold.parallel.tensor.layers import (
    REPLICATED,
    ColumnParallelLinear,
    RowParallelLinear,
    ShardLayout,
    Style,
    VocabParallelEmbedding,
    is_conv1d,
    shard,
    unshard,
)
from fourfold.parallel.tensor.loss import vocab_parallel_cross_entropy
from fourfold.parallel.tensor.plan import (
    HF_STYLES,
    LazyState,
    ParameterBytes,
    expand_plan,
    fill_pieces,
    gather_full,
    gather_state_dict,
    heads,
    load_full_state_dict,
    parameter_bytes,
    shard_layouts,
    sum_partial_grads,
    sync_replicated_grads,
    tensor_parallel,
)
from fourfold.parallel.tensor.regions import shard_regions

__all__ = [
    "REPLICATED",
    "ColumnParallelLinear",
    "Group",
    "HF_STYLES",
    "ShardLayout",
    "LazyState",
    "ParameterBytes",
    "RowParallelLinear",
    "Style",
    "VocabParallelEmbedding",
    "expand_plan",
    "fill_pieces",
    "gather_full",
    "gather_state_dict",
    "heads",
    "is_conv1d",
    "load_full_state_dict",
    "parameter_bytes",
    "shard",
    "shard_layouts",
    "shard_regions",
    "sum_partial_grads",
    "sync_replicated_grads",
    "tensor_parallel",
    "unshard",
    "vocab_parallel_cross_entropy",
]
