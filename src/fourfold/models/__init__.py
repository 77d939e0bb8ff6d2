"""Model families and their plans, each plan beside its model: TinyGPT (``gpt``, ``gpt_plan``), Hugging Face GPT-2
and Llama (``hf``, with ``fourfold[hf]``), and plain ``nn.Sequential`` stacks. :func:`family_of` is how the
engine finds a model's tensor-parallel plan, pipeline split and tp checks."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
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
from fourfold.models.hf import hf_family
from fourfold.parallel.pipeline.blocks import Split
from fourfold.parallel.tensor.layers import computes_linear


@dataclass(frozen=True)
class Family:
    """What fourfold knows of a model family: its tensor-parallel ``plan`` (a ``{module: style}`` mapping, or
    ``fn(model, group, *, sequence_parallel, tracer)``), its pipeline ``split`` (None: the model lists its
    blocks itself), ``check(model, tp, pp)`` run before anything is cut, ``fixups(model, tp)`` after sharding,
    ``examples``:
    inputs showing the dims that may vary, ``documents(model)``, which makes the model keep packed
    documents apart (positions and attention read :func:`fourfold.data.packing.current_layout`), and
    ``regions(model)``: its blocks, final norm and head (None: its norm's output is gathered) by name, around
    which its plan's column -> row modules are entered once each and sequence parallelism runs (:func:`~fourfold.parallel.tensor.regions.shard_regions`)."""

    name: str
    plan: Callable[[nn.Module], Mapping[str, str] | Callable[..., nn.Module]] | None = None
    split: Callable[[nn.Module], Split] | None = None
    check: Callable[[nn.Module, int, int], None] | None = None
    fixups: Callable[[nn.Module, int], None] | None = None
    examples: Callable[[nn.Module], list[torch.Tensor]] | None = None
    documents: Callable[[nn.Module], None] | None = None
    context: Callable[[nn.Module, int], None] | None = None  # cp > 1: make its attention read the shard
    regions: Callable[[nn.Module], tuple[str, str, str | None]] | None = None

    @property
    def splits_sequence(self) -> bool:
        """Whether the family runs sequence parallelism: TinyGPT's plan itself, the others around their regions."""
        return self.name == "tinygpt" or self.regions is not None


def _reads_documents(model: nn.Module, *_: int) -> None:
    """TinyGPT's attention and positions read the layout (and the context-parallel shard) themselves."""


def sequential_plan(model: nn.Module) -> dict[str, str]:
    """An ``nn.Sequential``'s plan: each Linear followed (through elementwise modules only: activations,
    dropout) by another Linear makes a column -> row pair, Megatron's MLP; other layers stay replicated."""
    children = list(model.named_children())
    elementwise = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity, nn.LeakyReLU)
    out: dict[str, str] = {}
    i = 0
    while i < len(children):
        name, module = children[i]
        if computes_linear(module):
            j = i + 1
            while j < len(children) and isinstance(children[j][1], elementwise):
                j += 1
            if j < len(children) and computes_linear(children[j][1]):
                out[name], out[children[j][0]] = "column", "row"
                i = j + 1
                continue
        i += 1
    if not out:
        raise ValueError("tensor parallelism of an nn.Sequential needs a Linear -> (activation) -> Linear pair "
                         f"to split column -> row, got layers {[type(m).__name__ for _, m in children]}. Pass "
                         "tp_plan={'index': 'column' | 'row' | 'vocab'} to parallelize, or tp=1")
    return out


def _tinygpt_plan(model: nn.Module) -> Callable[..., nn.Module]:
    from fourfold.models.gpt_plan import parallelize_tinygpt

    return parallelize_tinygpt


def _hf(name: str) -> Family:
    from fourfold.models import hf

    def check(model: nn.Module, tp: int, pp: int) -> None:
        hf.check_supported(model.config)
        hf.check_tp(model.config, tp)  # type: ignore[union-attr]
        if pp > 1:  # the pipeline's pieces pass the layers fourfold's masks
            hf.check_attention(model, f"a pipeline (pp={pp})")

    def context(model: nn.Module, cp: int) -> None:
        from fourfold.models.hf_context import read_context

        read_context(model, cp)

    return Family(name, plan=hf.plan, split=hf.family_split, check=check, fixups=hf.shard_fixups, examples=hf.examples,
                  documents=hf.read_documents, context=context, regions=hf.block_sites)


