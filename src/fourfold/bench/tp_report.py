"""What ``fourfold bench tp`` reports once its rounds are done: a table per workload, the project's targets
(each fourfold variant's step time against DTensor's with the same plan, its collectives against
:func:`~fourfold.bench.tp.plan_theory`, its sharded bytes against 1/tp), OUT/bench.json and OUT/bench.png.
Rank 0 only; it reads the rows :mod:`fourfold.bench.tp` measured.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fourfold.bench.harness import fmt_time, run_record, save_png, write_report

__all__ = ["TARGET_RATIO", "report", "table"]

TARGET_RATIO = 1.05
"""The limit on a fourfold variant's median step time / the DTensor variant's with the same plan, at tp = 2."""


def _fwd_bwd(pairs: list[list[Any]]) -> str:
    """``[[phase, op, n], ...]`` -> ``"10+9"`` (forward + backward collectives)."""
    return "+".join(str(sum(n for ph, _, n in pairs if ph == phase)) for phase in ("forward", "backward"))


def table(result: dict[str, Any], p: int) -> str:
    """A workload's result as text: a row per variant, then the step-1 checks."""
    def mb(n: float) -> str:
        return f"{n / 2 ** 20:.2f}"

    lines = [f"\n{result['describe']}, {result['parameters'] / 1e6:.2f} M parameters, tp={p}",
             f"{'variant':<13} {'median':>9} {'min':>9} {'x dtensor':>9} {'paired':>6} {'x single':>8} {'MiB/rank':>8} "
             f"{'sharded':>7} {'repl.':>6} {'shard*tp':>8} {'coll f+b':>8} {'tracer':>6} {'theory':>6} "
             f"{'per block':>9}"]
    for r in result["rows"]:
        m, c = r["memory"], r["collectives"]
        frac = "-" if m["sharded_fraction"] is None else f"{m['sharded_fraction'] * p:.3f}"
        per_block = "-" if "tracer" not in c else "= theory" if c["tracer_per_block"] == c["theory_per_block"] \
            else "DIFFERS"
        lines.append(f"{r['variant']:<13} {fmt_time(r['median_s']):>9} {fmt_time(r['min_s']):>9} "
                     f"{'-' if r['x_dtensor'] is None else format(r['x_dtensor'], '.3f'):>9} "
                     f"{'-' if r['x_dtensor_paired'] is None else format(r['x_dtensor_paired'], '.3f'):>6} "
                     f"{r['x_single']:>8.3f} {mb(m['total']):>8} {mb(m['sharded']):>7} {mb(m['replicated']):>6} "
                     f"{frac:>8} {_fwd_bwd(c['counted']):>8} "
                     f"{_fwd_bwd(c['tracer']) if 'tracer' in c else '-':>6} {_fwd_bwd(c['theory']):>6} "
                     f"{per_block:>9}")
    for c in result["check"]:
        lines.append(f"check, step 1: {c['variant']:<13} loss {c['loss']:.6f} (rel. diff {c['loss_rel_diff']:.2g}); "
                     f"worst gradient {c['grad_rel_diff']:.2g} of max |g| on rank {c['grad_worst_rank']} "
                     f"({c['grad_worst_param']}) "
                     f"{'ok' if c['ok'] else 'FAILED'}")
    return "\n".join(lines)


def _targets(workloads: list[dict[str, Any]], p: int) -> list[dict[str, Any]]:
    """The project's targets, each with its value and whether it is met."""
    out = []
    for w in workloads:
        for r in w["rows"]:
            c, m = r["collectives"], r["memory"]
            if r["variant"].startswith("fourfold"):
                if r["x_dtensor"] is not None and p == 2:
                    out.append({"target": f"{w['model']} {r['variant']}: step time <= {TARGET_RATIO}x dtensor-"
                                f"{r['plan']}", "value": r["x_dtensor"], "limit": TARGET_RATIO,
                                "met": r["x_dtensor"] <= TARGET_RATIO, "paired": r["x_dtensor_paired"]})
                out.append({"target": f"{w['model']} {r['variant']}: collectives per block and step (tracer) = "
                            "theory", "value": _fwd_bwd(c["tracer"]), "limit": _fwd_bwd(c["theory"]),
                            "met": c["tracer_per_block"] == c["theory_per_block"] and c["tracer"] == c["theory"]})
            if r["plan"] != "none":
                out.append({"target": f"{w['model']} {r['variant']}: sharded parameter bytes per rank = 1/tp of "
                            "the full ones", "value": m["sharded_fraction"], "limit": 1 / p,
                            "met": m["sharded"] * p == m["full_sharded"]})
    return out


def report(ns: argparse.Namespace, p: int, workloads: list[dict[str, Any]], elapsed: float,
            load_before: tuple[float, float, float]) -> None:
    """Rank 0: the targets, bench.json and bench.png."""
    verdicts = _targets(workloads, p)
    print("\ntargets:")
    for t in verdicts:
        value = f"{t['value']:.3f}" if isinstance(t["value"], float) else t["value"]
        limit = f"{t['limit']:.3f}" if isinstance(t["limit"], float) else t["limit"]
        miss = "" if t["met"] or not isinstance(t["value"], float) else f" ({t['value'] / t['limit'] - 1:+.1%})"
        paired = f"; paired by round {t['paired']:.3f}" if t.get("paired") is not None else ""
        print(f"  {'met   ' if t['met'] else 'MISSED'} {t['target']}: {value} (limit {limit}){miss}{paired}")
    result = {**run_record(ns, p, elapsed, load_before),
              "settings": {"tp": p, "variants": ns.variants, "rounds": ns.rounds, "warmup": ns.warmup,
                           "optimizer": f"SGD(lr={ns.lr:g})", "dtype": "float32",
                           "timing": "slowest rank per step (forward+backward+optimizer), median over rounds"},
              "workloads": workloads, "targets": verdicts}
    write_report(Path(ns.out), result, elapsed, lambda path: _chart(workloads, p, path))


def _chart(workloads: list[dict[str, Any]], p: int, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3 + 3.5 * len(workloads), 4.5))
    for i, w in enumerate(workloads):
        ax = fig.add_subplot(1, len(workloads), i + 1)
        names = [r["variant"] for r in w["rows"]]
        ms = [r["median_s"] * 1e3 for r in w["rows"]]
        whiskers = [[m - r["min_s"] * 1e3 for m, r in zip(ms, w["rows"], strict=True)],
                    [r["max_s"] * 1e3 - m for m, r in zip(ms, w["rows"], strict=True)]]
        colors = ["0.6" if n == "single" else "C0" if n.startswith("fourfold") else "C1" for n in names]
        bars = ax.bar(names, ms, color=colors, yerr=whiskers, capsize=3)
        ax.bar_label(bars, [f"{r['x_dtensor']:.2f}x" if r["x_dtensor"] else "" for r in w["rows"]], fontsize=8)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        ax.set(ylabel="median step time (ms; bars: min..max)",
               title=f"{w['model']}: {w['parameters'] / 1e6:.2f} M params, tp={p}")
        ax.title.set_fontsize(9)
    fig.suptitle("tensor-parallel step, gloo on CPU: grey single, blue fourfold (label: x DTensor), orange DTensor",
                 fontsize=9)
    fig.tight_layout()
    save_png(fig, path)
