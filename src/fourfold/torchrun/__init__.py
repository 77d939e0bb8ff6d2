"""Start the ranks of a run through torchrun's own launcher (``torch.distributed.run``).

``fourfold train --nproc N`` calls :func:`launch_workers`, which hands torchrun the same argument list it
would get from the command line (``--nproc-per-node N ... --module fourfold.train FLAGS``). torchrun's agent
(this process) starts the workers, watches them, and reports the first failure.

On one machine the rendezvous is :class:`LoopbackRendezvous`: its TCPStore listens on 127.0.0.1 only (torchrun's
own ``--standalone`` store binds every interface). With ``--nnodes > 1`` the rendezvous is torchrun's static
TCP one at ``--rdzv-endpoint``, which must be reachable from the other machines.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import select
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from torch.distributed import DistError, PrefixStore, Store
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import (
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

from fourfold.comm.doctor import VERDICT_ENV
from fourfold.launch import loopback_store
from fourfold.torchrun.start import RANK_START_ENV, handover, rank_start, run_rank, warm

__all__ = ["LAB_ENV", "LOOPBACK_BACKEND", "RANK_START_ENV", "LaunchConfig", "LoopbackRendezvous", "create_loopback",
           "is_worker", "lab_default", "launch_workers", "rank_start", "report_error", "run_rank", "torchrun_args", "warm"]

LOOPBACK_BACKEND = "fourfold-loopback"
RENDEZVOUS_GRACE_S = 10.0
"""Seconds past --rdzv-timeout machine 0 (the store's host, whose own timeout ends it) is given before the
rendezvous watch ends it."""
ECHO_WAIT_S = 0.5
"""Seconds a rank that only lost a peer waits before it ends: torchrun's agent looks every 0.1 s and names the
first rank it finds ended, which is then the peer (forked ranks report only that one)."""
SHUTDOWN_S = 3  # seconds the ranks get after SIGTERM before SIGKILL (torchrun's 30 s keeps a stopped rank long)


def _help(text: str) -> dict[str, str]:
    return {"help": text}


LAB_ENV = "FOURFOLD_LAB_"
"""Inside ``fourfold lab run``, each node's command finds its launch defaults (``FOURFOLD_LAB_NPROC``,
``_NNODES``, ``_NODE_RANK``, ``_RDZV_ENDPOINT``, ``_LOCAL_ADDR``) here; flags still win."""


def lab_default(name: str, default: int) -> int:
    """``FOURFOLD_LAB_<name>`` as an int (set by ``fourfold lab run`` for each node's command), else ``default``."""
    return int(os.environ.get(LAB_ENV + name, default))


@dataclass(frozen=True)
class LaunchConfig:
    """How many processes, on how many machines (passed to torchrun's launcher)."""

    nproc: int = field(default_factory=lambda: lab_default("NPROC", 1), metadata=_help(
        "processes to start on this machine (through torchrun)"))
    nnodes: int = field(default_factory=lambda: lab_default("NNODES", 1), metadata=_help("machines taking part"))
    node_rank: int = field(default_factory=lambda: lab_default("NODE_RANK", 0), metadata=_help(
        "this machine's index, 0..nnodes-1"))
    rdzv_endpoint: str | None = field(default_factory=lambda: os.environ.get(LAB_ENV + "RDZV_ENDPOINT"),
                                      metadata=_help("host:port of the rendezvous, required when nnodes > 1"))
    local_addr: str | None = field(default_factory=lambda: os.environ.get(LAB_ENV + "LOCAL_ADDR"), metadata=_help(
        "with nnodes > 1: the address the other machines reach this one at (default: what its hostname resolves "
        "to)"))
    rdzv_timeout: int = field(default=300, metadata=_help(
        "with nnodes > 1: seconds to wait for the other machines to join before giving up"))
    max_restarts: int = field(default=0, metadata=_help(
        "restart every rank this many times when one fails; a restarted run resumes from OUT's newest "
        "checkpoint (see --checkpoint-every)"))

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got max_restarts={self.max_restarts}.")
        if self.rdzv_timeout < 1:
            raise ValueError(f"rdzv_timeout must be >= 1 second, got rdzv_timeout={self.rdzv_timeout}.")
        if self.nproc < 1 or self.nnodes < 1:
            raise ValueError(f"nproc and nnodes must be >= 1, got nproc={self.nproc}, nnodes={self.nnodes}.")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes), got node_rank={self.node_rank}, "
                             f"nnodes={self.nnodes}.")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(f"rdzv_endpoint must be given when nnodes > 1, got nnodes={self.nnodes} and no "
                             "endpoint. Pass --rdzv-endpoint HOST:PORT (the same on every machine).")

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes



