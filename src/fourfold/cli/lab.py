"""``fourfold lab``: run any fourfold command across an emulated cluster of network namespaces on this machine.

    fourfold lab run --nodes 2 --gpus-per-node 2 --link 1gbit -- fourfold train --steps 3
    fourfold lab run --nodes 4 --link 100mbit -- fourfold bench allreduce --sizes 16MB --algorithms ring,master
    fourfold lab sweep --nodes 2,4,8 --link 250mbit --size 16MB     # time against G per algorithm, bytes per link
    fourfold lab check        # can this machine make a lab? (root, iproute2, tbf), in one line
    fourfold lab down         # remove a lab a killed run left behind (``run`` does it itself, also on Ctrl-C)

``run`` makes the lab (:mod:`fourfold.lab.net`), starts the command once per node inside that node's
namespace, with ``--gpus-per-node`` ranks there (torchrun's multi-node launch: node 0's address is the
rendezvous, each node's gloo on its own veth), waits for every node, and removes the lab. The command's output is
node 0's; another node's is printed only when it fails. The exit code is the worst node's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fourfold.cli.args import make_parser
from fourfold.config import LAB_ENV

__all__ = ["main"]

RDZV_PORT = 29411


def _tcp_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tcp", default="auto", help="each node's TCP congestion control, windows kept across idle "
                   "(tcp_slow_start_after_idle=0); keep: this machine's TCP settings (default auto: cubic, Linux's "
                   "default, where the kernel lets a namespace choose it (tcp_allowed_congestion_control), else "
                   "the machine's default, said at start; bbr's pacing and probing over the shaped links made a "
                   "ring 19%% slower than its model)")


def _parser() -> argparse.ArgumentParser:
    p = make_parser("fourfold lab", "An emulated cluster on this machine: nodes as network namespaces, links shaped "
                    "with tc (needs root).")
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    run = sub.add_parser("run", help="run a fourfold command across a lab: fourfold lab run --nodes 2 -- fourfold "
                         "train ...")
    run.add_argument("--nodes", type=int, default=2, help="machines (namespaces) in the lab (default: 2)")
    run.add_argument("--gpus-per-node", type=int, default=1, help="ranks per node, talking over the node's own "
                     "loopback, unshaped (default: 1)")
    run.add_argument("--link", default="1gbit", help="each node's link to the switch, both ways, as tc writes "
                     "rates: 100mbit, 1gbit, 10gbit (default: 1gbit)")
    _tcp_flag(run)
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command, e.g. fourfold train ...")
    sw = sub.add_parser("sweep", help="one all-reduce size across labs of growing size: time against G per "
                        "algorithm, bytes per link, the alpha-beta model beside them")
    sw.add_argument("--nodes", default="2,4,8", help="comma-separated node counts, one lab each (default: 2,4,8)")
    sw.add_argument("--gpus-per-node", type=int, default=1, help="ranks per node (default: 1)")
    sw.add_argument("--link", default="250mbit", help="each node's link, both ways (default: 250mbit: slow "
                    "enough that the links, not this machine's cores, decide the time at 8 ranks)")
    sw.add_argument("--size", default="16MB", help="the all-reduce's size, float32 (default: 16MB)")
    sw.add_argument("--algorithms", default="ring,master,naive,rabenseifner,native",
                    help="comma-separated, as bench allreduce takes them (default: ring,master,naive,rabenseifner,"
                    "native)")
    _tcp_flag(sw)
    sw.add_argument("--iters", type=int, default=3, help="timed calls per algorithm and lab (default: 3)")
    sw.add_argument("--out", default="runs/lab-sweep", help="where sweep.json, sweep.png and each lab's bench "
                    "output go (default: runs/lab-sweep)")
    sub.add_parser("check", help="say whether this machine can make a lab, and if not why")
    sub.add_parser("down", help="remove every lab namespace (a killed run's leftovers)")
    return p


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


def main(argv: list[str] | None = None) -> int:
    from fourfold.lab import Lab, LabUnavailable
    from fourfold.lab.net import leftovers, unavailable

    parser = _parser()
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if ns.action == "check":
        why = unavailable()
        print(why or "fourfold lab: this machine can make a lab (root, iproute2, tbf)")
        return 1 if why else 0
    if ns.action == "down":
        try:
            left = leftovers()
            Lab(1).down()
        except LabUnavailable as e:  # LabBusy: a running lab is not a leftover
            print(f"fourfold lab: {e}", file=sys.stderr)
            return 2
        print(f"fourfold lab: removed {', '.join(left)}" if left else "fourfold lab: no lab to remove")
        return 0
    try:
        Lab(1, ns.link, ns.tcp)  # refuse a bad --link or --tcp before any lab is made
        if ns.action == "sweep":
            from fourfold.lab.sweep import sweep

            try:
                counts = [int(x) for x in ns.nodes.split(",")]
            except ValueError:
                raise ValueError(f"nodes must be comma-separated counts such as 2,4,8, got {ns.nodes!r}.") from None
            return sweep(counts, ns.gpus_per_node, ns.link, ns.size, ns.algorithms, ns.iters, Path(ns.out), ns.tcp)
        return run_command(ns.nodes, ns.gpus_per_node, ns.link, ns.command, ns.tcp)
    except ValueError as e:
        parser.error(str(e))
    except LabUnavailable as e:
        print(f"fourfold lab: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the nodes are stopped and the lab removed (Lab.up removes what it made)
        print("fourfold lab: interrupted; the lab is removed", file=sys.stderr)
        return 130
    return 1
