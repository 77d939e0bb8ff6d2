"""``fourfold plan --memory``: what each rank of a layout will hold, before anything is launched.

    fourfold plan --memory --nproc 8 --dp 2 --tp 2 --pp 2 --zero 1 --batch-size 32
    fourfold plan --memory --model gpt2 --nproc 4 --zero 3 --memory-limit 2GB

Takes ``fourfold train``'s flags (the same model, data shape and layout) and prints, per pipeline rank, the
bytes of parameters, gradients, optimiser state and peak activations (:mod:`fourfold.plan.estimate`; the
formulas are in docs/memory.md), the memory available per rank and whether the layout fits; when it does not,
the largest term and the cheapest change that fits. ``fourfold train`` runs the same check before it launches
(``--no-memory-check`` skips it) and refuses a layout that would not fit; the plan runs train's checks before
launch first (:func:`fourfold.run.preflight.preflight`), so it refuses what train refuses, with train's message.

    fourfold plan --gpus 64 --gpu-mem 80GB --link 400gbit --model gpt2 --model-config xl.json --batch-size 512
    fourfold plan --nproc 8 --batch-size 16                      # this machine, its units timed here
    fourfold plan --nproc 8 --lab 4 --link 250mbit --batch-size 16   # a lab of 4 nodes x 2 ranks (docs/lab.md)

ranks every layout (dp x tp x pp, schedule, micro-batches, ZeRO stage) of the model that fits in memory by its
predicted step time (:mod:`fourfold.plan.predict`; docs/simulator.md). ``--gpus``: on paper, the model built
on the meta device (any size), each unit's time from its FLOPs at ``--gpu-flops`` x ``--mfu``, links from
``--link`` (between machines of ``--gpus-per-node``) and ``--node-link`` (within one). ``--nproc``: this
machine, the units timed here and the links from the fitted cost model (``fourfold bench allreduce``);
with ``--lab N``, as ``fourfold lab run --nodes N --link RATE`` would run it: --nproc / N ranks per node over
this machine's own links, the nodes joined by the lab's (its fitted model if ``fourfold lab run ... -- fourfold
bench allreduce`` made one, else ``--link``'s rate at this machine's latency). Only the layouts that
``fourfold train``'s checks pass are ranked; the first is printed as a command that runs as it stands, with
the model and batch flags given here.
"""

from __future__ import annotations

import os
import sys

from fourfold.cli.ranking import PAPER_FLAGS, RANKING_FLAGS, rank
from fourfold.run.candidates import train_checks
from fourfold.run.fits import check_memory, check_verify_memory, layout_memory, overflow, per_rank_budget

__all__ = ["check_memory", "layout_memory", "main"]


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # a reader gone early shows here, inside the try, not in the interpreter's exit
        return code
    except BrokenPipeError:  # `fourfold plan ... | head`: the reader has what it wanted
        # the interpreter flushes stdout again at exit: into /dev/null now, not into the closed pipe
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141  # 128 + SIGPIPE, as a process the signal stopped reports it


def _main(argv: list[str] | None = None) -> int:
    from fourfold.plan.estimate import format_estimate
    from fourfold.train import parse_args

    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(f"usage: fourfold plan [--memory | --gpus N] [train's model, batch and layout flags]\n{__doc__}\n"
              f"{PAPER_FLAGS}\nThe model and batch flags are `fourfold train --help`'s.")
        return 0
    if "--memory" not in argv:
        return rank(argv)
    mixed = [a for a in dict.fromkeys(x.split("=")[0] for x in argv) if a in RANKING_FLAGS]
    if mixed:
        print(f"fourfold plan: error: --memory prints one layout's memory on --nproc ranks here, and {mixed[0]} "
              f"belongs to ranking layouts (on paper with --gpus), got both. Drop --memory to rank the layouts, or "
              f"{', '.join(mixed)} to see one layout's memory.", file=sys.stderr)
        return 2
    argv = [a for a in argv if a != "--memory"]
    try:
        cfg = parse_args(argv)
        world = cfg.launch.world_size
        train_checks(cfg, world)  # what train refuses before launch, refused here the same: one path
        rows, options, estimate, splits = layout_memory(cfg, world)
    except ValueError as e:
        print(f"fourfold plan: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # the estimate cannot read this model (train goes on without it): one line, not a trace
        print(f"fourfold plan: error: the memory estimate could not run this model: {type(e).__name__}: {e}. "
              "fourfold train skips its check for it (and says so); --no-memory-check skips it silently.",
              file=sys.stderr)
        return 2
    t = cfg.train
    p = cfg.parallel
    available, where = per_rank_budget(cfg, world)
    cp = f" cp={options['cp']} ({p.cp_algorithm})" if options.get("cp", 1) > 1 else ""
    layout = f"dp={options['dp']} tp={options['tp']} pp={options['pp']}{cp}" + (
        " model parallelism" if options["pp"] > 1 and p.strategy == "model" else
        f" {p.schedule} x{options['microbatches']}" if options["pp"] > 1 else
        f" grad-accum {options['microbatches']}" if options["microbatches"] > 1 else "") + (
        f" zero={options['zero']}" if options["zero"] else "") + (
        f" checkpointing={p.activation_checkpointing}" if options["checkpoint_every"] else "") + (
        " sequence-parallel" if options["sequence_parallel"] else "")
    print(f"memory per rank, {t.model} on {world} rank(s), {layout}, batch {t.batch_size} x {cfg.model.seq_len}, "
          f"{t.dtype}:")
    print(format_estimate(rows, available, where))
    over = overflow(rows, available, options, estimate, sequence_parallel=splits)
    if over is not None:
        term, size, fix = over
        print(f"  largest term: {term}, {size}; cheapest change that fits: {fix}")
        return 1
    if t.verify:
        try:
            check_verify_memory(cfg, rows, options, estimate, available, where)
        except ValueError as e:
            print(f"  but: {e}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
