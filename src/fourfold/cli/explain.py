"""``fourfold explain ALGORITHM --world G``: draw an all-reduce step by step, from a real run of it.

    fourfold explain ring --world 4          # the ring's share-reduce and share-only steps
    fourfold explain tree --world 5          # recursive doubling, with the fold for a non-power of two
    fourfold explain naive --world 3
    fourfold explain rabenseifner --world 8  # recursive halving, then recursive doubling: the ring's bytes, 6 steps
    fourfold explain hierarchical --world 4 --ranks-per-node 2   # ring in each node, across nodes, in each again
    fourfold explain ring-attention --cp 4   # context parallelism's ring: whose K/V each rank holds, step by step

G ranks are started through torchrun's launcher and run the algorithm for real on a tiny integer tensor in
which rank r holds the value 2**r everywhere. Since every contribution is a distinct bit, any element's value
says exactly which ranks' data it sums: 0b0101 is "a+c". Every message is recorded as it is sent (source,
destination, which segment, what it held), and every rank's tensor after every step, so the picture is the
algorithm's own behaviour, not a drawing of the theory. Ranks are lettered a, b, c, ... and segments numbered
0..G-1, so ``a2+b2`` is the sum of ranks 0 and 1's segment 2, as in the diagrams that teach the ring.

Prints the steps as text and writes a PNG (``--out``, default ``runs/explain-ALGORITHM-G.png``).
"""

from __future__ import annotations

import difflib
import os
import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch

__all__ = ["Sent", "main", "masks_label"]

LETTERS = "abcdefghijklmnop"


class Sent(NamedTuple):
    """One recorded message: at exchange number ``exchange`` (this rank's count), ``src`` sent ``dst`` a range."""

    exchange: int
    phase: str
    step: int
    src: int
    dst: int
    segments: tuple[int, ...]   # which of the G segments the range covers
    mask: int                   # the contributions it carried (bit r = rank r)


def masks_label(mask: int, segment: int | None = None) -> str:
    """``0b101, 2`` -> ``"a2+c2"``; without a segment, ``"a+c"``."""
    sub = "" if segment is None else str(segment)
    return "+".join(f"{LETTERS[r]}{sub}" for r in range(mask.bit_length()) if mask >> r & 1) or "0"


def _segment_of(offset: int, numel: int, bounds: list[tuple[int, int]]) -> tuple[int, ...]:
    return tuple(j for j, (o, n) in enumerate(bounds) if n and o < offset + max(numel, 1) and offset < o + n)


def _run_worker(algorithm: str, per_segment: int, node_size: int | None = None) -> int:
    import torch.distributed as dist

    from fourfold import comm, launch
    from fourfold.comm import auto
    from fourfold.comm.ring import segments

    with launch.init("cpu", timeout_s=60) as ctx:
        g = ctx.world_size
        flat = torch.full((g * per_segment,), 1 << ctx.rank, dtype=torch.int64)
        bounds = segments(flat.numel(), g)
        sent: list[Sent] = []
        states: list[list[int]] = []  # per-segment masks as each exchange starts, then at the end
        keys: list[tuple[str, int]] = []  # each exchange's (phase, step): the same exchange on every rank

        class Recorder(comm.Communicator):
            """Records what each exchange carried and the tensor's state after it."""

            def post(self, peer, tensor):  # no receive ahead: each state shows exactly what the steps before it did
                return comm.Posted(peer, tensor, None)

            def exchange(self, sends=(), recvs=(), *, algorithm, step, phase="", offsets=None, labels=None,
                         posted=()):
                recvs = [*recvs, *((r.peer, r.tensor) for r in posted)]
                index = len(states)
                states.append([int(flat[o]) for o, _ in bounds])  # after the previous step's additions
                keys.append((phase, step))
                for k, (peer, t) in enumerate(sends):
                    offset = offsets[0][k] if offsets else 0
                    segs = _segment_of(offset, t.numel(), bounds) if t.numel() < flat.numel() else \
                        tuple(range(g))
                    sent.append(Sent(index, phase, step, self.rank, peer, segs, int(t.reshape(-1)[0])))
                super().exchange(sends, recvs, algorithm=algorithm, step=step, phase=phase, offsets=offsets,
                                 labels=labels)

        rec = Recorder(None, timeout_s=60)
        if node_size is not None:  # nodes of node_size ranks, though every rank is on this machine
            from fourfold.comm import hierarchical

            hierarchical.allreduce(rec, flat, node_size=node_size)
        else:
            comm.allreduce(flat, algorithm, comm=rec)
        states.append([int(flat[o]) for o, _ in bounds])
        expected = (1 << g) - 1
        if not bool((flat == expected).all()):
            raise RuntimeError(f"{algorithm} left rank {ctx.rank} with {flat.tolist()}, expected all {expected}.")
        gathered: list[Any] = [None] * g if ctx.rank == 0 else []
        dist.gather_object((sent, states, keys), gathered if ctx.rank == 0 else None, dst=0)
        if ctx.rank == 0:
            chose = next(iter(auto.picks(rec).values()), None) if algorithm == "auto" else None
            _report(algorithm, g, gathered, chose, node_size)
    return 0


