"""``fourfold bench allreduce``: every all-reduce algorithm timed side by side, the cost model fitted, a chart.

    fourfold bench allreduce --nproc 2                      # sizes 4 KB..64 MB, every algorithm, ~1 minute
    fourfold bench allreduce --nproc 4 --sizes 4KB,1MB --algorithms ring,tree,auto,native --iters 10
    python benchmarks/allreduce.py --nproc 2                # the same code

The parent starts ``--nproc`` ranks through torchrun's launcher (:func:`fourfold.torchrun.launch_workers`), each
running ``python -m fourfold.bench.allreduce ...``. On the ranks:

1. ping-pong over 4 B..16 MB through :class:`~fourfold.comm.Communicator` (the path every algorithm takes):
   ranks 0 and 1 for the link inside a node, and where the ranks span nodes (``LOCAL_WORLD_SIZE`` < G) rank 0
   and the next node's first rank for the link between nodes; one-way time t(n) = α + βn (``fit_alpha_beta``:
   α the small sizes' floor, β the slope of the large ones); γ from timing ``add_`` on rank 0. The model (with
   the link between nodes as its ``network``) is saved (``--cost-model``, default ``$FOURFOLD_COST_MODEL`` or
   ``~/.cache/fourfold/cost_model.json``) and is what ``auto`` uses in this run; every algorithm's row carries
   the two-level model's prediction (:mod:`fourfold.comm.network`) and its error.
2. per size (float32), the algorithms interleaved (the order rotates every iteration), warm-up calls first
   (the first also checks the exact sum), a barrier before each timed call, one Communicator per algorithm;
   a call's time is the slowest rank's; the figure is the median over ``--iters`` (capped for large sizes).
3. rank 0 prints the table (busbw = size/time * 2(G-1)/G, the NCCL-tests convention), auto's switch points,
   auto against the best, the project's targets, and writes OUT/bench.json and OUT/bench.png.

A benchmark, not a test: it prints figures and refuses nothing but bad flags and wrong sums.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from fourfold.bench.harness import (
    add_output_flags,
    fit_alpha_beta,
    fit_line,
    fmt_time,
    format_bytes,
    lab_nodes,
    lab_nproc,
    machine,
    parse_size,
    run_or_launch,
    save_png,
    start_rank,
    write_report,
)

__all__ = ["fit_line", "main", "parse_size"]

DEFAULT_SIZES = "4KB,16KB,64KB,256KB,1MB,4MB,16MB,64MB"
CANDIDATES = ("ring", "tree", "rabenseifner", "hierarchical")  # what auto may pick: "auto vs best" compares with these
_PINGPONG = [4, 64, 1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


def _parser() -> argparse.ArgumentParser:
    from fourfold.run.args import make_parser

    p = make_parser("fourfold bench allreduce", "Time every all-reduce algorithm side by side on --nproc ranks, "
                    "fit the alpha-beta cost model auto uses, and chart it.")
    p.add_argument("--nproc", type=int, default=lab_nproc(), help="ranks to start on this machine, >= 2 in all "
                   f"(default: {lab_nproc()})")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"message sizes, float32 (default: {DEFAULT_SIZES})")
    p.add_argument("--algorithms", default=None, help="comma-separated (default: every registered one but "
                   "hierarchical, which is the ring on one machine, plus auto and native)")
    p.add_argument("--iters", type=int, default=50, help="timed calls per size and algorithm; capped at "
                   "max(20, ITERS*1MB/size) above 1 MB (default: 50)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first (default: 2)")
    p.add_argument("--cost-model", default=None, metavar="PATH", help="where to save the fitted model (default: "
                   "$FOURFOLD_COST_MODEL or ~/.cache/fourfold/cost_model.json)")
    p.add_argument("--save-model", action=argparse.BooleanOptionalAction, default=True,
                   help="save the fitted cost model for auto to use in later runs (default: yes)")
    add_output_flags(p, "allreduce")
    return p


def _check(ns: argparse.Namespace) -> argparse.Namespace:
    """Turn the flags into values (``ns.sizes``: bytes; ``ns.algorithms``: names) or raise ValueError."""
    from fourfold.comm import ALGORITHMS

    ns.sizes = [parse_size(s) for s in ns.sizes.split(",") if s.strip()]
    if not ns.sizes:
        raise ValueError("sizes must name at least one size, got none. E.g. --sizes 4KB,1MB.")
    default = [a for a in ALGORITHMS if a != "hierarchical"]
    ns.algorithms = default if ns.algorithms is None else [a.strip() for a in ns.algorithms.split(",") if a.strip()]
    for a in ns.algorithms:
        if a not in ALGORITHMS:
            raise ValueError(f"algorithms must be among {', '.join(ALGORITHMS)}, got {a!r}.")
    if len(set(ns.algorithms)) != len(ns.algorithms) or not ns.algorithms:
        raise ValueError(f"algorithms must be distinct and at least one, got {ns.algorithms}.")
    if ns.nproc * lab_nodes() < 2:
        raise ValueError(f"nproc must be >= 2 (an all-reduce over one rank does nothing), got {ns.nproc}. "
                         f"Pass --nproc 2.")
    if ns.iters < 1 or ns.warmup < 1:
        raise ValueError(f"iters and warmup must be >= 1 (the first warm-up call checks the sum), got "
                         f"iters={ns.iters}, warmup={ns.warmup}.")
    return ns


def main(argv: list[str] | None = None) -> int:
    """``fourfold bench allreduce ...``: launch the ranks (parent) or run the benchmark (a rank)."""
    return run_or_launch("allreduce", argv, _parser(), _check, _run)


def _run(ns: argparse.Namespace) -> None:
    """One rank's benchmark: ping-pong and fit, then every size x algorithm; rank 0 reports."""
    import torch
    import torch.distributed as dist

    from fourfold.comm import Communicator, allreduce, auto

    ctx, say, started, load_before = start_rank("[bench]", ns.timeout)
    g, main_rank = ctx.world_size, ctx.rank == 0
    say(f"G={g}, sizes {', '.join(format_bytes(s) for s in ns.sizes)}, algorithms {', '.join(ns.algorithms)}")

    # phase 1: alpha, beta from ping-pongs (0 <-> 1 inside a node, 0 <-> the next node's first rank across
    # nodes); gamma from add_ on rank 0
    from fourfold.comm.hierarchical import resolve_node_size

    node_size = resolve_node_size(g)
    pp_comm = Communicator(timeout_s=ns.timeout)
    pairs = {"node": 1} if node_size > 1 else {}
    if node_size < g:
        pairs["network"] = node_size
    pingpongs = {link: _pingpong(pp_comm, ctx.rank, peer) for link, peer in pairs.items()}
    reduce_times: list[tuple[int, float]] = []
    if main_rank:
        for nbytes in (64 << 10, 1 << 20, 4 << 20, 16 << 20):
            a, b = torch.ones(nbytes // 4), torch.ones(nbytes // 4)
            times = []
            for _ in range(12):
                t0 = time.perf_counter()
                a.add_(b)
                times.append(time.perf_counter() - t0)
            reduce_times.append((nbytes, statistics.median(times[2:])))
    model = None
    if main_rank:
        gamma = fit_line([n for n, _ in reduce_times], [s for _, s in reduce_times])[1]
        fits = {}
        for link, points in pingpongs.items():
            alpha, beta = fit_alpha_beta(points)
            if alpha < 0:
                say(f"warning: the {link} fit gave alpha = {alpha * 1e6:.1f} us < 0 (noise); using 0")
            fits[link] = auto.CostModel(max(alpha, 0.0), max(beta, 0.0), max(gamma, 0.0),
                                        source=f"fourfold bench allreduce, {link} ping-pong")
        info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "machine": machine(g), "pingpong": pingpongs, "reduce": reduce_times, "node_size": node_size,
                "fit": "one-way ping-pong: alpha the median of <= 4 KB, beta the slope of >= 1 MB through alpha; "
                        "gamma: add_ slope"}
        first, between = fits.get("node") or fits["network"], fits.get("network")
        model = auto.CostModel(first.alpha_s, first.beta_s_per_byte, first.gamma_s_per_byte,
                               source=f"fourfold bench allreduce --nproc {g}", info=info,
                               network=(between.alpha_s, between.beta_s_per_byte) if between else None)
        for link, m in fits.items():
            say(f"{link} link: alpha {m.alpha_s * 1e6:.1f} us, beta {m.beta_s_per_byte * 1e9:.3f} ns/B "
                f"({1e-9 / max(m.beta_s_per_byte, 1e-30):.2f} GB/s); gamma {gamma * 1e9:.3f} ns/B")
        if ns.save_model:
            say(f"saved the cost model to {model.save(ns.cost_model)}")
    comms = {a: Communicator(timeout_s=ns.timeout) for a in ns.algorithms}
    model = auto.attach(comms.get("auto") or Communicator(timeout_s=ns.timeout), model)  # rank 0's, everywhere

    # phase 2: every size, the algorithms interleaved
    rows: list[dict[str, Any]] = []
    for k, nbytes in enumerate(ns.sizes):
        numel = nbytes // 4
        iters = max(min(ns.iters, 20), min(ns.iters, ns.iters * (1 << 20) // nbytes))
        pattern = (torch.arange(numel) % 7 + 1).to(torch.float32)  # (N,) small integers: float32 sums exact
        src, work = pattern * (ctx.rank + 1), torch.empty(numel)
        expected = pattern * (g * (g + 1) // 2)
        timed = torch.zeros(len(ns.algorithms), iters, dtype=torch.float64)  # (algorithms, iters)
        for it in range(ns.warmup + iters):
            for j in [(it + m) % len(ns.algorithms) for m in range(len(ns.algorithms))]:
                name = ns.algorithms[j]
                if it == ns.warmup:
                    comms[name].stats.reset()
                work.copy_(src)
                dist.barrier()
                t0 = time.perf_counter()
                allreduce(work, name, comm=comms[name], check=False)
                elapsed = time.perf_counter() - t0
                if it >= ns.warmup:
                    timed[j, it - ns.warmup] = elapsed
                elif it == 0 and not torch.equal(work, expected):
                    bad = int((work != expected).nonzero()[0])
                    raise RuntimeError(f"rank {ctx.rank}: {name} gave a wrong sum at {format_bytes(nbytes)}: element "
                                       f"{bad} is {work[bad].item()}, expected {expected[bad].item()}.")
        dist.all_reduce(timed, op=dist.ReduceOp.MAX)  # a call takes as long as its slowest rank
        sent = torch.tensor([comms[a].stats.sent_bytes // iters for a in ns.algorithms], dtype=torch.int64)
        sent_all = [torch.empty_like(sent) for _ in range(g)]
        dist.all_gather(sent_all, sent)
        chosen = auto.choose(numel, 4, g, model, node_size)[0]  # as auto chooses in the run
        for j, name in enumerate(ns.algorithms):
            rows.append(_row(name, nbytes, g, timed[j].tolist(), [int(s[j]) for s in sent_all], model, node_size,
                             chosen))
        _ratios(rows, nbytes)
        say(f"size {k + 1}/{len(ns.sizes)}: {format_bytes(nbytes)}, {iters} iters, {time.monotonic() - started:.0f} s")
        if main_rank:
            print(_table([r for r in rows if r["bytes"] == nbytes], header=k == 0), flush=True)
    if main_rank:
        _report(ns, g, model, rows, time.monotonic() - started, load_before)
    dist.barrier()
    ctx.close()


def _pingpong(comm: Any, rank: int, peer: int) -> list[tuple[int, float]]:
    """``[(bytes, one-way seconds)]`` between ranks 0 and ``peer`` (median per size; every rank takes part in the
    barriers, only those two in the messages)."""
    import torch
    import torch.distributed as dist

    out = []
    for nbytes in _PINGPONG:
        t, reps, times = torch.zeros(nbytes // 4), (30 if nbytes <= 64 << 10 else 8), []
        for i in range(reps + 2):
            dist.barrier()  # as before every timed call below: back-to-back p2p on gloo can fall into 4 ms stalls
            t0 = time.perf_counter()
            if rank == 0:
                comm.exchange([(peer, t)], algorithm="pingpong", step=i)
                comm.exchange([], [(peer, t)], algorithm="pingpong", step=i)
            elif rank == peer:
                comm.exchange([], [(0, t)], algorithm="pingpong", step=i)
                comm.exchange([(0, t)], algorithm="pingpong", step=i)
            times.append((time.perf_counter() - t0) / 2)
        out.append((nbytes, statistics.median(times[2:])))
    return out


def _theory(name: str, numel: int, g: int, node_size: int) -> list[int] | None:
    """Each rank's bytes sent by theory (float32), for every point-to-point algorithm (not native)."""
    from fourfold.comm import auto
    from fourfold.comm.network import ALGORITHMS

    return auto.sent_by_rank(name, numel, g, 4, node_size) if name in ALGORITHMS else None


def _row(name: str, nbytes: int, g: int, times: list[float], sent: list[int], model: Any, node_size: int,
         chosen: str) -> dict:
    from fourfold.comm import auto
    from fourfold.comm.network import ALGORITHMS

    runs = chosen if name == "auto" else name
    median = statistics.median(times)
    return {"bytes": nbytes, "algorithm": name, "runs": runs, "median_s": median, "min_s": min(times),
            "times_s": times, "algbw_GBps": nbytes / median / 1e9,
            "busbw_GBps": nbytes / median / 1e9 * 2 * (g - 1) / g,
            "sent_bytes_counted": None if name == "native" else sent,
            "sent_bytes_theory": _theory(runs, nbytes // 4, g, node_size),
            "predicted_s": auto.predict(model, runs, nbytes // 4, 4, g, node_size) if runs in ALGORITHMS else None}


def _ratios(rows: list[dict], nbytes: int) -> None:
    here = {r["algorithm"]: r for r in rows if r["bytes"] == nbytes}
    native = here.get("native")
    for r in here.values():
        r["vs_native"] = r["median_s"] / native["median_s"] if native else None


def _table(rows: list[dict], header: bool) -> str:
    lines = [f"{'size':>8} {'algorithm':<13} {'median':>9} {'min':>9} {'busbw GB/s':>10} {'x native':>8} "
             f"{'sent/rank':>10} {'theory':>10} {'predicted':>9} {'error':>6}"] if header else []
    for r in rows:
        name = f"auto->{r['runs']}" if r["algorithm"] == "auto" else r["algorithm"]
        counted, theory = r["sent_bytes_counted"], r["sent_bytes_theory"]
        ok = "" if counted is None or theory is None or counted == theory else " !"
        lines.append(f"{format_bytes(r['bytes']):>8} {name:<13} {fmt_time(r['median_s']):>9} "
                     f"{fmt_time(r['min_s']):>9} {r['busbw_GBps']:>10.3f} "
                     f"{'-' if r['vs_native'] is None else format(r['vs_native'], '.2f'):>8} "
                     f"{'-' if counted is None else format_bytes(max(counted)):>10} "
                     f"{'-' if theory is None else format_bytes(max(theory)):>10}{ok} "
                     f"{'-' if r['predicted_s'] is None else fmt_time(r['predicted_s']):>9} "
                     f"{'-' if r['predicted_s'] is None else format(r['median_s'] / r['predicted_s'] - 1, '+.0%'):>6}")
    return "\n".join(lines)


def _report(ns: argparse.Namespace, g: int, model: Any, rows: list[dict], elapsed: float,
            load_before: tuple[float, float, float]) -> None:
    """Rank 0: switch points, auto vs best, targets; bench.json and bench.png."""
    from fourfold.comm import auto

    node_size = model.info.get("node_size", g)
    switches = auto.switch_points(4, g, model, node_size)
    text = ", ".join(f"{b} from {format_bytes(n * 4)}" for n, _, b in switches) or "none"
    print(f"\nauto (G={g}): {switches[0][1] if switches else auto.choose(1, 4, g, model, node_size)[0]} first; {text}")
    verdicts, best_rows = [], []
    for nbytes in ns.sizes:
        here = {r["algorithm"]: r for r in rows if r["bytes"] == nbytes}
        cands = [r for a, r in here.items() if a in CANDIDATES]
        if "auto" in here and cands:
            best = min(cands, key=lambda r: r["median_s"])
            overall = min((r for a, r in here.items() if a != "auto"), key=lambda r: r["median_s"])
            ratio = here["auto"]["median_s"] / best["median_s"]
            pick = here["auto"]["runs"]
            # The pick's own row measures the choice without the noise between two runs of the same code.
            pick_ratio = here[pick]["median_s"] / best["median_s"] if pick in here else None
            best_rows.append({"bytes": nbytes, "auto_runs": pick, "auto_s": here["auto"]["median_s"],
                              "best": best["algorithm"], "best_s": best["median_s"], "ratio": ratio,
                              "pick_ratio": pick_ratio, "best_overall": overall["algorithm"],
                              "best_overall_s": overall["median_s"]})
            print(f"  {format_bytes(nbytes):>8}: auto->{pick} {fmt_time(here['auto']['median_s'])} = {ratio:.2f}x "
                  f"the best candidate, {best['algorithm']} {fmt_time(best['median_s'])}"
                  + ("" if pick_ratio is None else f" ({pick}'s own row: {pick_ratio:.2f}x)")
                  + f"; best of all {overall['algorithm']} {fmt_time(overall['median_s'])}")
            verdicts.append((f"auto within 10% of the best candidate at {format_bytes(nbytes)}", ratio, 1.10))
        ring_r, native_r, tree_r = here.get("ring"), here.get("native"), here.get("tree")
        if g == 2 and ring_r and native_r:
            limit = 1.10 if nbytes >= 16 << 20 else 1.3 if (1 << 20) <= nbytes <= (4 << 20) else None
            if limit:
                verdicts.append((f"G=2 ring <= {limit}x native at {format_bytes(nbytes)}",
                                 ring_r["median_s"] / native_r["median_s"], limit))
        if g == 4 and ring_r and tree_r and nbytes < 64 << 10:
            verdicts.append((f"G=4 tree beats ring at {format_bytes(nbytes)}",
                             tree_r["median_s"] / ring_r["median_s"], 1.0))
        verdicts += _lab_verdicts(here, g, model.info.get("node_size", g), nbytes)
    print("\ntargets:")
    for what, value, limit in verdicts:
        met = value <= limit
        print(f"  {'met   ' if met else 'MISSED'} {what}: {value:.2f} {'<=' if met else '>'} {limit:.2f}")
    out = Path(ns.out)
    result = {"command": ns.command, "argv": sys.argv, "date": model.info.get("date"), "elapsed_s": elapsed,
              "machine": machine(g), "load_before": load_before, "load_after": os.getloadavg(),
              "settings": {"sizes": ns.sizes, "algorithms": ns.algorithms, "iters": ns.iters, "warmup": ns.warmup,
                           "dtype": "float32", "timing": "slowest rank per call, median over iters"},
              "cost_model": model.to_dict(), "switch_points": [{"bytes": n * 4, "from": a, "to": b}
                                                               for n, a, b in switches],
              "results": rows, "auto_vs_best": best_rows,
              "targets": [{"target": w, "value": v, "limit": lim, "met": v <= lim} for w, v, lim in verdicts]}
    write_report(out, result, elapsed, lambda path: _chart(rows, g, model, path))


def _lab_verdicts(here: dict[str, dict], g: int, node_size: int, nbytes: int) -> list[tuple[str, float, float]]:
    """Across nodes (a lab, a cluster): at 16 MB and more the master does not scale and hierarchical beats the
    ring when nodes hold several ranks; at every size, every algorithm takes the time its alpha-beta model predicts
    (within 20 %: measured/predicted and predicted/measured both <= 1.2)."""
    if node_size >= g:
        return []
    out = []
    ring_r, master_r, hier_r = here.get("ring"), here.get("master"), here.get("hierarchical")
    if ring_r and master_r and g in (4, 8) and nbytes >= 16 << 20:
        need = 1.5 if g == 4 else 2.5
        out.append((f"G={g} master >= {need}x ring at {format_bytes(nbytes)} (ring/master <= {1 / need:.2f})",
                    ring_r["median_s"] / master_r["median_s"], 1 / need))
    if ring_r and hier_r and node_size > 1 and nbytes >= 16 << 20:
        out.append((f"hierarchical < ring with {g // node_size} nodes x {node_size} at {format_bytes(nbytes)}",
                    hier_r["median_s"] / ring_r["median_s"], 1.0))
    for name, r in here.items():
        if r["predicted_s"] and name != "auto":
            ratio = r["median_s"] / r["predicted_s"]
            out.append((f"{name} within 20% of its model at {format_bytes(nbytes)} (measured/predicted "
                        f"{ratio:.2f})", max(ratio, 1 / ratio), 1.2))
    return out


def _chart(rows: list[dict], g: int, model: Any, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    ax = fig.add_subplot()
    for name in dict.fromkeys(r["algorithm"] for r in rows):
        mine = [r for r in rows if r["algorithm"] == name]
        line, = ax.plot([r["bytes"] for r in mine], [r["median_s"] * 1e3 for r in mine], "o-", label=name)
        model = [r for r in mine if r["predicted_s"] is not None]
        if model and name != "auto":
            ax.plot([r["bytes"] for r in model], [r["predicted_s"] * 1e3 for r in model], ":",
                    color=line.get_color(), label=f"{name} (model)")
    ax.set(xscale="log", yscale="log", xlabel="message size (bytes, float32)", ylabel="median time (ms)",
           title=f"all-reduce on G={g} ranks, gloo on CPU")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save_png(fig, path)


if __name__ == "__main__":
    sys.exit(main())
