"""How fourfold's launcher starts a rank: forked from a fork server that has imported torch, or a fresh interpreter.

torchrun's agent starts a rank as a fresh ``python -m module`` (each importing torch again: about 4 s of CPU a
rank on a 2-core machine), or, given a function and a start method, through :mod:`multiprocessing`. fourfold
gives it :func:`run_rank` and ``forkserver``: one clean, single-threaded process (started by :func:`warm`,
early, so its import of torch overlaps the launcher's own checks) forks every rank, which then runs
``module.main(argv)`` as ``python -m module argv`` would, in the launcher's environment, directory, import path
and standard streams at the time of the launch (:class:`Handover`). :func:`rank_start` says which way.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import sysconfig
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["PRELOAD", "RANK_START_ENV", "Handover", "handover", "rank_start", "run_rank", "warm"]


RANK_START_ENV = "FOURFOLD_RANK_START"
"""``forkserver`` or ``exec`` forces one way of starting the ranks; unset: :func:`rank_start` decides."""

PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "fourfold.torchrun.start", "fourfold.train", "fourfold.testing"]
"""What the fork server imports once for every rank (torch imports ``torch._dynamo`` lazily on the first in-place
random init, ~1.5 s of CPU a rank otherwise). The first user of the server in a process sets it; a module that
fails to import is skipped by the server. No module of the user's is ever in it: a rank imports those itself,
knowing its rank."""

_SERVER_ENV = dict(os.environ)
"""The environment this module was imported in: in a rank forked from the server, the server's (it imports this
module at its start), which tells apart what torchrun's agent set for the rank."""

_RANK_VARS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
              "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
              "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
              "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
"""The variables torchrun's agent sets for each rank (its documented ones), always the rank's own."""


def rank_start() -> str:
    """How :func:`launch_workers` starts the ranks: ``forkserver`` (each rank skips the 4 s import of torch: 8
    ranks start about 20 s sooner here) where the platform has one and this process's main module is one that a
    rank may import again harmlessly, as :mod:`multiprocessing` does in every child: a module run with ``python -m``
    (``fourfold``, ``pytest``), an installed command (``.venv/bin/fourfold``), or none (``python -c``, a notebook).
    A script of yours calling ``fourfold.train.main`` gets ``exec``, fresh interpreters, torchrun's usual way: a
    script without an ``if __name__ == "__main__":`` guard would run again in every rank.
    ``FOURFOLD_RANK_START=forkserver`` (vouching for your script's guard) or ``exec`` decides instead."""
    chosen = os.environ.get(RANK_START_ENV, "")
    if chosen not in ("", "exec", "forkserver"):
        raise ValueError(f"{RANK_START_ENV} must be forkserver or exec (or unset), got {chosen!r}.")
    if chosen == "exec" or "forkserver" not in multiprocessing.get_all_start_methods():
        return "exec"
    return "forkserver" if chosen == "forkserver" or _main_is_importable() else "exec"


def _main_is_importable() -> bool:
    main = sys.modules.get("__main__")
    if getattr(main, "__spec__", None) is not None:  # python -m module
        return True
    path = getattr(main, "__file__", None)
    return path is None or Path(path).resolve().parent == Path(sysconfig.get_path("scripts")).resolve()


def warm() -> None:
    """Start the fork server now, if the ranks will come from one (one machine: on several, it starts after the
    rendezvous, as the watch of it reads "no child process yet"), so that its import of torch overlaps what the
    launcher does before it launches (the preflight). Idempotent; the server ends with this process."""
    if rank_start() != "forkserver":
        return
    from multiprocessing import forkserver

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # counts only before the server starts (a process has one)
    forkserver.ensure_running()


@dataclass(frozen=True)
class Handover:
    """What a forked rank takes from its launcher at the launch, as a fresh interpreter would have it: the
    environment, and standard output and error (file descriptors, passed through the fork server's socket); the
    directory and import path come through :mod:`multiprocessing` itself. ``alive``: the read end of a pipe only
    the launcher writes to: its end of file means the launcher is gone, and the rank ends (the kernel's
    parent-death signal would wait for the server, which waits for its ranks). Made by :func:`handover`."""

    env: dict[str, str]
    streams: tuple[_Fd, _Fd]
    alive: _Fd


@contextlib.contextmanager
def handover() -> Iterator[Handover]:
    """The :class:`Handover` of a launch, its pipe open until the launch ends."""
    read, write = os.pipe()
    try:
        yield Handover(dict(os.environ), (_Fd(1), _Fd(2)), _Fd(read))
    finally:
        os.close(read)
        os.close(write)


class _Fd:
    """A file descriptor of the launcher's; unpickled in a rank forked by the server, a descriptor of the rank's
    own open on the same file (a pipe, a terminal, pytest's capture)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        return (_adopt, (reduction.DupFd(self.fd),))


def _adopt(dup: Any) -> _Fd:
    return _Fd(dup.detach())


def run_rank(module: str, argv: list[str], handover: Handover) -> None:
    """The body of a rank forked by the server: ``module.main(argv)``, as ``python -m module argv`` would run it,
    in the launcher's environment (plus the rank's variables torchrun's agent set), import path (plus
    ``PYTHONPATH``'s entries, which a fresh interpreter reads) and standard streams. The interpreter's own signal
    handlers come first; a non-zero return is the exit status, an uncaught error's traceback is printed and ends
    it with 1, as the interpreter would."""
    from importlib import import_module, util

    _adopt_handover(handover)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)
    _name_process(f"fourfold-rank{os.environ.get('RANK', '')}")
    spec = util.find_spec(module)
    sys.argv = [spec.origin if spec is not None and spec.origin else module, *argv]
    try:
        code = import_module(module).main(argv)
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except Exception:  # printed as the interpreter would (multiprocessing would keep it in a file)
        sys.excepthook(*sys.exc_info())
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        raise SystemExit(code)


def _adopt_handover(given: Handover) -> None:
    rank_vars = {k: v for k, v in os.environ.items() if k in _RANK_VARS or _SERVER_ENV.get(k) != v}
    os.environ.clear()
    os.environ.update({**given.env, **rank_vars})
    for entry in reversed([p for p in given.env.get("PYTHONPATH", "").split(os.pathsep) if p]):
        if entry not in sys.path:
            sys.path.insert(1, entry)  # after the directory a ``python -m`` puts first
    # multiprocessing made the server's start method this process's default: a fresh interpreter's is the
    # platform's (a lock of tqdm's would otherwise be left to the launcher's resource tracker, which warns of it)
    multiprocessing.set_start_method(None, force=True)
    sys.stdout.flush()
    sys.stderr.flush()
    for target, fd in zip((1, 2), given.streams, strict=True):
        os.dup2(fd.fd, target)
        os.close(fd.fd)
    threading.Thread(target=_end_with_launcher, args=(given.alive.fd,), name="fourfold-launcher-watch",
                     daemon=True).start()


def _end_with_launcher(fd: int) -> None:
    with contextlib.suppress(OSError):
        while os.read(fd, 1):
            pass
    os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's parent-death signal would: nothing of the run is left


def _name_process(name: str) -> None:
    """Linux: the name ``ps``, ``top`` and ``/proc/PID/comm`` show (a forked rank would show its launcher's
    command line under ``ps -f``; its name says which rank it is). At most 15 bytes are kept."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_name = 15
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_name, name.encode()[:15], 0, 0, 0)
