"""``fourfold bench zero``: fourfold's ZeRO stages against PyTorch's FSDP2 (``fully_shard``) and DDP, on the same
model, batch and ranks, side by side: step time and the memory each rank holds.

    fourfold bench zero --nproc 2                        # TinyGPT 4 x 256, AdamW, ~1 min
    fourfold bench zero --variants fsdp2,zero3,zero3-ring --rounds 30

Variants (``--variants``):

* ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every block, then on the model (parameters resharded
  after forward, as ZeRO-3), the reference;
* ``ddp``: ``DistributedDataParallel``: nothing sharded, for scale;
* ``zeroK`` / ``zeroK-ring`` (K = 1, 2, 3): ``fourfold.parallelize(model, Mesh(dp=G), Layout(zero=K))`` on the backend's
  reduce-scatter / all-gather (``zeroK``) or fourfold's counted ring (``-ring``), stepped by ``engine.step``.

Method, as ``bench dp``: every variant holds its own copy of the model (one seed) and its own AdamW; round k
draws one global batch and runs one training step of every variant, the order rotating; a barrier precedes
every step; a step takes as long as its slowest rank; the figure is the median over ``--rounds`` (and the
paired ratio, the median of per-round ratios to fsdp2). Memory: the bytes each rank holds between steps
(parameters, gradients, optimiser state: the distinct storages of its local tensors, a DTensor's local shard),
the largest over ranks. The warm-up rounds check that every variant's loss equals fsdp2's (float32 tolerance).
Rank 0 prints the table and the target (ZeRO-3 step time <= 1.05x FSDP2's, memory <=) and writes
OUT/bench.json and OUT/bench.png.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from fourfold.bench.harness import (
    add_output_flags,
    add_round_flags,
    check_rounds,
    fmt_time,
    format_bytes,
    paired_ratio,
    run_or_launch,
    run_record,
    save_png,
    start_rank,
    timed_rounds,
    write_report,
)

__all__ = ["DEFAULT_VARIANTS", "TARGET", "main", "parse_variant"]

DEFAULT_VARIANTS = "fsdp2,zero3,zero3-ring,zero2,zero1,ddp"
TARGET = ("zero3", 1.05)
"""(variant, limit on its median step time / fsdp2's); its held memory must not exceed fsdp2's either."""
LOSS_RTOL = 1e-4  # float32, a few AdamW steps: every variant's loss within this of fsdp2's
_TERMS = ("parameters", "gradients", "optimizer")


def parse_variant(text: str) -> tuple[str, int, str]:
    """``"zero3-ring"`` -> ("zero3-ring", 3, "ring"); ``"fsdp2"`` -> ("fsdp2", 0, "fsdp2"); ``"ddp"`` likewise."""
    name = text.strip()
    if name in ("fsdp2", "ddp"):
        return name, 0, name
    stage, _, algorithm = name.removeprefix("zero").partition("-")
    if not name.startswith("zero") or stage not in ("1", "2", "3") or algorithm not in ("", "ring", "native"):
        raise ValueError(f"variants must be fsdp2, ddp or zeroK[-ring|-native] with K 1, 2 or 3, got {text!r}. "
                         f"E.g. --variants {DEFAULT_VARIANTS}.")
    return name, int(stage), algorithm or "native"


def _parser() -> argparse.ArgumentParser:
    from fourfold.run.args import make_parser

    p = make_parser("fourfold bench zero", "Time a training step of fourfold's ZeRO stages, PyTorch's FSDP2 "
                    "and DDP side by side on --nproc ranks, and the memory each rank holds.")
    add_round_flags(p, nproc="data-parallel ranks", rounds=10, warmup=2, checks="the losses against fsdp2's")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"fsdp2, ddp, zeroK[-ring] (default: "
                   f"{DEFAULT_VARIANTS})")
    p.add_argument("--layers", type=int, default=4, help="TinyGPT n_layer (default: 4)")
    p.add_argument("--d-model", type=int, default=256, help="TinyGPT d_model (default: 256)")
    p.add_argument("--heads", type=int, default=4, help="TinyGPT n_head (default: 4)")
    p.add_argument("--seq-len", type=int, default=128, help="TinyGPT seq_len (default: 128)")
    p.add_argument("--batch", type=int, default=8, help="global batch in sequences (default: 8)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    add_output_flags(p, "zero")
    return p


def _check(ns: argparse.Namespace) -> argparse.Namespace:
    ns.variants = [parse_variant(v) for v in ns.variants.split(",") if v.strip()]
    names = [v[0] for v in ns.variants]
    if len(set(names)) != len(names) or "fsdp2" not in names:
        raise ValueError(f"variants must be distinct and include fsdp2 (the reference), got {names}.")
    check_rounds(ns, "ZeRO shards over data-parallel ranks", "the losses against fsdp2's")
    if ns.batch % ns.nproc or ns.batch < ns.nproc:
        raise ValueError(f"batch must be a positive multiple of nproc, got {ns.batch} on {ns.nproc} ranks.")
    return ns


def main(argv: list[str] | None = None) -> int:
    """``fourfold bench zero ...``: launch the ranks (parent) or run the benchmark (a rank)."""
    return run_or_launch("zero", argv, _parser(), _check, _run)


@dataclass(eq=False)
class _Replica:
    name: str
    step: Any  # (x, y) -> the step's Loss (its all-reduce waited for after the optimiser)
    optimizer: Any
    params: list[Any]  # what the optimiser steps (local shards; DTensors for FSDP2)
    losses: list[float]


def _replica(variant: tuple[str, int, str], ns: argparse.Namespace, ranks: Any) -> _Replica:
    import torch

    from fourfold.engine.layout import Layout
    from fourfold.engine.parallelize import parallelize
    from fourfold.engine.step import Loss
    from fourfold.loss import lm_loss
    from fourfold.models import GPTConfig, TinyGPT

    name, stage, kind = variant
    cfg = GPTConfig(seq_len=ns.seq_len, n_layer=ns.layers, n_head=ns.heads, d_model=ns.d_model)
    model = TinyGPT(cfg, seed=0)
    if stage:
        engine = parallelize(model, ranks.using(timeout_s=ns.timeout), Layout(zero=stage, allreduce=kind))  # type: ignore[arg-type]
        params = engine.parameters()
        return _Replica(name, engine.step, torch.optim.AdamW(params, lr=ns.lr), params, [])
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (ranks.mesh.world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped: Any = model  # the model itself, now an FSDP module
    else:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)

    def step(x: Any, y: Any) -> Any:
        loss = lm_loss(wrapped(x), y)
        loss.backward()
        value = loss.detach().reshape(1).to(torch.float64)  # the global mean loss, as the engine reports it:
        return Loss.all_reduced(value, ranks.mesh.dp, None, ns.timeout)  # waited in item()

    params = list(wrapped.parameters())
    return _Replica(name, step, torch.optim.AdamW(params, lr=ns.lr), params, [])


def _step(r: _Replica, x: Any, y: Any, it: int, held: dict[str, dict[str, int]]) -> None:
    from fourfold.observe.memory import held_bytes

    loss = r.step(x, y)
    r.optimizer.step()
    if r.name not in held:
        held[r.name] = held_bytes(r.params, r.optimizer)  # fixed from the first step on (before zero_grad)
    r.optimizer.zero_grad(set_to_none=True)
    r.losses.append(float(loss))


def _run(ns: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from fourfold.comm.wait import barrier
    from fourfold.data import BatchLoader, load_corpus
    from fourfold.mesh import Mesh
    from fourfold.models import GPTConfig, TinyGPT

    ctx, say, started, load_before = start_rank("[bench zero]", ns.timeout)
    g = ctx.world_size
    ranks = Mesh.for_world(g, dp=g).build(ns.timeout)
    loader = BatchLoader(load_corpus(), ns.batch, ns.seq_len, seed=0, dp_rank=ctx.rank, dp_size=g)
    replicas = [_replica(v, ns, ranks) for v in ns.variants]
    n = TinyGPT(GPTConfig(seq_len=ns.seq_len, n_layer=ns.layers, n_head=ns.heads, d_model=ns.d_model),
                device="meta").num_parameters()
    say(f"G={g}, TinyGPT L={ns.layers} C={ns.d_model} T={ns.seq_len}, batch {ns.batch}, {n / 1e6:.2f} M "
        f"parameters; {ns.warmup} warm-up + {ns.rounds} rounds of {', '.join(v[0] for v in ns.variants)}")
    held: dict[str, dict[str, int]] = {}
    timed = timed_rounds([partial(_step, r, held=held) for r in replicas], loader.shard, ns.warmup, ns.rounds)
    reference = next(r for r in replicas if r.name == "fsdp2")
    worst = max(abs(a - b) / abs(b) for r in replicas for a, b in zip(r.losses, reference.losses, strict=True))
    if worst > LOSS_RTOL:
        raise RuntimeError(f"every variant's loss must equal fsdp2's within rtol {LOSS_RTOL:g}, got "
                           f"{worst:.3g}: " + "; ".join(f"{r.name} {r.losses[:ns.warmup]}" for r in replicas))
    mine = torch.tensor([[held[r.name][t] for t in _TERMS] for r in replicas], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the rank that holds most
    rows = []
    for r, t, m in zip(replicas, timed, mine.tolist(), strict=True):
        rows.append({"variant": r.name, **{k: t[k] for k in ("median_s", "min_s", "max_s", "times_s")},
                     "x_fsdp2": t["median_s"] / timed[replicas.index(reference)]["median_s"],
                     "x_fsdp2_paired": paired_ratio(t["times_s"], timed[replicas.index(reference)]["times_s"]),
                     "held_bytes": dict(zip(_TERMS, (int(v) for v in m), strict=True)), "held_total": int(sum(m))})
    if ctx.rank == 0:
        _report(ns, g, rows, worst, time.monotonic() - started, load_before)
    barrier("finish the benchmark")
    ctx.close()


def _report(ns: argparse.Namespace, g: int, rows: list[dict[str, Any]], worst: float, elapsed: float,
            load_before: tuple[float, float, float]) -> None:
    print(f"\n{'variant':<11} {'median':>9} {'min':>9} {'x fsdp2':>7} {'paired':>6} {'params':>10} {'grads':>10} "
          f"{'optim':>10} {'held':>10}")
    for r in rows:
        h = r["held_bytes"]
        print(f"{r['variant']:<11} {fmt_time(r['median_s']):>9} {fmt_time(r['min_s']):>9} {r['x_fsdp2']:>7.3f} "
              f"{r['x_fsdp2_paired']:>6.3f} {format_bytes(h['parameters']):>10} {format_bytes(h['gradients']):>10} "
              f"{format_bytes(h['optimizer']):>10} {format_bytes(r['held_total']):>10}")
    print(f"losses: every variant within {worst:.2g} (relative) of fsdp2's (rtol {LOSS_RTOL:g})")
    ref = next(r for r in rows if r["variant"] == "fsdp2")
    row = next((r for r in rows if r["variant"] == TARGET[0]), None)
    verdicts = []
    if row is not None:
        verdicts.append({"target": f"{TARGET[0]}: step time <= {TARGET[1]}x fsdp2", "value": row["x_fsdp2"],
                         "paired": row["x_fsdp2_paired"], "met": row["x_fsdp2"] <= TARGET[1]})
        verdicts.append({"target": f"{TARGET[0]}: held memory <= fsdp2's", "value": row["held_total"],
                         "reference": ref["held_total"], "met": row["held_total"] <= ref["held_total"]})
        print("\ntargets:")
        print(f"  {'met   ' if verdicts[0]['met'] else 'MISSED'} {verdicts[0]['target']}: {row['x_fsdp2']:.3f}x; "
              f"paired by round {row['x_fsdp2_paired']:.3f}")
        print(f"  {'met   ' if verdicts[1]['met'] else 'MISSED'} {verdicts[1]['target']}: "
              f"{format_bytes(row['held_total'])} vs {format_bytes(ref['held_total'])}")
    result = {**run_record(ns, g, elapsed, load_before),
              "settings": {"variants": [v[0] for v in ns.variants], "rounds": ns.rounds, "warmup": ns.warmup,
                           "optimizer": f"AdamW(lr={ns.lr:g})", "dtype": "float32",
                           "model": {"n_layer": ns.layers, "d_model": ns.d_model, "n_head": ns.heads,
                                     "seq_len": ns.seq_len, "batch": ns.batch}},
              "rows": rows, "loss_max_rel_diff": worst, "targets": verdicts}
    write_report(Path(ns.out), result, elapsed, lambda path: _chart(rows, g, path))


def _chart(rows: list[dict[str, Any]], g: int, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.2))
    xs = range(len(rows))
    names = [r["variant"] for r in rows]
    ax = fig.add_subplot(1, 2, 1)
    ax.bar(xs, [r["median_s"] * 1e3 for r in rows], color=["C1" if n in ("fsdp2", "ddp") else "C0" for n in names])
    for x, r in zip(xs, rows, strict=True):
        ax.annotate(f"{r['x_fsdp2']:.2f}x", (x, r["median_s"] * 1e3), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), names, rotation=30, fontsize=8)
    ax.set(ylabel="median step time (ms)", title=f"step time, G={g} (label: x fsdp2)")
    ax = fig.add_subplot(1, 2, 2)
    bottom = [0.0] * len(rows)
    for term, color in zip(_TERMS, ("C0", "C2", "C3"), strict=True):
        values = [r["held_bytes"][term] / 2**20 for r in rows]
        ax.bar(xs, values, bottom=bottom, color=color, label=term)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(list(xs), names, rotation=30, fontsize=8)
    ax.set(ylabel="MiB held per rank between steps", title="memory per rank (the largest rank)")
    ax.legend(fontsize=8)
    fig.suptitle("ZeRO: fourfold (blue) vs PyTorch FSDP2 and DDP (orange), gloo on CPU", fontsize=9)
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    import sys

    sys.exit(main())
