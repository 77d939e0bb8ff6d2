"""The hang doctor: when a rank has waited too long, find the rank that never arrived, say what it is doing
instead, and end the run in seconds rather than after ``--timeout``.

A thread in every rank (started by ``launch.init`` for runs of more than one process) writes a heartbeat to the
run's store once a second: a counter, the time, this rank's ledger (:mod:`fourfold.comm.ledger`: the operation it
waits in, if any, with group, sequence number, shape and dtype, and the one before) and, when it is not waiting,
the top of its main thread's stack. The beats go over a connection of their own, so a beat never queues behind
a blocking store call of the training thread.

When this rank's current wait passes ``hang_s`` (``--hang-threshold``, default 10 s), the thread reads the
other ranks' beats and follows the chain of waits from this one (:func:`diagnose`):

* a rank in the same collective (same group, same sequence number) or at the other end of the same transfer has
  arrived; any other rank the wait needs has not;
* a rank that has not arrived and is waiting on something else is followed in turn (rank 0 waits for rank 1,
  which waits for rank 2, ...);
* the chain ends at a rank whose heartbeat stopped (SIGSTOP, a debugger, a frozen machine, a dead process), a
  rank that left the run, or a cycle of ranks waiting on each other (a deadlock): that rank is the fault. The
  first rank to find it prints one line naming it, its last ledger entry and stack, writes the verdict for the
  launcher (``FOURFOLD_VERDICT``), and every rank that found it exits with code 1; torchrun's agent stops the
  rest (or restarts the run with ``--max-restarts``);
* a rank that is alive and computing is slow, not hung: one warning says so, and the wait goes on up to
  ``--timeout``, whose :class:`~fourfold.comm.wait.CommError` carries the doctor's account.

On CUDA the bounded wait blocks the host until the NCCL collective completes (``WorkNCCL::wait`` given a
timeout does), so the ledger shows completions as on CPU; torch's own NCCL watchdog and flight recorder
(``TORCH_NCCL_TRACE_BUFFER_SIZE``) see inside the GPU's queue beyond that.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import re
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from fourfold.comm import wait
from fourfold.comm.ledger import LEDGER, Entry, describe

__all__ = ["DEFAULT_HANG_S", "Doctor", "Finding", "HangFound", "diagnose"]

DEFAULT_HANG_S = 10.0
"""Seconds a rank may wait in one operation before the doctor looks for the rank that never arrived."""

INTERVAL_S = 1.0  # between heartbeats
STALE_S = 3.0  # a heartbeat this old means the rank is stopped or dead
GIVE_UP = 10  # beats in a row that failed to reach the store before the thread stops trying
VERDICT_ENV = "FOURFOLD_VERDICT"  # where the launcher wants the verdict (a file path)


class HangFound(RuntimeError):
    """This rank failed because another rank's doctor found a hang and ended the run (its line says which)."""


@dataclass
class Finding:
    """What :func:`diagnose` found: ``faulty`` ranks (empty when every rank needed is alive and computing)."""

    line: str
    faulty: list[int] = field(default_factory=list)
    summary: str = ""
    stopped: list[tuple[str, int]] = field(default_factory=list)  # (host, pid) of the ranks found stopped

    @property
    def fatal(self) -> bool:
        return bool(self.faulty)


def _doing(beat: Mapping[str, Any], now: float) -> str:
    """What a rank's last beat says it was doing: its wait, or computing since its last wait ended, with stack."""
    where = f" at step {beat['step']}" if beat.get("step") is not None else ""
    if beat.get("now"):
        e = beat["now"]
        return f"waiting in {describe(e)} for {now - e['since']:.1f} s{where}"
    last = f" ({describe(beat['last'])} ended {now - beat['idle_since']:.1f} s earlier)" if beat.get("last") \
        else ""
    stack = f", in {beat['stack']}" if beat.get("stack") else ""
    return f"computing{last}{where}{stack}"


