"""What ``fourfold bench pp`` reports once its rounds are done: the table, the project's targets (each
fourfold variant's step time against torch's with the same schedule, its measured bubble against
(p-1)/(m+p-1), 1F1B's peak activation bytes against GPipe's), OUT/bench.json and OUT/bench.png. Rank 0 only;
it reads the result :mod:`fourfold.bench.pp` measured (the timelines, a collective, are drawn there).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

from fourfold.bench.harness import fmt_time, run_record, save_png, write_report

__all__ = ["BUBBLE_POINTS", "MEMORY_SLACK", "TARGET_RATIO", "report", "table"]

TARGET_RATIO = 1.05
"""The limit on a fourfold variant's median step time / torch's with the same schedule, at pp = 2."""
BUBBLE_POINTS = 0.05
"""How far (absolute) the measured bubble may lie from (p-1)/(m+p-1)."""
MEMORY_SLACK = 0.10
"""1F1B's peak activation bytes on each rank must be <= (p/m) * GPipe's * (1 + MEMORY_SLACK)."""


def _targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The project's targets, each with its value, its limit and whether it is met."""
    p, m, out = result["pp"], result["microbatches"], []
    rows = {r["variant"]: r for r in result["rows"]}
    for r in rows.values():
        if r["x_torch"] is not None and p == 2:
            out.append({"target": f"pp=2 m={m} {r['variant']}: step time <= {TARGET_RATIO}x torch-{r['schedule']}",
                        "value": r["x_torch"], "limit": TARGET_RATIO, "met": r["x_torch"] <= TARGET_RATIO,
                        "paired": r["x_torch_paired"]})
        if "bubble" in r:
            b = r["bubble"]
            out.append({"target": f"pp={p} {r['variant']}: measured bubble within {BUBBLE_POINTS * 100:g} points "
                        f"of (p-1)/(m+p-1) = {b['theory']:.1%}", "value": b["measured"],
                        "limit": [b["theory"] - BUBBLE_POINTS, b["theory"] + BUBBLE_POINTS],
                        "met": abs(b["measured"] - b["theory"]) <= BUBBLE_POINTS})
    if "fourfold-gpipe" in rows and "fourfold-1f1b" in rows:
        gpipe = rows["fourfold-gpipe"]["memory"]["peak_activation_bytes_by_rank"]
        one = rows["fourfold-1f1b"]["memory"]["peak_activation_bytes_by_rank"]
        for rank, (g, o) in enumerate(zip(gpipe, one, strict=True)):
            limit = p / m * g * (1 + MEMORY_SLACK)
            out.append({"target": f"pp={p} rank {rank}: 1F1B peak activation bytes <= (p/m) x GPipe's + "
                        f"{MEMORY_SLACK:.0%}", "value": o, "limit": limit, "met": o <= limit,
                        "fraction_of_gpipe": o / g})
    return out


def table(result: dict[str, Any]) -> str:
    """The result as text: a row per variant, each fourfold variant's costs, the step-1 checks."""
    p = result["pp"]
    lines = [f"\npp={p}, m={result['microbatches']}, batch {result['batch']}, stages: {result['stages']}",
             f"{'variant':<15} {'median':>9} {'min':>9} {'x torch':>7} {'paired':>6} {'bubble':>7} {'theory':>7} "
             f"{'simul.':>7} {'by rank (trace)':>16} {'waits':>6} {'by rank (waits)':>16} {'peak act. MiB/rank':>20}"]

    def ranks(xs: list[float], spec: str) -> str:
        return " ".join(format(x, spec) for x in xs)

    for r in result["rows"]:
        b, mem = r.get("bubble"), r.get("memory")
        lines.append(
            f"{r['variant']:<15} {fmt_time(r['median_s']):>9} {fmt_time(r['min_s']):>9} "
            f"{'-' if r['x_torch'] is None else format(r['x_torch'], '.3f'):>7} "
            f"{'-' if r['x_torch_paired'] is None else format(r['x_torch_paired'], '.3f'):>6} "
            + (f"{b['measured']:>7.1%} {b['theory']:>7.1%} {b['simulated']:>7.1%} "
               f"{ranks(b['measured_by_rank'], '.3f'):>16} {b['runtime_wait']:>6.1%} "
               f"{ranks(b['runtime_wait_by_rank'], '.3f'):>16} "
               f"{ranks([n / 2 ** 20 for n in mem['peak_activation_bytes_by_rank']], '.2f'):>20}" if b else
               f"{'-':>7} {'-':>7} {'-':>7} {'-':>16} {'-':>6} {'-':>16} {'-':>20}"))
    for r in result["rows"]:
        if "bubble" in r:
            b = r["bubble"]
            lines.append(f"{r['variant']}: median F {ranks([f * 1e3 for f in b['f_s_by_rank']], '.2f')} ms, B "
                         f"{ranks([x * 1e3 for x in b['b_s_by_rank']], '.2f')} ms by rank; step window "
                         f"{fmt_time(b['window_median_s'])}, simulated {fmt_time(b['simulated_makespan_s'])}; "
                         f"a transfer in the run takes {fmt_time(b['comm_in_situ_s'])} (mean; median "
                         f"{fmt_time(b['comm_in_situ_median_s'])}), simulated with the mean: bubble "
                         f"{b['simulated_in_situ']:.1%}, {fmt_time(b['simulated_in_situ_makespan_s'])}; ranks "
                         f"computing at once: {b['concurrency']:.2f} on average")
    cores = os.cpu_count() or 1
    if p > cores:
        lines.append(f"note: {p} ranks on {cores} cores: at most {cores} compute at once, so every rank idles at "
                     f"least {1 - cores / p:.0%} of the step whatever the schedule, and compute spans stretch while "
                     "ranks share a core: the trace's bubble measures the cores here; compare the schedules by "
                     "'simul.' (their order, with the measured costs)")
    for c in result["check"]:
        lines.append(f"check, step 1: {c['variant']:<15} loss {c['loss']:.7f} vs {c['reference']} "
                     f"{c['reference_loss']:.7f} (rel. diff {c['loss_rel_diff']:.2g}); worst gradient "
                     f"{c['grad_rel_diff']:.2g} of max |g| {'ok' if c['ok'] else 'FAILED'}")
    return "\n".join(lines)


