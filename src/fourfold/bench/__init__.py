"""``fourfold bench NAME``: fourfold beside PyTorch's own implementation, side by side in one run.

    fourfold bench allreduce --nproc 2     every all-reduce algorithm, and the cost model auto uses
    fourfold bench dp --nproc 2            a training step: fourfold DataParallel vs DDP vs no sync
    fourfold bench tp --nproc 2            a training step: fourfold tensor parallelism vs DTensor vs unsharded
    fourfold bench pp --nproc 2            a training step: fourfold GPipe and 1F1B vs torch.distributed.pipelining
    fourfold bench packing                 the same documents padded vs packed first-fit vs bfd
    fourfold bench zero --nproc 2          ZeRO-1/2/3 vs FSDP2 (fully_shard) vs DDP: step time, memory per rank
    fourfold bench predict                 the simulator's predicted step time beside the measured, per layout
    fourfold bench cp --nproc 4            one process's causal attention vs cp = 2, 4 with each algorithm

Each benchmark is one module here on the shared :mod:`fourfold.bench.harness` (the training-step ones also on
:mod:`fourfold.bench.workloads`; ``tp`` and ``pp`` keep their report beside them, ``tp_report``, ``pp_report``);
a rank runs ``python -m fourfold.bench.NAME``.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["BENCHMARKS", "main"]

BENCHMARKS = {
    "allreduce": "every all-reduce algorithm side by side, and the cost model of auto",
    "dp": "a training step: fourfold DataParallel vs DDP vs no sync",
    "tp": "a training step: fourfold tensor parallelism vs DTensor vs unsharded",
    "pp": "a training step: fourfold GPipe and 1F1B vs torch.distributed.pipelining",
    "packing": "the same documents padded vs packed (first-fit, bfd): real tokens/s against the bound",
    "zero": "a training step: fourfold ZeRO-1/2/3 vs FSDP2 vs DDP, and the memory each rank holds",
    "predict": "the simulator's predicted step time beside fourfold train's, layout by layout",
    "cp": "one process's attention vs context parallelism's (ring, all-gather, Ulysses): time, memory, bytes",
}


def main(argv: list[str] | None = None) -> int:
    """``fourfold bench NAME [FLAGS]``: hand the flags to benchmark NAME's own ``main``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        rows = "\n".join(f"  {name:<10} {text}" for name, text in BENCHMARKS.items())
        print(f"usage: fourfold bench NAME [--nproc G] [FLAGS]\n\nbenchmarks:\n{rows}\n\n"
              "Run `fourfold bench NAME --help` for its flags.")
        return 0
    if argv[0] not in BENCHMARKS:
        print(f"fourfold bench: unknown benchmark {argv[0]!r}. Benchmarks: {', '.join(BENCHMARKS)}.",
              file=sys.stderr)
        return 2
    return int(importlib.import_module(f"fourfold.bench.{argv[0]}").main(argv[1:]) or 0)