def _arrived(rank: int, wait_: Mapping[str, Any], other: Mapping[str, Any] | None) -> bool:
    """Whether the rank whose beat is ``other`` is in the operation ``rank`` waits in (``wait_``)."""
    theirs = (other or {}).get("now")
    if not theirs:
        return False
    if wait_.get("group") is not None:
        return (theirs.get("group") is not None and list(theirs["group"]) == list(wait_["group"])
                and theirs["seq"] == wait_["seq"])
    if theirs.get("peer") != rank or theirs.get("group") is not None:
        return False
    # the other end of the transfer: my receive meets its send, my send its receive. Both receiving from each
    # other (or both sending) is not an arrival: each waits for a message the other has not sent (a stopped
    # rank's last beat can show it waiting to receive from the very rank that now waits on it)
    mine, its = wait_.get("direction"), theirs.get("direction")
    if wait_.get("message") and theirs.get("message") and wait_["message"] != theirs["message"]:
        return False  # it sends (or takes) another message: this one waits behind it
    return mine is None or its is None or mine != its


def _needed(rank: int, wait_: Mapping[str, Any]) -> list[int]:
    if wait_.get("group") is not None:
        return [r for r in wait_["group"] if r != rank]
    return [wait_["peer"]] if wait_.get("peer") is not None else []


def running(pid: int | None) -> bool:
    """Whether process ``pid`` on this machine exists and is not stopped (Linux ``/proc``; elsewhere, False: the
    heartbeat decides). A rank that beats no more but runs is starved, not hung: a busy machine can keep a
    process off the CPU, or in one long call holding the GIL, for seconds (seen: 8 ranks on 2 cores restarting,
    one silent 3 s while importing), and ending the run for it would lose the run."""
    if not pid:
        return False
    try:
        with open(f"/proc/{int(pid)}/stat", encoding="ascii", errors="replace") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError, ValueError):
        return False
    return state not in ("T", "t", "Z", "X")  # stopped, traced, a zombie, dead


def diagnose(me: int, entry: Mapping[str, Any], beats: Mapping[int, Mapping[str, Any] | None],
             stale: Mapping[int, float], *, hang_s: float, now: float | None = None) -> Finding | None:
    """Follow the waits from ``me``'s ``entry`` through the other ranks' last ``beats`` (rank -> beat, None when
    it never beat); ``stale``: rank -> seconds since its last beat, for ranks that stopped beating. None when
    every rank needed has arrived (the transport itself is slow or stuck: ``--timeout`` decides)."""
    now = time.time() if now is None else now
    mine = {"now": dict(entry), "step": None}  # my own wait, as the others would read it

    def beat_of(r: int) -> Mapping[str, Any] | None:
        return mine if r == me else beats.get(r)

    head = f"rank {me} has waited {now - entry['since']:.1f} s in {describe(entry)}"
    parts: list[str] = []
    faulty: list[int] = []
    stopped: list[tuple[str, int]] = []
    short: list[str] = []
    slow: list[str] = []
    seen = {me}
    todo: list[tuple[int, Mapping[str, Any]]] = [(me, entry)]
    while todo:
        rank, wait_ = todo.pop(0)
        missing = [r for r in _needed(rank, wait_) if not _arrived(rank, wait_, beat_of(r))]
        for r in missing:
            beat = beat_of(r)
            if beat is None:
                parts.append(f"rank {r} never started (no heartbeat)")
                faulty.append(r)
                short.append(f"rank {r} never started")
            elif beat.get("exited"):
                parts.append(f"rank {r} has left the run (it finished or failed; its own output says which)")
                faulty.append(r)
                short.append(f"rank {r} left the run")
            elif r in stale:
                parts.append(f"rank {r} never entered it: it is stopped (no heartbeat for {stale[r]:.1f} s: "
                             f"SIGSTOP, a debugger, a frozen machine or a dead process); it was last "
                             f"{_doing(beat, now - stale[r])}")
                faulty.append(r)
                stopped.append((beat["host"], beat["pid"]))
                what = f"waiting in '{beat['now']['op']}'" if beat.get("now") else "computing"
                step = f" at step {beat['step']}" if beat.get("step") is not None else ""
                short.append(f"rank {r} is stopped (no heartbeat for {stale[r]:.0f} s; last {what}{step})")
            elif beat.get("now") and now - beat["now"]["since"] >= hang_s / 2:
                if r in seen:  # rank waits on r, which (through others) waits on rank: a cycle
                    parts.append(f"rank {r} and rank {rank} are in a deadlock: rank {r} is {_doing(beat, now)}")
                    faulty += [r, rank]
                    short.append(f"ranks {r} and {rank} are deadlocked in '{beat['now']['op']}' and "
                                 f"'{wait_['op']}'")
                else:
                    parts.append(f"rank {r} never entered it: it is {_doing(beat, now)}")
                    seen.add(r)
                    todo.append((r, beat["now"]))
            else:
                slow.append(f"rank {r} has not entered it yet: it is {_doing(beat, now)}")
    if not faulty and not slow:
        return None
    if not faulty:
        return Finding(f"{head}; {'; '.join(slow)}. Slow, not stopped: waiting on up to --timeout.")
    culprits = sorted(set(faulty))
    summary = (f"{', '.join(short)}; rank {me} ended the run after waiting {now - entry['since']:.0f} s in "
               f"'{entry['op']}'")
    return Finding(f"hang: {head}; {'; '.join(parts + slow)}.", culprits, summary, stopped)


