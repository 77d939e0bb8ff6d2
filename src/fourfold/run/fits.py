"""Whether a run fits, before anything is launched: each rank's memory estimated for a layout
(:func:`layout_memory`, :mod:`fourfold.plan.estimate`), ``fourfold train``'s check before launch
(:func:`check_memory`: a layout that would not fit is refused, with its largest term and the cheapest change that
fits; ``--verify``'s whole-model copies counted too), and whether this machine can build a model whole at all
(:func:`too_big_here`: a model that cannot is sized on the meta device, never built and killed by the kernel).
``fourfold plan --memory`` prints the same (:mod:`fourfold.cli.plan`).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

__all__ = ["WHOLE_MODEL_TIMES", "LayoutMemory", "check_memory", "check_verify_memory", "layout_memory", "overflow",
           "per_rank_budget", "too_big_here"]


class LayoutMemory(NamedTuple):
    """One layout's estimate: its ``rows`` (one per pipeline rank), the ``options`` they were estimated with,
    ``estimate`` (options -> rows, to try changes), and whether ``--sequence-parallel`` is a change to try (the
    model as built runs it, TinyGPT or a Hugging Face family however it was named, and tp divides the sequence)."""

    rows: list[Any]
    options: dict[str, Any]
    estimate: Any
    can_split_sequence: bool


def layout_memory(cfg: Any, world_size: int) -> LayoutMemory:
    """:class:`LayoutMemory` for ``cfg`` on ``world_size`` ranks."""
    from fourfold.engine.parallelize import model_blocks
    from fourfold.models import family_of, shard_plan, split_of
    from fourfold.models.build import build_model, check_causal, check_forward
    from fourfold.models.hf import FAMILIES
    from fourfold.parallel.checkpointing import parse_policy
    from fourfold.plan.estimate import estimate_memory, probe_activations

    t = cfg.train
    p = cfg.parallel
    mesh = p.mesh(world_size)

    def probed(model: Any) -> tuple[list[Any], Any, Any]:
        split = split_of(model)
        try:
            blocks = model_blocks(model, split)
        except ValueError:
            blocks = []  # a model without a blocks list: one unit (it cannot be pipelined or checkpointed anyway)
        shards = shard_plan(model)
        return blocks, shards, probe_activations(model, blocks, cfg.model.seq_len, shards)

    # Sizes and activations, from one sample run through the model. Built for real where it fits this machine
    # whole: the activations its kernels keep, exactly, and its forward failing is a refusal before launch. A model
    # that does not fit (TinyGPT, a Hugging Face family: their parameters counted on the meta device first) is
    # probed on the meta device, as fourfold plan --gpus probes it, and refused here rather than killed by the
    # kernel as it is built (a default-sized --model llama, 6.7 B parameters). A model of your own is always built
    # for real, as each of its ranks will build it.
    too_big = too_big_here(cfg, WHOLE_MODEL_TIMES.build)
    meta = too_big[0] if too_big is not None else None
    model = meta if meta is not None else build_model(cfg, weights=False)
    try:
        blocks, shards, probe = probed(model)
    except Exception:
        if meta is None:
            check_forward(model, cfg)  # the model's own forward fails: ModelError, the run is refused
        raise  # the estimate's own failure
    if meta is None and t.model != "tinygpt" and t.model not in FAMILIES:
        check_causal(model, cfg)  # a model of yours: next-token training needs it causal

    # "microbatches": the pipeline's (model parallelism runs the whole shard as one), or without one gradient
    # accumulation's (a rank holds one at a time)
    micro = (1 if p.strategy == "model" else p.microbatches) if mesh.pp > 1 else p.grad_accum
    options = {"dp": mesh.dp, "tp": mesh.tp, "pp": mesh.pp, "cp": mesh.cp, "batch_size": t.batch_size,
               "microbatches": micro, "schedule": p.schedule, "virtual": p.virtual,
               "strategy": p.strategy, "zero": p.zero if mesh.replicas > 1 else 0,
               "checkpoint_every": parse_policy(p.activation_checkpointing), "shards": shards,
               "sequence_parallel": p.sequence_parallel, "probe": probe}

    def estimate(opts: dict[str, Any]) -> list[Any]:
        return estimate_memory(model, blocks, **opts)

    family = family_of(model)
    splits = family is not None and family.splits_sequence and mesh.tp > 1 and cfg.model.seq_len % mesh.tp == 0
    return LayoutMemory(estimate(options), options, estimate, splits)


def per_rank_budget(cfg: Any, world_size: int) -> tuple[int, str]:
    """(bytes per rank, where that came from): ``--memory-limit``, else the device's (per_rank_memory)."""
    from fourfold.plan.estimate import per_rank_memory
    from fourfold.units import parse_bytes

    t = cfg.train
    if t.memory_limit is not None:
        return parse_bytes(t.memory_limit), "--memory-limit"
    from fourfold.torchrun import LAB_ENV

    # the ranks sharing this machine's memory: its own, on real machines; all of them in a lab (one machine)
    here = cfg.launch.nproc if cfg.launch.nnodes > 1 and LAB_ENV + "NNODES" not in os.environ else world_size
    return per_rank_memory(here, "cuda" if t.device == "cuda" else "cpu")


def overflow(rows: list[Any], available: int, options: dict[str, Any], estimate: Any, *,
             sequence_parallel: bool = False) -> tuple[str, str, str] | None:
    """None when the largest rank fits; else (its largest term, that term's size, the cheapest change that
    fits; ``sequence_parallel``: the model runs it, so it is one to try)."""
    from fourfold.plan.estimate import suggest
    from fourfold.units import format_bytes

    worst = max(rows, key=lambda r: r.total)
    if worst.total <= available:
        return None
    term, size = worst.largest()
    return term, format_bytes(size), suggest(estimate, available, options, sequence_parallel=sequence_parallel)


