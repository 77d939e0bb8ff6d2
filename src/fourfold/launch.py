"""Join the process group: the one place in fourfold that calls ``dist.init_process_group``.

Works the same under torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``
in the environment) and as a plain single process (world size 1, nothing in the environment)::

    from fourfold import launch

    with launch.init() as ctx:             # gloo on CPU, NCCL when the device is CUDA
        print(ctx.rank, ctx.world_size, ctx.device)

Promises:

* every collective is bounded by one timeout (``timeout_s``, default :data:`DEFAULT_TIMEOUT_S`), never
  gloo's 30-minute default;
* a run on one machine listens on loopback only: gloo's and NCCL's sockets are pinned to the loopback
  interface, and a TCPStore this module creates is handed a socket already bound to 127.0.0.1 (left to
  itself, PyTorch's TCPStore binds every interface);
* ``OMP_NUM_THREADS=1`` per rank when several ranks share a machine, unless the user set it;
* the process group is destroyed on exit (context manager, or at interpreter exit);
* with more than one rank, the hang doctor (:mod:`fourfold.comm.doctor`) heartbeats this rank's ledger to the
  store and, when a wait passes ``hang_s``, names the rank that never arrived.
"""

from __future__ import annotations

import atexit
import datetime
import ipaddress
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from fourfold.comm import wait
from fourfold.comm.doctor import DEFAULT_HANG_S, VERDICT_ENV, Doctor
from fourfold.comm.wait import DEFAULT_TIMEOUT_S

__all__ = [
    "DEFAULT_HANG_S",
    "DEFAULT_TIMEOUT_S",
    "DistContext",
    "init",
    "loopback_store",
    "on_close",
    "resolve_device",
]


DeviceName = Literal["auto", "cpu", "cuda"]