_FRAME = re.compile(r'\s*File "(.*)", line (\d+) in (.*)')


def _stack(thread_id: int | None, dump: Any = None) -> str:
    """The innermost frames of the thread ``thread_id`` (the main one) outside ``threading``, innermost first,
    read through :func:`faulthandler.dump_traceback` into ``dump`` (a file; a temporary one if None).
    (``traceback.extract_stack`` on ``sys._current_frames()`` walks the running thread's frame objects, and
    crashed the process with SIGSEGV once in ~15 suite runs on Python 3.11; faulthandler reads the frames
    without making objects, as it does from a signal handler.)"""
    if thread_id is None:
        return ""
    with contextlib.ExitStack() as stack:
        f = dump if dump is not None else stack.enter_context(tempfile.TemporaryFile("w+"))
        f.seek(0)
        f.truncate()
        faulthandler.dump_traceback(f, all_threads=True)
        f.flush()
        f.seek(0)
        text = f.read()
    frames, inside = [], False
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            inside = int(line.split("0x", 1)[1].split()[0], 16) == thread_id
        elif inside and (found := _FRAME.match(line)) and "/threading.py" not in found.group(1):
            frames.append(f"{os.path.basename(found.group(1))}:{found.group(2)} {found.group(3)}")
    return " <- ".join(frames[:4])  # faulthandler lists the most recent call first