def _global_order(keys: list[list[tuple[str, int]]]) -> list[tuple[str, int]]:
    """Every rank's exchanges, ``(phase, step)`` in its own order, merged into one order that keeps each rank's
    (a topological sort): a rank that sits out some, as a non-power-of-two world's folded rank does, has a
    shorter list than the others."""
    after: dict[tuple[str, int], set[tuple[str, int]]] = {}
    for mine in keys:
        for i, key in enumerate(mine):
            after.setdefault(key, set()).update(mine[:i])
    order: list[tuple[str, int]] = []
    while len(order) < len(after):
        ready = [k for k in after if k not in order and after[k] <= set(order)]
        if not ready:
            raise RuntimeError(f"the ranks ran their exchanges in different orders: {keys}")
        order.append(ready[0])
    return order


def _aligned(gathered: list[Any]) -> tuple[list[Sent], list[list[list[int]]]]:
    """The messages numbered by the global exchange, and ``states[rank][k]``: its segments as global exchange
    ``k`` starts (``k`` = the number of exchanges: at the end), whether or not the rank takes part in it."""
    order = _global_order([keys for _, _, keys in gathered])
    messages, states = [], []
    for sent, mine, keys in gathered:
        at = [order.index(key) for key in keys]
        messages += [m._replace(exchange=at[m.exchange]) for m in sent]
        # before global exchange k: the state before this rank's first own exchange at or after k
        states.append([mine[next((i for i, a in enumerate(at) if a >= k), len(at))] for k in range(len(order) + 1)])
    return sorted(messages, key=lambda m: (m.exchange, m.src)), states


