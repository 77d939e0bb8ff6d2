"""``fourfold bench packing``: the same documents each step, padded vs packed first-fit vs packed bfd.

    fourfold bench packing                       # 1 rank; --nproc 2 splits each step's documents over dp

The documents are a skewed mix (``--short-fraction`` of them at most ``--short-ratio`` of the longest, which is
``--seq-len``: the seed's "80 % of your sequences are short"). Every round every variant trains one step of
TinyGPT on that round's documents, through the engine users train with, in rotating order; the time is the
slowest rank's. Reported per variant: step time, real tokens/s (targets that are not padding), padding
fraction, and the speed-up over ``pad`` beside its bound 1 / (1 - pad's padding fraction): the speed-up if
padding cost nothing and real tokens everything. The losses of the three must agree (same documents).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

from fourfold.bench.harness import (
    add_output_flags,
    fmt_time,
    name_list,
    paired_ratio,
    run_or_launch,
    run_record,
    save_png,
    start_rank,
    timed_rounds,
    write_report,
)
from fourfold.run.args import make_parser

__all__ = ["main"]

VARIANTS = ("pad", "first-fit", "bfd", "pad-dense", "first-fit-dense", "bfd-dense")
DEFAULT = ("pad", "first-fit", "bfd")
TARGET = 0.85  # bfd's speed-up over pad, as a fraction of the bound
DENSE_TARGET = 2.0  # at rows of 4096: document-by-document attention against the dense mask, same rows


def _parser() -> argparse.ArgumentParser:
    p = make_parser("fourfold bench packing", "Train the same documents padded and packed (first-fit, bfd) side "
                    "by side; report real tokens/s, padding and the bound on packing's speed-up.")
    p.add_argument("--nproc", type=int, default=1, help="ranks (data-parallel) to start (default: 1)")
    p.add_argument("--variants", default=",".join(DEFAULT), help=f"of {', '.join(VARIANTS)}: -dense attends through "
                   "one (B, 1, T, T) block-diagonal mask instead of document by document (default: "
                   f"{','.join(DEFAULT)})")
    p.add_argument("--docs-per-step", type=int, default=64, help="documents per step (default: 64)")
    p.add_argument("--seq-len", type=int, default=256, help="row length, and the longest document (default: 256)")
    p.add_argument("--short-fraction", type=float, default=0.8, help="share of short documents (default: 0.8)")
    p.add_argument("--short-ratio", type=float, default=0.125, help="short: at most this share of the longest "
                   "(default: 0.125)")
    p.add_argument("--layers", type=int, default=2, help="TinyGPT n_layer (default: 2)")
    p.add_argument("--d-model", type=int, default=128, help="TinyGPT d_model (default: 128)")
    p.add_argument("--rounds", type=int, default=10, help="timed steps per variant (default: 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default: 2)")
    add_output_flags(p, "packing")
    return p


def _check(ns: argparse.Namespace) -> argparse.Namespace:
    ns.variants = name_list(ns.variants, VARIANTS, "variants", "pad,bfd")
    for flag in ("nproc", "docs_per_step", "layers", "d_model", "rounds", "warmup"):
        if getattr(ns, flag) < 1:
            raise ValueError(f"{flag.replace('_', '-')} must be >= 1, got {getattr(ns, flag)}.")
    if ns.seq_len < 8 or not 0 <= ns.short_fraction <= 1 or not 0 < ns.short_ratio <= 1:
        raise ValueError(f"seq-len must be >= 8, short-fraction in [0, 1], short-ratio in (0, 1], got "
                         f"{ns.seq_len}, {ns.short_fraction}, {ns.short_ratio}.")
    return ns


def main(argv: list[str] | None = None) -> int:
    return run_or_launch("packing", argv, _parser(), _check, _run)


def _run(ns: argparse.Namespace) -> None:
    import torch

    from fourfold.comm.wait import barrier
    from fourfold.data import DocumentLoader, skewed_documents
    from fourfold.engine.layout import Layout
    from fourfold.engine.parallelize import parallelize
    from fourfold.mesh import Mesh
    from fourfold.models import GPTConfig, TinyGPT
    from fourfold.models.attention import packed_attention

    ctx, say, started, load_before = start_rank("[bench packing]", ns.timeout)
    g = ctx.world_size
    ranks = Mesh.for_world(g, dp=g).build(ns.timeout)
    steps = ns.warmup + ns.rounds
    docs = skewed_documents(ns.docs_per_step * steps, ns.seq_len + 1, short_fraction=ns.short_fraction,
                            short_ratio=ns.short_ratio, seed=0)
    cfg = GPTConfig(vocab_size=256, seq_len=ns.seq_len, n_layer=ns.layers, n_head=4, d_model=ns.d_model)
    say(f"G={g}: {docs}; TinyGPT {ns.layers} layers, d_model {ns.d_model}; {ns.warmup} warm-up + {ns.rounds} rounds")
    batches: dict[str, list[Any]] = {}
    engines: dict[str, Any] = {}
    opts: dict[str, torch.optim.Optimizer] = {}
    losses: dict[str, list[float]] = {}
    for v in ns.variants:  # every batch packed before the clock starts: the step is what is timed
        loader = DocumentLoader(docs, ns.seq_len, seed=0, dp_rank=ranks.coord.dp, dp_size=g,
                                docs_per_step=ns.docs_per_step, packing=v.removesuffix("-dense"))
        batches[v] = [loader.shard(k) for k in range(steps)]
        engines[v] = parallelize(TinyGPT(cfg, seed=0), ranks.using(timeout_s=ns.timeout), Layout())
        opts[v] = torch.optim.AdamW(engines[v].parameters(), lr=1e-3)
        losses[v] = []

    def step(v: str, x: Any, y: Any, k: int) -> None:
        b = batches[v][k]
        with packed_attention("dense" if v.endswith("-dense") else "auto"):
            loss = engines[v].step(b.inputs, b.targets, documents=b.documents, num_tokens=b.num_tokens)
        opts[v].step()
        opts[v].zero_grad(set_to_none=True)
        losses[v].append(loss.item())

    barrier("start the timed rounds")
    timed = timed_rounds([partial(step, v) for v in ns.variants], lambda k: (None, None), ns.warmup, ns.rounds)
    if ctx.rank == 0:
        _report(ns, g, docs, batches, timed, losses, time.monotonic() - started, load_before)
    barrier("finish the benchmark")
    ctx.close()


def _report(ns: argparse.Namespace, g: int, docs: Any, batches: dict[str, list[Any]], timed: list[dict[str, Any]],
            losses: dict[str, list[float]], elapsed: float, load_before: tuple[float, float, float]) -> None:
    from fourfold.data.packing import DocumentLayout
    from fourfold.models.attention import RUNS_FROM

    rows: list[dict[str, Any]] = []
    for v, t in zip(ns.variants, timed, strict=True):
        stats = [b.stats for b in batches[v][ns.warmup:]]
        real = [st["real_tokens"] / sec for st, sec in zip(stats, t["times_s"], strict=True)]
        rows.append({"variant": v, "median_s": t["median_s"], "min_s": t["min_s"], "max_s": t["max_s"],
                     "times_s": t["times_s"], "real_tokens_per_s": statistics.median(real),
                     "padding_fraction": statistics.mean(s["padding_fraction"] for s in stats),
                     "rows": statistics.mean(s["rows"] for s in stats),
                     "width": statistics.mean(s["width"] for s in stats),
                     "real_tokens": statistics.mean(s["real_tokens"] for s in stats),
                     "score_elements": statistics.mean(  # (query, key) pairs per step: dense B T^2, else runs'
                         b.documents.numel() * b.documents.size(1) if v.endswith("-dense") or
                         b.documents.size(1) < RUNS_FROM else DocumentLayout(b.documents).score_elements
                         for b in batches[v][ns.warmup:])})
    pad = next((r for r in rows if r["variant"] == "pad"), None)
    for r in rows:
        r["speedup"] = pad["median_s"] / r["median_s"] if pad else None
        r["speedup_paired"] = paired_ratio(pad["times_s"], r["times_s"]) if pad else None
    bound = 1.0 / (1.0 - pad["padding_fraction"]) if pad else None
    worst = max(abs(a - b) for v in ns.variants for a, b in zip(losses[v], losses[ns.variants[0]], strict=True))
    lines = [f"\n{docs.name}, {ns.docs_per_step} documents per step, rows of {ns.seq_len}, G={g}",
             f"{'variant':<16} {'rows':>6} {'width':>6} {'padding':>8} {'scores':>8} {'median':>9} "
             f"{'real tok/s':>11} {'x pad':>6} {'paired':>6}"]
    for r in rows:
        x = "-" if r["speedup"] is None else f"{r['speedup']:.2f}"
        xp = "-" if r["speedup_paired"] is None else f"{r['speedup_paired']:.2f}"
        lines.append(f"{r['variant']:<16} {r['rows']:>6.1f} {r['width']:>6.0f} {r['padding_fraction']:>8.1%} "
                     f"{r['score_elements'] / 1e6:>7.1f}M {fmt_time(r['median_s']):>9} "
                     f"{r['real_tokens_per_s']:>11,.0f} {x:>6} {xp:>6}")
    if pad is not None and bound is not None:
        lines.append(f"bound on packing's speed-up over pad: 1 / (1 - {pad['padding_fraction']:.3f}) = {bound:.2f}x")
    lines.append(f"same documents, same losses: max |loss difference| over {len(losses[ns.variants[0]])} steps "
                 f"{worst:.2g}")
    print("\n".join(lines), flush=True)
    verdicts = []
    by_name = {r["variant"]: r for r in rows}
    for r in rows:  # document-by-document attention against the dense mask, on the same rows
        dense = by_name.get(f"{r['variant']}-dense")
        if dense is not None:
            ratio = paired_ratio(dense["times_s"], r["times_s"])
            r["speedup_over_dense"] = ratio
            verdicts.append({"target": f"{r['variant']} at least {DENSE_TARGET}x faster than {dense['variant']}",
                             "value": ratio, "met": ratio >= DENSE_TARGET})
            print(f"{r['variant']}: attention document by document, {ratio:.2f}x the dense mask's speed (paired); "
                  f"{r['score_elements'] / dense['score_elements']:.3f} of its (query, key) pairs", flush=True)
    bfd = next((r for r in rows if r["variant"] == "bfd"), None)
    if bfd is not None and pad is not None and bound is not None:
        share = bfd["speedup"] / bound
        verdicts.append({"target": f"bfd reaches >= {TARGET} of the bound", "value": share, "met": share >= TARGET,
                         "speedup": bfd["speedup"], "bound": bound})
        print(f"\ntargets:\n  {'met   ' if share >= TARGET else 'MISSED'} bfd's speed-up {bfd['speedup']:.2f}x is "
              f"{share:.2f} of the bound {bound:.2f}x (target >= {TARGET})")
    result = {**run_record(ns, g, elapsed, load_before),
              "settings": {"docs_per_step": ns.docs_per_step, "seq_len": ns.seq_len,
                           "short_fraction": ns.short_fraction, "short_ratio": ns.short_ratio, "layers": ns.layers,
                           "d_model": ns.d_model, "rounds": ns.rounds, "warmup": ns.warmup, "dtype": "float32",
                           "attention": "document by document: one causal SDPA call per run length; -dense: SDPA "
                           "with one (B, 1, T, T) block-diagonal mask", "timing": "slowest rank per step, median "
                           "over rounds"},
              "rows": rows, "bound": bound, "max_loss_difference": worst, "targets": verdicts}
    write_report(Path(ns.out), result, elapsed, lambda path: _chart(rows, bound, path))


def _chart(rows: list[dict[str, Any]], bound: float | None, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3.8))
    ax, bx = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    names = [r["variant"] for r in rows]
    ax.bar(names, [r["real_tokens_per_s"] for r in rows], color=["0.6" if n == "pad" else "C0" for n in names])
    pad = next((r for r in rows if r["variant"] == "pad"), None)
    if pad is not None and bound is not None:
        ax.axhline(pad["real_tokens_per_s"] * bound, color="C3", ls="--", label=f"bound: pad x {bound:.2f}")
        ax.legend(fontsize=8)
    ax.set(ylabel="real tokens/s (median)", title="what is learned per second")
    bx.bar(names, [100 * r["padding_fraction"] for r in rows], color="C1")
    bx.set(ylabel="padding (% of positions computed)", title="what is wasted")
    for a in (ax, bx):
        a.title.set_fontsize(9)
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    sys.exit(main())
