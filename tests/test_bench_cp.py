"""``fourfold bench cp`` end to end on two ranks with a tiny attention layer, and its flag checks. Reading a
failure: the bytes come from the counted sends and must equal each algorithm's theory; the saved bytes from
``observe.memory.saved_bytes`` (ring at cp = 2 keeps half of one process's: its own q, k, v, output)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fourfold.bench.cp import main


@pytest.mark.parametrize("argv, words", [
    (["--cp", "3"], "each cp must be in [2, the world size 4]"),
    (["--nproc", "2", "--cp", "2", "--seq-lens", "6"], "must divide into 2 x cp = 4 chunks"),
    (["--nproc", "2", "--cp", "2", "--heads", "3", "--kv-heads", "3"], "Ulysses splits the 3 heads"),
    (["--algorithms", "flash"], "algorithms must be distinct names among"),
])
def test_bad_flags_are_refused_before_starting_ranks(argv, words, capsys):
    if argv[:2] == ["--cp", "3"]:
        argv = ["--nproc", "2", *argv]
        words = "each cp must be in [2, the world size 2]"
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert refused.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_bench_cp_runs_end_to_end_and_sends_its_theory(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "fourfold.cli", "bench", "cp", "--nproc", "2", "--cp", "2", "--seq-lens", "32,64",
           "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--rounds", "1", "--warmup", "0",
           "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=140, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((tmp_path / "out" / "bench.json").read_text())["rows"]
    assert {r["variant"] for r in rows} == {"full", "allgather-2", "ring-2", "ulysses-2"}
    assert all(r["sent_equals_theory"] and r["sent_bytes"] > 0 for r in rows if r["variant"] != "full")
    ring = [r for r in rows if r["variant"] == "ring-2"]
    assert all(r["saved_ratio"] == pytest.approx(0.5, abs=0.02) for r in ring), ring
    assert (tmp_path / "out" / "bench.png").is_file()
