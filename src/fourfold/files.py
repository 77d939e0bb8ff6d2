"""Writing files so that nothing is ever half-written or lost.

Every output (checkpoints, traces, metrics pictures) is written to a temporary file beside its target and then
moved into place with ``os.replace``, which is atomic on POSIX: a reader, or a crash mid-write, sees the old
file or the new one, never half of one.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["LOCK_NAME", "OUTPUTS", "atomic_path", "check_writable", "drop_replaced", "drawn_row", "earlier_outputs",
           "fsync", "median_row", "median_step", "move_aside", "open_metrics", "run_lock", "set_aside", "steady",
           "write_text_atomic", "written_by_a_run"]

LOCK_NAME = ".fourfold.lock"
OUTPUTS = ("run.json", "metrics.jsonl", "trace.json", "model.pt")
REPLACED = ".replaced-"  # OUT/.replaced-<time>/: an earlier run that an --overwrite run moved aside


def earlier_outputs(out: Path) -> list[Path]:
    """The files and directories of an earlier run in ``out``."""
    return sorted(p for p in out.glob("*") if p.name in OUTPUTS or p.name.startswith("trace-rank")
                  or p.name in ("checkpoints", "timeline.png", "tokenizer.json"))


def written_by_a_run(out: Path) -> bool:
    """Whether ``out``'s run.json is one a fourfold run wrote (its config and mesh), so the files named like a
    run's outputs beside it are that run's, not a user's own."""
    try:
        found = json.loads((out / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(found, dict) and {"config", "mesh", "world_size"} <= set(found)


def fsync(path: str | os.PathLike[str]) -> None:
    """Flush ``path`` (a file, or a directory: its entries) from the page cache to the disk. A filesystem that
    cannot flush a directory (some FUSE, CIFS and NFS mounts answer EINVAL) is left to its own ordering."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if not (os.path.isdir(path) and e.errno in (errno.EINVAL, errno.ENOTSUP, errno.EBADF)):
            raise
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike[str], *, durable: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path``, on failure it is removed. The
    caller may make a directory there: it replaces ``path`` when that is absent or an empty directory (rename's
    rule: anything in it stops the replacement), and is removed with its contents on failure.

    ``durable`` (checkpoints, model.pt): the file is on the disk before it replaces ``path``, and the
    replacement is too when this returns, so a power loss or a machine's crash after it cannot undo it (an
    older checkpoint pruned next is not the only one left). A write error that only the flush reports (a full
    NFS quota) fails the write here rather than passing unseen."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Not mkstemp: its 0600 mode would stick to the final file; a plain name gets the usual umask.
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        if durable:
            for written in ([*(p for p in tmp.rglob("*") if p.is_file()), tmp] if tmp.is_dir() else [tmp]):
                fsync(written)
        os.replace(tmp, target)
        if durable:
            fsync(target.parent)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike[str], text: str, *, durable: bool = False) -> None:
    with atomic_path(path, durable=durable) as tmp:
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


def check_writable(out: Path) -> None:
    """OUT, or the nearest directory above it that exists, must be a writable directory."""
    here = out.absolute()
    while not here.exists():
        here = here.parent
    if not here.is_dir():
        raise ValueError(f"out must be a directory, got {out}, which is under the file {here}. Pass another --out.")
    if not os.access(here, os.W_OK | os.X_OK):
        raise ValueError(f"out must be writable, got {out}: {here} is not writable by this user. Pass another "
                         "--out.")


def move_aside(out: Path) -> Path | None:
    """Move an earlier run's files to OUT/.replaced-<time>/, so a crash of this run never leaves a mix of two
    runs; the directory is removed when this run finishes."""
    earlier = earlier_outputs(out)
    if not earlier:
        return None
    aside = Path(tempfile.mkdtemp(prefix=f"{REPLACED}{time.strftime('%Y%m%d-%H%M%S')}-", dir=out))
    for p in earlier:
        p.rename(aside / p.name)
    print(f"fourfold train: --overwrite: the earlier run in {out} is kept in {aside.name}/ until this run "
          "finishes.", file=sys.stderr, flush=True)
    return aside


def drop_replaced(out: Path) -> None:
    """Remove the earlier runs moved aside in ``out`` (:func:`move_aside`), once an ``--overwrite`` run there is
    complete: it replaces them, as asked. A run without ``--overwrite`` leaves them (another run's, kept)."""
    for aside in set_aside(out):
        shutil.rmtree(aside, ignore_errors=True)


def set_aside(out: Path) -> list[Path]:
    """Earlier runs ``--overwrite`` runs moved aside in ``out`` and did not remove: those runs failed, so these
    are the runs they would have replaced, kept whole (move the files back to restore one)."""
    return sorted(p for p in out.glob(f"{REPLACED}*") if p.is_dir()) if out.is_dir() else []


def steady(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps that show a run's pace, from its metrics.jsonl rows: all after the first, which warms up
    (allocations, the first collectives' checks), or the only one. Every figure a run reports per step (the
    summary line, the demo's tables, ``bench predict``) is read over these."""
    return rows[1:] or rows


def steady_rate(rows: list[dict[str, Any]], key: str = "tokens_per_s") -> float:
    """A run's pace over its steady steps: the total of what ``key`` counts per second (tokens, real tokens)
    over their total time, each step's count ``key * step_time_s``. Steps of unequal work (packed batches hold
    different real tokens) count by what they did, not one step for the run; 0.0 without rows."""
    timed = steady(rows)
    total = sum(r["step_time_s"] for r in timed)
    return sum(r[key] * r["step_time_s"] for r in timed) / total if total > 0 else 0.0


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run's typical step: the steady step of median ``step_time_s`` (of two middles the faster: a step that
    ran, so its ms/step and tokens/s agree with each other); None without rows."""
    timed = steady(rows)
    return sorted(timed, key=lambda r: r["step_time_s"])[(len(timed) - 1) // 2] if timed else None


def drawn_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The step a run draws (``timeline.png``) and ``bench predict`` reads, its time and its spans alike:
    :func:`median_row` among the steady steps but the last, whose trace also holds the run's end (the model
    gathered from every rank), unless it is the only one; None without rows."""
    return median_row(rows[:-1] if len(rows) > 2 else rows)


def median_step(rows: list[dict[str, Any]]) -> int | None:
    """The number of :func:`drawn_row`'s step."""
    row = drawn_row(rows)
    return row["step"] if row is not None else None


def open_metrics(path: Path, keep_through: int) -> Any:
    """metrics.jsonl for writing: a fresh file, or (continuing a run) its rows up to step ``keep_through``
    kept, the rows a crashed run wrote after its checkpoint dropped, so every step appears once."""
    if keep_through == 0 or not path.exists():
        return open(path, "w")  # noqa: SIM115
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] <= keep_through:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by the crash
    write_text_atomic(path, "".join(kept))
    return open(path, "a")  # noqa: SIM115
