"""How fourfold's launcher starts a rank: a fresh interpreter, or, when asked and sound, a copy of itself.

torchrun's agent starts a rank as a fresh ``python -m module`` (each importing torch again: about 4 s of CPU a
rank on a 2-core machine), or, given a function, as a copy of the launcher (forked). Forking is opt-in and
experimental: one forked rank in about 300 launches never reached the store (``docs/reliability.md``, "How the
ranks start"). :func:`rank_start` says which; :func:`run_rank` is a copy's body.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

__all__ = ["RANK_START_ENV", "rank_start", "run_rank"]


RANK_START_ENV = "FOURFOLD_RANK_START"
"""``fork``: start the ranks as copies of the launcher where that is sound (experimental); ``exec`` or unset: fresh
interpreters. See :func:`rank_start`."""


def rank_start(threads: str | None) -> str:
    """How :func:`launch_workers` starts a rank whose ``OMP_NUM_THREADS`` is ``threads``: ``exec`` (a fresh
    ``python -m module``, torchrun's usual way) unless ``FOURFOLD_RANK_START=fork`` asks for copies of the launcher
    (each rank skips the 4 s import of torch: 8 ranks start about 20 s sooner here), which are taken only where
    the copy is known to be sound:

    * the torch build has no GPU support: a process that initialised CUDA cannot be copied;
    * each rank computes on one thread (the launcher's default with several ranks per machine): a copy of a
      process whose OpenMP pool has run hangs in its first parallel region;
    * this process is in no process group now (the transport's copied native state would abort the copy), and
      runs no Python thread but its main one (a thread holding a lock would leave the copy stuck on it).

    Asking for it vouches that no module of yours reads its rank at import: a module the launcher imported is
    every rank's, imported with no rank. Experimental: the launcher's own store serves the first copies while
    the next are made, and one rank in about 300 forked launches never reached it (the run failed at the
    timeout, naming the missing rank; not understood yet)."""
    import torch
    import torch.distributed as dist

    chosen = os.environ.get(RANK_START_ENV, "")
    if chosen not in ("", "exec", "fork"):
        raise ValueError(f"{RANK_START_ENV} must be fork or exec (or unset), got {chosen!r}.")
    sound = (torch.version.cuda is None and torch.version.hip is None and threads == "1" and not dist.is_initialized()
             and threading.active_count() == 1)
    return "fork" if chosen == "fork" and sound else "exec"


def run_rank(module: str, argv: list[str]) -> None:
    """The body of a forked rank: ``module.main(argv)``, as ``python -m module argv`` would run it. The copy
    starts with the launcher's signal handlers (torchrun's agent's, which would turn SIGTERM into its own
    exception), so the interpreter's own come back first; a non-zero return is the exit status, an uncaught
    error's traceback is printed and ends it with 1, as the interpreter would."""
    from importlib import import_module, util

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


def _name_process(name: str) -> None:
    """Linux: the name ``ps``, ``top`` and ``/proc/PID/comm`` show (a forked rank would show its launcher's
    command line under ``ps -f``; its name says which rank it is). At most 15 bytes are kept."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_name = 15
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_name, name.encode()[:15], 0, 0, 0)