class LoopbackRendezvous(RendezvousHandler):
    """The rendezvous of a one-machine run: a store on 127.0.0.1 that the workers join as clients."""

    def __init__(self, run_id: str, timeout_s: float) -> None:
        self._run_id = run_id
        self._timeout_s = timeout_s
        self._store: Store | None = None
        self._port = 0

    def get_backend(self) -> str:
        return LOOPBACK_BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # workers connect to this store instead of starting one of their own

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            store = loopback_store(0, world_size=1, timeout_s=self._timeout_s)
            self._store, self._port = store, store.port
        return RendezvousInfo(PrefixStore(self._run_id, self._store), 0, 1,
                              RendezvousStoreInfo("127.0.0.1", self._port))

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0  # one machine: nobody else ever joins

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        return True


def create_loopback(params: RendezvousParameters) -> RendezvousHandler:
    return LoopbackRendezvous(params.run_id, float(params.config.get("timeout", 600)))


def _register() -> None:
    try:
        rendezvous_handler_registry.register(LOOPBACK_BACKEND, create_loopback)
    except ValueError:
        pass  # registered already (a second launch in this process)


def is_worker() -> bool:
    """Whether this process is a rank torchrun started (fourfold's launcher, or torchrun run by hand), not the
    command that launches them: the one parent-or-worker switch of every command that starts ranks (train,
    bench, explain)."""
    return "RANK" in os.environ


def torchrun_args(module: str, argv: list[str], launch: LaunchConfig) -> list[str]:
    """The torchrun command line for ``launch`` running ``python -m module argv``."""
    args = ["--nproc-per-node", str(launch.nproc), "--nnodes", str(launch.nnodes),
            "--max-restarts", str(launch.max_restarts), "--shutdown-timeout", str(SHUTDOWN_S),
            # every machine's launcher must name the same run (the agents' keys in the store are prefixed by it)
            "--rdzv-id", f"fourfold-{uuid.uuid4().hex[:8]}" if launch.nnodes == 1 else
            "fourfold-" + re.sub(r"[^A-Za-z0-9]+", "-", launch.rdzv_endpoint or "")]
    if launch.nnodes == 1:
        args += ["--rdzv-backend", LOOPBACK_BACKEND, "--rdzv-endpoint", "127.0.0.1:0"]
    else:
        assert launch.rdzv_endpoint  # LaunchConfig refuses nnodes > 1 without one
        args += ["--rdzv-backend", "static", "--rdzv-endpoint", launch.rdzv_endpoint,
                 "--node-rank", str(launch.node_rank), "--rdzv-conf", f"timeout={launch.rdzv_timeout}"]
        if launch.local_addr:
            args += ["--local-addr", launch.local_addr]
    # "--": the command's own flags are never read as torchrun's (argparse takes a prefix such as --virtual for
    # torchrun's --virtual-local-rank and fails as ambiguous)
    return [*args, "--module", "--", module, *argv]


