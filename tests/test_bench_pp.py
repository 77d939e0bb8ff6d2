"""``fourfold bench pp`` end to end on two ranks with a tiny TinyGPT, and its flag checks (no processes).

Reading a failure: a non-zero exit prints the ranks' output in the assertion; ``losses and gradients must match``
there means fourfold's and torch's pipelines (or fourfold's two schedules) computed a different step 1 on the same
stages (the benchmark's own sanity check). A memory target missed means 1F1B held more micro-batches than p.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fourfold.bench.pp import VARIANTS, main


@pytest.mark.parametrize("argv, words", [
    (["--variants", "torch-zb"], "variants must be distinct names among"),
    (["--nproc", "1"], "nproc must be >= 2"),
    (["--gpt-batch", "12"], "gpt-batch must split into microbatches=8"),
    (["--nproc", "7", "--gpt-layers", "4"], "pp must be at most the model's blocks"),
    (["--gpt-heads", "3"], "d_model must be divisible by n_head"),
    (["--warmup", "0"], "rounds and warmup must be >= 1"),
])
def test_bad_flags_are_refused_before_starting_ranks(argv, words, capsys):
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert refused.value.code == 2 and words in capsys.readouterr().err  # argparse's usage error, no ranks


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_bench_pp_runs_end_to_end(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "fourfold.cli", "bench", "pp", "--nproc", "2", "--gpt-layers", "2",
           "--gpt-d-model", "32", "--gpt-heads", "2", "--gpt-seq-len", "16", "--gpt-batch", "8", "--microbatches",
           "4", "--rounds", "2", "--warmup", "1", "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "targets:" in proc.stdout and "check, step 1: torch-1f1b" in proc.stdout
    result = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert result["command"].startswith("fourfold bench pp --nproc 2")
    assert result["boundaries"] == [2]  # plan(): embed, blocks.0 | blocks.1, head
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == set(VARIANTS) and all(c["ok"] for c in result["check"]) and len(result["check"]) == 3
    assert all(len(r["times_s"]) == 2 and r["median_s"] > 0 for r in rows.values())
    for name in ("fourfold-gpipe", "fourfold-1f1b"):
        b = rows[name]["bubble"]
        assert b["theory"] == pytest.approx(1 / 5) and 0 <= b["measured"] < 1 and 0 <= b["simulated"] < 1
        assert rows[name]["x_torch"] == rows[name]["median_s"] / rows[name.replace("fourfold", "torch")]["median_s"]
    assert rows["fourfold-gpipe"]["memory"]["peak_in_flight_by_rank"] == [4, 4]
    assert rows["fourfold-1f1b"]["memory"]["peak_in_flight_by_rank"] == [2, 1]
    assert all(t["met"] for t in result["targets"] if "activation" in t["target"]), result["targets"]
    assert (tmp_path / "out" / "timeline-1f1b.png").exists() and (tmp_path / "out" / "bench.png").exists()
