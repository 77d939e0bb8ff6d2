"""All-reduce benchmark: the same code as ``fourfold bench allreduce``, runnable as a script.

    python benchmarks/allreduce.py --nproc 2                  # every algorithm, 4 KB..64 MB, about a minute
    python benchmarks/allreduce.py --nproc 4 --sizes 4KB,64KB --algorithms ring,tree,auto,native

Prints the table, fits and saves the cost model ``auto`` uses, writes runs/bench-allreduce/bench.json and
bench.png. See docs/allreduce.md for what the columns mean and the figures measured so far.
"""

from __future__ import annotations

import shlex
import sys

from fourfold.bench.allreduce import main

if __name__ == "__main__":
    sys.exit(main(["allreduce", *sys.argv[1:], f"--command={shlex.join(['python', *sys.argv])}"]))
