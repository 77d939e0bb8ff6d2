"""``fourfold bench tp``: fourfold's tensor parallelism against PyTorch's DTensor tensor parallelism, and against
no tensor parallelism at all, on the same model, the same batch and the same ranks, side by side.

    fourfold bench tp --nproc 2                  # TinyGPT (3.3 M) and a 2 x (2048 -> 8192 -> 2048) MLP, ~1 min
    fourfold bench tp --models gpt --variants single,fourfold-mlp,dtensor-mlp --rounds 40
    python benchmarks/tensor_parallel.py --nproc 2                # the same code

``--nproc`` ranks form one tensor-parallel group (tp = nproc). Variants (``--variants``), FRAMEWORK-PLAN:

* ``single``: every rank holds the whole model and runs the unsharded step on the whole batch (no
  communication): the reference of the check and of ``x single``. Always run.
* ``fourfold-mlp`` / ``dtensor-mlp``: every MLP block Y = GELU(X A) B split Megatron's way, A = [A_1 ... A_p] by
  columns and B = [B_1; ...; B_p] by rows; the rest replicated. fourfold: ``parallelize(model, Mesh(tp=p),
  Layout(tp=p), plan={fc: "column", proj: "row"})``; torch: ``parallelize_module(model, mesh, {fc: ColwiseParallel(), proj:
  RowwiseParallel()})``. The cleanest like-for-like: both run the same GEMMs and the same two all-reduces.
* ``fourfold-full`` / ``dtensor-full`` (TinyGPT only): also attention (qkv by heads, proj by rows), the
  embedding by vocabulary rows, the tied head by vocabulary columns and the loss on vocabulary-sharded logits.
  fourfold: ``parallelize(model, Mesh(tp=p))``, TinyGPT's own plan
  (:func:`~fourfold.models.gpt_plan.parallelize_tinygpt`); torch: the MLP plan plus ``ColwiseParallel``
  qkv, ``RowwiseParallel`` attn.proj, ``RowwiseParallel(input_layouts=Replicate())`` on wte,
  ``ColwiseParallel(output_layouts=Shard(-1))`` lm_head re-tied to wte's shard, and ``loss_parallel()``.
  TinyGPT's qkv is fused, W = [W_q; W_k; W_v] (3C, C), and ColwiseParallel cuts dim 0 into p contiguous blocks:
  at p = 2 rank 0 would get all of W_q and half of W_k, no whole heads. The DTensor copy therefore stores W's
  rows rank-major, [W_q,0; W_k,0; W_v,0; W_q,1; ...] (each rank's ``shard(W, ShardLayout(0, parts=3))``), so
  Shard(0) hands rank i fourfold's piece: one fused GEMM per rank, as fourfold runs.

Every fourfold variant steps through the engine users train with (``engine.step(x, y)``); ``single`` and the
DTensor variants run their own forward and backward, the comparison.

Method (as ``fourfold bench dp``). Every variant holds its own copy of the model (one seed) and its own SGD.
Round k draws one batch, the same on every rank (tensor parallelism splits weights, not data), and runs one step
(forward, backward, optimizer) of every variant, the order rotating each round; ``--warmup`` rounds first, not
timed. In the first, each variant's loss and every gradient is checked against ``single``'s (its shard of it;
float32 tolerance) and its collectives counted, by :class:`~torch.distributed.tensor.debug.CommDebugMode` for
every variant (around forward and backward; a collective run by autograd's engine counts as backward) and by
fourfold's :class:`~fourfold.observe.trace.Tracer` for fourfold's (per block, against
:func:`plan_theory`); later rounds run uninstrumented. A barrier precedes every timed step; a step takes as long
as its slowest rank; the figure is the median over ``--rounds``; ``x dtensor`` is a fourfold variant's median over
the DTensor one's with the same plan, and ``paired`` the median over rounds of the two steps' ratio in each round
(less moved by load that comes and goes). Rank 0 prints the tables and the project's targets and writes
OUT/bench.json and OUT/bench.png.

A benchmark, not a test: it prints figures and refuses nothing but bad flags and results that disagree.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from fourfold.bench.harness import (  # the harness imports torch lazily too
    GRAD_RTOL,
    add_output_flags,
    add_round_flags,
    check_rounds,
    format_bytes,
    name_list,
    paired_ratio,
    run_or_launch,
    start_rank,
    timed_rounds,
)
from fourfold.bench.tp_report import TARGET_RATIO, report, table
from fourfold.bench.workloads import GPT_SIZES, Workload, add_size_flags, gpt, gpt_config, mlp_blocks

__all__ = ["TARGET_RATIO", "VARIANTS", "main", "plan_theory"]

VARIANTS = ("single", "fourfold-mlp", "dtensor-mlp", "fourfold-full", "dtensor-full")
LOSS_RTOL = 1e-5  # float32: |loss - single's| <= 1e-5 * |single's|
SHARDS = {"none": "nothing: the whole model and batch on every rank",
          "mlp": "each MLP block: fc by columns, proj by rows",
          "full": "MLP + attention (qkv by heads, proj by rows) + embedding, tied head and loss by vocabulary"}
_SIZES = (*GPT_SIZES, ("gpt-batch", 8, "TinyGPT batch in sequences, every rank the same"),
          ("mlp-width", 2048, "MLP width W; each block is W -> 4W -> W"),
          ("mlp-blocks", 2, "MLP blocks, two Linear layers each"),
          ("mlp-batch", 64, "MLP batch in rows, every rank the same"))
Counts = dict[tuple[str, str], int]  # (phase, op) -> how many, e.g. ("forward", "all_reduce") -> 10


def plan_theory(plan: str, n_blocks: int, *, data_input: bool = False) -> tuple[list[Counts], Counts]:
    """The collectives of one step under ``plan``: (per block, per step), Megatron's counts.

    ``full`` is :func:`~fourfold.parallel.tensor.collective_theory` for TinyGPT. ``mlp`` shards one of a block's
    two column -> row halves, so a block issues half of what ``collective_theory`` counts: one all-reduce forward
    (g) and one backward (f). ``data_input``: the first block's input is the data, whose gradient autograd never
    asks for, so that block's f never all-reduces.
    """
    from fourfold.models.gpt_plan import collective_theory, collectives_per_step

    if plan == "none":
        return [{} for _ in range(n_blocks)], {}
    block = collective_theory(False)["block"]
    if plan == "full":
        return [dict(block) for _ in range(n_blocks)], collectives_per_step(n_blocks, False)
    blocks = [{key: n // 2 for key, n in block.items()} for _ in range(n_blocks)]
    if data_input and blocks:
        del blocks[0][("backward", "all_reduce")]
    step: Counts = {}
    for counts in blocks:
        for key, n in counts.items():
            step[key] = step.get(key, 0) + n
    return blocks, step


def _parser() -> argparse.ArgumentParser:
    from fourfold.run.args import make_parser

    p = make_parser("fourfold bench tp", "Time a training step of fourfold's tensor parallelism, PyTorch's "
                    "DTensor tensor parallelism and the unsharded model side by side on --nproc ranks (tp).")
    add_round_flags(p, nproc="the tp degree", rounds=20, warmup=3, checks="losses, gradients and collectives")
    p.add_argument("--models", default="gpt,mlp", help="gpt and/or mlp (default: gpt,mlp)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"among {', '.join(VARIANTS)}; single is "
                   "always run; the mlp model has only the mlp plan (default: all)")
    add_size_flags(p, _SIZES)
    p.add_argument("--lr", type=float, default=1e-3, help="SGD learning rate (default: 1e-3)")
    add_output_flags(p, "tp")
    return p


def _check(ns: argparse.Namespace) -> argparse.Namespace:
    """Turn the flags into values (``ns.models``, ``ns.variants``: names) or raise ValueError."""
    from fourfold.models.gpt_plan import check_tinygpt_tp

    ns.models = name_list(ns.models, ("gpt", "mlp"), "models", "gpt")
    ns.variants = name_list(ns.variants, VARIANTS, "variants", "single,fourfold-mlp,dtensor-mlp")
    ns.variants = ["single", *(v for v in ns.variants if v != "single")]  # the reference of the check
    check_rounds(ns, "tensor parallelism over one rank splits nothing", "the variants")
    small = {flag: getattr(ns, flag.replace("-", "_")) for flag, _, _ in _SIZES}
    if any(n < 1 for n in small.values()):
        raise ValueError(f"sizes must be >= 1, got {', '.join(f'--{f} {n}' for f, n in small.items() if n < 1)}. "
                         f"The defaults: {', '.join(f'--{f} {d}' for f, d, _ in _SIZES)}.")
    if "gpt" in ns.models:
        check_tinygpt_tp(gpt_config(ns), ns.nproc)
    if "mlp" in ns.models and 4 * ns.mlp_width % ns.nproc:
        raise ValueError(f"4*mlp-width (the hidden width) must be divisible by tp, got {4 * ns.mlp_width} and "
                         f"{ns.nproc}. Use --mlp-width {-(-ns.mlp_width // ns.nproc) * ns.nproc} or an nproc that "
                         f"divides {4 * ns.mlp_width}.")
    return ns


def main(argv: list[str] | None = None) -> int:
    """``fourfold bench tp ...``: launch the ranks (parent) or run the benchmark (a rank)."""
    return run_or_launch("tp", argv, _parser(), _check, _run)


@dataclass(eq=False)
class _Variant:
    """One variant's model copy, sharded as it shards it, with its optimizer, its step and what the check needs."""

    name: str
    plan: str                 # none | mlp | full
    model: Any                # this rank's (sharded) model: for fourfold, ``engine.model``
    run: Callable[[Any, Any], Any]  # (x, y) -> the loss, after forward and backward
    optimizer: Any
    layouts: dict[str, Any]   # parameter name -> fourfold ShardLayout of this rank's piece of single's tensor
    tracer: Any = None        # fourfold's, recording its collectives
    engine: Any = None        # fourfold's Engine
    probe: dict[str, Any] = field(default_factory=dict)


