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

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fourfold.comm import hierarchical, master, naive, rabenseifner, ring, tree
from fourfold.comm.p2p import Communicator
from fourfold.comm.wait import bounded_wait
from fourfold.files import write_text_atomic

__all__ = ["DEFAULT", "Cost", "CostModel", "allreduce", "attach", "candidates", "choose", "cost", "default_path",
           "picks", "predict", "sent_by_rank", "switch_points"]

log = logging.getLogger("fourfold.comm")

_FORMAT = "fourfold-cost-model"
_VERSION = 1


@dataclass(frozen=True)
class CostModel:
    """α (s per step), β (s per byte on a link), γ (s per byte reduced); ``source`` and ``info`` say whence."""

    alpha_s: float
    beta_s_per_byte: float
    gamma_s_per_byte: float = 0.0
    source: str = ""
    info: Mapping[str, Any] = field(default_factory=dict, compare=False)
    network: tuple[float, float] | None = None  # (α, β) of the links between nodes; None: one class of link

    def __post_init__(self) -> None:
        if self.network is not None:
            if not isinstance(self.network, (tuple, list)) or len(self.network) != 2 or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                    for v in self.network) or not any(self.network):
                raise ValueError(f"network must be (alpha_s, beta_s_per_byte) of the links between nodes, finite, "
                                 f">= 0 and not both 0, got {self.network!r}.")
            object.__setattr__(self, "network", (float(self.network[0]), float(self.network[1])))
        for name in ("alpha_s", "beta_s_per_byte", "gamma_s_per_byte"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}.")
        if self.alpha_s == 0 and self.beta_s_per_byte == 0:
            raise ValueError("alpha_s and beta_s_per_byte must not both be 0: the model would predict every "
                             "algorithm takes no time.")

    def to_dict(self) -> dict[str, Any]:
        return {"format": _FORMAT, "version": _VERSION, **asdict(self), "info": dict(self.info)}

    def save(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Write the model as JSON (atomically) to ``path`` or :func:`default_path`; return the path."""
        target = Path(path) if path is not None else default_path()
        write_text_atomic(target, json.dumps(self.to_dict(), indent=2) + "\n")
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None) -> CostModel:
        """The model in ``path``; with no path, the one at :func:`default_path`, or :data:`DEFAULT` if none.

        A file that exists but is not a cost model is refused (``ValueError``), never silently replaced.
        """
        if path is None:
            path = default_path()
            if not path.exists():
                return DEFAULT
        fix = "Re-run `fourfold bench allreduce --nproc 2` to write a fresh one, or delete the file to use " \
              "the built-in defaults."
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"cost model {path} must be JSON, got a parse error: {e}. {fix}") from None
        if not isinstance(data, dict) or data.get("format") != _FORMAT or data.get("version") != _VERSION:
            got = {k: data.get(k) for k in ("format", "version")} if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"cost model {path} must have format={_FORMAT!r} and version={_VERSION}, got "
                             f"{got}. {fix}")
        missing = [k for k in ("alpha_s", "beta_s_per_byte") if k not in data]
        if missing:
            raise ValueError(f"cost model {path} must have {' and '.join(missing)}, got keys {sorted(data)}. {fix}")
        try:
            network = data.get("network")
            return cls(data["alpha_s"], data["beta_s_per_byte"], data.get("gamma_s_per_byte", 0.0),
                       str(data.get("source", "")), dict(data.get("info") or {}),
                       tuple(network) if isinstance(network, list) else network)
        except (ValueError, TypeError) as e:
            raise ValueError(f"cost model {path}: {e} {fix}") from None


DEFAULT = CostModel(
    alpha_s=114e-6, beta_s_per_byte=0.22e-9, gamma_s_per_byte=0.029e-9,
    source="built-in default: `fourfold bench allreduce --nproc 2` on a 2-core x86-64 VM, gloo over loopback, "
           "torch 2.13 CPU, 2026-11-21 (machine clock); rounded (docs/allreduce.md)",
)
"""Used when no cost-model file exists: α 114 us, β 0.22 ns/B (4.6 GB/s), γ 0.029 ns/B, measured on the machine
this project is developed on (the run in docs/allreduce.md). Loopback figures: a real network has larger α and
β, so run the benchmark on yours; the crossover moves, the shape does not."""


def default_path() -> Path:
    """``$FOURFOLD_COST_MODEL`` if set, else ``~/.cache/fourfold/cost_model.json``."""
    env = os.environ.get("FOURFOLD_COST_MODEL")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fourfold" / "cost_model.json"


class Cost(NamedTuple):
    """One algorithm's critical path: steps, bytes on the wire, bytes reduced."""

    steps: int
    wire_bytes: int
    reduced_bytes: int


def sent_by_rank(algorithm: str, numel: int, world_size: int, itemsize: int, node_size: int | None = None
                 ) -> list[int]:
    """Each rank's bytes sent in ``algorithm`` (any of fourfold's point-to-point ones), from its own
    ``theory()``: what the counted bytes must equal."""
    if algorithm == "hierarchical":
        return [hierarchical.theory(numel, world_size, r, itemsize, node_size)[0] for r in range(world_size)]
    fn = {"ring": ring.theory, "tree": tree.theory, "rabenseifner": rabenseifner.theory, "naive": naive.theory,
          "master": master.theory}[algorithm]
    return [fn(numel, world_size, r, itemsize)[0] for r in range(world_size)]


@lru_cache(maxsize=4096)
def _max_sent(algorithm: str, numel: int, world_size: int, itemsize: int, node_size: int) -> int:
    """The busiest rank's bytes sent (:func:`sent_by_rank`)."""
    return max(sent_by_rank(algorithm, numel, world_size, itemsize, node_size))


def cost(algorithm: str, numel: int, itemsize: int, world_size: int, node_size: int | None = None) -> Cost:
    """The critical path of ``algorithm`` (any of fourfold's point-to-point ones) summing ``numel`` elements over G
    ranks. naive and master are not ``auto``'s candidates; they are here so that every algorithm has a prediction."""
    g_, n = world_size, numel
    if g_ == 1 or n == 0:
        return Cost(0, 0, 0)
    if algorithm == "ring":
        steps, reduced = 2 * (g_ - 1), (g_ - 1) * -(-n // g_)
    elif algorithm == "tree":
        d, extra = g_.bit_length() - 1, g_ - (1 << (g_.bit_length() - 1))
        steps, reduced = d + (2 if extra else 0), (d + (1 if extra else 0)) * n
    elif algorithm == "rabenseifner":
        d, extra = g_.bit_length() - 1, g_ - (1 << (g_.bit_length() - 1))
        steps = 2 * d + (2 if extra else 0)
        reduced = ((1 << d) - 1) * -(-n // (1 << d)) + (n if extra else 0)
    elif algorithm == "hierarchical":
        g = node_size or g_
        nodes = g_ // g
        steps = 2 * (g - 1) + 2 * (nodes - 1)
        reduced = (g - 1) * -(-n // g) + (nodes - 1) * -(-n // g_)
    elif algorithm in ("naive", "master"):
        steps, reduced = (1 if algorithm == "naive" else 2), (g_ - 1) * n  # master: gather, then broadcast
    else:
        raise ValueError(f"algorithm must be ring, tree, rabenseifner, hierarchical, naive or master for the cost "
                         f"model, got {algorithm!r}.")
    wire = _max_sent(algorithm, n, g_, itemsize, node_size or g_)
    if algorithm in ("tree", "rabenseifner") and g_ & (g_ - 1):
        wire += n * itemsize  # the fold: received by ranks j < E before they send anything
    if algorithm == "master":
        wire *= 2  # the root receives (G-1)N before it sends as much
    return Cost(steps, wire, reduced * itemsize)


def predict(model: CostModel, algorithm: str, numel: int, itemsize: int, world_size: int,
            node_size: int | None = None) -> float:
    """Predicted seconds for one all-reduce: steps*α + wire_bytes*β + reduced_bytes*γ; across nodes (``node_size``
    < G) of a model that knows its ``network`` link, the two-level model of :mod:`fourfold.comm.network`."""
    if model.network is not None and node_size is not None and node_size < world_size:
        from fourfold.comm.network import Network  # it builds on this module

        between = CostModel(*model.network, model.gamma_s_per_byte)
        return Network(node_size, model, between).predict(algorithm, numel, itemsize, world_size)
    c = cost(algorithm, numel, itemsize, world_size, node_size)
    return c.steps * model.alpha_s + c.wire_bytes * model.beta_s_per_byte + c.reduced_bytes * model.gamma_s_per_byte


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
