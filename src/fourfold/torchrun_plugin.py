"""torchrun's plugin entry point (group ``torchrun.handlers``, name ``fourfold-loopback``): a hand-run torchrun
gets fourfold's one-machine rendezvous, whose store listens on 127.0.0.1 only::

    torchrun --nproc-per-node 2 --rdzv-backend fourfold-loopback --rdzv-endpoint 127.0.0.1:0 -m fourfold.train

torchrun loads entry points while ``torch.distributed.elastic.rendezvous`` is being imported, so this module
imports nothing at load time (importing :mod:`fourfold.torchrun` here would be circular).
"""

from __future__ import annotations

from typing import Any

__all__ = ["loopback_handler"]


def loopback_handler() -> Any:
    """What torchrun's registry calls: the function that creates the rendezvous handler."""

    def create(params: Any) -> Any:
        from fourfold.torchrun import create_loopback

        return create_loopback(params)

    return create
