"""The lab's network: namespaces, veth pairs, a bridge and token-bucket filters, made and torn down.

Layout for ``Lab(nodes=3, link="1gbit")``::

    namespace fourfold-lab-n0   ffl-n0 10.213.0.1/24 ─┐ tbf 1gbit each way
    namespace fourfold-lab-n1   ffl-n1 10.213.0.2/24 ─┼── ffl-s0..2 ── bridge ffl-br   (namespace fourfold-lab-sw)
    namespace fourfold-lab-n2   ffl-n2 10.213.0.3/24 ─┘

Node k's end shapes what it sends (its upload); the switch's end shapes what reaches it (its download), so a
node's link carries ``--link`` each way, full duplex, as a NIC does. Everything has the ``fourfold-lab-`` /
``ffl-`` prefix and lives inside the lab's namespaces; :meth:`Lab.down` deletes the namespaces (their veths and
qdiscs go with them), and :meth:`Lab.up` first removes what a crashed lab left.

Each node's TCP uses ``tcp`` congestion control (default ``cubic``, Linux's own default and a cluster's usual
one, where the kernel lets a namespace choose it: :mod:`fourfold.lab.tcp`) and keeps a connection's window while it
sits idle (``tcp_slow_start_after_idle=0``, the usual tuning for long-lived connections that carry bursts);
``keep`` leaves the machine's settings. This VM's kernel defaults to
``bbr``, whose pacing and probing over these shaped links made a G = 4 ring all-reduce 19 % slower than its
alpha-beta model, against 3-4 % with ``cubic``; Rabenseifner, whose partner changes every step so that each
connection idles between its two uses, went from +32 % to +13 % at G = 8 once windows survived the idle.

Needs root, ``ip`` and ``tc`` (iproute2) and the ``tbf`` qdisc; :func:`unavailable` says in one line what is
missing (``netem`` is not needed: latency comes from the real stack, bandwidth from ``tbf``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fourfold.lab.tcp import (
    CONGESTION_FILE,
    IDLE_RESTART_FILE,
    PREFERRED_TCP,
    congestion_controls,
    default_tcp,
    resolve_tcp,
)

__all__ = ["LOCK", "PREFERRED_TCP", "PREFIX", "SUBNET", "Lab", "LabBusy", "LabUnavailable", "congestion_controls",
           "cost_model_path", "default_tcp", "holding", "leftovers", "parse_rate", "rate_words", "signals_ignored",
           "unavailable"]

PREFIX = "fourfold-lab-"
SUBNET = "10.213.0.0/24"
"""The lab's addresses: node k is 10.213.0.(k+1), on its own veth only."""
MAX_NODES = 64
LOCK = Path("/run/fourfold-lab.lock")
"""Held (``flock``) by the process whose lab is up, and released by the kernel when it exits: one lab at a time,
and a crashed one's leftovers are told apart from a running one's."""
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)(bit|bps)\s*$", re.IGNORECASE)


class LabUnavailable(RuntimeError):
    """This machine cannot make a lab (not root, no ``ip``/``tc``, no namespaces or ``tbf``)."""


class LabBusy(LabUnavailable):
    """Another process's lab is up: making or removing one now would cut its running ranks off."""


