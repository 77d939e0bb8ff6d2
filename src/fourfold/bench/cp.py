"""``fourfold bench cp``: one process's causal attention beside context parallelism's, growing sequences.

    fourfold bench cp --nproc 4                       # cp = 2 and 4, each algorithm, sequences 1k-8k
    fourfold bench cp --nproc 2 --cp 2 --seq-lens 2048,4096 --algorithms ring,ulysses

One attention layer (B = 1, ``--heads`` query heads, ``--kv-heads`` key/value heads, head width ``--head-dim``,
float32), forward and backward, as a model's attention runs it: ``full`` is
``scaled_dot_product_attention(is_causal=True)`` on one rank over the whole sequence; ``ALGORITHM-N`` is
:func:`fourfold.parallel.context.attend` on ranks 0..N-1, each holding T / N positions (the head-tail cut).
Reported per variant and length: step time (the slowest rank's median), the bytes autograd saves for backward
per rank (:func:`fourfold.observe.memory.saved_bytes`; the largest rank's) and their ratio to ``full``'s, and the
bytes each rank sent against the algorithm's theory. On a machine with fewer cores than ranks the times measure
the cores' sharing as much as the algorithm; the memory and the bytes do not depend on it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from fourfold.bench.harness import (
    add_output_flags,
    fmt_time,
    lab_nodes,
    name_list,
    run_or_launch,
    run_record,
    save_png,
    start_rank,
    timed_rounds,
    write_report,
)
from fourfold.run.args import make_parser

__all__ = ["main"]

ALGORITHMS = ("allgather", "ring", "ulysses")
TARGET = 0.35  # saved-for-backward bytes per rank at cp = 4 (ring, Ulysses) against one process's, at 8k


def _parser() -> argparse.ArgumentParser:
    p = make_parser("fourfold bench cp", "One process's causal attention beside context parallelism's algorithms "
                    "on growing sequences: time, saved-for-backward bytes per rank, bytes sent against theory.")
    p.add_argument("--nproc", type=int, default=4, help="ranks to start (default: 4)")
    p.add_argument("--cp", default="2,4", help="context-parallel sizes, each <= --nproc (default: 2,4)")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS), help=f"of {', '.join(ALGORITHMS)} (default: all)")
    p.add_argument("--seq-lens", default="1024,2048,4096,8192", help="sequence lengths (default: 1024,2048,4096,8192)")
    p.add_argument("--heads", type=int, default=8, help="query heads (default: 8)")
    p.add_argument("--kv-heads", type=int, default=4, help="key/value heads (default: 4)")
    p.add_argument("--head-dim", type=int, default=64, help="head width (default: 64)")
    p.add_argument("--rounds", type=int, default=3, help="timed steps per variant (default: 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default: 1)")
    add_output_flags(p, "cp")
    return p


def _check(ns: argparse.Namespace) -> argparse.Namespace:
    ns.algorithms = name_list(ns.algorithms, ALGORITHMS, "algorithms", "ring,ulysses")
    try:
        ns.cp = sorted({int(c) for c in ns.cp.split(",") if c})
        ns.seq_lens = [int(t) for t in ns.seq_lens.split(",") if t]
    except ValueError as e:
        raise ValueError(f"cp and seq-lens must be comma-separated integers, got {ns.cp!r} and {ns.seq_lens!r}.") from e
    world = ns.nproc * lab_nodes()  # in a lab (fourfold lab run), --nproc ranks on each node
    if not ns.cp or min(ns.cp) < 2 or max(ns.cp) > world:
        raise ValueError(f"each cp must be in [2, the world size {world}], got {ns.cp}. Pass --nproc "
                         f"{max(ns.cp or [2])}")
    for c in ns.cp:
        bad = [t for t in ns.seq_lens if t % (2 * c)]
        if bad:
            raise ValueError(f"sequence lengths must divide into 2 x cp = {2 * c} chunks (the head-tail cut), got "
                             f"{bad}. Pass multiples of {2 * max(ns.cp)}")
        if "ulysses" in ns.algorithms and ns.heads % c:
            raise ValueError(f"Ulysses splits the {ns.heads} heads over cp={c}. Pass --heads a multiple of {c}")
    if ns.heads % ns.kv_heads:
        raise ValueError(f"heads must be a multiple of kv-heads, got {ns.heads} and {ns.kv_heads}.")
    for flag in ("heads", "kv_heads", "head_dim", "rounds"):
        if getattr(ns, flag) < 1:
            raise ValueError(f"{flag.replace('_', '-')} must be >= 1, got {getattr(ns, flag)}.")
    if ns.warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {ns.warmup}.")
    return ns


def main(argv: list[str] | None = None) -> int:
    return run_or_launch("cp", argv, _parser(), _check, _run)


def _run(ns: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from fourfold.comm.p2p import Communicator
    from fourfold.comm.wait import barrier

    ctx, say, started, load_before = start_rank("[bench cp]", ns.timeout)
    g, rank = ctx.world_size, ctx.rank
    comms: dict[int, Communicator | None] = {}
    for c in ns.cp:  # ranks 0..c-1 (every rank creates every group)
        group = dist.new_group(list(range(c))) if c < g else None
        comms[c] = Communicator(group, ns.timeout) if rank < c else None
    variants = ["full"] + [f"{a}-{c}" for c in ns.cp for a in ns.algorithms]
    say(f"G={g}: {ns.heads} heads ({ns.kv_heads} key/value) x {ns.head_dim}, float32, B=1; variants "
        f"{', '.join(variants)}; lengths {ns.seq_lens}; {ns.warmup} warm-up + {ns.rounds} rounds")
    rows = []
    for T in ns.seq_lens:
        state: dict[str, dict[str, Any]] = {v: {} for v in variants}
        steps = [_step(ns, v, T, rank, comms, state[v]) for v in variants]
        barrier("start the timed rounds")
        timed = timed_rounds(steps, lambda k: (None, None), ns.warmup, ns.rounds)
        for v, t in zip(variants, timed, strict=True):
            figures = torch.tensor([state[v].get("saved", 0), state[v].get("sent", 0), state[v].get("theory", 0)],
                                   dtype=torch.float64)
            everyone = [torch.zeros_like(figures) for _ in range(g)]
            dist.all_gather(everyone, figures)
            saved = max(int(e[0]) for e in everyone)
            exact = all(int(e[1]) == int(e[2]) for e in everyone)
            rows.append({"seq_len": T, "variant": v, "median_s": t["median_s"], "times_s": t["times_s"],
                         "saved_bytes": saved, "sent_bytes": max(int(e[1]) for e in everyone),
                         "theory_bytes": max(int(e[2]) for e in everyone), "sent_equals_theory": exact})
        say(f"T={T} done")
    if rank == 0:
        _report(ns, g, rows, time.monotonic() - started, load_before)
    barrier("finish the benchmark")
    ctx.close()


def _step(ns: argparse.Namespace, variant: str, T: int, rank: int, comms: dict[int, Any],
          state: dict[str, Any]) -> Any:
    """One variant's timed step (forward + backward) on this rank, and its figures measured on the first call."""
    import torch
    import torch.nn.functional as F

    from fourfold.parallel.context import ContextShard, attend, theory

    gen = torch.Generator().manual_seed(0)
    H, hk, D = ns.heads, ns.kv_heads, ns.head_dim
    if variant == "full":
        if rank != 0:
            return lambda x, y, k: None
        q, k, v = (torch.randn(1, h, T, D, generator=gen, requires_grad=True) for h in (H, hk, hk))

        def full() -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != hk)

        return _timed(full, state, None)
    algorithm, c = variant.rsplit("-", 1)
    comm = comms[int(c)]
    if comm is None:  # not one of this variant's ranks
        return lambda x, y, k: None
    shard = ContextShard(comm, algorithm, T, True)  # type: ignore[arg-type]
    t = T // int(c)
    q, k, v = (torch.randn(1, h, t, D, generator=gen, requires_grad=True) for h in (H, hk, hk))
    bytes_q, bytes_kv = q.numel() * 4, 2 * k.numel() * 4
    th = theory(algorithm, int(c), q_bytes=bytes_q, kv_bytes=bytes_kv,  # type: ignore[arg-type]
                kv_heads_divide=hk % int(c) == 0, heads_per_kv=H // hk)
    state["theory"] = th["forward"] + th["backward"]
    return _timed(lambda: attend(shard, q, k, v), state, comm)


def _timed(attention: Any, state: dict[str, Any], comm: Any) -> Any:
    import torch

    from fourfold.observe.memory import saved_bytes

    def step(x: Any, y: Any, k: int) -> None:
        before = comm.stats.sent_bytes if comm is not None else 0
        if "saved" not in state:
            with saved_bytes() as saved:
                out = attention()
            state["saved"] = sum(saved.values())
        else:
            out = attention()
        out.backward(torch.ones_like(out))
        if comm is not None and "sent" not in state:
            state["sent"] = comm.stats.sent_bytes - before

    return step


def _report(ns: argparse.Namespace, g: int, rows: list[dict[str, Any]], elapsed: float,
            load_before: tuple[float, float, float]) -> None:
    full = {r["seq_len"]: r for r in rows if r["variant"] == "full"}
    lines = [f"\none attention layer, forward + backward: {ns.heads} heads ({ns.kv_heads} key/value) x "
             f"{ns.head_dim}, float32, B=1, G={g}",
             f"{'T':>6} {'variant':<13} {'median':>9} {'x full':>7} {'saved/rank':>11} {'of full':>8} "
             f"{'sent/rank':>11} {'= theory':>9}"]
    for r in rows:
        f = full[r["seq_len"]]
        r["time_ratio"] = r["median_s"] / f["median_s"]
        r["saved_ratio"] = r["saved_bytes"] / f["saved_bytes"] if f["saved_bytes"] else None
        theory_ok = "-" if r["variant"] == "full" else ("yes" if r["sent_equals_theory"] else "NO")
        lines.append(f"{r['seq_len']:>6} {r['variant']:<13} {fmt_time(r['median_s']):>9} {r['time_ratio']:>7.2f} "
                     f"{r['saved_bytes'] / 2**20:>9.1f}MB {r['saved_ratio'] or 0:>8.2f} "
                     f"{r['sent_bytes'] / 2**20:>9.1f}MB {theory_ok:>9}")
    print("\n".join(lines), flush=True)
    verdicts = []
    longest = max(ns.seq_lens)
    for a in ("ring", "ulysses"):
        found = [r for r in rows if r["variant"] == f"{a}-4" and r["seq_len"] == longest]
        if found and found[0]["saved_ratio"] is not None:
            ratio = found[0]["saved_ratio"]
            met = ratio <= TARGET
            verdicts.append({"target": f"{a} at cp=4, T={longest}: saved bytes per rank <= {TARGET} of one "
                             "process's", "value": ratio, "met": met})
            print(f"{'met   ' if met else 'MISSED'} {a}-4 at T={longest} saves {ratio:.2f} of one "
                  f"process's bytes per rank (target <= {TARGET})")
    if not all(r["sent_equals_theory"] for r in rows if r["variant"] != "full"):
        print("MISSED some variant sent other bytes than its theory", flush=True)
    result = {**run_record(ns, g, elapsed, load_before),
              "settings": {"cp": ns.cp, "algorithms": ns.algorithms, "seq_lens": ns.seq_lens, "heads": ns.heads,
                           "kv_heads": ns.kv_heads, "head_dim": ns.head_dim, "rounds": ns.rounds,
                           "warmup": ns.warmup, "dtype": "float32", "cut": "head-tail",
                           "timing": "slowest rank per step, median over rounds"},
              "rows": rows, "targets": verdicts}
    write_report(Path(ns.out), result, elapsed, lambda path: _chart(rows, path))


def _chart(rows: list[dict[str, Any]], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.8))
    ax, bx = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for v in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == v]
        xs = [r["seq_len"] for r in mine]
        style: dict[str, Any] = {"color": "k", "lw": 2} if v == "full" else {}
        ax.plot(xs, [r["median_s"] for r in mine], marker="o", label=v, **style)
        bx.plot(xs, [r["saved_bytes"] / 2**20 for r in mine], marker="o", label=v, **style)
    ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="step time (s, median)",
           title="attention forward + backward")
    bx.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="saved for backward per rank (MB)",
           title="activation memory per rank")
    ax.legend(fontsize=7)
    for a in (ax, bx):
        a.title.set_fontsize(9)
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    sys.exit(main())
