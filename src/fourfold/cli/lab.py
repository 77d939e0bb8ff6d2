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
import sys
from pathlib import Path

from fourfold.lab.run import run_command
from fourfold.run.args import make_parser

__all__ = ["main"]



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
            from fourfold.bench.sweep import sweep

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
