"""``fourfold bench zero`` end to end on two ranks with a tiny TinyGPT, and its flag checks. Reading a failure:
every variant trains the same batches from the same weights, so their losses must agree with FSDP2's; the
memory columns come from each variant's local tensors (a DTensor's local shard for FSDP2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fourfold.bench.zero import main, parse_variant


@pytest.mark.parametrize("argv, words", [
    (["--variants", "zero3,zero2"], "include fsdp2"),
    (["--variants", "fsdp2,zero4"], "zeroK[-ring|-native] with K 1, 2 or 3"),
    (["--nproc", "1"], "nproc must be >= 2"),
    (["--batch", "3"], "multiple of nproc"),
])
def test_bad_flags_are_refused_before_starting_ranks(argv, words, capsys):
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert refused.value.code == 2 and words in capsys.readouterr().err


def test_parse_variant():
    assert parse_variant("zero3-ring") == ("zero3-ring", 3, "ring")
    assert parse_variant("zero1") == ("zero1", 1, "native")
    assert parse_variant("fsdp2") == ("fsdp2", 0, "fsdp2")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_bench_zero_runs_end_to_end(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "fourfold.cli", "bench", "zero", "--nproc", "2", "--layers", "2", "--d-model", "32",
           "--heads", "2", "--seq-len", "16", "--batch", "4", "--rounds", "2", "--warmup", "1",
           "--variants", "fsdp2,zero3,zero3-ring,zero1,ddp", "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=140, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "out" / "bench.json").read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == {"fsdp2", "zero3", "zero3-ring", "zero1", "ddp"}
    assert result["loss_max_rel_diff"] <= 1e-4
    held = {name: r["held_bytes"] for name, r in rows.items()}
    assert held["zero3"] == held["zero3-ring"]
    assert held["zero3"]["parameters"] < held["zero1"]["parameters"] == held["ddp"]["parameters"]
    assert held["zero1"]["optimizer"] < held["ddp"]["optimizer"]
    assert abs(rows["zero3"]["held_total"] - rows["fsdp2"]["held_total"]) <= 0.05 * rows["fsdp2"]["held_total"]
    assert "zero3: step time <= 1.05x fsdp2" in proc.stdout and (tmp_path / "out" / "bench.png").is_file()
