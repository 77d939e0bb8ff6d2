"""``fourfold lab sweep``: one all-reduce size across labs of growing size, drawn as time against G per algorithm
and bytes on the busiest link (the seed's picture: the master's grows with G, the ring's stays flat).

    fourfold lab sweep --nodes 2,4,8 --link 250mbit --size 16MB --algorithms ring,master,naive,native

For each node count it makes a lab and runs ``fourfold bench allreduce`` in it (its ping-pongs fit the link, its
rows carry the two-level model's prediction, :mod:`fourfold.comm.network`), then reads every ``bench.json`` and
writes OUT/sweep.json and OUT/sweep.png, and prints the table, each lab's targets (bench allreduce's: the master
against the ring, hierarchical against the ring, each algorithm against its model) and the ring's across labs.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["sweep"]


def sweep(nodes: list[int], gpus: int, link: str, size: str, algorithms: str, iters: int, out: Path,
          tcp: str = "auto") -> int:
    """Run the bench in a lab per entry of ``nodes``; report and draw. The worst exit code of the runs."""
    from fourfold.bench.harness import format_bytes, parse_size, write_report
    from fourfold.comm.network import link_bytes, messages
    from fourfold.lab import Lab
    from fourfold.lab.run import run_command

    started = time.monotonic()
    nbytes = parse_size(size)
    if not nodes or min(nodes) < 1 or gpus * min(nodes) < 2:
        raise ValueError(f"nodes must be counts >= 1 with at least 2 ranks in each lab, got nodes={nodes}, "
                         f"gpus-per-node={gpus}.")
    results: dict[int, list[dict[str, Any]]] = {}
    targets: list[tuple[str, bool]] = []  # each lab's own (bench allreduce's), then the ring's across labs
    for n in nodes:
        where = out / f"nodes{n}"
        print(f"fourfold lab sweep: {n} node(s) x {gpus}, {size} ...", file=sys.stderr, flush=True)
        code = run_command(n, gpus, link, ["fourfold", "bench", "allreduce", "--nproc", str(gpus), "--sizes", size,
                                           "--algorithms", algorithms, "--iters", str(iters), "--no-save-model",
                                           "--out", str(where)], tcp)
        if code != 0:
            print(f"fourfold lab sweep: the run on {n} node(s) failed (exit {code}); stopping", file=sys.stderr)
            return code
        bench = json.loads((where / "bench.json").read_text())
        results[n * gpus] = bench["results"]
        targets += [(f"G={n * gpus}: {t['target']}", t["met"]) for t in bench["targets"]]
    names = list(dict.fromkeys(r["algorithm"] for rows in results.values() for r in rows))
    table: list[dict[str, Any]] = []
    for g, rows in results.items():
        for r in rows:
            busiest = mean = None
            if r["runs"] in ("naive", "master", "ring", "tree", "rabenseifner", "hierarchical"):
                _, links = link_bytes(messages(r["runs"], nbytes // 4, 4, g, gpus), gpus)
                loads = [max(v) for v in links.values()] or [0]
                busiest, mean = max(loads), sum(loads) / (g // gpus)
            table.append({"ranks": g, "nodes": g // gpus, "algorithm": r["algorithm"], "median_s": r["median_s"],
                          "predicted_s": r["predicted_s"], "busiest_link_bytes": busiest, "mean_link_bytes": mean})
    _print(table, names, nbytes, format_bytes)
    targets += _flat_ring(table)
    for what, ok in targets:
        print(f"  {'met   ' if ok else 'MISSED'} {what}")
    result = {"command": " ".join(sys.argv), "nodes": nodes, "gpus_per_node": gpus, "link": link,
              "tcp": Lab(1, link, tcp).tcp,
              "bytes": nbytes, "rows": table, "targets": [{"target": w, "met": ok} for w, ok in targets]}
    write_report(out, result, time.monotonic() - started, lambda path: _chart(table, names, nbytes, link, gpus, path), name="sweep")
    return 0


def _cell(rows: list[dict[str, Any]], g: int, name: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["ranks"] == g and r["algorithm"] == name), None)


def _ms(seconds: float) -> str:
    """Milliseconds to 3 figures below 100 ms (a small all-reduce takes 1-3), whole ones above."""
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def _print(table: list[dict[str, Any]], names: list[str], nbytes: int, fmt: Any) -> None:
    ranks = sorted({r["ranks"] for r in table})
    print(f"\nall-reduce of {fmt(nbytes)}: median time (model's prediction, error); busiest network link's bytes")
    print(f"{'algorithm':<13}" + "".join(f"{f'G={g}':>34}" for g in ranks))
    for name in names:
        cells = []
        for g in ranks:
            r = _cell(table, g, name)
            if r is None:
                cells.append(f"{'-':>34}")
                continue
            text = f"{_ms(r['median_s'])} ms"
            if r["predicted_s"]:
                text += f" ({_ms(r['predicted_s'])}, {r['median_s'] / r['predicted_s'] - 1:+.0%})"
            if r["busiest_link_bytes"] is not None:
                text += f" {fmt(r['busiest_link_bytes'])}"
            cells.append(f"{text:>34}")
        print(f"{name:<13}" + "".join(cells))


def _flat_ring(table: list[dict[str, Any]]) -> list[tuple[str, bool]]:
    """The one target no single lab can check: the ring's time at G = 8 within 1.3x of G = 4."""
    ring = {r["ranks"]: r["median_s"] for r in table if r["algorithm"] == "ring"}
    if 4 in ring and 8 in ring:
        return [(f"ring G=8 {ring[8] / ring[4]:.2f}x G=4 (<= 1.3)", ring[8] / ring[4] <= 1.3)]
    return []


def _chart(table: list[dict[str, Any]], names: list[str], nbytes: int, link: str, gpus: int, path: Path) -> None:
    from matplotlib.figure import Figure

    from fourfold.bench.harness import save_png

    fig = Figure(figsize=(12, 5))
    ax, bx = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    markers = iter("os^vDP*X" * 4)  # equal lines (master's and naive's busiest link) stay visible
    for name in names:
        mine = sorted((r for r in table if r["algorithm"] == name), key=lambda r: r["ranks"])
        line, = ax.plot([r["ranks"] for r in mine], [r["median_s"] * 1e3 for r in mine], "o-", label=name)
        model = [r for r in mine if r["predicted_s"]]
        if model:
            ax.plot([r["ranks"] for r in model], [r["predicted_s"] * 1e3 for r in model], ":",
                    color=line.get_color())
        counted = [r for r in mine if r["busiest_link_bytes"] is not None]
        if counted:
            x = [r["ranks"] for r in counted]
            bx.plot(x, [r["busiest_link_bytes"] / 2**20 for r in counted], marker=next(markers), ls="-",
                    color=line.get_color(), label=f"{name}: busiest link")
            bx.plot(x, [r["mean_link_bytes"] / 2**20 for r in counted], ls="--", color=line.get_color(),
                    label=f"{name}: mean link")
    ranks = sorted({r["ranks"] for r in table})
    per_node = f", {gpus} ranks per node" if gpus > 1 else ""
    ax.set(xlabel="ranks G", ylabel="median time (ms); dotted: alpha-beta model", xticks=ranks,
           title=f"all-reduce of {nbytes / 2**20:g} MB, links {link}{per_node}")
    bx.set(xlabel="ranks G", ylabel="MB on a node's link (up or down, the larger)", xticks=ranks,
           title="bytes per link: the master's root link grows with G,\nthe ring's stay flat")
    for a in (ax, bx):
        a.grid(True, alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path)