def holding() -> int:
    """An fd holding :data:`LOCK` (its pid written in it); :class:`LabBusy` naming the holder if it is taken."""
    import fcntl  # Linux's, as the lab is; fourfold plan imports this module on any system

    try:
        fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise LabUnavailable(f"cannot open the lab's lock {LOCK} ({e.strerror}): the lab needs root on "
                             "Linux.") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise LabBusy(f"a lab is up, made by pid {holder} (its namespaces {PREFIX}*): removing or remaking it "
                      "would cut that run's ranks off mid-step. Wait for it to end, or stop it (Ctrl-C removes "
                      "its lab).") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    """Ctrl-C and SIGTERM ignored inside (in the main thread; elsewhere signals reach no handler anyway): for
    cleanup that must finish once begun."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def parse_rate(text: str, most: float = 1e11) -> int:
    """``"1gbit"`` -> 1_000_000_000 bits/s (tc's units: kbit, mbit, gbit, or kbps/mbps/gbps for bytes/s, so
    ``"1gbps"`` is 8 Gbit/s); between 100 kbit/s and ``most`` bits/s (tc's tbf shapes up to 100 Gbit/s)."""
    m = _RATE.match(text)
    if not m:
        raise ValueError(f"link must be a rate such as 100mbit, 1gbit or 10gbit, got {text!r} (tc's units: kbit, "
                         "mbit, gbit are bits per second; kbps, mbps, gbps bytes per second).")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()]
    bits = int(value * (8 if m.group(3).lower() == "bps" else 1))
    if not 1e5 <= bits <= most:
        raise ValueError(f"link must be between 100kbit and {most / 1e9:g}gbit, got {text!r}.")
    return bits


def rate_words(text: str, bits: int) -> str:
    """``text`` as given, with its rate in bits where tc's units read it as bytes: ``1Gbps (8 Gbit/s: tc's bps is
    bytes per second)`` (most who write Gbps mean gigabits; tc, and so the lab, do not)."""
    if not text.strip().lower().endswith("bps"):
        return text
    scale, unit = next(((s, u) for s, u in ((1e12, "Tbit/s"), (1e9, "Gbit/s"), (1e6, "Mbit/s")) if bits >= s),
                       (1e3, "kbit/s"))
    return f"{text} ({bits / scale:.3g} {unit}: tc's bps is bytes per second)"


