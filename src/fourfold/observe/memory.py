"""Memory a rank holds, measured: its parameters, gradients and optimiser state (distinct storages, so a tied
weight or a gradient that is a view of a bucket counts once), the activations autograd saved for backward,
and the process's own peak (the CUDA allocator's, or the resident set size on CPU).

    with saved_bytes(exclude=parameter_storages(params)) as saved:
        loss = model(x).sum()                  # saved: {storage: bytes} of what backward will read
    loss.backward(); optimizer.step()
    held = held_bytes(params, optimizer)      # fixed from the first step on: measure once, before zero_grad
    row = {**held, "activations": sum(saved.values()), **process_peak(device)}
"""

from __future__ import annotations

import contextlib
import resource
import sys
from collections.abc import Callable, Hashable, Iterable, Iterator

import torch

__all__ = ["estimate_held", "held_bytes", "parameter_storages", "process_peak", "saved_bytes", "saved_bytes_once",
           "storage_bytes"]


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None skipped; a DTensor counts its local shard, as
    FSDP2's parameters, gradients and optimiser state are)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            local = t.to_local() if hasattr(t, "to_local") else t
            seen[_key(local)] = local.untyped_storage().nbytes()
    return sum(seen.values())


def parameter_storages(params: Iterable[torch.Tensor]) -> set[int]:
    """The storages of ``params``: what :func:`saved_bytes` leaves out (weights are not activations)."""
    return {_key(p) for p in params}


@contextlib.contextmanager
def saved_bytes(exclude: set[int] | Callable[[], set[int]] = frozenset()  # type: ignore[assignment]
                ) -> Iterator[dict[int, int]]:
    """While the block runs, record {storage: bytes} of every tensor autograd saves for backward, those in
    ``exclude`` (the parameters; a function returning them where they move, as ZeRO-3's gathered weights do)
    left out. Inside a checkpointed block only its input is seen (kept for the recompute); what the block's
    operations save is dropped and recomputed, which is the point."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _key(t)
        if key not in (exclude() if callable(exclude) else exclude):
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, _same):
        yield saved


@contextlib.contextmanager
def saved_bytes_once(known: dict[Hashable, int], key: Hashable,
                     exclude: set[int] | Callable[[], set[int]] = frozenset()  # type: ignore[assignment]
                     ) -> Iterator[dict[int, int] | None]:
    """:func:`saved_bytes` the first time ``key`` (the input's shapes) comes, None after: the caller stores the
    figure in ``known[key]``. A step of the same shapes saves the same bytes, and the hooks cost about 2 % of a
    small model's step, so the steady state runs without them."""
    if key in known:
        yield None
    else:
        with saved_bytes(exclude) as saved:
            yield saved


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def held_bytes(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """This rank's bytes of parameters, gradients (call before ``zero_grad``) and optimiser state: fixed once
    the first step has made the gradients and the state, so a run measures them once."""
    params = list(params)
    state = [t for s in (optimizer.state.values() if optimizer is not None else ()) for t in s.values()
             if isinstance(t, torch.Tensor)]
    return {"parameters": storage_bytes(params), "gradients": storage_bytes(p.grad for p in params),
            "optimizer": storage_bytes(state)}


def process_peak(device: torch.device) -> dict[str, int]:
    """The process's peak so far: ``cuda_peak_allocated`` on CUDA, ``rss_peak`` (the resident set) on CPU."""
    if device.type == "cuda":
        return {"cuda_peak_allocated": torch.cuda.max_memory_allocated(device)}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"rss_peak": peak if sys.platform == "darwin" else peak * 1024}


def estimate_held(numel: int, itemsize: int, *, dp: int = 1, zero: int = 0, optimizer_slots: int = 2) -> dict[str, int]:
    """What a rank holding ``numel`` parameter elements (its stages', its tensor-parallel pieces) keeps between
    steps, by the ZeRO paper's formulas with fourfold's dtypes: parameters Ψ, gradients Ψ, optimiser state KΨ
    (AdamW: K = 2, its two moments), each of them divided by ``dp`` from stage 3, 2 and 1 on (a segment is
    ceil(Ψ/dp) per bucket; the optimiser's scalar ``step`` counters are left out)."""
    shard = -(-numel // dp) if zero else numel
    return {"parameters": (shard if zero >= 3 else numel) * itemsize,
            "gradients": (shard if zero >= 2 else numel) * itemsize,
            "optimizer": optimizer_slots * shard * itemsize}
