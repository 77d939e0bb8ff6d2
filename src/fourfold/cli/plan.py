"""``fourfold plan --memory``: what each rank of a layout will hold, before anything is launched.

    fourfold plan --memory --nproc 8 --dp 2 --tp 2 --pp 2 --zero 1 --batch-size 32
    fourfold plan --memory --model gpt2 --nproc 4 --zero 3 --memory-limit 2GB

Takes ``fourfold train``'s flags (the same model, data shape and layout) and prints, per pipeline rank, the
bytes of parameters, gradients, optimiser state and peak activations (:mod:`fourfold.observe.estimate`; the
formulas are in docs/memory.md), the memory available per rank and whether the layout fits; when it does not,
the largest term and the cheapest change that fits. ``fourfold train`` runs the same check before it launches
(``--no-memory-check`` skips it) and refuses a layout that would not fit.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["check_memory", "layout_memory", "main"]


def layout_memory(cfg: Any, world_size: int) -> tuple[list[Any], dict[str, Any], Any]:
    """(rows, the estimate's options, a function of options -> rows) for ``cfg`` on ``world_size`` ranks."""
    from fourfold.engine import model_blocks
    from fourfold.mesh import Mesh
    from fourfold.models import family_of, shard_plan
    from fourfold.models.build import build_model
    from fourfold.observe.estimate import estimate_memory, probe_activations
    from fourfold.parallel.checkpointing import parse_policy

    t = cfg.train
    mesh = Mesh.for_world(world_size, dp=t.dp, tp=t.tp, pp=t.pp)
    model = build_model(cfg)
    family = family_of(model)
    split = family.split(model) if family is not None and family.split is not None else None
    try:
        blocks = model_blocks(model, split)
    except ValueError:
        blocks = []  # a model without a blocks list: one unit (it cannot be pipelined or checkpointed anyway)
    shards = shard_plan(model)
    probe = probe_activations(model, blocks, cfg.model.seq_len, shards)
    options = {"dp": mesh.dp, "tp": mesh.tp, "pp": mesh.pp, "batch_size": t.batch_size,
               "microbatches": t.microbatches if mesh.pp > 1 else 1, "schedule": t.schedule, "virtual": t.virtual,
               "strategy": t.strategy, "zero": t.zero if mesh.dp > 1 else 0,
               "checkpoint_every": parse_policy(t.activation_checkpointing), "shards": shards,
               "sequence_parallel": t.sequence_parallel, "probe": probe}

    def estimate(opts: dict[str, Any]) -> list[Any]:
        return estimate_memory(model, blocks, **opts)

    return estimate(options), options, estimate


def _available(cfg: Any, world_size: int) -> tuple[int, str]:
    """(bytes per rank, where that came from): ``--memory-limit``, else the device's (per_rank_memory)."""
    from fourfold.observe.estimate import per_rank_memory
    from fourfold.units import parse_bytes

    t = cfg.train
    if t.memory_limit is not None:
        return parse_bytes(t.memory_limit), "--memory-limit"
    return per_rank_memory(world_size, "cuda" if t.device == "cuda" else "cpu")


def _overflow(rows: list[Any], available: int, options: dict[str, Any],
              estimate: Any) -> tuple[str, str, str] | None:
    """None when the largest rank fits; else (its largest term, that term's size, the cheapest change that
    fits)."""
    from fourfold.observe.estimate import suggest
    from fourfold.units import format_bytes

    worst = max(rows, key=lambda r: r.total)
    if worst.total <= available:
        return None
    term, size = worst.largest()
    return term, format_bytes(size), suggest(estimate, available, options)


def check_memory(cfg: Any, world_size: int) -> str:
    """Estimate every rank's memory for ``cfg``; refuse (ValueError: the largest term, the cheapest change that
    fits) a layout that would not fit. Returns the one line a run prints first."""
    from fourfold.units import format_bytes

    try:
        rows, options, estimate = layout_memory(cfg, world_size)
    except Exception as e:  # the estimate must never stop a run it cannot read: say so and go on
        return f"memory estimate skipped: {type(e).__name__}: {e}"
    available, where = _available(cfg, world_size)
    worst = max(rows, key=lambda r: r.total)
    over = _overflow(rows, available, options, estimate)
    if over is not None:
        term, size, fix = over
        raise ValueError(
            f"this layout needs {format_bytes(worst.total)} on pipeline rank {worst.pp_rank}'s ranks, more than the "
            f"{format_bytes(available)} each rank has ({where}); the largest term is {term}, {size}. Cheapest "
            f"change that fits: {fix}. See `fourfold plan --memory` with the same flags, or --no-memory-check to "
            "try anyway.")
    return (f"memory per rank (estimated, largest: pp rank {worst.pp_rank}): parameters "
            f"{format_bytes(worst.parameters)}, gradients {format_bytes(worst.gradients)}, optimiser "
            f"{format_bytes(worst.optimizer)}, activations {format_bytes(worst.activations)} = "
            f"{format_bytes(worst.total)} of {format_bytes(available)} ({where})")


def main(argv: list[str] | None = None) -> int:
    from fourfold.observe.estimate import format_estimate
    from fourfold.train import parse_args

    argv = sys.argv[1:] if argv is None else list(argv)
    if "--memory" not in argv:
        print("fourfold plan: pass --memory (the only plan so far: memory per rank for train's flags). E.g. "
              "fourfold plan --memory --nproc 4 --zero 2", file=sys.stderr)
        return 2
    argv = [a for a in argv if a != "--memory"]
    try:
        cfg = parse_args(argv)
        world = cfg.launch.world_size
        rows, options, estimate = layout_memory(cfg, world)
    except ValueError as e:
        print(f"fourfold plan: error: {e}", file=sys.stderr)
        return 2
    t = cfg.train
    available, where = _available(cfg, world)
    layout = f"dp={options['dp']} tp={options['tp']} pp={options['pp']}" + (
        f" {t.schedule} x{options['microbatches']}" if options["pp"] > 1 else "") + (
        f" zero={options['zero']}" if options["zero"] else "") + (
        f" checkpointing={t.activation_checkpointing}" if options["checkpoint_every"] else "")
    print(f"memory per rank, {t.model} on {world} rank(s), {layout}, batch {t.batch_size} x {cfg.model.seq_len}, "
          f"{t.dtype}:")
    print(format_estimate(rows, available, where))
    over = _overflow(rows, available, options, estimate)
    if over is not None:
        term, size, fix = over
        print(f"  largest term: {term}, {size}; cheapest change that fits: {fix}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
