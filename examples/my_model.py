"""A model of your own, ready for every fourfold strategy: its tensor-parallel plan and pipeline split ride on
the module as two attributes, so ``fourfold train`` needs nothing but its name.

    cd examples
    fourfold train --model my_model:build --nproc 2 --tp 2             # Megatron MLPs, the head split by vocabulary
    fourfold train --model my_model:build --nproc 2 --pp 2 --microbatches 2
    fourfold train --model my_model:build --model-config my_model.json # build(**that JSON object)

The model: token and position embeddings, ``layers`` residual blocks (a causal running mean mixes positions, an
MLP transforms them), a final norm and a vocabulary head. See docs/your-model.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fourfold import Split


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        count = torch.arange(1, h.shape[1] + 1, device=h.device, dtype=h.dtype).unsqueeze(-1)
        h = h + h.cumsum(1) / count  # each position sees the mean of itself and those before it
        return h + self.down(F.gelu(self.up(self.norm(h))))


def embed(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Before the blocks: token + position embeddings."""
    return m.tokens(ids) + m.positions(torch.arange(ids.shape[1], device=ids.device))


def unembed(m: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """After the blocks: norm, then logits."""
    return m.head(m.norm(h))


class MyModel(nn.Module):
    def __init__(self, vocab_size: int = 256, width: int = 32, layers: int = 4, seq_len: int = 64) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions = nn.Embedding(seq_len, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        # Tensor parallelism: which Linear/Embedding splits how (wildcards match each path component).
        self.fourfold_tp_plan = {"tokens": "vocab", "layers.*.up": "column", "layers.*.down": "row", "head": "head"}
        # Pipeline parallelism: the blocks by path, and what runs before and after them.
        self.fourfold_split = Split(blocks="layers", before=embed, after=unembed)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = embed(self, ids)
        for layer in self.layers:
            h = layer(h)
        return unembed(self, h)


def build(**kwargs: int) -> MyModel:
    """The factory ``--model my_model:build`` calls, with ``--model-config``'s JSON object as keywords."""
    return MyModel(**kwargs)