@dataclass(frozen=True)
class DistContext:
    """This process's place in the run, returned by :func:`init`."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    timeout_s: float
    _owns_group: bool = field(default=True, repr=False)
    doctor: Any = field(default=None, repr=False, compare=False)

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that prints and writes the shared outputs."""
        return self.rank == 0

    @property
    def single_machine(self) -> bool:
        return self.local_world_size == self.world_size

    def close(self, settle: bool = True) -> None:
        """Stop the hang doctor and destroy the process group (idempotent); ``settle``: first wait for the
        collectives still in flight (a loss never read), as a clean exit does (not after an error, when a peer may
        never send them)."""
        if self.doctor is not None:
            self.doctor.stop()
        if self._owns_group and dist.is_initialized():
            if settle:
                wait.settle_pending()
            dist.destroy_process_group()
            for forget in (wait.forget_groups, *_ON_CLOSE):
                forget()

    def __enter__(self) -> DistContext:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.close(settle=kind is None)


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    """``"auto"`` is ``cuda:<local_rank>`` when CUDA is available, else CPU; ``"cuda"`` gains the index."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device must be available, got 'cuda' on a machine without CUDA. "
                             "Pass --device cpu (or auto).")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if device == "cpu":
        return torch.device("cpu")
    raise ValueError(f"device must be one of auto, cpu, cuda, got {device!r}.")


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _loopback_interface() -> str:
    return "lo0" if sys.platform == "darwin" else "lo"


def loopback_store(port: int = 0, *, world_size: int, timeout_s: float) -> dist.TCPStore:
    """A TCPStore server that listens on 127.0.0.1 only.

    TCPStore binds every interface when it opens its own socket; handing it a socket already bound to the
    loopback address (``master_listen_fd``) keeps a single-machine run off the network.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)
    port = sock.getsockname()[1]
    # detach(): the store owns the descriptor from now on; the Python object must not close it when collected.
    return dist.TCPStore(
        "127.0.0.1", port, world_size, True, timeout=datetime.timedelta(seconds=timeout_s),
        master_listen_fd=sock.detach(), wait_for_workers=False,
    )


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def init(
    device: str = "auto",
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    store: dist.Store | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    backend: str | None = None,
    hang_s: float = DEFAULT_HANG_S,
) -> DistContext:
    """Join (or create) the default process group and return this rank's :class:`DistContext`.

    ``rank``/``world_size``/``store`` are for harnesses that start ranks themselves (the test harness uses a
    FileStore); otherwise they come from torchrun's environment, or default to a single process. ``hang_s``:
    the hang doctor's threshold (0: it only heartbeats, and explains waits that reach ``timeout_s``).
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}.")
    if not hang_s >= 0:
        raise ValueError(f"hang_s must be >= 0 seconds (0 = off), got {hang_s}.")
    user_threads = os.environ.get("OMP_NUM_THREADS", "")
    explicit = rank is not None or world_size is not None  # a harness placed us; ignore stray torchrun vars
    rank = _env_int("RANK", 0) if rank is None else rank
    world_size = _env_int("WORLD_SIZE", 1) if world_size is None else world_size
    local_rank = rank if explicit else _env_int("LOCAL_RANK", rank)
    local_world_size = world_size if explicit else _env_int("LOCAL_WORLD_SIZE", world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}.")

    dev = resolve_device(device, local_rank)
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo"
    if user_threads.isdigit() and int(user_threads) > 0:
        torch.set_num_threads(int(user_threads))  # the variable alone is too late if torch was imported first
    elif local_world_size > 1:
        torch.set_num_threads(1)  # N ranks on one machine: don't let each spawn one thread per core
    if local_world_size == world_size:
        # One machine: keep the transport's sockets on loopback (they bind a routable interface otherwise).
        os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
        os.environ.setdefault("NCCL_SOCKET_IFNAME", _loopback_interface())
    if dev.type == "cuda":
        torch.cuda.set_device(dev)

    if not explicit and "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()  # started by torchrun's agent: its death ends this rank
    if dist.is_initialized():
        raise RuntimeError("fourfold.launch.init() was called twice in one process: the default process group "
                           "already exists. Reuse the DistContext from the first call, or close() it first.")
    if store is None:
        store = _default_store(rank, world_size, timeout_s)
    timeout = wait.group_timeout(timeout_s, backend)  # NCCL's watchdog after the named errors (wait.group_timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=dev if dev.type == "cuda" else None)
    wait.set_default_timeout(timeout_s)
    doctor = None
    if world_size > 1:
        doctor = Doctor(store, rank, world_size, hang_s=hang_s, attempt=_env_int("TORCHELASTIC_RESTART_COUNT", 0),
                        verdict_path=os.environ.get(VERDICT_ENV)).start()
    ctx = DistContext(rank, world_size, local_rank, local_world_size, dev, backend, timeout_s, doctor=doctor)
    atexit.register(_close_at_exit, ctx)
    return ctx


_ON_CLOSE: list[Callable[[], None]] = []


def on_close(forget: Callable[[], None]) -> None:
    """Call ``forget`` whenever :meth:`DistContext.close` destroys the process group: a cache of groups made
    under it empties, so nothing holds a dead group's native threads (a copy of this process, a forked rank,
    that dropped one later would abort joining threads it does not have)."""
    if forget not in _ON_CLOSE:
        _ON_CLOSE.append(forget)


def _close_at_exit(ctx: DistContext) -> None:
    """A script's exit without ``with``: settle what is in flight only when it ends cleanly (an uncaught
    exception has been printed by now, into ``sys.last_value``: a peer may never send that work)."""
    ctx.close(settle=getattr(sys, "last_value", None) is None)


def _default_store(rank: int, world_size: int, timeout_s: float) -> dist.Store:
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        return dist.HashStore()  # a lone process needs no socket at all
    addr = os.environ.get("MASTER_ADDR")
    port = os.environ.get("MASTER_PORT")
    if not addr or not port:
        raise RuntimeError(
            f"rank {rank} of {world_size} needs MASTER_ADDR and MASTER_PORT to find its peers, got "
            f"MASTER_ADDR={addr!r} MASTER_PORT={port!r}. Launch with `fourfold train --nproc N` or torchrun.")
    timeout = datetime.timedelta(seconds=timeout_s)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if rank == 0 and not agent_store and _is_loopback(addr):
        return loopback_store(int(port), world_size=world_size, timeout_s=timeout_s)
    # A client of the torchrun agent's store, or of rank 0's on another machine.
    store = dist.TCPStore(addr, int(port), world_size, rank == 0 and not agent_store, timeout=timeout)
    if agent_store:  # the agent's store outlives a restart: each attempt keeps to its own keys
        return dist.PrefixStore(f"/worker/attempt_{_env_int('TORCHELASTIC_RESTART_COUNT', 0)}", store)
    return store


def die_with_parent() -> None:
    """Linux: ask the kernel to kill this process when its parent (torchrun's agent) dies, even by SIGKILL, so
    no rank trains on unsupervised. Exits at once if the parent is gone already."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the request was in place
        os._exit(1)
