"""TinyGPT: a small decoder-only transformer, the reference model for fourfold's demos, tests and benchmarks.

The model is a plain stack ``embed -> blocks[0..L-1] -> head`` where every stage maps one tensor to one
tensor, so parallel strategies can cut it anywhere::

    import torch
    from fourfold.models import GPTConfig, TinyGPT

    model = TinyGPT(GPTConfig(n_layer=2), seed=0)
    idx = torch.randint(0, 256, (4, 64))               # (B, T)
    logits, loss = model(idx, targets=idx)             # (B, T, V), scalar
    pipe = torch.nn.Sequential(*model.layers())        # the same function, stage by stage
    assert torch.equal(pipe(idx), logits)

Initialisation is a pure function of ``seed``: it draws from its own ``torch.Generator`` in float64 on the
CPU and never touches torch's global RNG, so every rank of any layout can build the same weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from fourfold.loss import lm_loss
from fourfold.models.attention import causal_attention, position_ids
from fourfold.models.meta import on_meta

__all__ = [
    "MLP",
    "Block",
    "CausalSelfAttention",
    "Embedding",
    "GPTConfig",
    "Head",
    "TinyGPT",
    "lm_loss",
]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a TinyGPT: V = vocab_size, T = seq_len (the context length), L = n_layer, C = d_model."""

    vocab_size: int = 256
    seq_len: int = 64
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.0
    tie_weights: bool = True
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {name}={value!r}. Pass {name}>=1")
        if self.d_model % self.n_head != 0:
            fix = self.n_head * max(1, round(self.d_model / self.n_head))
            raise ValueError(
                f"d_model must be divisible by n_head, got d_model={self.d_model}, n_head={self.n_head}. "
                f"Pass d_model={fix} or an n_head that divides {self.d_model}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got dropout={self.dropout}. Pass e.g. dropout=0.1")


class Embedding(nn.Module):
    """x[b, t] = wte[idx[b, t]] + wpe[t], then dropout: (B, T) token ids -> (B, T, C)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.seq_len = config.seq_len
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.dim() != 2:
            raise ValueError(
                f"idx must have shape (B, T), got shape {tuple(idx.shape)}. Add a batch dimension"
            )
        T = idx.size(1)
        if T > self.seq_len:
            raise ValueError(
                f"sequence length must be at most seq_len, got T={T} > seq_len={self.seq_len}. "
                f"Crop the input to its last {self.seq_len} tokens or build the model with seq_len>={T}"
            )
        pos = position_ids(idx)  # (T,), or (B, T) restarting at each packed document
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)


class CausalSelfAttention(nn.Module):
    """softmax(Q K^T / sqrt(d_head) + M) V over n_head heads, M masking j > i; then y W_proj."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        p = self.dropout if self.training else 0.0
        y = causal_attention(q, k, v, p)  # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_drop(self.proj(y))  # (B, T, C)


class MLP(nn.Module):
    """dropout(GELU(x W_fc) W_proj): C -> 4C -> C."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model, bias=config.bias)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(4 * config.d_model, config.d_model, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.gelu(self.fc(x))))  # (B, T, C)


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then + mlp(ln2(.)): (B, T, C) -> (B, T, C)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))  # (B, T, C)
        return x + self.mlp(self.ln2(x))  # (B, T, C)


class Head(nn.Module):
    """logits = LayerNorm(x) W_lm^T: (B, T, C) -> (B, T, V)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.d_model, bias=config.bias)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))  # (B, T, V)


class TinyGPT(nn.Module):
    """logits = head(blocks[L-1](... blocks[0](embed(idx)))), deterministic from ``seed``."""

    def __init__(
        self,
        config: GPTConfig,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}. Pass GPTConfig(...)")
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point dtype, got dtype={dtype}. Pass torch.float32")
        self.config = config
        self.seed = seed
        # Build on the meta device so nn.Linear/nn.Embedding's own init never draws from the global RNG;
        # every value is then written by _init_parameters from our generator.
        with on_meta():
            self.embed = Embedding(config)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
            self.head = Head(config)
        self.to(dtype=dtype).to_empty(device=device)
        if config.tie_weights:
            self.head.lm_head.weight = self.embed.wte.weight  # one Parameter, seen by both modules
        self._init_parameters(seed)

    @torch.no_grad()
    def _init_parameters(self, seed: int) -> None:
        """Fill every parameter in registration order from one float64 CPU generator, then cast."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        std = 0.02
        # GPT-2's scaled init (Radford et al. 2019, sec. 2.3): each block adds two residual branches, so the
        # projections that write into the residual stream get std / sqrt(2L), keeping the stream's variance
        # independent of depth.
        resid_std = std / math.sqrt(2 * self.config.n_layer)
        resid_proj = {m for name, m in self.named_modules() if name.endswith(("attn.proj", "mlp.proj"))}
        seen: set[int] = set()
        for module in self.modules():
            for name, p in module.named_parameters(recurse=False):
                if id(p) in seen or p.is_meta:  # a tied weight is drawn once, by its first owner (embed.wte);
                    continue  # on the meta device there is nothing to fill (shapes only: memory estimates)
                seen.add(id(p))
                if isinstance(module, nn.LayerNorm):
                    value = torch.ones(p.shape, dtype=torch.float64) if name == "weight" else None
                elif name == "bias":
                    value = None
                else:
                    value = torch.empty(p.shape, dtype=torch.float64)
                    value.normal_(0.0, resid_std if module in resid_proj else std, generator=gen)
                if value is None:
                    p.zero_()
                else:
                    p.copy_(value)  # float64 CPU -> the model's dtype and device, rounding once

    def layers(self) -> list[nn.Module]:
        """The model as a list of stages, ``[embed, *blocks, head]``; composing them gives forward's logits."""
        return [self.embed, *self.blocks, self.head]

    def example_inputs(self) -> list[torch.Tensor]:
        """Two inputs differing in batch and length, for the pipeline split to learn which dims may vary."""
        device = next(self.parameters()).device
        T = self.config.seq_len
        return [torch.zeros(1, T, dtype=torch.long, device=device),
                torch.zeros(2, max(T - 1, 1), dtype=torch.long, device=device)]

    def num_parameters(self) -> int:
        """Number of scalar parameters, counting a tied weight once."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(idx)  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        logits = self.head(x)  # (B, T, V)
        if targets is None:
            return logits
        return logits, lm_loss(logits, targets)
