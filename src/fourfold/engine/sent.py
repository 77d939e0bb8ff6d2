"""What a rank sent on each axis of the mesh in one step, read from its trace's comm spans: ``metrics.jsonl``'s
``bytes_by_axis`` and the run's summary. One row of :data:`COUNTED` per axis."""

from __future__ import annotations

from collections.abc import Callable

from fourfold.observe.trace import DATA_PARALLEL_SPANS, Span
from fourfold.parallel.tensor.comm import wire_bytes

__all__ = ["COUNTED", "bytes_by_axis"]


def bytes_by_axis(spans: list[Span]) -> dict[str, int]:
    """Bytes this rank sent on each axis in ``spans`` (one step's, say).

    ``tp``: what a ring sends for each tensor-parallel collective (:func:`~fourfold.parallel.tensor.comm.wire_bytes`:
    the backend's own collectives are not counted, so they are counted as the ring would move them, and a
    sequence-parallel reduce-scatter + all-gather adds up to the all-reduce it replaces); ``pp``: activations,
    gradients and tied-weight gradients sent between stages (headers included); ``cp``: what context parallelism's
    attention sent (K/V blocks, their gradients, Ulysses' swaps); ``dp``: what fourfold's
    all-reduce algorithms put on the wire (``native`` counts none: the backend sends on its own).
    """
    out = dict.fromkeys(COUNTED, 0)
    for s in spans:
        if s.kind != "comm":
            continue
        for axis, sent in COUNTED.items():
            counted = sent(s)
            if counted is not None:
                out[axis] += counted
                break
    return out


def _tp_sent(s: Span) -> int | None:
    return wire_bytes(s.name.removeprefix("tp."), s.bytes, s.args.get("ranks", 2)) if s.name.startswith("tp.") \
        else None


COUNTED: dict[str, Callable[[Span], int | None]] = {
    "dp": lambda s: s.bytes if s.name.startswith(DATA_PARALLEL_SPANS) else None,  # ZeRO: the ring's halves
    "tp": _tp_sent,
    "pp": lambda s: s.bytes if s.name in ("send", "tied_grads") else None,
    "cp": lambda s: s.bytes if s.name.startswith("cp.") else None,  # what the attention algorithm sent
}
"""Each mesh axis's bytes in one comm span (None: not this axis's span), in the mesh's order: a strategy that
adds an axis adds its row, and metrics.jsonl's ``bytes_by_axis`` and the run's summary show it."""

