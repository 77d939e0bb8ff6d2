"""Which layouts of a number of devices can run a model and batch, why the others cannot, and their ranking by
predicted step time: what ``fourfold plan`` lists. Every candidate passes ``fourfold train``'s own checks before
launch (:func:`fourfold.run.preflight.preflight`), so the plan never suggests a layout train refuses.
"""

from __future__ import annotations

from typing import Any

__all__ = ["cannot_run", "divisors", "layouts", "layouts_and_why", "model_heads", "none_runs", "rank_layouts",
           "uneven_machines"]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def model_heads(model: Any) -> int | None:
    """Attention heads per block, where the model says (tensor parallelism splits them)."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    if heads is None:
        heads = next((m.n_head for m in model.modules() if isinstance(getattr(m, "n_head", None), int)),
                     None)
    return int(heads) if heads else None


def layouts(world: int, blocks: int, batch_size: int, *, heads: int | None, tensor_plan: bool,
            per_node: int, cp_sizes: tuple[int, ...] = (1,)) -> list[Any]:
    """Every layout of ``world`` ranks worth predicting: tp within a machine dividing the heads, pp up to the
    blocks, dp dividing the batch; with pp each schedule at pp, 2pp and 4pp micro-batches (interleaved: 2
    stages per rank); ZeRO 0-3 where dp x cp > 1; each cp of ``cp_sizes`` (ring, and Ulysses where the heads
    divide by tp x cp)."""
    return layouts_and_why(world, blocks, batch_size, heads=heads, tensor_plan=tensor_plan, per_node=per_node,
                           cp_sizes=cp_sizes)[0]


def layouts_and_why(world: int, blocks: int, batch_size: int, *, heads: int | None, tensor_plan: bool,
                     per_node: int, cp_sizes: tuple[int, ...] = (1,)) -> tuple[list[Any], dict[str, str]]:
    """(:func:`layouts`, {``"dpX tpY ppZ"``: why none of its layouts can run} for the dp x tp x pp (x cp) splits
    of ``world`` that make none)."""
    out: list[Any] = []
    why: dict[str, str] = {}
    for cp in cp_sizes:
        if world % cp == 0:
            made, reasons = _splits(world // cp, cp, blocks, batch_size, heads, tensor_plan, per_node)
            out += made
            why.update(reasons)
    return out, why


def _splits(world: int, cp: int, blocks: int, batch_size: int, heads: int | None, tensor_plan: bool,
            per_node: int) -> tuple[list[Any], dict[str, str]]:
    """The layouts of dp x tp x pp = ``world`` with each sequence over ``cp`` more ranks."""
    from fourfold.parallel.schedule import pipeline_schedule
    from fourfold.plan.predict import Candidate

    algorithms = ["ring"] if cp == 1 else ["ring", "ulysses"]
    out: list[Any] = []
    why: dict[str, str] = {}
    for tp in divisors(world):
        for pp in divisors(world // tp):
            dp = world // tp // pp
            split = f"dp{dp} tp{tp} pp{pp}" + (f" cp{cp}" if cp > 1 else "")
            reason = cannot_run(Candidate(dp, tp, pp, cp=cp), batch_size, blocks, tensor_plan, heads, per_node)
            if reason:
                why[split] = reason
                continue
            shapes = [("1f1b", 1, 1)] if pp == 1 else [
                (s, m, 2 if s == "interleaved" else 1) for m in (pp, 2 * pp, 4 * pp)
                for s in ("gpipe", "1f1b", "interleaved", "zb")]
            made = []
            for schedule, m, v in shapes:
                if cannot_run(Candidate(dp, tp, pp, schedule, m, v), batch_size, blocks, tensor_plan, heads, per_node):
                    continue
                if pp > 1:
                    try:
                        pipeline_schedule("pipeline", schedule, pp, m, v)
                    except ValueError:
                        continue
                made += [Candidate(dp, tp, pp, schedule, m, v, z, cp=cp, cp_algorithm=a)
                         for z in ((0, 1, 2, 3) if dp * cp > 1 else (0,)) for a in algorithms
                         if a == "ring" or heads is not None and heads % (tp * cp) == 0]
            if not made:
                why[split] = (f"a dp shard's {batch_size // dp} sequences do not divide into {pp}, {2 * pp} or "
                              f"{4 * pp} micro-batches")
            out += made
    return out, why


def rank_layouts(profile: Any, candidates: list[Any], links: Any, batch_size: int, available: int, *,
                 sequence_parallel: bool = False) -> list[Any]:
    """(prediction, fits) for every candidate, fastest first (of equal times, the smaller memory); a layout that
    does not fit after all that fit. A tensor-parallel layout that does not fit is tried again with sequence
    parallelism where the model runs it (``sequence_parallel``) and tp splits its sequences; then one without a
    pipeline with gradient accumulation (``--grad-accum k``, the fewest micro-batches that fit: one micro-batch's
    activations held at a time, the same step), as a pipeline's micro-batches are."""
    from dataclasses import replace

    from fourfold.plan.predict import predict

    ranked = []
    for layout in candidates:
        p = predict(profile, layout, links, batch_size)
        if p.peak_bytes > available and sequence_parallel and layout.tp > 1 and not layout.sequence_parallel \
                and profile.seq_len % layout.tp == 0:
            p = predict(profile, replace(layout, sequence_parallel=True), links, batch_size)
        if p.peak_bytes > available and layout.pp == 1:
            layout = p.layout
            for k in divisors(batch_size // layout.dp)[1:]:
                accumulated = predict(profile, replace(layout, grad_accum=k), links, batch_size)
                if accumulated.peak_bytes <= available:
                    p = accumulated
                    break
        ranked.append((p, p.peak_bytes <= available))
    return sorted(ranked, key=lambda pf: (not pf[1], round(pf[0].step_s, 12), pf[0].peak_bytes))


def uneven_machines(gpus: int, per_node: int) -> str:
    """The refusal of ``--gpus`` that machines of ``per_node`` GPUs cannot make up (each runs --nproc per_node)."""
    lower, fits = gpus // per_node * per_node, [d for d in divisors(gpus) if d > 1]
    return (f"--gpus {gpus} must be a multiple of --gpus-per-node {per_node} (every machine runs --nproc {per_node} "
            f"ranks), got {gpus} = {gpus // per_node} x {per_node} + {gpus % per_node}. Pass --gpus {lower} or "
            f"{lower + per_node}, or a --gpus-per-node that divides {gpus} "
            f"({', '.join(map(str, fits[:-1]))}{' or ' if len(fits) > 1 else ''}{fits[-1]}).")


def cannot_run(layout: Any, batch_size: int, blocks: int, tensor_plan: bool, heads: int | None,
                per_node: int | None = None) -> str | None:
    """Why this model and batch cannot run ``layout`` (None: they can); ``per_node``: a machine's ranks, which a
    tp group must stay within."""
    dp, tp, m = layout.dp, layout.tp, layout.microbatches
    if batch_size % (dp * m):
        return (f"batch {batch_size} does not divide by dp {dp}" if m == 1 else
                f"batch {batch_size} does not divide into dp x microbatches = {dp} x {m}")
    if tp > 1 and not tensor_plan:
        return "the model has no tensor plan"
    if tp > 1 and heads is not None and heads % tp:
        return f"its {heads} heads do not divide by tp {tp}"
    if tp > 1 and per_node is not None and tp > per_node:
        return f"tp {tp} is more than a machine's {per_node} ranks (tensor parallelism stays within one)"
    if layout.pp * layout.virtual > blocks:
        return f"{blocks} block(s) do not make {layout.pp * layout.virtual} stages"
    return None


def none_runs(cfg: Any, world: int, flag: str, devices: str, why: dict[str, str], runs_some: Any) -> str:
    """The error when no layout of ``world`` ``devices`` can run: each reason with the splits it rules out, then
    the nearest ``--batch-size`` and device counts (``flag``: --gpus or --nproc) that make one
    (``runs_some(world, cfg) -> bool``)."""
    from dataclasses import replace

    splits: dict[str, list[str]] = {}
    for split, reason in why.items():
        splits.setdefault(reason, []).append(split)
    shown = [f"{', '.join(s)}: {reason}" for reason, s in splits.items()]
    listed = "; ".join(shown[:6]) + (f"; and {len(shown) - 6} more" if len(shown) > 6 else "")
    t, fixes = cfg.train, []
    batches = sorted({-(-(t.batch_size + 1) // d) * d for d in divisors(world)})  # one per dp, the next multiple
    batch = next((b for b in batches if runs_some(world, replace(cfg, train=replace(t, batch_size=b)))), None)
    if batch is not None:
        fixes.append(f"--batch-size {batch}")
    near = [next((g for g in range(world - 1, max(world // 2, 1) - 1, -1) if runs_some(g, cfg)), None),
            next((g for g in range(world + 1, 2 * world + 1) if runs_some(g, cfg)), None)]
    if any(near):
        fixes.append(f"{flag} {' or '.join(str(g) for g in near if g)}")
    return (f"no layout of {world} {devices} can run this model and batch {t.batch_size}: {listed}."
            + (f" Pass {', or '.join(fixes)}." if fixes else ""))
