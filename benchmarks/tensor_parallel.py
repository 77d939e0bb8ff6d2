"""Tensor-parallel benchmark: the same code as ``fourfold bench tp``, runnable as a script.

    python benchmarks/tensor_parallel.py --nproc 2                    # TinyGPT and a big MLP, ~1 minute
    python benchmarks/tensor_parallel.py --models gpt --variants single,fourfold-mlp,dtensor-mlp --rounds 40

A training step of fourfold's tensor parallelism against PyTorch's DTensor tensor parallelism
(``parallelize_module``) on the same plan, and against the unsharded model, side by side; checks that step 1
agrees, prints the table and the project's targets, writes runs/bench-tp/bench.json and bench.png. See
docs/tensor-parallel.md for the figures measured.
"""

from __future__ import annotations

import shlex
import sys

from fourfold.bench.tp import main

if __name__ == "__main__":
    sys.exit(main([*sys.argv[1:], f"--command={shlex.join(['python', *sys.argv])}"]))
