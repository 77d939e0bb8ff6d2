"""Hierarchical all-reduce: a ring inside each node, a ring across nodes on 1/g of the data, a ring inside.

The G ranks of the group sit on n = G/g nodes of g ranks each (group ranks k*g .. k*g+g-1 on node k). Rank
r = k*g + i (node k, local index i), N elements:

1. intra-node reduce-scatter: a ring over node k's g ranks; afterwards rank r holds node k's sum of segment i
   (segments of N into g parts, lengths s_0..s_{g-1}).
2. inter-node all-reduce of segment i only: a ring (reduce-scatter, then all-gather) over the n ranks with
   local index i, one per node; afterwards rank r holds the total of segment i. The g such rings are
   independent and run side by side.
3. intra-node all-gather: a ring over node k's ranks; afterwards every rank holds every segment.

Cost per rank (t_0..t_{n-1} the lengths of segment i cut into n parts):

* inside the node: 2N - s_i - s_{i+1} elements in 2(g-1) messages, about 2(g-1)/g * N;
* across nodes: 2*s_i - t_k - t_{k+1} elements in 2(n-1) messages, about **2(n-1)/n * N/g** — none when
  segment i is empty (N < g);
* steps: 2(g-1) + 2(n-1), of which only 2(n-1) cross nodes.

The total per rank, about 2(G-1)/G * N, is the flat ring's. The point is where it goes: every one of a flat
ring's 2(G-1) lock-step steps waits on the slowest (inter-node) link, each node's one boundary link carrying
about 2N; here the slow links see 2(n-1) steps and the inter-node traffic is split over g rings, N/g each,
that can use g network links at once. With g = 1 (one rank per node) or g = G (one node) two of the phases are
empty and this *is* the flat ring: the same messages, bytes and result.

The node size g comes from ``node_size`` (in group ranks) or else from the ``LOCAL_WORLD_SIZE`` variable that
torchrun sets: global ranks r // LOCAL_WORLD_SIZE share a node, and the group's ranks must then fill equal,
contiguous runs of nodes (a strided data-parallel group of 4 out of 8 ranks on 2 nodes gets g = 2). Without
either, the group is one node. Tested on one machine with "virtual nodes": ``node_size=2`` at G = 4.

Every rank ends with bitwise the same result: each piece is summed once (by the ring's owner of it, inside the
node, then across nodes) and copied from there.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence

import torch

from fourfold.comm import ring
from fourfold.comm.p2p import Communicator

__all__ = ["allreduce", "resolve_node_size", "theory"]


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def resolve_node_size(world_size: int, node_size: int | None = None,
                      global_ranks: Sequence[int] | None = None) -> int:
    """The number g of the group's ranks per node: ``node_size``, else from ``LOCAL_WORLD_SIZE``, else G.

    ``global_ranks`` (group rank -> global rank; default 0..G-1) places the group's ranks on nodes of
    ``LOCAL_WORLD_SIZE`` global ranks. Raises ``ValueError`` naming G and g unless the group fills whole
    nodes.
    """
    fix = "or use algorithm='ring'"
    if node_size is not None:
        if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1:
            raise ValueError(f"node_size must be a positive int (ranks per node), got {node_size!r}. "
                             f"Pass one that divides the group size, e.g. node_size=1.")
        if world_size % node_size:
            raise ValueError(f"hierarchical all-reduce needs whole nodes: a group of G={world_size} ranks "
                             f"does not divide into nodes of g={node_size}. Pass node_size= one of "
                             f"{_divisors(world_size)}, {fix}.")
        return node_size
    env = os.environ.get("LOCAL_WORLD_SIZE")
    if env is None:
        return world_size  # no launcher told us: one node
    local = int(env) if env.strip().isdigit() else 0
    if local < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE must be a positive int (ranks per node), got {env!r}. "
                         f"Unset it, or pass node_size=.")
    ranks = list(range(world_size)) if global_ranks is None else list(global_ranks)
    runs = [(node, len(list(members))) for node, members in itertools.groupby(r // local for r in ranks)]
    counts = {n for _, n in runs}
    if len(counts) > 1 or len({node for node, _ in runs}) < len(runs):
        per_node = ", ".join(f"node {node}: {n}" for node, n in runs)
        raise ValueError(f"hierarchical all-reduce needs whole nodes: the group's G={world_size} ranks "
                         f"(global {ranks}) fall on nodes of g=LOCAL_WORLD_SIZE={local} ranks unevenly "
                         f"({per_node}). Give every node the same number of the group's ranks, pass "
                         f"node_size= one of {_divisors(world_size)}, {fix}.")
    return counts.pop()


def allreduce(comm: Communicator, flat: torch.Tensor, node_size: int | None = None) -> None:
    """Sum ``flat`` over the group in place: ring inside each node, ring across nodes, ring inside again."""
    g = resolve_node_size(comm.size, node_size, comm.global_ranks)  # checked first: every rank refuses alike
    if comm.size == 1 or flat.numel() == 0:
        return
    n = comm.size // g
    node, i = divmod(comm.rank, g)
    local = [node * g + j for j in range(g)]  # this node's ranks
    across = [k * g + i for k in range(n)]  # local index i on every node
    # phase 1: intra-node reduce-scatter (default labels: "segment j: sum of ranks <this node's>")
    offset, length = ring.reduce_scatter(comm, flat, local, "hierarchical", phase="intra-node reduce-scatter")
    # phase 2: inter-node all-reduce of segment i alone; skipped alike by all its ranks when it is empty
    if length and n > 1:
        piece = flat[offset:offset + length]  # (s_i,) a view: the ring sums into flat itself

        def across_label(j: int, nodes: list[int]) -> str:  # a node's part is the sum of its ranks
            return f"segment {i}.{j}: sum of nodes {','.join(map(str, nodes))}" if len(nodes) > 1 else \
                f"segment {i}.{j} of node {nodes[0]}"

        ring.reduce_scatter(comm, piece, across, "hierarchical", step0=g - 1,
                            phase="inter-node reduce-scatter", offset=offset, label=across_label)
        ring.all_gather(comm, piece, across, "hierarchical", g - 1 + n - 1, phase="inter-node all-gather",
                        offset=offset, label=across_label)
    # phase 3: intra-node all-gather of the totals
    ring.all_gather(comm, flat, local, "hierarchical", g - 1 + 2 * (n - 1), phase="intra-node all-gather",
                    label=lambda j, _: f"segment {j}: sum of all ranks")


def theory(numel: int, world_size: int, rank: int, itemsize: int,
           node_size: int | None = None) -> tuple[int, int]:
    """``(bytes, messages)`` group rank ``rank`` sends in :func:`allreduce` of ``numel`` elements.

    ``node_size`` as in :func:`allreduce` (resolved for the whole world when None). Elements sent:
    ``2N - s_i - s_{i+1}`` in 2(g-1) messages inside the node, plus ``2 s_i - t_k - t_{k+1}`` in 2(n-1)
    messages across nodes when s_i > 0; nothing when N = 0 or G = 1.
    """
    g = resolve_node_size(world_size, node_size)
    if numel == 0 or world_size == 1:
        return 0, 0
    n = world_size // g
    node, i = divmod(rank, g)
    s = ring.segments(numel, g)
    elements, messages = 2 * numel - s[i][1] - s[(i + 1) % g][1], 2 * (g - 1)
    if s[i][1] and n > 1:
        t = ring.segments(s[i][1], n)
        elements += 2 * s[i][1] - t[node][1] - t[(node + 1) % n][1]
        messages += 2 * (n - 1)
    return elements * itemsize, messages
