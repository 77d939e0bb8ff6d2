"""Run a function on N ranks, one process each: the harness for fourfold's tests and for yours. A test::

    import torch
    import torch.distributed as dist
    from fourfold.testing import run_ranks

    def sum_of_ranks(ctx, scale):                # module level: each rank unpickles it by name
        t = torch.tensor([float(ctx.rank)])       # ctx: this rank's launch.DistContext
        dist.all_reduce(t)
        return t.item() * scale                   # any picklable value, copied back

    @pytest.mark.timeout(60)                      # a backstop above run_ranks' own timeout_s
    def test_sum_of_ranks():
        assert run_ranks(sum_of_ranks, 4, 2.0) == [12.0] * 4     # results in rank order

Each rank is a fresh process, forked from a server that has imported torch already (tens of milliseconds to
start, not seconds; spawned where there is no forkserver). It gets the caller's environment, plus
``OMP_NUM_THREADS=1`` unless set, plus ``env``; joins a gloo group through a FileStore in a temp dir (no ports)
with :func:`fourfold.launch.init`; runs ``fn(ctx, *args, **kwargs)``; sends the result back; destroys the group.
Its stdout/stderr lines reach the caller's as ``[rank 1] ...`` (so ``capsys``/``capfd`` see them). Collectives
time out after ``dist_timeout_s`` (default 0.8 x ``timeout_s``): gloo names a stuck operation before the
harness's clock runs out. No rank outlives the call, nor a caller that dies.

Reading a failure:

* :class:`RankError` ``rank 1 of 4 failed: ValueError: ...``: the first rank to fail and its traceback; the
  ranks that failed after it (often only because a peer went away); the stacks of those still running. A rank
  that died without a Python exception (``os._exit``, a segfault, gloo's abort) is reported with its exit code
  or signal, and for a crash the Python stack that faulthandler wrote.
* :class:`RankTimeout` ``ranks 1, 2 of 4 still running after timeout_s=...``: the stack of each of them
  (SIGUSR1 -> faulthandler), printed to stderr and in the message.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from fourfold import launch
from fourfold.torchrun.start import PRELOAD

__all__ = ["RankError", "RankTimeout", "run_ranks"]

_FAILURE_GRACE_S = 0.5  # after the first failure, how long the other ranks get to report theirs
_EXIT_GRACE_S = 5.0  # how long ranks that returned get to exit by themselves
_DUMP_WAIT_S = 2.0  # how long a rank gets to write its stack after SIGUSR1
_KILL_GRACE_S = 1.0  # SIGTERM, then SIGKILL after this
_POLL_S = 0.1  # how often rank output is copied to ours


class RankError(RuntimeError):
    """A rank raised or died. ``rank``: the first to fail; ``ranks``: every rank that failed, in time order."""

    rank: int
    ranks: list[int]


class RankTimeout(RuntimeError, TimeoutError):
    """Ranks were still running after ``timeout_s``. ``ranks``: those ranks; ``stacks``: rank -> its stack."""

    ranks: list[int]
    stacks: dict[int, str]


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60.0,
              backend: str = "gloo", dist_timeout_s: float | None = None,
              env: Mapping[str, str] | None = None, hang_s: float = 0.0, **kwargs: Any) -> list[Any]:
    """Run ``fn(ctx, *args, **kwargs)`` on ranks ``0..world_size-1`` and return their results in rank order.
    ``hang_s``: the hang doctor's threshold (0, the default here: it heartbeats and explains timeouts only).

    Raises :class:`RankError` when a rank fails, :class:`RankTimeout` when ``timeout_s`` (wall clock for the
    whole run, start-up included) passes first.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}.")
    for name, value in (("timeout_s", timeout_s), ("dist_timeout_s", dist_timeout_s)):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be > 0 seconds, got {value!r}.")
    payload = (fn, args, kwargs)  # multiprocessing pickles it to each rank
    try:  # checked here: a lambda or a local function is refused before any process starts
        pickle.dumps(payload)
    except Exception as exc:
        raise TypeError(f"fn, args and kwargs must be picklable, got fn={fn!r}: {exc}. Define fn at module "
                        "level and pass plain values (tensors are copied).") from exc
    env = {"OMP_NUM_THREADS": "1", **os.environ, **(env or {})}
    ctx: mp.context.ForkServerContext | mp.context.SpawnContext
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")  # one per process, the launcher's too; its preload counts before it starts
        ctx.set_forkserver_preload(PRELOAD)
    else:
        ctx = mp.get_context("spawn")
    dist_timeout_s = dist_timeout_s or 0.8 * timeout_s
    alive_r, alive_w = ctx.Pipe(duplex=False)  # only we hold alive_w: the ranks see EOF when we die
    tmp = tempfile.mkdtemp(prefix="fourfold-ranks-")
    procs: list[Any] = []
    conns: list[Connection] = []
    offsets: dict[str, int] = {}  # how much of each rank's output we have copied
    exit_grace_s = 0.0
    try:
        deadline = time.monotonic() + timeout_s
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            conns.append(recv)
            rank_env = {**env, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                        "LOCAL_WORLD_SIZE": str(world_size)}
            rank_args = (rank, world_size, payload, rank_env, tmp, backend, (dist_timeout_s, hang_s), send, alive_r)
            proc = ctx.Process(target=_rank_main, args=rank_args, name=f"fourfold-rank-{rank}")
            proc.start()
            procs.append(proc)  # started ones only: _stop joins them
            send.close()  # the rank holds the only write end now: EOF means it is gone
        results = _collect(procs, conns, tmp, offsets, deadline, timeout_s)
        exit_grace_s = _EXIT_GRACE_S
        return results
    finally:
        _stop(procs, exit_grace_s)
        _relay(tmp, world_size, offsets, final=True)
        for conn in (*conns, alive_r, alive_w):
            conn.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _rank_main(rank: int, world_size: int, payload: tuple[Any, ...], env: dict[str, str], tmp: str, backend: str,
               timeouts: tuple[float, float], conn: Connection, alive: Connection) -> None:
    """The body of one rank's process."""
    threading.Thread(target=_exit_with_parent, args=(alive,), daemon=True).start()
    os.environ.clear()  # a forkserver child would otherwise see the server's environment, not the caller's
    os.environ.update(env)
    for fd, kind in ((1, "out"), (2, "err")):  # the parent copies these files to its own stdout/stderr
        out = os.open(_path(tmp, rank, kind), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(out, fd)
        os.close(out)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    stack_file = open(_path(tmp, rank, "stack"), "w")  # noqa: SIM115 - open for the life of the process
    faulthandler.enable(stack_file, all_threads=True)  # Python stack on SIGSEGV / SIGABRT / ...
    faulthandler.register(signal.SIGUSR1, stack_file, all_threads=True)  # ... and when the parent asks
    ctx, ok = None, False
    try:
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # torch is imported already: the variable is late
        fn, args, kwargs = payload
        store = dist.FileStore(os.path.join(tmp, "store"), world_size)
        ctx = launch.init("cpu", timeout_s=timeouts[0], store=store, rank=rank, world_size=world_size,
                          backend=backend, hang_s=timeouts[1])
        result = fn(ctx, *args, **kwargs)
        try:  # plain pickle copies tensors by value; multiprocessing's would share memory that dies with us
            message = pickle.dumps(("ok", result))
        except Exception as exc:
            raise TypeError(f"fn must return a picklable value, got {type(result).__name__}: {exc}") from exc
        ok = True
    except BaseException as exc:  # noqa: B036 - SystemExit and KeyboardInterrupt are failures of the rank too
        summary = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        detail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        message = pickle.dumps(("err", time.time(), summary, detail))
    sys.stdout.flush()
    sys.stderr.flush()
    conn.send_bytes(message)  # before closing the group: the cause reaches us before its peers' errors do
    if ctx is not None:
        ctx.close(settle=ok)  # after a failure nothing in flight is waited for: its peer may never send it


def _exit_with_parent(alive: Connection) -> None:
    os.read(alive.fileno(), 1)  # returns only at EOF: the caller is gone, so nobody will collect this rank
    os._exit(1)


def _path(tmp: str, rank: int, kind: str) -> str:
    return os.path.join(tmp, f"rank{rank}.{kind}")


def _read(path: str, offset: int = 0) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read()
    except OSError:
        return b""


def _relay(tmp: str, world_size: int, offsets: dict[str, int], final: bool = False) -> None:
    """Copy the new whole lines (all that is left when ``final``) of each rank's stdout/stderr to ours."""
    for rank in range(world_size):
        for kind, stream in (("out", sys.stdout), ("err", sys.stderr)):
            path = _path(tmp, rank, kind)
            data = _read(path, offsets.get(path, 0))
            data = data if final else data[: data.rfind(b"\n") + 1]
            offsets[path] = offsets.get(path, 0) + len(data)
            for line in data.decode(errors="replace").splitlines():
                print(f"[rank {rank}] {line}", file=stream, flush=True)


def _collect(procs: list[Any], conns: list[Connection], tmp: str, offsets: dict[str, int], deadline: float,
             timeout_s: float) -> list[Any]:
    """Wait for every rank's message or death; stop early after a failure; raise on failure or timeout."""
    world_size = len(procs)
    results: list[Any] = [None] * world_size
    failures: list[tuple[float, int, str, str]] = []  # (time, rank, summary, detail)
    pending = set(range(world_size))
    stop_at = deadline
    while pending and (now := time.monotonic()) < stop_at:
        wait([conns[r] for r in pending] + [procs[r].sentinel for r in pending], min(stop_at - now, _POLL_S))
        woke = time.time()  # a crash is dated when we noticed it, as early as we can
        _relay(tmp, world_size, offsets)
        for rank in sorted(pending):
            message = _poll(procs[rank], conns[rank], tmp, rank, woke)
            if message is not None:
                pending.discard(rank)
                if message[0] == "ok":
                    results[rank] = message[1]
                else:
                    failures.append((message[1], rank, message[2], message[3]))
                    stop_at = min(stop_at, time.monotonic() + _FAILURE_GRACE_S)
    still = sorted(pending)
    stacks = _dump_stacks(procs, still, tmp)
    if failures:
        failures.sort()
        _, rank, summary, detail = failures[0]
        lines = [f"rank {rank} of {world_size} failed: {summary}", "", detail.rstrip()]
        lines += [f"also failed: rank {r}: {s.splitlines()[0][:500]}" for _, r, s, _ in failures[1:]]
        if still:
            lines += ["", f"{_ranks(still)} still running when rank {rank} failed (killed); their stacks:"]
        error = RankError("\n".join(lines) + _format_stacks(stacks))
        error.rank, error.ranks = rank, [r for _, r, _, _ in failures]
        raise error
    if still:
        text = (f"{_ranks(still)} of {world_size} still running after timeout_s={timeout_s} s (killed); "
                f"their stacks:{_format_stacks(stacks)}\nHINT: a rank waits in a collective or recv its peers "
                "never join, or loops; the stacks show where. If the work is just slow, raise timeout_s.")
        print(text, file=sys.stderr, flush=True)
        timeout = RankTimeout(text)
        timeout.ranks, timeout.stacks = still, stacks
        raise timeout
    return results


def _poll(proc: Any, conn: Connection, tmp: str, rank: int, woke: float) -> tuple[Any, ...] | None:
    """The rank's message, a failure for a rank that died without one, or None while it still runs."""
    alive = proc.is_alive()  # checked first: once a rank is dead, everything it sent is readable
    if conn.poll():
        try:
            # Bytes our own child pickled, over a pipe only this call and that child hold (not a file or a
            # socket): plain pickle so tensors come by value (see _rank_main).
            return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            pass  # the pipe closed without a (whole) message: the rank died
        except Exception as exc:
            return ("err", woke, f"its result could not be unpickled here: {exc!r}", "")
    elif alive:
        return None
    proc.join(_KILL_GRACE_S)
    code = proc.exitcode
    how = f"exited with code {code}"
    if code is not None and code < 0:
        how = f"was killed by signal {signal.Signals(-code).name} (exit code {code})"
    stack = _read(_path(tmp, rank, "stack")).decode(errors="replace") or "(faulthandler wrote no Python stack)"
    hint = ("; if the error above mentions the 'bootstrapping phase', call run_ranks under `if __name__ == "
            "\"__main__\":` in your script (each rank imports it first)") if code == 1 else ""
    return ("err", woke, f"its process {how} without raising a Python exception{hint}", stack)


def _dump_stacks(procs: list[Any], ranks: list[int], tmp: str) -> dict[int, str]:
    """Ask each rank still running for its Python stack (SIGUSR1 -> faulthandler); read what it wrote."""
    for rank in ranks:
        try:
            os.kill(procs[rank].pid, signal.SIGUSR1)
        except OSError:
            pass  # exited meanwhile
    paths = {rank: _path(tmp, rank, "stack") for rank in ranks}
    end = time.monotonic() + _DUMP_WAIT_S
    while time.monotonic() < end and any(procs[r].is_alive() and not _read(paths[r]) for r in ranks):
        time.sleep(0.02)  # until each rank has written its stack or died (SIGUSR1 kills one not yet set up)
    time.sleep(0.1 if ranks else 0.0)  # let a dump that has begun finish
    return {rank: _read(path).decode(errors="replace")
            or "(no stack: the rank had not started, or did not answer SIGUSR1)" for rank, path in paths.items()}


def _format_stacks(stacks: dict[int, str]) -> str:
    return "".join(f"\n\n--- rank {rank} ---\n{text.rstrip()}" for rank, text in stacks.items())


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _stop(procs: list[Any], exit_grace_s: float) -> None:
    """Leave no rank behind: wait ``exit_grace_s`` for them to exit, then SIGTERM, then SIGKILL; reap them."""
    _join(procs, exit_grace_s)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    _join(procs, _KILL_GRACE_S)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    _join(procs, _KILL_GRACE_S)
    for proc in procs:
        if not proc.is_alive():
            proc.close()  # releases its sentinel; one that survived SIGKILL (stuck in the kernel) keeps it


def _join(procs: list[Any], timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(max(0.0, end - time.monotonic()))
