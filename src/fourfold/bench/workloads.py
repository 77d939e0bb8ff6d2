"""The models and data the training-step benchmarks (``dp``, ``tp``, ``pp``) run: the TinyGPT size flags they
share, and each model with its batches as a :class:`Workload`.

    GPT_SIZES                   --gpt-layers, --gpt-d-model, --gpt-heads, --gpt-seq-len; add_size_flags adds them
    gpt_config(ns)              the GPTConfig those flags describe
    gpt(ns, dp_rank, dp_size)   TinyGPT on the corpus, dp_rank's shard of each global batch
    mlp(ns, dp_rank, dp_size)   --mlp-layers Linear(W, W) layers, dp_rank's shard of random rows
    mlp_blocks(ns)              --mlp-blocks TinyGPT MLP blocks (W -> 4W -> W), the whole batch on every rank

Every ``build()`` makes the same weights on every call from its own seeded generator (torch's global RNG is
left alone), so every variant's copy of a model starts equal.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from fourfold.models import GPTConfig

__all__ = ["GPT_SIZES", "Workload", "add_size_flags", "gpt", "gpt_config", "mlp", "mlp_blocks"]

GPT_SIZES = (("gpt-layers", 4, "TinyGPT n_layer"), ("gpt-d-model", 256, "TinyGPT d_model"),
             ("gpt-heads", 4, "TinyGPT n_head"), ("gpt-seq-len", 128, "TinyGPT seq_len"))
"""(flag, default, what it sets): TinyGPT's shape, the same flags in every training-step benchmark."""


def add_size_flags(parser: argparse.ArgumentParser, sizes: Sequence[tuple[str, int, str]]) -> None:
    """``--FLAG N`` (an int, ``what (default: N)``) for each ``(flag, default, what)`` of ``sizes``."""
    for flag, default, what in sizes:
        parser.add_argument(f"--{flag}", type=int, default=default, help=f"{what} (default: {default})")


def gpt_config(ns: argparse.Namespace, **changes: Any) -> GPTConfig:
    """The :class:`~fourfold.models.GPTConfig` of the ``GPT_SIZES`` flags, with ``changes`` (e.g. tie_weights)."""
    from fourfold.models import GPTConfig

    return GPTConfig(seq_len=ns.gpt_seq_len, n_layer=ns.gpt_layers, n_head=ns.gpt_heads, d_model=ns.gpt_d_model,
                     **changes)


class Workload(NamedTuple):
    """A model and its data: ``build()`` the same weights on every call, ``shard(k)`` this rank's rows of
    round k's global batch, ``loss(model(x), y)``."""

    name: str
    describe: str
    build: Callable[[], Any]
    shard: Callable[[int], tuple[Any, Any]]
    loss: Callable[[Any, Any], Any]


def gpt(ns: argparse.Namespace, dp_rank: int, dp_size: int) -> Workload:
    """TinyGPT (``gpt_config``) on the corpus: ``dp_rank``'s sequences of each ``--gpt-batch`` global batch."""
    from fourfold.data import BatchLoader, load_corpus
    from fourfold.models import TinyGPT
    from fourfold.models.gpt import lm_loss

    cfg = gpt_config(ns)
    loader = BatchLoader(load_corpus(), ns.gpt_batch, cfg.seq_len, seed=0, dp_rank=dp_rank, dp_size=dp_size)
    return Workload("gpt", f"TinyGPT L={cfg.n_layer} C={cfg.d_model} H={cfg.n_head} T={cfg.seq_len}, batch "
                    f"{ns.gpt_batch} ({ns.gpt_batch // dp_size}/rank)", lambda: TinyGPT(cfg, seed=0),
                    loader.shard, lm_loss)


def mlp(ns: argparse.Namespace, dp_rank: int, dp_size: int) -> Workload:
    """``--mlp-layers`` Linear(W, W) layers (GELU between), MSE against random targets: ``dp_rank``'s rows of
    each ``--mlp-batch`` global batch."""
    import torch
    from torch import nn

    width, rows = ns.mlp_width, ns.mlp_batch // dp_size

    def build() -> nn.Module:
        layers: list[nn.Module] = []
        for i in range(ns.mlp_layers):
            layers += [nn.Linear(width, width, device="meta")] + ([nn.GELU()] if i < ns.mlp_layers - 1 else [])
        model = nn.Sequential(*layers).to_empty(device="cpu")
        gen = torch.Generator().manual_seed(0)  # our own generator: every copy equal, torch's global RNG untouched
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * width ** -0.5 if p.dim() == 2 else torch.zeros(p.shape))
        return model

    def shard(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(k * dp_size + dp_rank)
        return torch.randn(rows, width, generator=gen), torch.randn(rows, width, generator=gen)  # (B/G, W) x2

    return Workload("mlp", f"MLP {ns.mlp_layers} x Linear({width}, {width}), batch {ns.mlp_batch} ({rows}/rank)",
                    build, shard, nn.functional.mse_loss)


def mlp_blocks(ns: argparse.Namespace) -> Workload:
    """``--mlp-blocks`` TinyGPT MLP blocks of width W (W -> 4W -> W, GELU), MSE against random targets; round
    k's ``--mlp-batch`` rows are the same on every rank."""
    import torch
    from torch import nn

    from fourfold.models import GPTConfig
    from fourfold.models.gpt import MLP

    cfg, width = GPTConfig(d_model=ns.mlp_width, n_head=1), ns.mlp_width

    def build() -> nn.Module:
        with torch.device("meta"):
            model = nn.Sequential(*(MLP(cfg) for _ in range(ns.mlp_blocks)))
        model.to_empty(device="cpu")
        gen = torch.Generator().manual_seed(0)  # every copy equal; torch's global RNG untouched
        for name, param in model.named_parameters():
            fan_in = param.shape[-1]
            nn.init.normal_(param, std=fan_in ** -0.5, generator=gen) if name.endswith("weight") else \
                nn.init.zeros_(param)
        return model

    def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(k)  # round k's batch, the same on every rank
        return torch.randn(ns.mlp_batch, width, generator=gen), torch.randn(ns.mlp_batch, width, generator=gen)

    return Workload("mlp", f"MLP {ns.mlp_blocks} x (Linear({width}, {4 * width}), GELU, Linear({4 * width}, "
                    f"{width})), batch {ns.mlp_batch} rows", build, batch, nn.functional.mse_loss)
