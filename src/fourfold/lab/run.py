"""Run a command on every node of a lab (:mod:`fourfold.lab.net`): what ``fourfold lab run`` and ``lab sweep`` do.

    code = run_command(nodes=2, gpus=2, link="1gbit", command=["fourfold", "train", "--steps", "3"])
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fourfold.torchrun import LAB_ENV

__all__ = ["RDZV_PORT", "run_command"]

RDZV_PORT = 29411


def _node_env(lab, k: int, gpus: int) -> dict[str, str]:  # noqa: ANN001 - a Lab
    """Node ``k``'s environment. A cost model fitted in the lab (``bench allreduce`` saves one) is the lab's,
    kept apart from this machine's own unless ``FOURFOLD_COST_MODEL`` says otherwise: ``auto`` on loopback must
    not pick algorithms for 250 Mbit/s links."""
    from fourfold.lab.net import cost_model_path

    return {"FOURFOLD_COST_MODEL": str(cost_model_path(lab.nodes, gpus, lab.link, lab.tcp)), **os.environ,
            LAB_ENV + "NPROC": str(gpus), LAB_ENV + "NNODES": str(lab.nodes),
            LAB_ENV + "NODE_RANK": str(k), LAB_ENV + "RDZV_ENDPOINT": f"{lab.address(0)}:{RDZV_PORT}",
            LAB_ENV + "LOCAL_ADDR": lab.address(k),
            "GLOO_SOCKET_IFNAME": lab.interface(k),
            "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")}  # no reverse-DNS warnings


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _stop(procs: list[subprocess.Popen[bytes]], within_s: float = 15.0) -> None:
    """Ctrl-C to every node still running (torchrun passes it to its ranks), then, ``within_s`` later, kill what
    is left. A second Ctrl-C or SIGTERM meanwhile is ignored: stopping half-way left node launchers running,
    orphaned, in namespaces about to be deleted."""
    from fourfold.lab.net import signals_ignored

    with signals_ignored():
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        deadline = time.monotonic() + within_s
        for p in procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _wait_all(procs: list[subprocess.Popen[bytes]]) -> list[int]:
    """Every node's exit code; once one fails, the others are stopped (they would wait for it in the
    rendezvous or a collective until their timeouts)."""
    while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            _stop(procs)
            break
        time.sleep(0.2)
    return [int(p.returncode) for p in procs]


def run_command(nodes: int, gpus: int, link: str, command: list[str], tcp: str = "auto") -> int:
    """Make the lab, run ``command`` on every node, remove the lab; the worst node's exit code."""
    from fourfold.lab import Lab
    from fourfold.lab.net import rate_words

    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ValueError("lab run needs a command after --, e.g. fourfold lab run --nodes 2 -- fourfold train "
                         "--steps 3.")
    if command[0] == "fourfold":  # the same fourfold as this one (its interpreter), wherever PATH points
        command = [sys.executable, "-m", "fourfold.cli", *command[1:]]
    if gpus < 1:
        raise ValueError(f"gpus-per-node must be >= 1, got {gpus}.")
    lab = Lab(nodes, link, tcp)
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="fourfold-lab-") as tmp, contextlib.ExitStack() as files, lab:
        logs = Path(tmp)
        print(f"fourfold lab: {nodes} node(s) x {gpus} rank(s), links {rate_words(link, lab.rate)} each way, TCP "
              f"{lab.tcp}, addresses {lab.address(0)}..{lab.address(nodes - 1)}", file=sys.stderr, flush=True)
        if lab.note:
            print(f"fourfold lab: note: {lab.note}", file=sys.stderr, flush=True)
        previous = signal.signal(signal.SIGTERM, _interrupt)  # a killed lab run still removes its lab
        try:
            for k in range(nodes):  # node 0 speaks on this terminal; the others into a log, shown if they fail
                out = None if k == 0 else files.enter_context(open(logs / f"node{k}.log", "wb"))
                procs.append(subprocess.Popen(lab.exec_argv(k, command), env=_node_env(lab, k, gpus), stdout=out,
                                              stderr=subprocess.STDOUT if out else None))
            codes = _wait_all(procs)
        except KeyboardInterrupt:
            _stop(procs)
            raise  # the lab is removed on the way out; main says so
        finally:
            signal.signal(signal.SIGTERM, previous)
        for k, code in enumerate(codes[1:], start=1):
            if code != 0:
                print(f"fourfold lab: node {k} exited {code}; its output:\n"
                      + (logs / f"node{k}.log").read_text(errors="replace")[-4000:], file=sys.stderr)
    return max(codes, key=abs)