def _build(name: str, w: Workload, device_mesh: Any, ranks: Any, lr: float, timeout_s: float) -> _Variant:
    """``name``'s copy of ``w``'s model, sharded over every rank of the world (``ranks``: fourfold's tp mesh,
    ``device_mesh``: DTensor's)."""
    import torch
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    from fourfold.engine.layout import Layout
    from fourfold.engine.parallelize import parallelize
    from fourfold.models.gpt import MLP
    from fourfold.observe.trace import Tracer
    from fourfold.parallel.tensor import ShardLayout

    framework, _, plan = name.partition("-")
    model = w.build()
    mlps = [n for n, m in model.named_modules() if isinstance(m, MLP)]
    if framework == "fourfold":  # the engine's step; "full" is TinyGPT's own plan, its loss vocabulary-parallel
        tracer = Tracer(ranks.rank)
        tp_plan = None if plan == "full" else {f"{n}.{layer}": style for n in mlps
                                                for layer, style in (("fc", "column"), ("proj", "row"))}
        engine = parallelize(model, ranks.using(tracer=tracer, timeout_s=timeout_s), Layout(tp=ranks.mesh.tp),
                             plan=tp_plan, loss_fn=w.loss)
        return _Variant(name, plan, engine.model, engine.step, torch.optim.SGD(engine.parameters(), lr=lr),
                        engine.layouts, tracer, engine)
    layouts: dict[str, Any] = {}
    context: Callable[[], Any] = contextlib.nullcontext
    if framework == "dtensor":
        fused = _dtensor_parallel(model, plan, mlps, device_mesh)
        if plan == "full":
            context = loss_parallel
        for n, param in model.named_parameters():
            place = param.placements[0] if isinstance(param, DTensor) else None
            if isinstance(place, Shard):
                layouts[n] = ShardLayout(place.dim, 3 if n in fused else 1)

    def run(x: Any, y: Any) -> Any:  # single's and DTensor's own step
        with context():
            loss = w.loss(model(x), y)
            loss.backward()
        return loss

    return _Variant(name, plan or "none", model, run, torch.optim.SGD(model.parameters(), lr=lr), layouts)


