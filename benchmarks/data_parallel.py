"""Data-parallel benchmark: the same code as ``fourfold bench dp``, runnable as a script.

    python benchmarks/data_parallel.py --nproc 2                      # TinyGPT and a big MLP, ~1 minute
    python benchmarks/data_parallel.py --models gpt --variants none,ddp,native,ring,native@4,ring@4

A training step of fourfold's DataParallel (native and ring all-reduce) against PyTorch's
DistributedDataParallel and against no gradient sync, side by side; prints the table and the project's
targets, writes runs/bench-dp/bench.json and bench.png. See docs/data-parallel.md for the figures measured.
"""

from __future__ import annotations

import shlex
import sys

from fourfold.bench.dp import main

if __name__ == "__main__":
    sys.exit(main([*sys.argv[1:], f"--command={shlex.join(['python', *sys.argv])}"]))
