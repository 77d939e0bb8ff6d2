"""``fourfold bench packing`` end to end on two data-parallel ranks with a tiny TinyGPT, and its flag checks.
Reading a failure: the three variants train the same documents each step, so their losses must agree; the
figures (rows, padding) come from the packer, the times from the shared harness."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fourfold.bench.packing import main


@pytest.mark.parametrize("argv, words", [
    (["--variants", "pad,pad"], "variants must be distinct names among"),
    (["--seq-len", "4"], "seq-len must be >= 8"),
    (["--short-fraction", "1.5"], "short-fraction in [0, 1]"),
    (["--rounds", "0"], "rounds must be >= 1"),
])
def test_bad_flags_are_refused_before_starting_ranks(argv, words, capsys):
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert refused.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_bench_packing_runs_end_to_end(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "fourfold.cli", "bench", "packing", "--nproc", "2", "--docs-per-step", "16",
           "--seq-len", "32", "--layers", "1", "--d-model", "16", "--rounds", "2", "--warmup", "1",
           "--variants", "pad,first-fit,bfd,bfd-dense",
           "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=140, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "out" / "bench.json").read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == {"pad", "first-fit", "bfd", "bfd-dense"}
    # rows of 32 attend through the mask either way (run by run from RUNS_FROM): the same pairs computed
    assert rows["bfd"]["score_elements"] == rows["bfd-dense"]["score_elements"] and "speedup_over_dense" in rows["bfd"]
    assert rows["bfd"]["rows"] < rows["pad"]["rows"] and rows["bfd"]["padding_fraction"] < rows["pad"]["padding_fraction"]
    assert result["bound"] == pytest.approx(1 / (1 - rows["pad"]["padding_fraction"]))
    assert result["max_loss_difference"] < 1e-4  # the same documents each step: the same losses (float32)
    assert "bound on packing's speed-up over pad" in proc.stdout and (tmp_path / "out" / "bench.png").is_file()
