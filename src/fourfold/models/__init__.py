"""Model families and their plans, each plan beside its model: TinyGPT (``gpt``) and its tensor-parallel plan
(``gpt_plan``). :func:`tensor_plan` is how the engine finds a model's plan."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from fourfold.models.gpt import (
    MLP,
    Block,
    CausalSelfAttention,
    Embedding,
    GPTConfig,
    Head,
    TinyGPT,
    lm_loss,
)


def tensor_plan(model: nn.Module) -> Callable[..., nn.Module]:
    """The tensor-parallel plan of ``model``'s family: ``fn(model, group, *, sequence_parallel, tracer)``."""
    from fourfold.models.gpt_plan import parallelize_tinygpt

    plans: dict[type, Callable[..., nn.Module]] = {TinyGPT: parallelize_tinygpt}
    for cls, plan in plans.items():
        if isinstance(model, cls):
            return plan
    raise ValueError(f"tensor parallelism needs a plan for the model, got a {type(model).__name__} and no plan "
                     f"for it. Pass tp_plan={{'module.name': 'column' | 'row' | 'vocab', ...}} to parallelize, "
                     f"or tp=1.")


__all__ = [
    "MLP",
    "Block",
    "CausalSelfAttention",
    "Embedding",
    "GPTConfig",
    "Head",
    "TinyGPT",
    "lm_loss",
    "tensor_plan",
]
