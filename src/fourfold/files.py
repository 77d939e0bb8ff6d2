"""Writing files so that nothing is ever half-written or lost.

Every output (checkpoints, traces, metrics pictures) is written to a temporary file beside its target and then
moved into place with ``os.replace``, which is atomic on POSIX: a reader, or a crash mid-write, sees the old
file or the new one, never half of one.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["LOCK_NAME", "atomic_path", "run_lock", "write_text_atomic"]

LOCK_NAME = ".fourfold.lock"


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path``, on failure it is removed."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Not mkstemp: its 0600 mode would stick to the final file; a plain name gets the usual umask.
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


@contextmanager
def run_lock(out: str | os.PathLike[str]) -> Iterator[None]:
    """Hold ``out``'s lock for the duration: a second run on the same directory is refused (ValueError naming
    the holder) instead of mixing its files with the first's. The kernel drops the lock when the holder dies."""
    import fcntl

    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    f = open(target / LOCK_NAME, "a+", encoding="utf-8")  # noqa: SIM115
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise ValueError(f"out {target} is in use by another run ({holder}). Wait for it to finish, or pass "
                         "another --out.") from None
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    try:
        yield
    finally:
        f.close()