def _run(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise LabUnavailable(f"`{' '.join(args)}` failed: {(proc.stderr or proc.stdout).strip()}")
    return proc


def unavailable() -> str | None:
    """Why no lab can be made here, in one line; None when one can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the lab needs root (network namespaces and tc): run as root, or skip the lab"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"the lab needs {' and '.join(missing)} (Debian: apt-get install iproute2)"
    probe = PREFIX + "probe"
    try:
        _run(["ip", "netns", "add", probe])
        _run(["ip", "-n", probe, "link", "add", "ffl-probe", "type", "veth", "peer", "name", "ffl-probe2"])
        _run(["tc", "-n", probe, "qdisc", "add", "dev", "ffl-probe", "root", "tbf", "rate", "1gbit", "burst",
              "128kb", "latency", "50ms"])
    except LabUnavailable as e:
        return f"this machine cannot make a lab: {e}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def cost_model_path(nodes: int, ranks_per_node: int, link: str, tcp: str | None = None) -> Path:
    """Where a cost model fitted in a lab of this shape is kept (``fourfold lab run`` points
    ``FOURFOLD_COST_MODEL`` there; ``fourfold plan --lab`` reads it): apart from this machine's own. ``tcp``: the
    congestion control the lab used (None: the one it uses unless told, :func:`default_tcp`)."""
    tcp = default_tcp()[0] if tcp is None else tcp
    return Path.home() / ".cache" / "fourfold" / "lab" / f"cost_model-{nodes}x{ranks_per_node}-{link}-{tcp}.json"


def leftovers() -> list[str]:
    """The lab namespaces that exist now (a running lab's, or a crashed one's)."""
    out = _run(["ip", "netns", "list"], check=False).stdout
    return sorted(line.split()[0] for line in out.splitlines() if line.startswith(PREFIX))


@dataclass
class Lab:
    """``nodes`` namespaces joined by ``link``-shaped veths; ``with Lab(...) as lab:`` makes and removes it."""

    nodes: int
    link: str = "1gbit"
    tcp: str = "auto"  # each node's TCP congestion control; "auto": default_tcp()'s; "keep": the machine's
    _lock: int | None = field(default=None, init=False, repr=False, compare=False)  # holding(): while it is up

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"nodes must be between 1 and {MAX_NODES}, got {self.nodes}.")
        self.rate = parse_rate(self.link)
        self.tcp, self.note = resolve_tcp(self.tcp)  # note: said at start, when it is not the one asked for

    def namespace(self, k: int) -> str:
        return f"{PREFIX}n{k}"

    def address(self, k: int) -> str:
        return f"10.213.0.{k + 1}"

    def interface(self, k: int) -> str:
        return f"ffl-n{k}"

    def up(self) -> None:
        """Make the lab (after removing a crashed one's leftovers); on any failure, remove what was made."""
        why = unavailable()
        if why:
            raise LabUnavailable(why)
        self._lock = holding()  # LabBusy while another process's lab is up
        self._remove()  # a crashed lab's leftovers: nobody holds the lock
        sw = PREFIX + "sw"
        burst = max(self.rate // 8 // 250, 32 * 1024)  # bytes: at least one timer tick's worth at this rate
        shape = ["root", "tbf", "rate", f"{self.rate}bit", "burst", str(burst), "latency", "100ms"]
        try:
            _run(["ip", "netns", "add", sw])
            _run(["ip", "-n", sw, "link", "add", "ffl-br", "type", "bridge"])
            _run(["ip", "-n", sw, "link", "set", "ffl-br", "up"])
            for k in range(self.nodes):
                ns, node_end, switch_end = self.namespace(k), self.interface(k), f"ffl-s{k}"
                _run(["ip", "netns", "add", ns])
                _run(["ip", "link", "add", node_end, "netns", ns, "type", "veth", "peer", "name", switch_end,
                      "netns", sw])
                _run(["ip", "-n", ns, "addr", "add", f"{self.address(k)}/24", "dev", node_end])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
                _run(["ip", "-n", ns, "link", "set", node_end, "up"])
                _run(["ip", "-n", sw, "link", "set", switch_end, "master", "ffl-br"])
                _run(["ip", "-n", sw, "link", "set", switch_end, "up"])
                _run(["tc", "-n", ns, "qdisc", "add", "dev", node_end, *shape])      # what node k sends
                _run(["tc", "-n", sw, "qdisc", "add", "dev", switch_end, *shape])    # what reaches node k
                if self.tcp != "keep":  # /proc/sys/net is the namespace's own, seen from inside it; each file
                    # closed in turn, so a value the kernel refuses fails here instead of at garbage collection
                    _run(["ip", "netns", "exec", ns, sys.executable, "-c",
                          f"for path, value in (({CONGESTION_FILE!r}, {self.tcp!r}), ({IDLE_RESTART_FILE!r}, '0')):\n"
                          "    with open(path, 'w') as f:\n        f.write(value)"])
        except BaseException:
            self.down()
            raise

    def down(self) -> None:
        """Remove every lab namespace (this lab's or a crashed one's; their veths and qdiscs go with them), then
        let the next lab be made. Refuses (:class:`LabBusy`) another process's running lab."""
        lock = self._lock if self._lock is not None else holding()
        try:
            with signals_ignored():  # a second Ctrl-C must not leave half the namespaces behind
                self._remove()
        finally:
            os.close(lock)
            self._lock = None

    @staticmethod
    def _remove() -> None:
        for ns in leftovers():
            _run(["ip", "netns", "del", ns], check=False)

    def exec_argv(self, k: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside node ``k``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(k), *argv]

    def qdiscs(self, k: int) -> str:
        """``tc qdisc show`` of node ``k``'s end (what shapes its upload)."""
        return _run(["tc", "-n", self.namespace(k), "qdisc", "show", "dev", self.interface(k)]).stdout

    def tcp_settings(self, k: int) -> tuple[str, int]:
        """Node ``k``'s TCP congestion control and ``tcp_slow_start_after_idle``."""
        out = _run(self.exec_argv(k, ["cat", CONGESTION_FILE, IDLE_RESTART_FILE])).stdout.split()
        return out[0], int(out[1])

    def __enter__(self) -> Lab:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()
