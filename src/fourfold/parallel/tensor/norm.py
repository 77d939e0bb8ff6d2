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

The arithmetic follows the module it replaces, found by trying it (:func:`numerics`): transformers' RMSNorms
compute in float32 whatever the input's dtype, and multiply by the weight after casting back (Llama's, Qwen's) or
before (OLMo's, T5's); torch's ``nn.RMSNorm`` computes in the input's dtype. A norm that is none of these
(Gemma's ``1 + weight``) is refused by name.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fourfold.observe.trace import Tracer
from fourfold.parallel.tensor.comm import Group, sum_over_tp
from fourfold.parallel.tensor.layers import ShardLayout, _copy_shards, _divisible

__all__ = ["ARITHMETIC", "ShardedRMSNorm", "numerics"]

ARITHMETIC = ("input", "float32, weight after the cast", "float32, weight before the cast")
"""The RMSNorms :class:`ShardedRMSNorm` computes as: ``nn.RMSNorm``'s (in the input's dtype); transformers' Llama
RMSNorm (``weight * h.to(dtype)``); OLMo's and T5's (``(weight * h).to(dtype)``), h computed in float32."""


class ShardedRMSNorm(nn.Module):
    """RMSNorm over ``features`` split p ways: this rank's ``features / p`` of them and of the weight, the mean
    square over all ``features`` (one all-reduce of a value per token). ``arithmetic``: one of
    :data:`ARITHMETIC`. ``eps`` None: the input dtype's machine epsilon, as ``nn.RMSNorm``'s default."""

    def __init__(self, features: int, group: Group, *, eps: float | None, arithmetic: str,
                 tracer: Tracer | None = None, site: str = "", device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if arithmetic not in ARITHMETIC:
            raise ValueError(f"arithmetic must be one of {ARITHMETIC}, got {arithmetic!r}.")
        self.rank, self.tp = dist.get_rank(group), dist.get_world_size(group)
        _divisible("the norm's features", features, self.tp)
        self.features, self.eps, self.arithmetic = features, eps, arithmetic
        self.group, self.tracer, self.site = group, tracer, site
        self.weight = nn.Parameter(torch.ones(features // self.tp, device=device, dtype=dtype))

    def layouts(self) -> dict[str, ShardLayout]:
        return {"weight": ShardLayout(0)}

    @classmethod
    @torch.no_grad()
    def from_norm(cls, norm: nn.Module, group: Group, **kw: Any) -> ShardedRMSNorm:
        """This rank's slice of ``norm``'s weight, computing as ``norm`` does (:func:`numerics`)."""
        weight = getattr(norm, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
            raise TypeError(f"plan style 'norm' shards an RMSNorm's 1-D weight, got {type(norm).__name__} with "
                            f"weight {None if weight is None else tuple(weight.shape)}. Use it on an RMSNorm "
                            "with a learned scale")
        eps, arithmetic = numerics(norm)
        layer = cls(weight.numel(), group, eps=eps, arithmetic=arithmetic, device=weight.device, dtype=weight.dtype,
                    **kw)
        _copy_shards(layer, norm)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.weight, self.eps, self.arithmetic, self.features,
                         lambda part: sum_over_tp(part, self.group, tracer=self.tracer, site=self.site))

    def extra_repr(self) -> str:
        return f"{self.features} (/{self.tp}), eps={self.eps}, {self.arithmetic}"


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float | None, arithmetic: str, features: int,
              total: Any) -> torch.Tensor:
    """x / sqrt(mean square over ``features`` + eps) * weight; ``total`` sums this rank's part over the ranks.
    The part is the local mean times the local share, so with every feature here it is the mean, exactly."""
    dtype = x.dtype
    h = x if arithmetic == "input" else x.to(torch.float32)
    square = h.pow(2).mean(-1, keepdim=True)
    if h.shape[-1] != features:
        square = square * (h.shape[-1] / features)
    h = h * torch.rsqrt(total(square) + (torch.finfo(h.dtype).eps if eps is None else eps))
    if arithmetic == "float32, weight after the cast":
        return weight * h.to(dtype)
    return (weight * h).to(dtype)


@torch.no_grad()
def numerics(norm: nn.Module) -> tuple[float | None, str]:
    """``(eps, arithmetic)`` of ``norm``: a copy of it (a random weight) is run beside each of :data:`ARITHMETIC`
    on a float64 input, where the one that computes as it does matches it to 1e-12 (the others are float32's
    1e-7 away), and then on bfloat16, where only the right order of cast and weight matches it bit for bit.
    Refused, naming the module, when none does."""
    weight = norm.weight
    assert isinstance(weight, torch.Tensor)
    eps = getattr(norm, "variance_epsilon", None)
    eps = getattr(norm, "eps", None) if eps is None else eps  # None: nn.RMSNorm's, the input dtype's epsilon
    eps = None if eps is None else float(eps)
    gen = torch.Generator().manual_seed(0)
    candidates = list(ARITHMETIC)
    for dtype, tolerance in ((torch.float64, 1e-12), (torch.bfloat16, 0.0)):
        probe = _copy(norm, dtype)
        probe_weight = probe.weight
        assert isinstance(probe_weight, torch.Tensor)
        probe_weight.copy_(torch.rand(weight.shape, generator=gen, dtype=torch.float64) + 0.5)
        x = torch.randn(3, weight.numel(), generator=gen, dtype=torch.float64).to(dtype)
        want = probe(x).double()
        candidates = [a for a in candidates if _error(x, probe_weight, eps, a, want) <= tolerance]
        if len(candidates) <= 1:
            break
    if candidates:
        return eps, candidates[0]
    raise ValueError(f"plan style 'norm' computes an RMSNorm, x / sqrt(mean(x^2) + eps) * weight, got a "
                     f"{type(norm).__name__} that computes otherwise on a test input. Gather its input whole "
                     "instead: shard the layer before it as 'head' (Hugging Face's colwise_gather_output)")


def _error(x: torch.Tensor, weight: torch.Tensor, eps: float | None, arithmetic: str, want: torch.Tensor) -> float:
    """How far ``arithmetic`` on ``x`` (all the features here) is from ``want``, relative to its largest value."""
    got = _rms_norm(x, weight, eps, arithmetic, x.shape[-1], lambda part: part).double()
    return ((got - want).abs().max() / want.abs().max()).item() if got.shape == want.shape else float("inf")


def _copy(norm: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``norm`` on the CPU in ``dtype``, its buffers kept (a meta module's are made empty: it has none
    to keep)."""
    if any(t.is_meta for t in [*norm.parameters(), *norm.buffers()]):
        return copy.deepcopy(norm).to_empty(device="cpu").to(dtype)
    return copy.deepcopy(norm).to("cpu", dtype)