def report(ns: argparse.Namespace, result: dict[str, Any], elapsed: float,
            load_before: tuple[float, float, float]) -> None:
    """Rank 0: the targets, bench.json and bench.png."""
    verdicts = _targets(result)
    print("\ntargets:")
    for t in verdicts:
        value = f"{t['value']:.3f}" if isinstance(t["value"], float) else f"{t['value']:,}"
        limit = (f"{t['limit'][0]:.3f}..{t['limit'][1]:.3f}" if isinstance(t["limit"], list)
                 else f"{t['limit']:.3f}" if t["limit"] < 100 else f"{t['limit']:,.0f}")
        extra = f"; paired by round {t['paired']:.3f}" if t.get("paired") is not None else \
            f"; {t['fraction_of_gpipe']:.3f} of GPipe's" if "fraction_of_gpipe" in t else ""
        print(f"  {'met   ' if t['met'] else 'MISSED'} {t['target']}: {value} (limit {limit}){extra}")
    write_report(Path(ns.out), {
        **run_record(ns, result["pp"], elapsed, load_before),
        "settings": {"model": dataclasses.asdict(ns.config), "variants": ns.variants, "rounds": ns.rounds,
                     "warmup": ns.warmup, "optimizer": f"SGD(lr={ns.lr:g})", "dtype": "float32",
                     "timing": "slowest rank per step (pipeline step + optimizer), median over rounds"},
        **result, "targets": verdicts}, elapsed, lambda path: _chart(result, path))


def _chart(result: dict[str, Any], path: Path) -> None:
    from matplotlib.figure import Figure

    rows, p = result["rows"], result["pp"]
    fig = Figure(figsize=(10, 4.5))
    ax = fig.add_subplot(1, 2, 1)
    ms = [r["median_s"] * 1e3 for r in rows]
    bars = ax.bar([r["variant"] for r in rows], ms, color=["C0" if r["framework"] == "fourfold" else "C1"
                                                           for r in rows],
                  yerr=[[m - r["min_s"] * 1e3 for m, r in zip(ms, rows, strict=True)],
                        [r["max_s"] * 1e3 - m for m, r in zip(ms, rows, strict=True)]], capsize=3)
    ax.bar_label(bars, [f"{r['x_torch']:.2f}x" if r["x_torch"] else "" for r in rows], fontsize=8)
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    ax.set(ylabel="median step time (ms; bars: min..max)", title=f"step, pp={p}, m={result['microbatches']}")
    ax = fig.add_subplot(1, 2, 2)
    ours = [r for r in rows if "bubble" in r]
    kinds = (("measured", "measured (trace)"), ("simulated", "simulate(f, b, comm)"), ("theory", "(p-1)/(m+p-1)"))
    for k, (key, label) in enumerate(kinds):
        ax.bar([i + (k - 1) * 0.27 for i in range(len(ours))], [r["bubble"][key] * 100 for r in ours], 0.27,
               label=label)
    ax.set_xticks(range(len(ours)), [r["variant"] for r in ours], fontsize=8)
    ax.set(ylabel="bubble (% of the step, mean over ranks)", title="fourfold's bubble")
    ax.legend(fontsize=8)
    fig.suptitle("pipeline step, gloo on CPU: blue fourfold (label: x torch), orange torch.distributed.pipelining",
                 fontsize=9)
    fig.tight_layout()
    save_png(fig, path)
