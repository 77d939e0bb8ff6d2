"""``fourfold bench predict``: the simulator's predicted step time beside the measured one, layout by layout.

    fourfold bench predict                                 # every layout runnable on this machine
    fourfold bench predict --layouts "dp2,tp2,pp2:1f1b" --steps 8 --repeats 2     # quicker, noisier
    fourfold bench predict --replay runs/bench-predict/bench.json --out runs/again  # the same runs, refitted

Times one model's units in this process (:func:`~fourfold.plan.costs.measure_units`) before each round of
runs and keeps the fastest timing (:func:`~fourfold.plan.costs.fastest`, as the runs are the fastest of
theirs), calibrates on
five short real runs (:mod:`fourfold.plan.runs`: dp=2, compute slowed by ranks sharing the machine and the
link's beta; tp=2, the time per collective; pp=2, a pipeline action's overhead and a message's latency; dp=4
and dp=2 pp=2, more ranks than cores). Every layout, those five included, runs ``fourfold train`` ``--repeats`` times for ``--steps`` steps, in rotation (all of them once, then
again in reverse order: a machine whose speed drifts weighs on the calibration and the checked runs alike); the
figure is the median step after the first of the fastest run (a shared machine's noise only ever adds time; the
slowest over it is printed as the spread). Then it puts the prediction
(:func:`~fourfold.plan.predict.predict`) beside it: the error per layout, whether the ranking by predicted
time matches the measured one (:func:`swapped_pairs`: the pairs of layouts ordered otherwise, and whether
their measured times differ by more than their runs' own spread), ``bench.json`` and ``bench.png`` (predicted beside measured), and per layout
``layouts/<layout>.json`` (Perfetto) and ``.png``: every rank's measured step above the predicted one.
docs/simulator.md has a run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

from fourfold.bench.harness import add_output_flags, fmt_time, machine, write_report
from fourfold.mesh import Mesh
from fourfold.observe.chrome_trace import write_chrome_trace
from fourfold.observe.visualize import draw_step, rank_labels
from fourfold.plan.predict import Candidate, Measured, Prediction
from fourfold.plan.runs import LabShape, best_runs_and_units, calibration_layouts

__all__ = ["LAYOUTS", "main", "parse_layout", "swapped_pairs"]

LAYOUTS = "dp2,tp2,pp2:gpipe,pp2:1f1b,pp2:interleaved,pp2:zb,dp2tp2,tp2pp2:1f1b,dp2pp2:1f1b,dp2tp2pp2:1f1b"


def parse_layout(text: str, microbatches: int) -> Candidate:
    """``"dp2tp2pp2:zb"`` -> Candidate(dp=2, tp=2, pp=2, schedule="zb", microbatches=...); ``"dp2:accum4"``: with
    gradient accumulation (``--grad-accum 4``; no pipeline); ``"tp2:sp"``: with sequence parallelism
    (``--sequence-parallel``; tp > 1)."""
    import re

    match = re.fullmatch(r"(?:dp(\d+))?(?:tp(\d+))?(?:pp(\d+))?(?::(gpipe|1f1b|interleaved|zb))?(?::accum(\d+))?"
                         r"(:sp)?", text.strip())
    if not text.strip() or match is None or match.group(3) and match.group(5) or match.group(6) and not (
            match.group(2) and int(match.group(2)) > 1):
        raise ValueError(f"layout must look like dp2, tp2pp2:1f1b, dp2tp2pp2:zb, dp2:accum2 or tp2:sp (sizes, then "
                         f":schedule with pp, or :accumK without, then :sp with tp), got {text!r}.")
    dp, tp, pp = (int(g) if g else 1 for g in match.groups()[:3])
    schedule = match.group(4) or "1f1b"
    return Candidate(dp=dp, tp=tp, pp=pp, schedule=schedule, microbatches=microbatches if pp > 1 else 1,
                  virtual=2 if pp > 1 and schedule == "interleaved" else 1, grad_accum=int(match.group(5) or 1),
                  sequence_parallel=bool(match.group(6)))


def swapped_pairs(rows: list[dict[str, Any]]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The pairs of layouts (rows with ``layout``, ``predicted_s``, ``measured_s``, ``spread``) that the
    prediction orders otherwise than the measurement: those whose measured times differ by more than the larger
    of their two spreads (the slowest of a layout's runs over its fastest), a swap the runs can tell, and those
    closer than that, which a rerun may order either way."""
    beyond: list[tuple[str, str]] = []
    within: list[tuple[str, str]] = []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            if (a["predicted_s"] - b["predicted_s"]) * (a["measured_s"] - b["measured_s"]) >= 0:
                continue
            apart = max(a["measured_s"], b["measured_s"]) / min(a["measured_s"], b["measured_s"])
            (beyond if apart > max(a["spread"], b["spread"]) else within).append((a["layout"], b["layout"]))
    return beyond, within


