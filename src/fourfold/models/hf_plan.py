"""Each Hugging Face family's tensor-parallel plan (:mod:`fourfold.models.hf`): GPT-2's is fourfold's
(transformers ships none), the Llama-shaped families' the one each model carries (``model.tp_plan``, Hugging
Face's vocabulary, read by :func:`~fourfold.parallel.tensor.tensor_parallel`), Gemma's applied around its scaled
embedding, Phi-3's fused projections split block by block.

The attention modules find their head count from the (split) projection's width, so a column-parallel q/k/v
gives each rank its own heads; GPT-2's ``split_size`` and Phi-3's head counts, which slice a fused output, are
what must follow (:func:`shard_fixups`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fourfold.parallel.tensor.layers import ColumnParallelLinear

__all__ = ["GPT2_PLAN", "fused_plan", "plan", "block_sites", "shard_fixups"]


GPT2_PLAN = {
    "transformer.wte": "vocab",
    "transformer.h.*.attn.c_attn": "column:3",  # [W_q | W_k | W_v]: each part split by heads
    "transformer.h.*.attn.c_proj": "row",
    "transformer.h.*.mlp.c_fc": "column",
    "transformer.h.*.mlp.c_proj": "row",
    "lm_head": "head",  # tied to wte: both split by vocabulary rows
}


def block_sites(model: nn.Module) -> tuple[str, str, str | None]:
    """The family's blocks, the norm between the last one and the head, and the head where it reads the norm's
    output position by position (None: GPT-2, whose model reshapes that output by the whole sequence's length):
    where its attention and MLP are entered once each, and sequence parallelism runs
    (:func:`~fourfold.parallel.tensor.regions.shard_regions`)."""
    if _kind(model) == "gpt2":
        return "transformer.h", "transformer.ln_f", None
    return "model.layers", "model.norm", "lm_head"


def _kind(model: nn.Module) -> str | None:
    """The Hugging Face ``model_type`` of a causal LM (one with ``lm_head``), as
    :func:`~fourfold.models.hf.hf_family` reads it (that module imports this one)."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    return kind if hasattr(model, "lm_head") else None


def plan(model: nn.Module) -> dict[str, str] | Callable[..., nn.Module]:
    """The model's tensor-parallel plan: fourfold's for GPT-2, the model's own (``tp_plan``) for the others;
    Gemma's applied around its scaled embedding (:func:`_scaled_embedding_plan`)."""
    if _kind(model) == "gpt2":
        return dict(GPT2_PLAN)
    carried = dict(getattr(model, "tp_plan", None) or {})
    if not carried:
        raise ValueError(f"tensor parallelism needs a plan, got a {type(model).__name__} carrying none "
                         "(model.tp_plan is empty). Pass tp_plan={'module.path': 'column' | 'row' | ...}")
    if _scaled_embedding(model):  # Gemma's, Gemma 2's, Gemma 3's
        return functools.partial(_scaled_embedding_plan, carried)
    if _kind(model) == "phi3":
        return {**carried, **fused_plan(model.config)}
    if _kind(model) in QK_NORMS_OVER_HEADS:
        return {**carried, **qk_norm_plan()}
    return carried


QK_NORMS_OVER_HEADS = ("olmo2", "olmo3")
"""Families whose q/k norms normalise all of a token's heads at once (``q_norm`` over ``heads * head_dim``)."""


def qk_norm_plan() -> dict[str, str]:
    """OLMo's attention split as Megatron splits it. Its own plan gathers q, k and v whole on every rank
    (``colwise_gather_output``, "due to the added norm on q and k"), so every rank computes every head; here each
    rank keeps its heads (``column``, then ``row`` for ``o_proj``) and its slice of each norm's weight, and the
    norms' mean square is summed over the ranks (style ``norm``: one all-reduce of a value per token)."""
    attention = "model.layers.*.self_attn"
    return {f"{attention}.q_proj": "column", f"{attention}.k_proj": "column", f"{attention}.v_proj": "column",
            f"{attention}.o_proj": "row", f"{attention}.q_norm": "norm", f"{attention}.k_norm": "norm"}


def fused_plan(config: Any) -> dict[str, str]:
    """Phi-3's fused projections split as Megatron splits them. Its own plan gathers ``qkv_proj`` and
    ``gate_up_proj`` whole on every rank (``colwise_gather_output``) because its forward slices them; here each
    rank takes its heads of q, of k and of v (``column:<q>,<kv>,<kv>``, in heads) and its slice of gate and of
    up (``column:2``), so attention and the MLP run on this rank's part only, as Llama's separate projections do.
    The attention's slicing then reads this rank's head counts (:func:`shard_fixups`)."""
    q, kv = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    layers = "model.layers.*"
    return {f"{layers}.self_attn.qkv_proj": f"column:{q},{kv},{kv}", f"{layers}.self_attn.o_proj": "row",
            f"{layers}.mlp.gate_up_proj": "column:2", f"{layers}.mlp.down_proj": "row"}


def _scaled_embedding(model: nn.Module) -> bool:
    """Whether the token embedding scales what it looks up (``embed_scale``: the Gemma families')."""
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    return hasattr(embed, "embed_scale")


def _scaled_embedding_plan(carried: dict[str, str], model: nn.Module, group: Any, *, sequence_parallel: bool,
                           tracer: Any) -> nn.Module:
    """Gemma's plan: its token embedding multiplies what it looks up by ``embed_scale`` (sqrt(hidden_size)), in a
    subclass of ``nn.Embedding`` the vocabulary-parallel style does not take as it is. The table is sharded as a
    plain embedding's (tied to the head still), and the scale applied to the summed lookup, as Gemma's does.
    ``sequence_parallel`` is applied after (:func:`~fourfold.parallel.tensor.regions.shard_regions`), the
    embedding's output whole as without it."""
    from fourfold.parallel.tensor import tensor_parallel

    scaled: Any = model.get_submodule("model.embed_tokens")
    plain = nn.Embedding(scaled.num_embeddings, scaled.embedding_dim, scaled.padding_idx, device="meta",
                         dtype=scaled.weight.dtype)
    plain.weight = scaled.weight  # the same parameter: the head's tie holds
    model.get_submodule("model").embed_tokens = plain
    out = tensor_parallel(model, carried, group, tracer=tracer)
    out.get_submodule("model.embed_tokens").register_forward_hook(functools.partial(_scale, scaled.embed_scale))
    return out


def _scale(scale: torch.Tensor, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    return output * scale.to(output.dtype)  # as GemmaTextScaledWordEmbedding: the scale in the table's dtype


def shard_fixups(model: nn.Module, tp: int) -> None:
    """After sharding: GPT-2's attention splits its c_attn output by ``split_size``, now C/tp per part; Phi-3's
    slices its qkv_proj output by the config's head counts, which each attention now reads as this rank's."""
    family = _kind(model)
    module: Any
    for module in model.modules():
        if family == "gpt2" and hasattr(module, "split_size") and isinstance(getattr(module, "c_attn", None),
                                                                             ColumnParallelLinear):
            module.split_size //= tp
            module.num_heads //= tp
        elif family == "phi3" and isinstance(getattr(module, "qkv_proj", None), ColumnParallelLinear) \
                and not isinstance(module.config, _RankHeads):  # split by the plan, and not already fixed
            module.config = _RankHeads(module.config, tp)
            module.num_key_value_heads //= tp


class _RankHeads:
    """A model's config as one tensor-parallel rank's attention reads it: its share of the query and key/value
    heads; every other attribute the model's own (read through, so a later ``set_attn_implementation`` on the model
    reaches it)."""

    def __init__(self, config: Any, tp: int) -> None:
        self._config = config
        self.num_attention_heads = config.num_attention_heads // tp
        self.num_key_value_heads = (config.num_key_value_heads or config.num_attention_heads) // tp

    def __getattr__(self, name: str) -> Any:
        if name == "_config":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self._config, name)