class Doctor:
    """The heartbeat thread of one rank. ``store``: a store every rank can reach (a second connection is opened
    to a TCPStore); ``hang_s``: when to look (0: heartbeats only, looked at by timed-out waits)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, *, hang_s: float = DEFAULT_HANG_S,
                 attempt: int = 0, verdict_path: str | None = None) -> None:
        self.store = dist.PrefixStore(f"fourfold-doctor/attempt_{attempt}/", _own_connection(store))
        self.rank, self.world_size, self.hang_s = rank, world_size, hang_s
        self.verdict_path, self.attempt = verdict_path, attempt
        self.host = socket.gethostname()
        self._count = 0
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (beat counter, when first seen at that count)
        self._warned: Entry | None = None
        self._stop = threading.Event()
        self._main = threading.main_thread().ident
        self._dump = tempfile.TemporaryFile("w+")  # noqa: SIM115 - where each beat's stacks are read, for its life
        self._thread = threading.Thread(target=self._run, name="fourfold-doctor", daemon=True)

    def start(self) -> Doctor:
        LEDGER.reset(self.rank)
        self._beat()
        self._thread.start()
        wait.set_explainer(self.explain)
        return self

    def stop(self) -> None:
        """Stop beating and mark this rank as having left the run (a wait on it is not a hang)."""
        wait.set_explainer(None)
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * INTERVAL_S)
        if not self._thread.is_alive():
            self._dump.close()
        try:
            self.store.set(str(self.rank), json.dumps({"exited": True, "n": self._count + 1}))
        except Exception:
            pass  # the store is gone with the run

    def verdict_given(self) -> bool:
        """Whether some rank's doctor has ended the run (so this rank's broken waits are a consequence)."""
        try:
            return self.store.check(["verdict"])
        except Exception:
            return False

    def _beat(self) -> None:
        self._count += 1
        cur, last = LEDGER.current, LEDGER.last
        beat = {"n": self._count, "t": time.time(), "host": self.host, "pid": os.getpid(), "step": LEDGER.step,
                "now": cur.as_dict() if cur else None, "last": last.as_dict() if last else None,
                "idle_since": LEDGER.idle_since, "stack": "" if cur else _stack(self._main, self._dump)}
        self.store.set(str(self.rank), json.dumps(beat))

    def _run(self) -> None:
        failed = 0
        while not self._stop.wait(INTERVAL_S):
            try:
                self._beat()
                self._look()
                failed = 0
            except Exception:  # one slow or broken store call (a busy machine) must not end the watch for good
                failed += 1
                if failed >= GIVE_UP:  # the store is gone: the run is ending, nothing left to watch
                    return

    def _read(self, rank: int) -> dict[str, Any] | None:
        return json.loads(self.store.get(str(rank))) if self.store.check([str(rank)]) else None

    def _silence(self, rank: int, beat: Mapping[str, Any] | None, now: float, mono: float) -> float:
        """Seconds since ``rank`` last beat (0 for a rank that never beat or left: not a stopped one)."""
        if beat is None or beat.get("exited"):
            return 0.0
        if beat.get("host") == self.host:  # one clock: the beat's own time says how old it is
            age = now - beat["t"]
            return 0.0 if age > STALE_S and running(beat.get("pid")) else age
        n, first = self._seen.get(rank, (None, mono))  # another machine's clock: how long the counter stood
        if n != beat["n"]:
            self._seen[rank] = (beat["n"], mono)
            first = mono
        return mono - first

    def _diagnose(self, entry: Entry) -> Finding | None:
        """:func:`diagnose` on the beats of the ranks its chain of waits reaches, each read once, on first use:
        one look reads a handful of keys, not one per rank of the world."""
        beats = _OnFirstUse(self._read)
        now, mono = time.time(), time.monotonic()
        stale = _OnFirstUse(lambda r: self._silence(r, beats[r], now, mono), keep=lambda age: age > STALE_S)
        return diagnose(self.rank, entry.as_dict(), beats, stale, hang_s=self.hang_s)

    def explain(self, entry: Entry) -> str:
        """The doctor's account of ``entry`` (a wait of this rank), for a timed-out wait's error."""
        finding = self._diagnose(entry)
        return finding.line if finding else "every rank it needs is in the same operation."

    def _look(self) -> None:
        entry = LEDGER.current
        if not self.hang_s or entry is None or time.time() - entry.since < self.hang_s:
            return
        finding = self._diagnose(entry)
        if finding is None or LEDGER.current is not entry:
            return
        if finding.fatal:
            self._end(finding)
        elif self._warned is not entry and time.time() - entry.since >= self.hang_s + STALE_S:
            self._warned = entry
            print(f"fourfold: warning: {finding.line}", file=sys.stderr, flush=True)

    def _end(self, finding: Finding) -> None:
        """Print the verdict (first finder only), leave it for the launcher, and end this rank: its main thread
        is blocked inside a collective that will never complete."""
        first = self.store.add("verdict", 1) == 1
        if first:
            print(f"fourfold: {finding.line}", file=sys.stderr, flush=True)
            if self.verdict_path:
                try:
                    from fourfold.files import write_text_atomic

                    write_text_atomic(self.verdict_path, json.dumps(
                        {"pid": os.getpid(), "rank": self.rank, "attempt": self.attempt, "faulty": finding.faulty,
                         "summary": finding.summary, "stopped": finding.stopped}))
                except OSError:
                    pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


class _OnFirstUse(Mapping[int, Any]):
    """rank -> ``fetch(rank)``, fetched when first asked for and kept; ranks whose value fails ``keep`` are
    absent. Iterating it is not supported: a diagnosis asks for the ranks it needs by name."""

    def __init__(self, fetch: Callable[[int], Any], keep: Callable[[Any], bool] = lambda _: True) -> None:
        self._fetch, self._keep = fetch, keep
        self._got: dict[int, Any] = {}

    def __getitem__(self, rank: int) -> Any:
        if rank not in self._got:
            self._got[rank] = self._fetch(rank)
        if not self._keep(self._got[rank]):
            raise KeyError(rank)
        return self._got[rank]

    def __iter__(self) -> Iterator[int]:
        raise TypeError("ask for ranks by name")

    def __len__(self) -> int:
        raise TypeError("ask for ranks by name")


def _own_connection(store: dist.Store) -> dist.Store:
    base = store.underlying_store if isinstance(store, dist.PrefixStore) else store
    if isinstance(base, dist.TCPStore):
        import datetime

        return dist.TCPStore(base.host, base.port, is_master=False, timeout=datetime.timedelta(seconds=30),
                             wait_for_workers=False)
    return base
