"""``auto``: pick the all-reduce algorithm per message from a measured α-β-γ cost model.

For N = numel * itemsize bytes over G ranks, each candidate's time is predicted as::

    T(alg, N, G) = steps(alg, G) * α  +  wire_bytes(alg, N, G) * β  +  reduced_bytes(alg, N, G) * γ

α is the cost of one step (a message's latency: software, syscalls, the wire), β the seconds per byte on a link,
γ the seconds per byte of local reduction (one ``add_``). Per algorithm, along the critical path
(``wire_bytes`` is the busiest rank's bytes sent, from the algorithm's own ``theory()``; d = floor(log2 G),
E = G - 2^d)::

    ring          2(G-1) steps          2(G-1)N/G on the wire    (G-1)N/G reduced
    tree          d (+2 if E > 0)       d*N (+2N if E > 0)       d*N (+N if E > 0)
    rabenseifner  2d (+2 if E > 0)      2(P-1)N/P (+2N if E > 0) (P-1)N/P (+N if E > 0), P = 2^d
    hierarchical  2(g-1) + 2(n-1)       2(G-1)N/G                (g-1)N/g + (n-1)N/(gn)

(the tree's fold is a receive, so ``theory()``, which counts sends, misses N of its wire bytes; it is added
here; cf. Thakur, Rabenseifner & Gropp, "Optimization of collective communication operations in MPICH", 2005.)

Why γ: with α and β alone the tree and the ring move the same bytes at G = 2 and the tree takes one step
fewer, so the model would never pick the ring there; what the ring saves is half the additions (N/2 against N),
and on a CPU, where loopback "wire" and addition both run at memory speed, that is what makes it win for large
messages. γ is cheap to measure (time ``add_``) and costs nothing to evaluate.

Candidates: ``ring``, ``tree`` and ``rabenseifner``; ``hierarchical`` when the group spans more than one node (g ranks per node,
1 < g < G, from ``LOCAL_WORLD_SIZE`` as :func:`fourfold.comm.hierarchical.resolve_node_size` reads it). With one
(α, β) for every link it is the ring's bytes in fewer steps, and across slow inter-node links it gains more,
so the single-link model never favours it wrongly. A model that also knows the link *between* nodes
(``network``: ``fourfold bench allreduce`` fits it where the ranks span nodes, e.g. in ``fourfold lab``) predicts
across nodes with the two-level model of :mod:`fourfold.comm.network` instead, which sees a node's ranks share
its link: on 2 nodes of 4 over 250 Mbit/s it ranks hierarchical first and Rabenseifner (whose first and last steps
put 2N on each node's link) last, as measured (docs/lab.md). ``rabenseifner`` sends the ring's bytes in 2 log2 G steps, so
at powers of two above 2 the model prefers it to the ring for every size (at G = 2 they are the same exchange:
the tie goes to the ring; elsewhere its fold costs 2N more); measured on this machine at G = 4 it is 0.78-0.90x
the ring's time from 256 KB to 16 MB (docs/allreduce.md). ``naive`` is left out: at G = 2 it is the tree's one
exchange plus two copies, and beyond it sends (G-1)N; ``master`` funnels 2(G-1)N through one rank.

Every rank must run the same algorithm, so the choice depends only on (numel, itemsize, G, model, g), and the
model and g are rank 0's: the first ``auto`` call on a :class:`Communicator` (or :func:`attach`) broadcasts
rank 0's model (the file at ``$FOURFOLD_COST_MODEL`` or ``~/.cache/fourfold/cost_model.json`` if it exists,
else :data:`DEFAULT`) and node size to the group, once, and keeps them on the communicator. Pass the same
``comm=`` across calls to pay that broadcast once; a fresh communicator per call pays it per call.

    from fourfold.comm import auto
    auto.choose(256, 4, 4, auto.DEFAULT)    # ('tree', 'tree 229 us <= ring 684 us predicted for 1024 B ...')
    m = auto.CostModel.load()                # what `fourfold bench allreduce` measured, or DEFAULT
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fourfold.comm import hierarchical, rabenseifner, ring, tree
from fourfold.comm.cost import DEFAULT, Cost, CostModel, cost, default_path, sent_by_rank
from fourfold.comm.network import predict
from fourfold.comm.p2p import Communicator
from fourfold.comm.wait import bounded_wait

__all__ = ["DEFAULT", "Cost", "CostModel", "allreduce", "attach", "candidates", "choose", "cost", "default_path",
           "picks", "predict", "sent_by_rank", "switch_points"]

log = logging.getLogger("fourfold.comm")

def candidates(world_size: int, node_size: int | None = None) -> list[str]:
    """The algorithms ``auto`` may pick, in tie-break order."""
    multi_node = node_size is not None and 1 < node_size < world_size
    return ["ring", "tree", "rabenseifner"] + (["hierarchical"] if multi_node else [])


def _fmt_s(s: float) -> str:
    return f"{s * 1e6:.0f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def choose(numel: int, itemsize: int, world_size: int, model: CostModel,
           node_size: int | None = None) -> tuple[str, str]:
    """``(algorithm, reason)``: the candidate with the least predicted time (ties: the earlier candidate).

    Pure: depends on nothing but its arguments, so every rank given the same ones picks the same algorithm.
    """
    if numel < 0 or itemsize < 1 or world_size < 1:
        raise ValueError(f"numel >= 0, itemsize >= 1 and world_size >= 1 required, got numel={numel}, "
                         f"itemsize={itemsize}, world_size={world_size}.")
    times = {a: predict(model, a, numel, itemsize, world_size, node_size) for a in candidates(world_size, node_size)}
    best = min(times, key=times.__getitem__)  # min keeps the first of equal times
    others = ", ".join(f"{a} {_fmt_s(t)}" for a, t in times.items() if a != best)
    reason = (f"{best} {_fmt_s(times[best])} <= {others} predicted for {numel * itemsize} B over G={world_size}"
              + (f" (g={node_size} per node)" if best == "hierarchical" else "")
              + f" [alpha {model.alpha_s * 1e6:.1f} us, beta {model.beta_s_per_byte * 1e9:.3f} ns/B, "
                f"gamma {model.gamma_s_per_byte * 1e9:.3f} ns/B"
              + (f"; between nodes of {node_size}: alpha {model.network[0] * 1e6:.1f} us, beta "
                 f"{model.network[1] * 1e9:.3f} ns/B" if model.network and node_size and node_size < world_size
                 else "") + "]")
    return best, reason


def switch_points(itemsize: int, world_size: int, model: CostModel, node_size: int | None = None,
                  max_bytes: int = 1 << 30) -> list[tuple[int, str, str]]:
    """``[(numel, before, after)]``: the smallest element counts at which :func:`choose` changes its pick.

    Scans powers of two up to ``max_bytes`` and bisects each change to the exact element count.
    """
    def pick(n: int) -> str:
        return choose(n, itemsize, world_size, model, node_size)[0]

    out, lo = [], 1
    while lo * itemsize < max_bytes:
        hi = lo * 2
        if pick(hi) != pick(lo):
            a, b = lo, hi  # pick(a) != pick(b): narrow to adjacent counts
            while b - a > 1:
                mid = (a + b) // 2
                a, b = (mid, b) if pick(mid) == pick(a) else (a, mid)
            out.append((b, pick(a), pick(b)))
        lo = hi
    return out


# The per-communicator state: rank 0's model and node size, and the choices made so far.
_STATE = "_fourfold_auto"


@dataclass
class _AutoState:
    model: CostModel
    node_size: int | None
    picks: dict[tuple[int, int], tuple[str, str]] = field(default_factory=dict)


def attach(comm: Communicator, model: CostModel | None = None, device: torch.device | None = None) -> CostModel:
    """Collective: give every rank of ``comm``'s group rank 0's cost model and node size; return the model.

    Rank 0 uses ``model``, else :meth:`CostModel.load` (the default file or :data:`DEFAULT`); the other ranks'
    ``model`` is ignored. A file rank 0 cannot read fails on every rank, not only on rank 0.
    """
    mine, error = model, None
    node_size: int | None = None
    if comm.rank == 0:
        try:
            mine = model if model is not None else CostModel.load()
        except (OSError, ValueError) as e:
            error = e
        try:
            node_size = hierarchical.resolve_node_size(comm.size, None, comm.global_ranks)
        except ValueError:
            node_size = None  # the group does not fill whole nodes: no hierarchical candidate
    network = (mine.network or (-1.0, -1.0)) if mine is not None else (-1.0, -1.0)
    payload = torch.tensor([mine.alpha_s, mine.beta_s_per_byte, mine.gamma_s_per_byte, float(node_size or 0),
                            *network] if mine is not None and error is None else [-1.0, 0.0, 0.0, 0.0, -1.0, -1.0],
                           dtype=torch.float64, device=device)
    if comm.size > 1:
        work = dist.broadcast(payload, comm.global_ranks[0], group=comm.group, async_op=True)
        bounded_wait(work, comm.timeout_s, rank=comm.global_rank, op="auto",
                     awaited=f"the cost-model broadcast from rank {comm.global_ranks[0]} to the group of",
                     group_ranks=comm.global_ranks)
    if error is not None:
        raise error
    alpha, beta, gamma, g, net_alpha, net_beta = payload.tolist()
    if alpha < 0:
        raise RuntimeError(f"rank {comm.global_rank}: auto: rank {comm.global_ranks[0]} could not load its cost "
                           f"model (its own error says why), so no rank can choose an algorithm.")
    if comm.rank != 0:
        mine = CostModel(alpha, beta, gamma, source=f"broadcast from rank {comm.global_ranks[0]}",
                         network=None if net_alpha < 0 else (net_alpha, net_beta))
    assert mine is not None
    setattr(comm, _STATE, _AutoState(mine, int(g) or None))
    return mine


def picks(comm: Communicator) -> dict[tuple[int, int], tuple[str, str]]:
    """What auto chose on ``comm`` so far: (numel, itemsize) -> (algorithm, reason)."""
    state: _AutoState | None = getattr(comm, _STATE, None)
    return dict(state.picks) if state is not None else {}


def allreduce(comm: Communicator, flat: torch.Tensor) -> None:
    """Sum ``flat`` over the group in place with the algorithm :func:`choose` predicts fastest."""
    state: _AutoState | None = getattr(comm, _STATE, None)
    if state is None:
        attach(comm, device=flat.device)
        state = getattr(comm, _STATE)
    key = (flat.numel(), flat.element_size())
    if key not in state.picks:
        state.picks[key] = choose(key[0], key[1], comm.size, state.model, state.node_size)
    name, reason = state.picks[key]
    if log.isEnabledFor(logging.DEBUG):
        log.debug("rank %d: auto chose %s: %s", comm.global_rank, name, reason)
    if name == "hierarchical":
        hierarchical.allreduce(comm, flat, node_size=state.node_size)
    elif name == "tree":
        tree.allreduce(comm, flat)
    elif name == "rabenseifner":
        rabenseifner.allreduce(comm, flat)
    else:
        ring.allreduce(comm, flat)