def _dtensor_parallel(model: Any, plan: str, mlps: list[str], mesh: Any) -> set[str]:
    """Shard ``model`` in place with torch's DTensor tensor parallelism; the names of the fused qkv tensors."""
    import torch
    from torch import nn
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from fourfold.models.gpt import CausalSelfAttention
    from fourfold.models.gpt_plan import _Attention
    from fourfold.parallel.tensor import ShardLayout, shard

    class LocalHeads(nn.Module):
        """TinyGPT attention on this rank's H/p heads; DTensor shards its qkv and proj."""

        forward = _Attention.forward  # fourfold's local-heads math: only the layers under it differ

        def __init__(self, attn: CausalSelfAttention, p: int) -> None:
            super().__init__()
            self.n_head, self.dropout = attn.n_head // p, attn.dropout
            self.qkv, self.proj, self.resid_drop = attn.qkv, attn.proj, attn.resid_drop

    p, fused = mesh.size(), set()
    styles: dict[str, Any] = {}
    for n in mlps:
        styles.update({f"{n}.fc": ColwiseParallel(), f"{n}.proj": RowwiseParallel()})
    if plan == "full":
        for i, block in enumerate(model.blocks):
            qkv = block.attn.qkv
            with torch.no_grad():  # rank-major rows, so that Shard(0) gives rank r whole heads of q, k and v
                for t in (qkv.weight, qkv.bias):
                    if t is not None:
                        t.copy_(torch.cat([shard(t, ShardLayout(0, 3), r, p) for r in range(p)]))
            fused |= {f"blocks.{i}.attn.qkv.weight", f"blocks.{i}.attn.qkv.bias"}
            block.attn = LocalHeads(block.attn, p)
            styles.update({f"blocks.{i}.attn.qkv": ColwiseParallel(), f"blocks.{i}.attn.proj": RowwiseParallel()})
        styles["embed.wte"] = RowwiseParallel(input_layouts=Replicate())  # token ids replicated, rows split
        styles["head.lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, mesh, styles)
    if plan == "full" and model.config.tie_weights:  # each got its own DTensor; both are Shard(0) of W (V, C)
        model.head.lm_head.weight = model.embed.wte.weight
    return fused


def _step(v: _Variant, x: Any, y: Any, it: int) -> None:
    """Round ``it``'s training step; in the first, count its collectives and keep its loss and gradients in
    v.probe."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    if it > 0:
        v.run(x, y)
    else:
        if v.engine is not None:
            v.engine.check_rows(x, y)  # its first step's one-time check, outside the step's count
        with warnings.catch_warnings(), CommDebugMode() as mode:
            warnings.simplefilter("ignore")  # CommDebugMode's full backward hooks warn that x needs no grad
            loss = v.run(x, y)
        local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
        phases = mode.comm_module_counts["Global"]  # split by autograd: collectives its engine ran are backward
        assert sum(sum(phases[ph].values()) for ph in ("forward", "backward")) == mode.get_total_counts()
        v.probe = {"loss": float(local(loss.detach())) if isinstance(loss, torch.Tensor) else float(loss),
                   "grads": {n: local(q.grad).detach().clone() for n, q in v.model.named_parameters()},
                   "counted": {(phase, _op_name(op)): k for phase in ("forward", "backward")
                               for op, k in phases[phase].items()}}
        if v.tracer is not None:
            v.tracer.enabled = False  # later steps run uninstrumented, as DTensor's do
    v.optimizer.step()
    v.optimizer.zero_grad(set_to_none=True)


def _op_name(op: Any) -> str:
    """``c10d_functional.all_reduce`` (DTensor) and ``c10d.allreduce_`` (fourfold, through c10d) -> all_reduce."""
    name = str(op).rpartition(".")[2].strip("_")
    return {"allreduce": "all_reduce", "allgather": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
            "all_gather_into_tensor": "all_gather", "_allgather_base": "all_gather"}.get(name, name)


def _traced(v: _Variant, n_blocks: int) -> tuple[list[Counts], Counts]:
    """fourfold's collectives in the probed step, per block (the block index in the layer's name) and in all."""
    blocks: list[Counts] = [{} for _ in range(n_blocks)]
    step: Counts = {}
    for s in v.tracer.spans if v.tracer is not None else []:
        if s.kind != "comm" or not s.name.startswith("tp."):
            continue  # the engine's forward and backward spans
        key = (s.args["phase"], s.name.removeprefix("tp."))
        step[key] = step.get(key, 0) + 1
        index = next((int(part) for part in s.args["site"].split(".") if part.isdigit()), None)
        if index is not None:
            blocks[index][key] = blocks[index].get(key, 0) + 1
    return blocks, step


def _checks(variants: list[_Variant], rank: int, p: int) -> list[dict[str, Any]]:
    """Every variant's step-1 loss and gradients (this rank's piece) against single's; raises on a mismatch."""
    import torch
    import torch.distributed as dist

    from fourfold.comm.wait import gather_objects
    from fourfold.parallel.tensor import REPLICATED, shard

    ref = variants[0].probe
    worst = torch.zeros(len(variants), 2, dtype=torch.float64)  # (variants, [loss, grads]): relative error
    where: list[str] = []  # per variant, this rank's worst parameter
    for i, v in enumerate(variants):
        worst[i, 0] = abs(v.probe["loss"] - ref["loss"]) / abs(ref["loss"])
        errors = {}
        for name, g in v.probe["grads"].items():
            want = shard(ref["grads"][name], v.layouts.get(name, REPLICATED), rank, p)
            errors[name] = ((g - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
        name = max(errors, key=errors.__getitem__)
        worst[i, 1] = errors[name]
        where.append(name)
    every = [torch.empty_like(worst) for _ in range(p)]
    dist.all_gather(every, worst)
    names: list[list[str]] = gather_objects(where, op="gather each rank's worst parameter per variant")
    stacked = torch.stack(every)  # (p, variants, 2)
    out = []
    for i, v in enumerate(variants):
        r = int(stacked[:, i, 1].argmax())
        out.append({"variant": v.name, "loss": v.probe["loss"], "loss_rel_diff": stacked[:, i, 0].max().item(),
                    "grad_rel_diff": stacked[r, i, 1].item(), "grad_worst_rank": r,
                    "grad_worst_param": names[r][i],
                    "ok": stacked[:, i, 0].max().item() <= LOSS_RTOL and stacked[r, i, 1].item() <= GRAD_RTOL})
    bad = [c for c in out if not c["ok"]]
    if bad:
        raise RuntimeError(f"losses and gradients must match single's on step 1 (rtol {LOSS_RTOL:g} and "
                           f"{GRAD_RTOL:g}), got " + ", ".join(f"{c['variant']}: loss {c['loss_rel_diff']:.3g}, "
                                                             f"grad {c['grad_rel_diff']:.3g}" for c in bad)
                           + ". A shard cut differently from its layout, or a missing all-reduce.")
    return out


def _memory(v: _Variant, single: _Variant) -> dict[str, Any]:
    """This rank's parameter bytes, split as sharded or replicated, and the full bytes of the sharded ones."""
    from torch.distributed.tensor import DTensor

    full = dict(single.model.named_parameters(remove_duplicate=False))  # a tied head's name too
    if v.engine is not None:  # fourfold
        held = v.engine.counters()["parameter_bytes"]
        sharded, replicated = held["sharded"], held["replicated"]
    else:
        sharded = replicated = 0
        for name, q in v.model.named_parameters():
            n = (q.to_local() if isinstance(q, DTensor) else q).nbytes
            sharded, replicated = (sharded + n, replicated) if name in v.layouts else (sharded, replicated + n)
    full_sharded = sum({id(full[n]): full[n].nbytes for n in v.layouts if v.layouts[n].dim is not None}.values())
    return {"sharded": sharded, "replicated": replicated, "total": sharded + replicated,
            "full_sharded": full_sharded, "sharded_fraction": sharded / full_sharded if full_sharded else None}


def _run(ns: argparse.Namespace) -> None:
    """One rank: every workload, every variant interleaved; rank 0 reports."""
    from torch.distributed.device_mesh import init_device_mesh

    from fourfold.comm.wait import barrier
    from fourfold.mesh import Mesh

    ctx, say, started, load_before = start_rank("[bench tp]", ns.timeout)
    p, main_rank = ctx.world_size, ctx.rank == 0
    device_mesh, ranks = init_device_mesh("cpu", (p,)), Mesh.for_world(p, tp=p).build(ns.timeout)  # torch's, ours
    say(f"tp={p}, variants {', '.join(ns.variants)}, {ns.warmup} warm-up + {ns.rounds} rounds")
    workloads = []
    for name in ns.models:
        w = gpt(ns, 0, 1) if name == "gpt" else mlp_blocks(ns)  # rank 0 of 1: the whole batch
        workloads.append(_measure(w, ns, device_mesh, ranks, say))
        if main_rank:
            print(table(workloads[-1], p), flush=True)
    if main_rank:
        report(ns, p, workloads, time.monotonic() - started, load_before)
    barrier("finish the benchmark")
    ctx.close()


def _measure(w: Workload, ns: argparse.Namespace, device_mesh: Any, ranks: Any,
             say: Callable[..., None]) -> dict[str, Any]:
    """Build every variant, run the rounds, gather the figures; the workload's result (the same on every rank)."""
    names = [v for v in ns.variants if w.name == "gpt" or not v.endswith("-full")]
    variants = [_build(v, w, device_mesh, ranks, ns.lr, ns.timeout) for v in names]
    single = variants[0]
    params = sum(q.numel() for q in single.model.parameters())
    n_blocks = ns.gpt_layers if w.name == "gpt" else ns.mlp_blocks
    say(f"{w.describe}: {params / 1e6:.2f} M parameters ({format_bytes(params * 4)} float32)")
    timed = timed_rounds([partial(_step, v) for v in variants], w.shard, ns.warmup, ns.rounds)
    checks = _checks(variants, ranks.rank, ranks.mesh.tp)
    rows = []
    for j, v in enumerate(variants):
        theory_blocks, theory_step = plan_theory(v.plan, n_blocks, data_input=w.name == "mlp")
        traced_blocks, traced_step = _traced(v, n_blocks)
        rows.append({"variant": v.name, "plan": v.plan, "shards": SHARDS[v.plan], **timed[j],
                     "memory": _memory(v, single),
                     "collectives": {"counted": _pairs(v.probe["counted"]), "theory": _pairs(theory_step),
                                     "theory_per_block": [_pairs(b) for b in theory_blocks],
                                     **({"tracer": _pairs(traced_step),
                                         "tracer_per_block": [_pairs(b) for b in traced_blocks]}
                                        if v.tracer is not None else {})}})
    for r in rows:
        twin = next((o for o in rows if o["variant"] == r["variant"].replace("fourfold", "dtensor")
                     and o is not r), None)
        r["x_dtensor"] = r["median_s"] / twin["median_s"] if twin else None
        r["x_dtensor_paired"] = paired_ratio(r["times_s"], twin["times_s"]) if twin else None
        r["x_single"] = r["median_s"] / rows[0]["median_s"]
    return {"model": w.name, "describe": w.describe, "parameters": params, "n_blocks": n_blocks, "rows": rows,
            "check": checks}


def _pairs(counts: Counts) -> list[list[Any]]:
    """``{(phase, op): n}`` as JSON: ``[[phase, op, n], ...]``, sorted."""
    return sorted([phase, op, n] for (phase, op), n in counts.items())


if __name__ == "__main__":
    sys.exit(main())