def _report(algorithm: str, g: int, gathered: list[Any], chose: tuple[str, str] | None = None,
            node_size: int | None = None) -> None:
    messages, states = _aligned(gathered)  # states[rank][i] = per-segment masks before exchange i
    steps = sorted({m.exchange for m in messages})
    k = min(2, g - 1)  # the legend's example segment: one that exists
    print(f"{algorithm} all-reduce on {g} ranks (rank 0 = a, rank 1 = b, ...), the tensor cut into {g} "
          f"segments; a{k}+b{k} = the sum of ranks 0 and 1's segment {k}, S{k} = segment {k} summed over every "
          "rank")
    if chose is not None:
        print(f"auto chose {chose[0]} for this tensor: {chose[1]}")
    print()
    _print_state(states, 0, g)
    for i in steps:
        batch = [m for m in messages if m.exchange == i]
        print(f"\nstep {i} ({batch[0].phase}):")
        for m in batch:
            what = masks_label(m.mask, m.segments[0] if len(m.segments) == 1 else None)
            where = (f"segment {m.segments[0]}" if len(m.segments) == 1 else "the whole tensor"
                     if len(m.segments) == g else f"segments {m.segments[0]}-{m.segments[-1]}")
            print(f"  rank {m.src} -> rank {m.dst}: {where} = {what}")
        _print_state(states, i + 1, g)
    pieces = sum(len(m.segments) for m in messages)
    by_rank = [sum(len(m.segments) for m in messages if m.src == r) for r in range(g)]
    each = (f"{by_rank[0]} sent by every rank" if len(set(by_rank)) == 1 else  # the ring's balance, or not
            "sent by rank " + ", ".join(f"{r}: {n}" for r, n in enumerate(by_rank)) +
            f"; the busiest rank sends {max(by_rank)}, which is what bounds its time")
    print(f"\n{len(messages)} messages in {len(steps)} step{'s' if len(steps) != 1 else ''}; {pieces} "
          f"segment-sized pieces moved, each 1/{g} of the tensor ({each}).")
    out = Path(os.environ.get("FOURFOLD_EXPLAIN_OUT", f"runs/explain-{algorithm}-{g}.png"))
    try:
        _draw(algorithm, g, messages, states, steps, out, node_size)
        print(f"picture: {out}")
    except ImportError as e:
        print(f"(no picture: {e})")


def _label(mask: int, segment: int, g: int) -> str:
    return f"S{segment}" if mask == (1 << g) - 1 else masks_label(mask, segment)


def _state_at(states: list[list[list[int]]], r: int, i: int | None) -> list[int]:
    """Rank ``r``'s segments as exchange ``i`` starts (None: at the end)."""
    return states[r][-1 if i is None else i]


def _print_state(states: list[list[list[int]]], i: int, g: int) -> None:
    print("  then:" if i else "start:")
    for r in range(g):
        row = _state_at(states, r, i)
        print(f"    rank {r}: " + " | ".join(f"{_label(m, j, g):<{4 * g}}" for j, m in enumerate(row)))


