"""The one bounded wait: every collective and send/recv in fourfold ends here, or in a :class:`CommError` that
names this rank, the operation and the peer it was waiting for.

    work = dist.irecv(buf, src, group=group)
    bounded_wait(work, timeout_s, rank=3, op="1F2", awaited="receive the activation of 0F2 from", peer=1)
    # -> CommError("rank 3: 1F2: receive the activation of 0F2 from rank 1 did not complete within 30 s. ...")

``awaited`` reads as a sentence before ``rank <peer>`` ("send to", "receive the gradient of ... from"); with no
peer (a collective), it names the operation and the group's ranks.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

__all__ = ["CommError", "bounded_wait"]

HINT = ("The peer is dead, stuck, or running a different operation; its own error (if any) says which.")


class CommError(RuntimeError):
    """A send, receive or collective that did not complete within the timeout (peer dead, stuck, out of step)."""


def bounded_wait(work: Any, timeout_s: float, *, rank: int, op: str, awaited: str, peer: int | None = None,
                 group_ranks: Sequence[int] | None = None, hint: str = HINT) -> None:
    """Wait for ``work`` (a ``dist.Work``) at most ``timeout_s`` seconds, or raise :class:`CommError` naming
    ``rank``, ``op`` and ``peer`` (or ``group_ranks`` for a collective). ``None`` work (nothing posted) returns."""
    if work is None:
        return
    try:
        work.wait(timeout=datetime.timedelta(seconds=max(timeout_s, 0.001)))
    except RuntimeError as e:
        who = f" rank {peer}" if peer is not None else (
            f" ranks {list(group_ranks)}" if group_ranks is not None else "")
        cause = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CommError(f"rank {rank}: {op}: {awaited}{who} did not complete within {timeout_s:g} s. {hint} "
                        f"[{cause}]") from e