def family_of(model: nn.Module) -> Family | None:
    """The family ``model`` belongs to, or None (a model of the user's own: pass ``tp_plan`` and ``split``).

    A model of your own may carry its plan and split as attributes, ``fourfold_tp_plan`` (``{module path:
    style}``) and ``fourfold_split`` (a :class:`Split`): they come first, so ``fourfold train --model
    MODULE:FACTORY`` finds them with no flag."""
    plan, split = getattr(model, "fourfold_tp_plan", None), getattr(model, "fourfold_split", None)
    if plan is not None or split is not None:
        if split is not None and not isinstance(split, Split):
            raise TypeError(f"fourfold_split must be a fourfold.Split, got {type(split).__name__}. Set "
                            "model.fourfold_split = Split(blocks=[...], before=..., block=..., after=...)")
        return Family("own", plan=None if plan is None else lambda m: dict(plan),
                      split=None if split is None else lambda m: split)
    if isinstance(model, TinyGPT):
        return Family("tinygpt", plan=_tinygpt_plan, documents=_reads_documents, context=_reads_documents)
    if isinstance(model, nn.Sequential):
        return Family("sequential", plan=sequential_plan)
    kind = hf_family(model)
    return _hf(kind) if kind is not None else None


def split_of(model: nn.Module, family: Family | None = None) -> Split | None:
    """How a pipeline cuts ``model`` (its family's :class:`Split`), or None: its blocks found by shape. The one
    place a family's split is asked for (``family``: ``family_of(model)``, when the caller has it)."""
    family = family if family is not None else family_of(model)
    return family.split(model) if family is not None and family.split is not None else None


def shard_plan(model: nn.Module) -> Mapping[str, str] | None:
    """What tensor parallelism splits in ``model``, as ``{module: style}`` (for memory estimates), or None when
    fourfold has no plan for it."""
    family = family_of(model)
    if family is None or family.plan is None:
        return None
    if family.name == "tinygpt":
        from fourfold.models.gpt_plan import TINYGPT_SHARDS

        return TINYGPT_SHARDS
    try:
        plan = family.plan(model)
    except ValueError:
        return None
    return plan if isinstance(plan, Mapping) else None


DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout", "dropout")
"""Hugging Face config keys of dropout probabilities (attention's is applied inside its kernel, by no module)."""


def dropout_sites(model: nn.Module) -> list[str]:
    """Where ``model`` draws dropout with p > 0: its config's probabilities (``attn_pdrop=0.1``), its dropout
    modules (``transformer.drop (p=0.1)``). Empty: it draws nothing random in training."""
    config = getattr(model, "config", None)
    found = [f"{key}={getattr(config, key)}" for key in DROPOUT_KEYS
             if isinstance(getattr(config, key, None), float) and getattr(config, key) > 0]
    return found + [f"{name} (p={m.p})" for name, m in model.named_modules() if isinstance(m, DROPOUTS) and m.p > 0]


def tensor_plan(model: nn.Module) -> Mapping[str, str] | Callable[..., nn.Module]:
    """The tensor-parallel plan of ``model``'s family; refused for a model fourfold has no plan for."""
    family = family_of(model)
    if family is None or family.plan is None:
        raise ValueError(f"tensor parallelism needs a plan for the model, got a {type(model).__name__} and no "
                         "plan for it. Pass tp_plan={'module.path': 'column' | 'row' | 'vocab' | 'head', ...} "
                         "to parallelize (wildcards: 'layers.*.mlp.up'; from fourfold train --model "
                         "MODULE:FACTORY, set model.fourfold_tp_plan to it), or tp=1.")
    return family.plan(model)


__all__ = [
    "split_of",
    "DROPOUTS",
    "DROPOUT_KEYS",
    "dropout_sites",
    "MLP",
    "Block",
    "CausalSelfAttention",
    "Embedding",
    "Family",
    "GPTConfig",
    "Head",
    "TinyGPT",
    "family_of",
    "lm_loss",
    "sequential_plan",
    "shard_plan",
    "tensor_plan",
]