def check_memory(cfg: Any, world_size: int) -> str:
    """Estimate every rank's memory for ``cfg``; refuse (ValueError: the largest term, the cheapest change that
    fits) a layout that would not fit. Returns the one line a run prints first."""
    from fourfold.models.build import ModelError
    from fourfold.units import format_bytes

    try:
        rows, options, estimate, splits = layout_memory(cfg, world_size)
    except ModelError:
        raise  # the model itself cannot be built or run as configured: the ranks would fail the same way
    except Exception as e:  # the estimate must never stop a run it cannot read: say so and go on
        return f"memory estimate skipped: {type(e).__name__}: {e}"
    available, where = per_rank_budget(cfg, world_size)
    worst = max(rows, key=lambda r: r.total)
    over = overflow(rows, available, options, estimate, sequence_parallel=splits)
    if over is not None:
        term, size, fix = over
        raise ValueError(
            f"this layout needs {format_bytes(worst.total)} on pipeline rank {worst.pp_rank}'s ranks, more than the "
            f"{format_bytes(available)} each rank has ({where}); the largest term is {term}, {size}. Cheapest "
            f"change that fits: {fix}. See `fourfold plan --memory` with the same flags, or --no-memory-check to "
            "try anyway.")
    if cfg.train.verify:
        check_verify_memory(cfg, rows, options, estimate, available, where)
    return (f"memory per rank (estimated, largest: pp rank {worst.pp_rank}): parameters "
            f"{format_bytes(worst.parameters)}, gradients {format_bytes(worst.gradients)}, optimiser "
            f"{format_bytes(worst.optimizer)}, activations {format_bytes(worst.activations)} = "
            f"{format_bytes(worst.total)} of {format_bytes(available)} ({where})")


def check_verify_memory(cfg: Any, rows: list[Any], options: dict[str, Any], estimate: Any, available: int,
                         where: str) -> None:
    """``--verify K`` gathers the whole model onto rank 0's host memory after each of the first K steps, during the
    run, then trains the whole model on the whole global batch in one process on the CPU, keeping its own K + 1
    states to compare: refuse, before launch, either that would not fit (rank 0 killed mid-run loses the run)."""
    from fourfold.launch import resolve_device
    from fourfold.plan.estimate import per_rank_memory
    from fourfold.units import format_bytes

    t = cfg.train
    k = t.verify
    one = estimate({**options, "dp": 1, "tp": 1, "pp": 1, "microbatches": 1, "zero": 0, "shards": None,
                    "sequence_parallel": False, "checkpoint_every": 0})[0]
    kept = k * one.parameters
    on_gpu = resolve_device(t.device).type == "cuda"  # then the copies go to the host, beside nothing of the run's
    if t.memory_limit is not None:  # the budget given, for every process
        (host, host_where), (machine, machine_where) = (available, where), (available, where)
    else:  # rank 0's share of this machine's memory (its GPU's on GPUs: the copies go to the host); the whole of it
        host, host_where = per_rank_memory(cfg.launch.nproc, "cpu") if on_gpu else (available, where)
        machine, machine_where = per_rank_memory(1, "cpu")  # after the run, the one process has the machine
    during = kept + (0 if on_gpu else rows[0].total)
    fix = "Pass a smaller --verify, or verify the layout on a smaller model (the same layout, fewer layers)"
    if during > host:
        beside = "" if on_gpu else f" beside the {format_bytes(rows[0].total)} it trains with"
        raise ValueError(f"--verify {k} keeps the whole model after each of the first {k} steps on rank 0, "
                         f"{format_bytes(kept)}{beside}: {format_bytes(during)}, more than the {format_bytes(host)} "
                         f"each rank has ({host_where}). {fix}.")
    after = one.total + kept + (k + 1) * one.parameters  # the layout's K states and the re-run's own K + 1
    if after > machine:
        raise ValueError(f"--verify {k} trains the whole model on the whole global batch in one process after the "
                         f"run, {format_bytes(one.total)} (estimated), and compares {2 * k + 1} whole copies of it "
                         f"({format_bytes((2 * k + 1) * one.parameters)}): {format_bytes(after)}, more than the "
                         f"{format_bytes(machine)} available ({machine_where}). {fix}.")


class _WholeModelTimes(NamedTuple):
    build: int  # the memory estimate's probe: the parameters, one sample's activations
    train: int  # timing units: parameters, gradients and AdamW's two moments


WHOLE_MODEL_TIMES = _WholeModelTimes(build=2, train=5)
"""What building a whole model in this process takes, in multiples of its parameters' bytes (activations and
what the process already holds in the margin)."""


def too_big_here(cfg: Any, times: int) -> tuple[Any, int, int] | None:
    """``(the model on the meta device, its parameters' bytes, this machine's available bytes)`` where ``times``
    its parameters would not fit this machine's memory, else None: TinyGPT and the Hugging Face families, counted
    on meta (nothing allocated). A model of your own is built for real as it is (its factory may read values)."""
    from fourfold.models.build import meta_model
    from fourfold.plan.estimate import per_rank_memory

    meta = meta_model(cfg) if ":" not in cfg.train.model else None  # MODULE:FACTORY: yours
    if meta is None:
        return None
    held = sum(p.numel() * p.element_size() for p in meta.parameters())  # a tied weight once
    available, _ = per_rank_memory(1)
    return (meta, held, available) if times * held > available else None