def launch_workers(module: str, argv: list[str], launch: LaunchConfig,
                   stopped: Callable[[], str] | None = None) -> int:
    """Run ``python -m module argv`` on ``launch.nproc`` local ranks (forked by a server or fresh:
    :func:`rank_start`); 0
    when every rank succeeded, else 1 (2 when the first rank to fail exited 2, refusing its input; 128 + the
    signal when one stopped the launcher: ``stopped()`` then says what is left, e.g. what to resume from)."""
    from torch.distributed import run as torchrun
    from torch.distributed.launcher.api import elastic_launch

    _register()
    if launch.nproc > 1:
        # torchrun would set this too, with a warning; one thread per rank avoids oversubscribing the cores.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    if launch.max_restarts > 0:
        # Restarts with gloo on torch 2.13 need the agent's rendezvous store kept apart from the workers'.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    for name in ("torch.distributed.elastic", "torch.multiprocessing.spawn"):  # ours say it once, shorter
        logging.getLogger(name).setLevel(logging.ERROR)
    _quiet_failed_line()
    verdict = Path(tempfile.mkdtemp(prefix="fourfold-verdict-")) / "verdict.json"
    os.environ[VERDICT_ENV] = str(verdict)  # the hang doctor of the rank that finds a hang writes it here
    start = rank_start()
    if launch.nnodes == 1:  # several machines: once they met (the rendezvous watch reads "no child yet" so)
        warm()  # started already where the command knew it would launch (the preflight overlaps its import of torch)
    done = threading.Event()
    watcher = threading.Thread(target=_end_stopped_ranks, args=(verdict, done), daemon=True)
    watcher.start()
    if launch.nnodes > 1:
        how = ("the lab starts every node" if LAB_ENV + "NNODES" in os.environ else
               f"start the same command with --node-rank 0...{launch.nnodes - 1} on each")
        print(f"fourfold: machine {launch.node_rank} of {launch.nnodes}: waiting up to {launch.rdzv_timeout} s for "
              f"the others at {launch.rdzv_endpoint} ({how}).", file=sys.stderr, flush=True)
    unwatch = _watch_rendezvous(launch, lambda: shutil.rmtree(verdict.parent, ignore_errors=True))
    try:
        config, cmd, cmd_args = torchrun.config_from_args(torchrun.parse_args(torchrun_args(module, argv, launch)))
        if start == "forkserver":
            config.start_method = "forkserver"
            sys.stdout.flush()  # what this process wrote comes before what its ranks write
            sys.stderr.flush()
            with handover() as given:
                elastic_launch(config, run_rank)(module, argv, given)
        else:
            elastic_launch(config, cmd)(*cmd_args)
    except SignalException as e:  # Ctrl-C or a kill reaching the agent: it has stopped the workers already
        if e.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        left = f"; {stopped()}" if stopped is not None else "."
        print(f"fourfold: stopped by signal {e.sigval.name}; the ranks were stopped with it{left}", flush=True)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        reported = _reported_errors(verdict.parent, e.get_first_failure()[0])
        if reported:
            print(reported, file=sys.stderr, flush=True)
        print(f"fourfold: {_last_line(e, verdict, launch.max_restarts)}", flush=True)
        return 2 if e.get_first_failure()[1].exitcode == 2 else 1  # 2: input the ranks refused, as before launch
    except (DistError, RendezvousError) as e:  # the machines never met: the store timed out or refused
        print(_no_rendezvous(launch, str(e).splitlines()[0] if str(e) else type(e).__name__), file=sys.stderr,
              flush=True)
        return 1
    finally:
        unwatch()
        done.set()
        watcher.join()  # a thread left running would keep the next launch in this process from forking
        shutil.rmtree(verdict.parent, ignore_errors=True)
    return 0


_REPORTS = ("error", "said", "echo")  # what a failed rank leaves: error-rank3.txt, said-rank3.txt, echo-rank3.txt
"""``error``: a traceback; ``said``: the one line a refusal or a damaged file gets; ``echo``: a rank's line that
it lost a peer (printed only when no rank left anything else: the peer's own report says more)."""


