"""Memory a rank holds, measured: its parameters, gradients and optimiser state (distinct storages, so a tied
weight or a gradient that is a view of a bucket counts once), the activations autograd saved for backward,
and the process's own peak (the CUDA allocator's, or the resident set size on CPU).

    with saved_bytes(exclude=parameter_storages(params)) as saved:
        loss = model(x).sum()                  # saved: {storage: bytes} of what backward will read
    figures = memory_figures(params, optimizer, activations=sum(saved.values()), device=device)
"""

from __future__ import annotations

import contextlib
import resource
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["memory_figures", "parameter_storages", "saved_bytes", "storage_bytes"]


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None skipped)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            seen[_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def parameter_storages(params: Iterable[torch.Tensor]) -> set[int]:
    """The storages of ``params``: what :func:`saved_bytes` leaves out (weights are not activations)."""
    return {_key(p) for p in params}


@contextlib.contextmanager
def saved_bytes(exclude: set[int] = frozenset()) -> Iterator[dict[int, int]]:  # type: ignore[assignment]
    """While the block runs, record {storage: bytes} of every tensor autograd saves for backward, those in
    ``exclude`` (the parameters) left out. Inside a checkpointed block only its input is seen (kept for the
    recompute); what the block's operations save is dropped and recomputed, which is the point."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _key(t)
        if key not in exclude:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, _same):
        yield saved


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def memory_figures(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer | None, activations: int,
                   device: torch.device) -> dict[str, Any]:
    """This rank's bytes of parameters, gradients (call before ``zero_grad``), optimiser state, peak saved
    activations, and the process peak: ``cuda_peak_allocated`` on CUDA, ``rss_peak`` (the resident set) on CPU."""
    params = list(params)
    state = [t for s in (optimizer.state.values() if optimizer is not None else ()) for t in s.values()
             if isinstance(t, torch.Tensor)]
    out: dict[str, Any] = {"parameters": storage_bytes(params), "gradients": storage_bytes(p.grad for p in params),
                           "optimizer": storage_bytes(state), "activations": activations}
    if device.type == "cuda":
        out["cuda_peak_allocated"] = torch.cuda.max_memory_allocated(device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        out["rss_peak"] = peak if sys.platform == "darwin" else peak * 1024
    return out
