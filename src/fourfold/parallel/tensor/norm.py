"""An RMSNorm over features tensor parallelism splits: OLMo 2's q/k norms, which normalise a token's query (or
key) over all its heads at once, after a column-parallel projection has left each rank its own heads.

Rank i holds its slice w_i of the weight and sees its slice x_i of a token's n features; the mean square is the
whole token's:

    y_i = x_i / sqrt(sum_j |x_j|^2 / n + eps) * w_i

so each rank adds its part of the sum of squares (its mean times n_i / n) and one all-reduce of B x T values
makes the whole (:func:`~fourfold.parallel.tensor.comm.sum_over_tp`; its backward sums every rank's gradient of
that statistic). Nothing else moves: the heads stay split through the norm, rotary and attention, as Megatron-LM
keeps them. transformers' own plan for OLMo 2 gathers q, k and v whole on every rank instead, so every rank
computes every head.

The arithmetic follows the module it replaces, found by trying it (:func:`numerics`): transformers' RMSNorm
computes in float32 whatever the input's dtype and multiplies by the weight before casting back; torch's
``nn.RMSNorm`` computes in the input's dtype. A norm that is neither (Gemma's ``1 + weight``) is refused by name.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fourfold.observe.trace import Tracer
from fourfold.parallel.tensor.comm import Group, sum_over_tp
from fourfold.parallel.tensor.layers import Layout, _copy_shards, _divisible

__all__ = ["ShardedRMSNorm", "numerics"]


class ShardedRMSNorm(nn.Module):
    """RMSNorm over ``features`` split p ways: this rank's ``features / p`` of them and of the weight, the mean
    square over all ``features`` (one all-reduce of a value per token). ``upcast``: computed in float32 whatever
    the input's dtype, the weight applied before casting back (transformers' RMSNorm); else in the input's dtype
    (``nn.RMSNorm``)."""

    def __init__(self, features: int, group: Group, *, eps: float, upcast: bool, tracer: Tracer | None = None,
                 site: str = "", device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.rank, self.tp = dist.get_rank(group), dist.get_world_size(group)
        _divisible("the norm's features", features, self.tp)
        self.features, self.eps, self.upcast = features, eps, upcast
        self.group, self.tracer, self.site = group, tracer, site
        self.weight = nn.Parameter(torch.ones(features // self.tp, device=device, dtype=dtype))

    def layouts(self) -> dict[str, Layout]:
        return {"weight": Layout(0)}

    @classmethod
    @torch.no_grad()
    def from_norm(cls, norm: nn.Module, group: Group, **kw: Any) -> ShardedRMSNorm:
        """This rank's slice of ``norm``'s weight, computing as ``norm`` does (:func:`numerics`)."""
        weight = getattr(norm, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
            raise TypeError(f"plan style 'norm' shards an RMSNorm's 1-D weight, got {type(norm).__name__} with "
                            f"weight {None if weight is None else tuple(weight.shape)}. Use it on an RMSNorm "
                            "with a learned scale")
        eps, upcast = numerics(norm)
        layer = cls(weight.numel(), group, eps=eps, upcast=upcast, device=weight.device, dtype=weight.dtype, **kw)
        _copy_shards(layer, norm)  # type: ignore[arg-type]
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.weight, self.eps, self.upcast, self.features,
                         lambda part: sum_over_tp(part, self.group, tracer=self.tracer, site=self.site))

    def extra_repr(self) -> str:
        return f"{self.features} (/{self.tp}), eps={self.eps}, {'float32' if self.upcast else 'input dtype'}"


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, upcast: bool, features: int,
              total: Any) -> torch.Tensor:
    """x / sqrt(mean square over ``features`` + eps) * weight; ``total`` sums this rank's part over the ranks.
    The part is the local mean times the local share, so with every feature here it is the mean, exactly."""
    dtype = x.dtype
    h = x.to(torch.float32) if upcast else x
    square = h.pow(2).mean(-1, keepdim=True)
    if h.shape[-1] != features:
        square = square * (h.shape[-1] / features)
    h = h * torch.rsqrt(total(square) + eps)
    return (weight * h).to(dtype)


@torch.no_grad()
def numerics(norm: nn.Module) -> tuple[float, bool]:
    """``(eps, upcast)`` of ``norm``, found by running a copy of it (a random weight, float64 input) beside both
    computations :class:`ShardedRMSNorm` knows: the one that matches it to 1e-12 (the other is float32's 1e-7
    away). Refused, naming the module, when neither does."""
    weight = norm.weight
    assert isinstance(weight, torch.Tensor)
    eps = getattr(norm, "variance_epsilon", None)
    eps = getattr(norm, "eps", None) if eps is None else eps
    eps = float(torch.finfo(weight.dtype).eps if eps is None else eps)  # nn.RMSNorm's eps=None
    probe = copy.deepcopy(norm).to_empty(device="cpu").double()  # any device, meta included: values of our own
    gen = torch.Generator().manual_seed(0)
    probe_weight = probe.weight
    assert isinstance(probe_weight, torch.Tensor)
    probe_weight.copy_(torch.rand(weight.shape, generator=gen, dtype=torch.float64) + 0.5)
    x = torch.randn(3, weight.numel(), generator=gen, dtype=torch.float64)
    want = probe(x)
    errors = {}
    for upcast in (True, False):
        got = _rms_norm(x, probe_weight, eps, upcast, weight.numel(), lambda part: part)
        errors[upcast] = ((got - want).abs().max() / want.abs().max()).item() if got.shape == want.shape else 1.0
        if errors[upcast] <= 1e-12:
            return eps, upcast
    raise ValueError(f"plan style 'norm' computes an RMSNorm, x / sqrt(mean(x^2) + eps) * weight, got a "
                     f"{type(norm).__name__} that computes otherwise (relative difference {min(errors.values()):.2g} "
                     f"on a test input). Gather its input whole instead: shard the layer before it as 'head' "
                     "(Hugging Face's colwise_gather_output)")