def report_error(error: BaseException, line: str | None = None, *, echo: bool = False) -> bool:
    """In a rank that fourfold's launcher started: leave ``error``'s traceback (or ``line``, its one-line message;
    ``echo``: a line saying that a peer failed) for the launcher, which prints each different one once, naming
    the ranks of a traceback (eight ranks failing alike would print eight interleaved copies). False, and nothing
    written, in a rank started otherwise (the user's own torchrun: no launcher of ours to print it), in an
    attempt the launcher will restart (``--max-restarts``: it would never print that attempt's), or when the
    file cannot be written: then the rank prints it."""
    import traceback

    verdict, rank = os.environ.get(VERDICT_ENV), os.environ.get("RANK")
    if not verdict or rank is None or not Path(verdict).parent.is_dir():
        return False
    attempt, most = (int(os.environ.get(k, "0")) for k in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"))
    if attempt < most:  # the launcher restarts the ranks and prints nothing of this attempt: say it here
        return False
    kind = "echo" if echo else "said" if line is not None else "error"
    text = line if line is not None else "".join(traceback.format_exception(error))
    try:
        Path(verdict).with_name(f"{kind}-rank{int(rank)}.txt").write_text(text)
    except (OSError, ValueError):
        return False
    if echo:  # the peer ended first: let torchrun's agent, which names the first rank it finds ended, see it first
        time.sleep(ECHO_WAIT_S)
    return True


def _reported_errors(folder: Path, first: int) -> str:
    """What the failed ranks left (:func:`report_error`), each different text once, the first failure's first:
    tracebacks under the ranks that raised them, then the one-line messages; a lost peer's echo only when no
    rank left anything else. "" when none left anything."""
    left: dict[str, dict[str, list[int]]] = {kind: {} for kind in _REPORTS}
    for path in folder.glob("*-rank*.txt"):
        kind, _, rank = path.name.removesuffix(".txt").partition("-rank")
        with contextlib.suppress(OSError):
            if kind in left and rank.isdigit():
                left[kind].setdefault(path.read_text(errors="replace"), []).append(int(rank))
    if left["error"] or left["said"]:
        left["echo"] = {}
    blocks = []
    for kind in _REPORTS:
        for text, ranks in sorted(left[kind].items(), key=lambda tr: (first not in tr[1], min(tr[1]))):
            if kind != "error":
                blocks.append(text.rstrip())
                continue
            ranks.sort()
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
            blocks.append(f"fourfold: {who} raised{' (the same error)' if len(ranks) > 1 else ''}:\n{text.rstrip()}")
    return "\n".join(blocks)


def _no_failed(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("failed (exitcode")


def _quiet_failed_line() -> None:
    """torchrun's agent logs ``E... api.py] failed (exitcode: -9) local_rank: 1 (pid ...) of binary ...`` for a
    rank that failed, between the rank's own error and fourfold's last line, which says the same and names the
    fault: that one record is left out (the filter sits on the logger that makes it; added once)."""
    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if _no_failed not in logger.filters:
        logger.addFilter(_no_failed)


def _no_rendezvous(launch: LaunchConfig, cause: str) -> str:
    return (f"fourfold: the rendezvous at {launch.rdzv_endpoint or 'loopback'} failed: not every machine joined "
            f"within {launch.rdzv_timeout} s (nnodes={launch.nnodes}, this is node {launch.node_rank}). Start the "
            f"others, check that the endpoint is reachable from each, or raise --rdzv-timeout. [{cause}]")


def _children() -> bool | None:
    """Whether this process has started any (its ranks); None where Linux's /proc does not say."""
    try:
        return any((task / "children").read_text().strip() for task in Path("/proc/self/task").iterdir())
    except OSError:
        return None


def _watch_rendezvous(launch: LaunchConfig, cleanup: Callable[[], None]) -> Callable[[], None]:
    """torchrun's static rendezvous waits inside the store's C++ code, where Python runs no signal handler until
    it returns: Ctrl-C did nothing for up to --rdzv-timeout (5 minutes by default), and a machine that only
    connects to the endpoint waited about 2.5 times that, printing C++ stacks. Until this launcher has started
    its ranks, a thread woken by the signal itself (``signal.set_wakeup_fd``) ends it at once on Ctrl-C, and
    at the timeout (machine 0: plus :data:`RENDEZVOUS_GRACE_S`) with the one line saying why. (SIGTERM needs no
    watch: no handler is installed before the ranks start, so it ends the process. A store client interrupted
    mid-connect may still log a C++ warning as the process ends.) Returns the function that stops the watch;
    from the ranks' start on, torchrun's agent handles signals itself."""
    if launch.nnodes == 1 or _children() is None or threading.current_thread() is not threading.main_thread():
        return lambda: None
    wake, wakeup = socket.socketpair()
    wakeup.setblocking(False)
    previous = signal.set_wakeup_fd(wakeup.fileno(), warn_on_full_buffer=False)
    stop = threading.Event()

    def end(code: int, line: str) -> None:
        print(line, file=sys.stderr, flush=True)
        cleanup()
        os._exit(code)  # the main thread is inside C++ and cannot be interrupted; nothing was started

    def watch() -> None:
        # machine 0 hosts the store, whose own timeout ends it cleanly (the watch is only a backstop there); the
        # others' store client would retry past the timeout, so for them the watch is what ends the wait
        wait = launch.rdzv_timeout + (RENDEZVOUS_GRACE_S if launch.node_rank == 0 else 0.0)
        deadline = time.monotonic() + wait
        while not stop.is_set() and _children() is False:  # None (/proc unreadable now): stop watching
            try:
                got = wake.recv(64) if select.select([wake], [], [], 0.5)[0] else b""
            except (OSError, ValueError):  # closed by unwatch: the launch is over
                return
            if signal.SIGINT in got and _children() is False:
                end(130, f"fourfold: interrupted while machine {launch.node_rank} waited for the others; no rank "
                         "was started.")
            if time.monotonic() > deadline and _children() is False:
                end(1, _no_rendezvous(launch, "no answer"))

    threading.Thread(target=watch, name="fourfold-rendezvous-watch", daemon=True).start()

    def unwatch() -> None:
        stop.set()
        signal.set_wakeup_fd(previous)
        wake.close()
        wakeup.close()

    return unwatch


def _end_stopped_ranks(verdict: Path, done: threading.Event) -> None:
    """SIGKILL the local ranks the hang doctor found stopped. torchrun's agent would, but only 30 s after its
    SIGTERM (which a stopped process never handles), whatever ``--shutdown-timeout`` says."""
    seen = None
    while not done.wait(0.2):
        try:
            found = json.loads(verdict.read_text())
        except (OSError, ValueError):
            continue
        if found == seen:
            continue
        seen = found
        for host, pid in found.get("stopped", []):
            if host == socket.gethostname() and os.getpid() in (_parent_of(pid), _parent_of(_parent_of(pid))):
                # our own worker (forked by the server we started, or started by us), nothing else
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


def _parent_of(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:  # Linux: /proc/PID/stat is "pid (comm) state ppid ..."; comm may hold spaces, so split after ')'
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _last_line(error: ChildFailedError, verdict: Path, last_attempt: int) -> str:
    """The launcher's last word: the faulty rank, from the hang doctor's verdict when a rank of the attempt that
    failed (the last: ``--max-restarts``) wrote it, else the first failure (and the signal that killed it). (A
    forked rank's failure names only the first rank to end, which need not be the doctor's.)"""
    try:
        found = json.loads(verdict.read_text())
    except (OSError, ValueError):
        found = None
    if found and (found.get("attempt") == last_attempt or any(f.pid == found.get("pid")
                                                               for f in error.failures.values())):
        return (f"hang: {found['summary']}; the doctor's line above has each rank's last operation (and its stack "
                "where it was computing).")
    rank, failure = error.get_first_failure()
    if failure.exitcode < 0:
        return (f"rank {rank} was killed by signal {-failure.exitcode} ({failure.signal_name()}); the others were "
                "stopped with it.")
    return f"rank {rank} failed (exit code {failure.exitcode}); its error is printed above."
