"""``fourfold bench tp`` end to end on two ranks with tiny models, its theory and its flag checks (no processes).

Reading a failure: a non-zero exit prints the ranks' output in the assertion; ``losses and gradients must match
single's`` there means a tensor-parallel variant (fourfold's or DTensor's) computed a different step 1 from the
unsharded model (the benchmark's own sanity check).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fourfold.bench.tp import main, plan_theory


def test_plan_theory():
    blocks, step = plan_theory("mlp", 3)
    assert blocks == [{("forward", "all_reduce"): 1, ("backward", "all_reduce"): 1}] * 3
    assert step == {("forward", "all_reduce"): 3, ("backward", "all_reduce"): 3}
    blocks, step = plan_theory("mlp", 3, data_input=True)  # nobody asks for the data's gradient
    assert blocks[0] == {("forward", "all_reduce"): 1} and step[("backward", "all_reduce")] == 2
    blocks, step = plan_theory("full", 4)  # TinyGPT: 2L + 3 forward, 2L + 1 backward
    assert step == {("forward", "all_reduce"): 11, ("backward", "all_reduce"): 9} and len(blocks) == 4
    assert plan_theory("none", 2) == ([{}, {}], {})


@pytest.mark.parametrize("argv, words", [
    (["--variants", "fourfold-attn"], "variants must be distinct names among"),
    (["--models", "resnet"], "models must be distinct names among gpt, mlp"),
    (["--nproc", "1"], "nproc must be >= 2"),
    (["--nproc", "3"], "n_head must be divisible by tp"),
    (["--models", "mlp", "--nproc", "3"], "4*mlp-width (the hidden width) must be divisible by tp"),
    (["--warmup", "0"], "rounds and warmup must be >= 1"),
])
def test_bad_flags_are_refused_before_starting_ranks(argv, words, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert words in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_bench_tp_runs_end_to_end(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "fourfold.cli", "bench", "tp", "--nproc", "2", "--gpt-layers", "2",
           "--gpt-d-model", "32", "--gpt-heads", "2", "--gpt-seq-len", "16", "--gpt-batch", "2", "--mlp-width", "32",
           "--mlp-blocks", "2", "--mlp-batch", "4", "--rounds", "2", "--warmup", "1", "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "targets:" in proc.stdout and "check, step 1: dtensor-full" in proc.stdout
    result = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert result["command"].startswith("fourfold bench tp --nproc 2")
    assert [w["model"] for w in result["workloads"]] == ["gpt", "mlp"]
    for w in result["workloads"]:
        rows = {r["variant"]: r for r in w["rows"]}
        want = {"single", "fourfold-mlp", "dtensor-mlp"} | ({"fourfold-full", "dtensor-full"} if w["model"] == "gpt"
                                                           else set())
        assert set(rows) == want
        assert all(c["ok"] for c in w["check"]) and len(w["check"]) == len(want)
        assert all(len(r["times_s"]) == 2 and r["median_s"] > 0 for r in rows.values())
        assert rows["single"]["collectives"]["counted"] == [] and rows["single"]["x_single"] == 1.0
        for name, r in rows.items():
            c, m = r["collectives"], r["memory"]
            if name.startswith("fourfold"):  # tracer, torch's CommDebugMode and the theory agree
                assert c["tracer"] == c["counted"] == c["theory"], (w["model"], name, c)
                assert c["tracer_per_block"] == c["theory_per_block"], (w["model"], name, c)
                assert r["x_dtensor"] == r["median_s"] / rows[name.replace("fourfold", "dtensor")]["median_s"]
            if name != "single":
                assert m["sharded"] * 2 == m["full_sharded"] > 0, (w["model"], name, m)
        assert rows["dtensor-mlp"]["collectives"]["counted"] == rows["fourfold-mlp"]["collectives"]["counted"]
    assert all(t["met"] for t in result["targets"] if "step time" not in t["target"]), result["targets"]