def _draw(algorithm: str, g: int, messages: list[Sent], states: list[list[list[int]]], steps: list[int],
          out: Path, node_size: int | None = None) -> None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("pictures need matplotlib: pip install 'fourfold[viz]'") from e
    from fourfold.files import atomic_path

    rows = [*steps, None]  # each step drawn with the state it starts from; None = the end
    fig = Figure(figsize=(3.3 * g + 1.4, 0.85 * len(rows) + 1.1), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    cmap = ["#deebf7", "#c6dbef", "#9ecae1", "#6baed6", "#4292c6", "#2171b5", "#08519c", "#08306b"]
    for y, step in enumerate(rows):
        batch = [m for m in messages if m.exchange == step]
        for r in range(g):
            masks = _state_at(states, r, step)
            for j, mask in enumerate(masks):
                x = r * (g + 1) + j
                n = bin(mask).count("1")
                color = cmap[min(len(cmap) - 1, round((n / g) * (len(cmap) - 1)))]
                to = [m.dst for m in batch if m.src == r and j in m.segments]
                ax.add_patch(_rect(x, -y, color, bool(to)))
                text = _label(mask, j, g).replace("+", "+\n") if n > 2 and n < g else _label(mask, j, g)
                ax.text(x + 0.5, -y + 0.55, text, ha="center", va="center", fontsize=6.5 if n < 3 else 5.5,
                        color="white" if n / g > 0.55 else "black")
                if to:
                    ax.text(x + 0.5, -y + 0.18, "→ " + ",".join(f"r{d}" for d in to), ha="center",
                            va="center", fontsize=6, color="#ffb3b3" if n / g > 0.55 else "#b30000",
                            fontweight="bold")
        label = "end" if step is None else f"step {step}\n{batch[0].phase if batch else ''}"
        ax.text(-0.4, -y + 0.5, label, ha="right", va="center", fontsize=7.5)
    for r in range(g):
        node = f", node {r // node_size}" if node_size else ""
        ax.text(r * (g + 1) + g / 2, 1.3, f"rank {r} ({LETTERS[r]}){node}", ha="center", fontsize=9)
    ax.set_xlim(-3.4, g * (g + 1))
    ax.set_ylim(-len(rows) + 0.8, 1.7)
    ax.axis("off")
    ax.set_title(f"{algorithm} all-reduce on {g} ranks. Each row: every rank's {g} segments as the step starts; "
                 "red = sent this step (→ to whom); darker = more ranks summed; Sj = segment j complete",
                 fontsize=8.5)
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png")


def _rect(x: float, y: float, color: str, sending: bool) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle((x + 0.04, y + 0.1), 0.92, 0.8, facecolor=color,
                     edgecolor="#d62728" if sending else "white", linewidth=2.0 if sending else 0.5)


def main(argv: list[str] | None = None) -> int:
    from fourfold.run.args import make_parser
    from fourfold.torchrun import LaunchConfig

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["ring-attention"]:  # context parallelism's ring: its own command
        from fourfold.cli import explain_cp

        return explain_cp.main(argv[1:])
    parser = make_parser("fourfold explain", __doc__)
    parser.add_argument("algorithm", help="naive, master, ring, tree, hierarchical, ...")
    parser.add_argument("--world", type=int, default=4, help="ranks (2..16, default 4)")
    parser.add_argument("--out", default=None, help="PNG path (default runs/explain-ALGORITHM-G.png)")
    parser.add_argument("--per-segment", type=int, default=1, help="elements per segment (default 1)")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="hierarchical only: ranks per node (default: all on one node, where it is a ring)")
    args = parser.parse_args(argv)
    from fourfold.torchrun import is_worker

    if is_worker():  # a rank started below
        return _run_worker(args.algorithm, args.per_segment, args.ranks_per_node)
    from fourfold.comm import ALGORITHMS

    if args.algorithm not in ALGORITHMS or args.algorithm == "native":
        names = [a for a in ALGORITHMS if a != "native"]
        near = difflib.get_close_matches(args.algorithm, names, n=1)
        parser.error(f"algorithm must be one of {', '.join(names)} (native's steps are inside the backend), "
                     f"got {args.algorithm!r}." + (f" Did you mean {near[0]!r}?" if near else ""))
    if not 2 <= args.world <= len(LETTERS):
        parser.error(f"--world must be in 2..{len(LETTERS)}, got {args.world}.")
    if args.ranks_per_node is not None:
        if args.algorithm != "hierarchical":
            parser.error(f"--ranks-per-node is hierarchical's (its rings inside and across nodes), got algorithm "
                         f"{args.algorithm!r}. Drop it, or explain hierarchical.")
        fits = [d for d in range(1, args.world + 1) if args.world % d == 0]
        if args.ranks_per_node not in fits:
            parser.error(f"--ranks-per-node must divide --world into whole nodes, got {args.ranks_per_node} for "
                         f"--world {args.world}. Pass one of {', '.join(map(str, fits))}.")
    elif args.algorithm == "hierarchical":
        split = next((d for d in range(2, args.world) if args.world % d == 0), None)
        print(f"hierarchical on one node of {args.world} ranks is the ring; "
              + (f"pass --ranks-per-node (e.g. {split}) to see nodes" if split else
                 "a --world with a divisor (4, 6, 8) and --ranks-per-node show nodes"))
    if args.out:
        os.environ["FOURFOLD_EXPLAIN_OUT"] = args.out
    from fourfold.torchrun import launch_workers

    worker_argv = [args.algorithm, "--per-segment", str(args.per_segment)]
    if args.ranks_per_node is not None:
        worker_argv += ["--ranks-per-node", str(args.ranks_per_node)]
    return launch_workers("fourfold.cli.explain", worker_argv, LaunchConfig(nproc=args.world))


if __name__ == "__main__":
    sys.exit(main())
