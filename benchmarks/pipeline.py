"""Pipeline benchmark: the same code as ``fourfold bench pp``, runnable as a script.

    python benchmarks/pipeline.py --nproc 2                           # TinyGPT (3.3 M, untied), m = 8, ~2 minutes
    python benchmarks/pipeline.py --variants fourfold-1f1b,torch-1f1b --rounds 40

A training step of fourfold's pipeline runtime against PyTorch's ``torch.distributed.pipelining``
(``ScheduleGPipe``, ``Schedule1F1B``) on the same stages, side by side; checks that step 1 agrees, prints the
step times, the bubble (measured, simulated, textbook) and the activation memory, and the project's targets;
writes runs/bench-pp/bench.json, bench.png and a measured timeline per schedule. See docs/pipeline-schedules.md
for the figures measured.
"""

from __future__ import annotations

import shlex
import sys

from fourfold.bench.pp import main

if __name__ == "__main__":
    sys.exit(main([*sys.argv[1:], f"--command={shlex.join(['python', *sys.argv])}"]))
