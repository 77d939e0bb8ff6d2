"""``fourfold bench dp`` end to end on two ranks with a tiny model, and its flag checks (no processes).

Reading a failure: a non-zero exit prints the ranks' output in the assertion; ``gradients must match`` there
means a fourfold variant's averaged step-1 gradients differ from DDP's (the benchmark's own sanity check).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fourfold.bench.dp import main, parse_variant


def test_parse_variant():
    assert parse_variant("ring", 25.0) == ("ring", "ring", 25.0)
    assert parse_variant("native@4", 25.0) == ("native@4", "native", 4.0)
    assert parse_variant("none", 25.0) == ("none", "none", None)
    assert parse_variant("ring+int8@4", 25.0) == ("ring+int8@4", "ring+int8", 4.0)


@pytest.mark.parametrize("argv, words", [
    (["--variants", "nccl"], "variants must be none, ddp or a fourfold algorithm"),
    (["--variants", "ring@0"], "bucket size must be a number of MB > 0"),
    (["--variants", "ddp+int8"], "the last optionally +bf16/+int8/+powersgd"),
    (["--variants", "ring+int4"], "the last optionally +bf16/+int8/+powersgd"),
    (["--variants", "ddp,ddp"], "variants must be distinct"),
    (["--models", "resnet"], "models must be distinct names among gpt, mlp"),
    (["--gpt-batch", "3"], "gpt-batch must be a positive multiple of nproc"),
    (["--nproc", "1"], "nproc must be >= 2"),
])
def test_bad_flags_are_refused_before_starting_ranks(argv, words, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert words in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_bench_dp_runs_end_to_end(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "fourfold.cli", "bench", "dp", "--nproc", "2", "--variants",
           "none,ddp,native,ring,ring@0.01,ring+int8", "--gpt-layers", "1", "--gpt-d-model", "32", "--gpt-seq-len", "16",
           "--gpt-batch", "4", "--mlp-width", "64", "--mlp-layers", "2", "--mlp-batch", "8", "--rounds", "2",
           "--warmup", "1", "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "targets:" in proc.stdout and "grad check, step 1: ring vs ddp" in proc.stdout
    result = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert result["command"].startswith("fourfold bench dp --nproc 2")
    assert [w["model"] for w in result["workloads"]] == ["gpt", "mlp"]
    for w in result["workloads"]:
        rows = {r["variant"]: r for r in w["rows"]}
        assert set(rows) == {"none", "ddp", "native", "ring", "ring@0.01", "ring+int8"}  # int8: lossy, no check
        assert all(c["ok"] and c["reference"] == "ddp" for c in w["grad_check"]) and len(w["grad_check"]) == 3
        assert rows["ddp"]["x_ddp"] == 1.0 and rows["none"]["x_none"] == 1.0
        assert rows["ring@0.01"]["buckets"] > rows["ring"]["buckets"] == 1  # 10 kB buckets split the model
        assert rows["ring"]["hidden_fraction"] is not None and rows["none"]["hidden_fraction"] is None
        assert all(len(r["times_s"]) == 2 and r["median_s"] > 0 for r in rows.values())
        columns = {"forward_s", "backward_s", "optimizer_s", "comm_s", "wait_s"}  # from every variant's spans
        assert all(columns <= set(r) and r["forward_s"] > 0 for r in rows.values())
        assert rows["ring"]["comm_s"] > 0 and rows["ring"]["wait_s"] > 0
    assert {t["target"].split(":")[0] for t in result["targets"]} == {"G=2 gpt native", "G=2 gpt ring"}
