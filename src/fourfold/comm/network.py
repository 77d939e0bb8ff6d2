"""What an all-reduce puts on each link of a two-level network, and how long that takes.

A cluster is nodes of g ranks. Ranks of one node talk over the node's own fabric (loopback here, NVLink in a GPU
server), each rank with its own way in and out; ranks of different nodes over the node's one network link, full
duplex, shared by the node's g ranks (in the lab: a veth shaped by ``tc``; in a cluster: the NIC)::

    net = Network(node_size=4, node=CostModel(20e-6, 0.2e-9), network=CostModel(0.5e-3, 32e-9))
    net.predict("hierarchical", numel, 4, world_size=8)   # seconds, from the rounds below
    rounds("ring", 8, 4)                                   # per round: elements on the busiest link of each class

The rounds come from the algorithms themselves: each is run once per rank on a recording communicator with
meta tensors (nothing allocated, nothing sent), its messages grouped by step. A round takes

    max(alpha_node + busiest rank's bytes in or out on the node fabric * beta_node,
        alpha_network + busiest node link's bytes up or down * beta_network)

(a class absent from the round costs nothing), plus gamma per byte reduced (``auto.cost``). With one class (g = G,
or g = 1 and one model) this is exactly ``auto``'s closed forms; across nodes it sees what the closed forms
cannot: the ring's two hops that cross nodes decide every step, the hierarchical ring's g ranks share their node's
link, the master's root downloads (G - g)N over one link.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import torch

from fourfold.comm import hierarchical, master, naive, rabenseifner, ring, tree
from fourfold.comm.cost import CostModel, cost
from fourfold.comm.p2p import Communicator, Message, Posted

__all__ = ["ALGORITHMS", "Network", "Round", "link_bytes", "messages", "predict", "rounds"]

ALGORITHMS = ("naive", "master", "ring", "tree", "rabenseifner", "hierarchical")  # the point-to-point ones
"""The algorithms written on point-to-point messages: the ones this model can record."""
_REFERENCE = 720720  # divisible by 1..16: the ranks' shares of a reference vector are whole


class _Recorder(Communicator):
    """One rank of ``size`` as an algorithm sees it: every send recorded, nothing moved."""

    def __post_init__(self) -> None:  # no process group: the caller sets rank, size and global_ranks
        self._buffers = {}

    def post(self, peer: int, tensor: torch.Tensor) -> Posted:
        return Posted(peer, tensor, None)

    def exchange(self, sends=(), recvs=(), *, algorithm, step, phase="", offsets=None, labels=None,  # type: ignore[no-untyped-def, override]
                 posted=()):
        for peer, t in sends:
            self.messages.append(Message(algorithm, phase, step, self.rank, peer, 0, t.numel(),
                                         t.numel() * t.element_size()))


def messages(algorithm: str, numel: int, itemsize: int, world_size: int,
             node_size: int | None = None) -> list[Message]:
    """Every message of every rank (group ranks) when ``algorithm`` sums ``numel`` elements over ``world_size``."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}.")
    dtype = {1: torch.int8, 2: torch.float16, 4: torch.float32, 8: torch.float64}[itemsize]
    out: list[Message] = []
    for r in range(world_size):
        comm = _Recorder(record_messages=True)
        comm.rank, comm.size, comm.global_ranks = r, world_size, list(range(world_size))
        flat = torch.empty(numel, dtype=dtype, device="meta")
        if algorithm == "hierarchical":
            hierarchical.allreduce(comm, flat, node_size=node_size or world_size)
        else:
            {"naive": naive, "master": master, "ring": ring, "tree": tree,
             "rabenseifner": rabenseifner}[algorithm].allreduce(comm, flat)
        out += comm.messages
    return out


class Round(NamedTuple):
    """One step of an algorithm, in elements per element of the vector summed (multiply by N and itemsize)."""

    step: int
    node: float      # the busiest rank's elements in or out on its node's fabric (0: none in this round)
    network: float   # the busiest node link's elements up or down (0: none)


def link_bytes(msgs: list[Message], node_size: int) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """``({rank: [out, in]} on node fabrics, {node: [up, down]} on network links)``: bytes per link."""
    fabric: dict[int, list[int]] = {}
    links: dict[int, list[int]] = {}
    for m in msgs:
        a, b = m.src // node_size, m.dst // node_size
        if a == b:
            fabric.setdefault(m.src, [0, 0])[0] += m.nbytes
            fabric.setdefault(m.dst, [0, 0])[1] += m.nbytes
        else:
            links.setdefault(a, [0, 0])[0] += m.nbytes
            links.setdefault(b, [0, 0])[1] += m.nbytes
    return fabric, links


@lru_cache(maxsize=256)
def rounds(algorithm: str, world_size: int, node_size: int | None = None) -> tuple[Round, ...]:
    """``algorithm``'s rounds over ``world_size`` ranks in nodes of ``node_size`` (None: one node), from one
    recorded run on a reference vector (elements: shares of N, so any N scales them)."""
    g = node_size or world_size
    msgs = messages(algorithm, _REFERENCE * world_size, 1, world_size, g)
    out = []
    for step in sorted({m.step for m in msgs}):
        fabric, links = link_bytes([m for m in msgs if m.step == step], g)
        busiest = [max((max(v) for v in d.values()), default=0) / (_REFERENCE * world_size)
                   for d in (fabric, links)]
        out.append(Round(step, *busiest))
    return tuple(out)


@dataclass(frozen=True)
class Network:
    """Nodes of ``node_size`` ranks: ``node`` the links inside a node, ``network`` each node's link to the others
    (None: the same as ``node``). gamma (seconds per byte reduced) is ``node``'s."""

    node_size: int
    node: CostModel
    network: CostModel | None = None

    def predict(self, algorithm: str, numel: int, itemsize: int, world_size: int) -> float:
        """Seconds for one all-reduce of ``numel`` elements of ``itemsize`` bytes over ``world_size`` ranks."""
        if world_size % self.node_size:
            raise ValueError(f"world_size must be whole nodes of {self.node_size} ranks, got {world_size}.")
        if world_size == 1 or numel == 0:
            return 0.0
        net = self.network or self.node
        nbytes = numel * itemsize
        total = 0.0
        for r in rounds(algorithm, world_size, self.node_size):
            parts = [m.alpha_s + share * nbytes * m.beta_s_per_byte
                     for m, share in ((self.node, r.node), (net, r.network)) if share > 0]
            total += max(parts, default=0.0)
        return total + cost(algorithm, numel, itemsize, world_size, self.node_size).reduced_bytes \
            * self.node.gamma_s_per_byte


def predict(model: CostModel, algorithm: str, numel: int, itemsize: int, world_size: int,
            node_size: int | None = None) -> float:
    """Predicted seconds for one all-reduce: steps*α + wire_bytes*β + reduced_bytes*γ; across nodes (``node_size``
    < G) of a model that knows its ``network`` link, the two-level model of :mod:`fourfold.comm.network`."""
    if model.network is not None and node_size is not None and node_size < world_size:
        between = CostModel(*model.network, model.gamma_s_per_byte)
        return Network(node_size, model, between).predict(algorithm, numel, itemsize, world_size)
    c = cost(algorithm, numel, itemsize, world_size, node_size)
    return c.steps * model.alpha_s + c.wire_bytes * model.beta_s_per_byte + c.reduced_bytes * model.gamma_s_per_byte
