"""Which TCP congestion control a lab's nodes use (:mod:`fourfold.lab.net`): ``cubic``, Linux's own default and a
cluster's usual one, where the kernel lets a network namespace choose it, else the machine's default, said.

Outside the machine's own namespace Linux lets a namespace choose only the congestion controls listed in
``net.ipv4.tcp_allowed_congestion_control``: this VM's kernel 6.18 defaults to bbr and allows ``reno bbr``. A
congestion control named that the kernel would refuse is refused here, before any namespace exists.
"""

from __future__ import annotations

__all__ = ["CONGESTION_FILE", "IDLE_RESTART_FILE", "PREFERRED_TCP", "congestion_controls", "default_tcp",
           "resolve_tcp"]

CONGESTION_FILE = "/proc/sys/net/ipv4/tcp_congestion_control"
IDLE_RESTART_FILE = "/proc/sys/net/ipv4/tcp_slow_start_after_idle"


def congestion_controls(which: str = "available") -> list[str]:
    """This kernel's TCP congestion controls (empty where it does not say): those it has (``available``), or
    those a network namespace other than the machine's may choose (``allowed``: the kernel refuses the others
    there, whatever the user)."""
    try:
        with open(CONGESTION_FILE.replace("congestion_control", f"{which}_congestion_control")) as f:
            return f.read().split()
    except OSError:
        return []


PREFERRED_TCP = "cubic"
"""The lab's congestion control where the kernel lets a namespace choose it (see the module's docstring)."""


def default_tcp() -> tuple[str, str | None]:
    """The congestion control a lab uses unless told (``--tcp auto``), and a note when it is not
    :data:`PREFERRED_TCP`: a kernel whose ``tcp_allowed_congestion_control`` leaves cubic out (this VM's 6.18
    allows ``reno bbr``) refuses it inside a namespace, so the nodes keep the machine's default."""
    allowed = congestion_controls("allowed")
    if not allowed or PREFERRED_TCP in allowed:
        return PREFERRED_TCP, None
    try:
        with open(CONGESTION_FILE) as f:
            machine = f.read().strip()
    except OSError:
        machine = allowed[-1]
    return machine, (f"{PREFERRED_TCP} cannot be chosen inside a network namespace on this kernel (its "
                     f"tcp_allowed_congestion_control is {' '.join(allowed)}), so the nodes use {machine}, the "
                     f"machine's default. To let the lab use {PREFERRED_TCP}: sysctl -w "
                     f"net.ipv4.tcp_allowed_congestion_control='{' '.join(allowed)} {PREFERRED_TCP}'")


def resolve_tcp(tcp: str) -> tuple[str, str | None]:
    """``tcp`` as a lab's nodes will use it (``auto``: :func:`default_tcp`'s; ``keep``: the machine's settings
    left as they are), and a note when it is not the one asked for; one this kernel has not, or would refuse
    inside a namespace, is refused naming the fix."""
    if tcp == "auto":
        return default_tcp()
    known, allowed = congestion_controls(), congestion_controls("allowed")
    if tcp != "keep" and known and tcp not in known:
        raise ValueError(f"tcp must be one of this kernel's congestion controls {known}, auto or keep, got {tcp!r}.")
    if tcp != "keep" and allowed and tcp not in allowed:
        raise ValueError(f"tcp must be one a network namespace may choose on this kernel (its "
                         f"tcp_allowed_congestion_control: {allowed}), auto or keep, got {tcp!r}. Pass "
                         f"--tcp {allowed[-1]}, or allow it machine-wide: sysctl -w "
                         f"net.ipv4.tcp_allowed_congestion_control='{' '.join(allowed)} {tcp}'")
    return tcp, None