def _side_by_side(layout: Candidate, measured: Measured, predicted: Prediction, out: Path) -> None:
    """``out/<layout>.json`` (Perfetto) and ``.png``: every rank's measured step beside the predicted one."""
    mesh = Mesh(dp=layout.dp, tp=layout.tp, pp=layout.pp)
    labels = {r: (f"{label} measured" if label else "measured") for r, label in rank_labels(mesh).items()}
    spans = {r: [replace(s, step=0) for s in row] for r, row in measured.spans.items()}
    for stage, row in predicted.spans(step=0).items():
        key = layout.world_size + stage
        spans[key] = [replace(s, rank=key) for s in row]
        labels[key] = f"stage {stage} predicted" if layout.pp > 1 else "predicted"
    name = str(layout).replace(" ", "-")
    out.mkdir(parents=True, exist_ok=True)
    write_chrome_trace(out / f"{name}.json", spans, groups=labels)
    draw_step(spans, 0, out / f"{name}.png", f"{layout}: measured {fmt_time(measured.step_s)}, predicted "
              f"{fmt_time(predicted.step_s)}", labels=labels, color_by="microbatch" if layout.pp > 1 else "name")


def _chart(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows)), 3.6))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["predicted_s"] * 1e3 for r in rows], 0.4, label="predicted", color="#9ecae1")
    ax.bar([x + 0.2 for x in xs], [r["measured_s"] * 1e3 for r in rows], 0.4, label="measured", color="#3182bd")
    for x, r in zip(xs, rows, strict=True):
        ax.text(x, max(r["predicted_s"], r["measured_s"]) * 1e3, f"{r['error']:+.0%}", ha="center", va="bottom",
                fontsize=8)
    ax.set_xticks(list(xs), [r["layout"].replace(" ", "\n") for r in rows], fontsize=7)
    ax.set_ylabel("step time (ms)")
    ax.set_title("fourfold bench predict: the simulator beside fourfold train")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(ns: argparse.Namespace) -> dict[str, Any]:
    import torch

    from fourfold.comm.auto import CostModel
    from fourfold.engine.parallelize import model_blocks
    from fourfold.models import shard_plan
    from fourfold.models.gpt import GPTConfig, TinyGPT
    from fourfold.plan.calibrate import calibrate
    from fourfold.plan.costs import measure_units
    from fourfold.plan.predict import Links, ModelProfile, predict

    started = time.monotonic()
    config = GPTConfig(vocab_size=256, seq_len=ns.seq_len, n_layer=ns.n_layer, n_head=4, d_model=ns.d_model)
    model_flags = ["--n-layer", str(ns.n_layer), "--d-model", str(ns.d_model), "--seq-len", str(ns.seq_len),
                   "--batch-size", str(ns.batch_size)]
    model = TinyGPT(config, seed=0, dtype=torch.float32)
    blocks = model_blocks(model, None)
    replayed = _replayed(ns.replay_data) if ns.replay_data is not None else None  # the model alone changes
    # timed at 1 and at a pipeline's micro-batch without dp (4 by default): the zero-bubble split is timed at the
    # size ZB-H1 runs at, and dp2 pp2's micro-batches lie between the two (interpolated, not extrapolated)
    samples = (1, max(2, ns.batch_size // ns.microbatches))
    cores = os.cpu_count() or 1
    fit_on = calibration_layouts(ns.microbatches)
    if replayed:
        links = replayed[1]
    else:
        link = CostModel.load()
        links = Links(node=link, network=link, ranks_per_node=64, cores=cores)
    if ns.lab is not None:  # every run in a lab: the nodes joined by its link, each node's ranks by this machine's
        links = ns.lab.links(links)
    print(f"fourfold bench predict: TinyGPT {ns.n_layer} x {ns.d_model}, batch {ns.batch_size} x {ns.seq_len}; "
          f"the units timed before each round of runs; calibrating on {', '.join(map(str, fit_on))} ...",
          flush=True)
    todo = list(dict.fromkeys([*fit_on, *ns.layouts]))
    done = iter(range(1, len(todo) * ns.repeats + 1))

    def progress(L: Candidate, m: Measured) -> None:
        print(f"  run {next(done)}/{len(todo) * ns.repeats}: {L} {fmt_time(m.step_s)} per step", flush=True)

    if replayed:
        costs, measured = replayed[0], replayed[2]
        print(f"  replaying the runs saved in {ns.replay}", flush=True)
    else:
        measured, costs = best_runs_and_units(
            todo, ns.repeats, ns.steps, model_flags, lambda: measure_units(model, blocks, ns.seq_len, samples=samples),
            samples[-1], ns.timeout, progress=progress, lab=ns.lab)
    print(f"  units: {costs.source}", flush=True)
    profile = ModelProfile.of(model, blocks, ns.seq_len, shard_plan(model), costs)
    saved = _measurements(costs, links, measured)
    saved["settings"] = {"n_layer": ns.n_layer, "d_model": ns.d_model, "seq_len": ns.seq_len,
                         "batch_size": ns.batch_size, "microbatches": ns.microbatches,
                         "layouts": [asdict(L) for L in ns.layouts]}
    profile, links, fitted = calibrate(profile, links, ns.batch_size, {L: measured[L][0] for L in fit_on})
    print("  fitted: " + ", ".join(f"{k} {v:.3g}" for k, v in fitted.items()), flush=True)
    rows: list[dict[str, Any]] = []
    print(f"{'layout':<30} {'predicted':>10} {'measured':>10} {'spread':>6} {'stolen':>6} {'error':>7}   bubble  "
          "dp exposed  memory/rank")
    for L in ns.layouts:
        m, spread = measured[L]
        p = predict(profile, L, links, ns.batch_size)
        error = p.step_s / m.step_s - 1
        rows.append({"layout": str(L), "predicted_s": p.step_s, "measured_s": m.step_s, "spread": spread,
                     "stolen": m.stolen, "error": error, "calibration": L in fit_on, "bubble": p.bubble,
                     "dp_exposed_s": p.dp_exposed_s, "tp_comm_s": p.tp_comm_s, "peak_bytes": p.peak_bytes})
        _side_by_side(L, m, p, Path(ns.out) / "layouts")
        note = "  (calibration run)" if L in fit_on else ""
        stolen = "-" if m.stolen is None else f"{m.stolen:.0%}"
        print(f"{str(L):<30} {fmt_time(p.step_s):>10} {fmt_time(m.step_s):>10} {spread:>5.2f}x {stolen:>6} "
              f"{error:>+7.1%}   "
              f"{p.bubble:>6.1%} {fmt_time(p.dp_exposed_s):>11}  {p.peak_bytes / 2**20:>7.1f} MiB{note}", flush=True)
    by_pred = [r["layout"] for r in sorted(rows, key=lambda r: r["predicted_s"])]
    by_meas = [r["layout"] for r in sorted(rows, key=lambda r: r["measured_s"])]
    checked = [r for r in rows if not r["calibration"]]
    worst = max(checked, key=lambda r: abs(r["error"])) if checked else None
    beyond, within = swapped_pairs(rows)
    pairs = len(rows) * (len(rows) - 1) // 2

    def listed(swaps: list[tuple[str, str]]) -> str:
        return "; ".join(f"{a} / {b}" for a, b in swaps)

    print(f"\nranking by predicted time: {' < '.join(by_pred)}\nranking by measured time:  {' < '.join(by_meas)}"
          f"\npairs ordered otherwise: {len(beyond) + len(within)} of {pairs}; {len(beyond)} measured apart by more "
          f"than their runs' spread{': ' + listed(beyond) if beyond else ''}"
          + (f"; within it: {listed(within)}" if within else "")
          + (f"\nlargest error outside calibration: {worst['layout']} {worst['error']:+.1%}" if worst else ""))
    return {"command": ns.command or " ".join(sys.argv), "machine": machine(cores), "fitted": fitted,
            "costs": costs.source, "rows": rows, "ranking_predicted": by_pred, "ranking_measured": by_meas,
            "swapped_beyond_spread": beyond, "swapped_within_spread": within, "measurements": saved,
            "elapsed_s": time.monotonic() - started}


def _replay_settings(ns: argparse.Namespace) -> dict[str, Any]:
    """Read ``--replay``'s bench.json; its model, batch and layouts replace the flags'. Refused with the reason if it
    holds no measurements."""
    import json

    try:
        report = json.loads(Path(ns.replay).read_text(encoding="utf-8"))
        data = report["measurements"]
        settings = data["settings"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--replay must name the bench.json of a `fourfold bench predict` run that saved its "
                         f"measurements (since 2026-11-23), got {ns.replay}: {type(e).__name__}: {e}.") from None
    for key in ("n_layer", "d_model", "seq_len", "batch_size", "microbatches"):
        setattr(ns, key, settings[key])
    ns.layouts = [Candidate(**d) for d in settings["layouts"]]
    ns.lab = None
    return dict(data)


def _measurements(costs: Any, links: Any, measured: dict[Candidate, tuple[Measured, float]]) -> dict[str, Any]:
    """What the prediction is fitted to and checked against, for ``--replay``: the units' times, the links before
    calibration, and every layout's fastest run (its median step's spans included) and spread."""
    return {"costs": asdict(costs), "links": asdict(links),
            "runs": [{"layout": asdict(L), "step_s": m.step_s, "spread": spread, "stolen": m.stolen,
                      "spans": {str(r): [s.to_dict() for s in row] for r, row in m.spans.items()}}
                     for L, (m, spread) in measured.items()]}


def _replayed(data: dict[str, Any]) -> tuple[Any, Any, dict[Candidate, tuple[Measured, float]]]:
    """:func:`_measurements` read back: the units' times, the links, the runs."""
    from fourfold.comm.auto import CostModel
    from fourfold.observe.trace import Span
    from fourfold.plan.costs import UnitCosts, split_fit
    from fourfold.plan.predict import Links

    c = data["costs"]
    fit = c.get("split_fit")  # saved since 2026-11-23 (late)
    costs = UnitCosts(tuple(map(tuple, c["forward"])), tuple(map(tuple, c["backward"])),
                      c["optimizer_s_per_element"], c["source"], tuple(c["split"]),
                      split_fit(fit) if fit is not None else None)
    known = {f.name for f in fields(Links)}  # a figure a later model no longer has is left out
    raw = {k: v for k, v in data["links"].items() if k in known}
    links = Links(**{**raw, "node": CostModel(**raw["node"]), "network": CostModel(**raw["network"])})
    runs = {Candidate(**r["layout"]): (Measured(r["step_s"], {int(k): [Span.from_dict(s) for s in row]
                                                          for k, row in r["spans"].items()}, r["stolen"]),
                                    r["spread"]) for r in data["runs"]}
    return costs, links, runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fourfold bench predict", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default=LAYOUTS, help=f"comma-separated layouts (default: {LAYOUTS})")
    parser.add_argument("--steps", type=int, default=8, help="steps per run; the first is not timed (default: 8)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per layout; the fastest counts, and the slowest over it is shown as the spread "
                             "(default: 3: with 2, one slow calibration run moved every pp2 prediction by 15-26 %% "
                             "on a 2-core VM)")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch (default: 16)")
    parser.add_argument("--microbatches", type=int, default=4, help="with pp: micro-batches (default: 4)")
    parser.add_argument("--n-layer", type=int, default=4, help="TinyGPT blocks (default: 4)")
    parser.add_argument("--d-model", type=int, default=128, help="TinyGPT width (default: 128)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sample (default: 64)")
    parser.add_argument("--lab-link", default=None, help="make every run (the calibration's too) in a lab of "
                        "--lab-ranks-per-node ranks a node, the nodes joined by this link, e.g. 250mbit (root; "
                        "docs/lab.md); the prediction joins them by the lab's fitted model or this rate")
    parser.add_argument("--lab-ranks-per-node", type=int, default=2, help="with --lab-link (default: 2)")
    parser.add_argument("--replay", default=None, metavar="BENCH_JSON",
                        help="run nothing: fit and predict anew from the measurements an earlier run saved in its "
                             "bench.json (its model, batch and layouts), so that two versions of the simulator are "
                             "compared on the same runs")
    add_output_flags(parser, "predict", "bench.json, bench.png and layouts/ (each layout's measured and "
                     "predicted step)")
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if ns.steps < 2:
            raise ValueError(f"--steps must be >= 2 (the first step is not timed), got {ns.steps}.")
        if ns.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {ns.repeats}.")
        ns.layouts = [parse_layout(t, ns.microbatches) for t in ns.layouts.split(",")]
        ns.lab = None if ns.lab_link is None else LabShape(ns.lab_ranks_per_node, ns.lab_link)
        ns.replay_data = None if ns.replay is None else _replay_settings(ns)  # its links include any lab's
        if ns.lab is not None:
            for L in [*calibration_layouts(ns.microbatches), *ns.layouts]:
                ns.lab.command(L)  # refuses a layout whose ranks do not fill whole nodes
        for L in ns.layouts:
            if ns.batch_size % (L.dp * L.microbatches):
                raise ValueError(f"--batch-size must divide into dp x microbatches for every layout, got "
                                 f"{ns.batch_size} for {L}.")
    except ValueError as e:
        parser.error(str(e))
    result = run(ns)
    write_report(Path(ns.out), result, result["elapsed_s"], lambda path: _chart(result["rows"], path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
