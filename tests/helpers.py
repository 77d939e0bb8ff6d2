"""What every parity test needs, in one place: seeded batches, the optimiser, the one-process reference run,
and the error measure. A layout passes when its losses and final state equal :func:`reference_run`'s.

    from helpers import TOL64, batches, max_error, reference_run

    want_losses, want_state = reference_run(CFG, batches(CFG))       # one process, the whole batch
    name, err = max_error(layout_state, want_state)                   # the worst tensor and its max |error|
    assert err <= TOL64, f"{name}: {err:.3g}"
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from fourfold.models import GPTConfig, TinyGPT

__all__ = ["LR", "TOL64", "WEIGHT_DECAY", "batches", "max_error", "optimizer", "process_tree", "reference_run",
           "shard"]

LR, WEIGHT_DECAY = 1e-2, 0.1
TOL64 = 1e-10  # float64: every layout equals one process to this, losses and every parameter


def batches(cfg: GPTConfig, batch: int = 8, steps: int = 3, seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of random token ids, (batch, seq_len) inputs and targets."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g),
             torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)) for _ in range(steps)]


def shard(batch: torch.Tensor, dp_rank: int, dp: int) -> torch.Tensor:
    """Data-parallel rank ``dp_rank``'s equal, contiguous share of a global batch."""
    n = batch.size(0) // dp
    return batch[dp_rank * n:(dp_rank + 1) * n]


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def reference_run(cfg: GPTConfig, steps: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype = torch.float64,
                  seed: int = 0) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the whole batch, the model's own forward: the losses and final state to reproduce."""
    model = TinyGPT(cfg, seed=seed, dtype=dtype)
    opt = optimizer(model.parameters())
    losses = []
    for x, y in steps:
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[str, float]:
    """The tensor of ``want`` that ``got`` misses by most, and by how much (inf: missing or reshaped)."""
    worst, err = "", -1.0
    for name, w in want.items():
        g = got.get(name)
        e = float("inf") if g is None or g.shape != w.shape else (g.double() - w.double()).abs().max().item()
        if e > err:
            worst, err = name, e
    return worst, err


def process_tree(pid: int) -> set[int]:
    """``pid`` and all its descendants, from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        found.add(p)
        todo.extend(children.get(p, []))
    return found
