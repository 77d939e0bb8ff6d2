"""Runs written before the package took its current shape still resume and export.

``fixtures/run-before-parallel-table`` is a run of the code as it was before ``Layout`` and the ``[parallel]``
table (commit b5941be): ``fourfold train --nproc 2 --zero 1 --allreduce ring --steps 2 --checkpoint-every 1
--n-layer 1 --n-head 2 --d-model 16 --seq-len 16 --batch-size 4 --dtype float64``. Its run.json and checkpoint
manifest keep the layout's settings under [train]. Its model.pt exports; resumed here under another layout (one
process), its third step must be the third step of the same run trained here from the start on one process, to
float64's 1e-10 (its first two steps, recorded then, too).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

FIXTURE = Path(__file__).parent / "fixtures" / "run-before-parallel-table"
MODEL = ["--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16", "--batch-size", "4",
         "--dtype", "float64", "--no-progress", "--device", "cpu", "--no-trace", "--no-save"]


def _train(args: list[str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "fourfold", "train", *args], capture_output=True, text=True,
                          timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def test_a_run_from_before_the_parallel_table_resumes_exactly_and_exports(tmp_path):
    old = tmp_path / "old"
    shutil.copytree(FIXTURE, old)
    assert "zero" in json.loads((old / "run.json").read_text())["config"]["train"]  # the old shape, on purpose
    export = subprocess.run([sys.executable, "-m", "fourfold", "export", str(old), "--out", str(tmp_path / "hf")],
                            capture_output=True, text=True, timeout=120)
    assert export.returncode == 0 and (tmp_path / "hf" / "model.safetensors").is_file(), export.stderr
    _train(["--resume", str(old), "--out", str(old), "--steps", "3", "--batch-size", "4", "--no-trace",
            "--no-progress", "--device", "cpu"])
    fresh = tmp_path / "fresh"
    _train([*MODEL, "--steps", "3", "--out", str(fresh)])
    resumed, whole = _losses(old), _losses(fresh)
    assert max(abs(resumed[k] - whole[k]) for k in (1, 2, 3)) <= 1e-10, (resumed, whole)
