"""The optimiser step every loop takes (:mod:`fourfold.run.optim`): the learning rate of each step, clipping by the
global gradient norm, and a non-finite norm stopping the run before the weights are touched.

The norm itself is checked against one process in every layout by ``test_engine`` and ``test_zero``; here the
flags go through ``fourfold train`` on a pipeline and ``--verify`` re-runs them on one process.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from fourfold import Layout, parallelize
from fourfold.config import Config, OptimConfig, TrainConfig
from fourfold.models import GPTConfig, TinyGPT
from fourfold.run.optim import NonFiniteLoss, lr_at, update
from helpers import batches, optimizer


def _config(steps: int = 20, **optim) -> Config:
    return Config(train=TrainConfig(steps=steps), optim=OptimConfig(**optim))


def test_the_learning_rate_warms_up_then_decays_to_min_lr_at_the_last_step():
    t = _config(steps=10, lr=1.0, warmup_steps=4, lr_decay="cosine", min_lr=0.1)
    lrs = [lr_at(t, s) for s in range(1, 11)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]  # warm-up: lr * step / warmup_steps
    assert lrs[9] == pytest.approx(0.1) and lrs[6] == pytest.approx(0.55)  # halfway through the decay: the middle
    assert all(a > b for a, b in zip(lrs[3:], lrs[4:], strict=False))  # falling from the peak
    linear = _config(steps=10, lr=1.0, warmup_steps=4, lr_decay="linear", min_lr=0.1)
    assert [lr_at(linear, s) for s in (4, 7, 10)] == pytest.approx([1.0, 0.55, 0.1])
    assert {lr_at(_config(steps=10, lr=0.5), s) for s in range(1, 11)} == {0.5}  # the default: constant
    assert lr_at(_config(steps=3, lr=1.0, warmup_steps=3, lr_decay="cosine"), 3) == 1.0  # all warm-up


@pytest.mark.parametrize("options, match", [
    ({"warmup_steps": 5, "steps": 3}, "warmup_steps must be between 0 and steps"),
    ({"warmup_steps": -1}, "warmup_steps must be between 0 and steps"),
    ({"min_lr": 0.01, "lr": 0.003}, r"min_lr must be >= 0 and below lr.*--min-lr 0.0003"),
    ({"max_grad_norm": -1.0}, "max_grad_norm must be finite and >= 0"),
    ({"max_grad_norm": math.inf}, "max_grad_norm must be finite and >= 0"),
    ({"max_grad_norm": math.nan}, "max_grad_norm must be finite and >= 0"),
])
def test_bad_schedules_and_norms_are_refused_with_the_fix(options, match):
    with pytest.raises(ValueError, match=match):
        _config(**options)


def test_min_lr_without_a_decay_is_named_unread():
    from fourfold.config import Config
    from fourfold.mesh import Mesh
    from fourfold.run.preflight import unused_flags

    got = unused_flags(Config(optim=OptimConfig(min_lr=1e-4)), Mesh())
    assert got == ["--min-lr 0.0001 (only --lr-decay linear or cosine reads it)"]


def test_a_non_finite_gradient_norm_stops_before_the_optimiser_step():
    cfg = GPTConfig(vocab_size=64, seq_len=8, n_layer=1, n_head=2, d_model=16)
    engine = parallelize(TinyGPT(cfg, seed=0, dtype=torch.float64))
    opt = optimizer(engine.parameters())
    engine.step(*batches(cfg, steps=1)[0])
    before = [p.detach().clone() for p in engine.parameters()]
    engine.parameters()[0].grad[0, 0] = math.inf  # type: ignore[index]
    with pytest.raises(NonFiniteLoss, match="step 3: the gradients' norm is inf; training stopped before"):
        update(engine, opt, _config(max_grad_norm=1.0), 3)
    assert all(torch.equal(a, p) for a, p in zip(before, engine.parameters(), strict=True))  # untouched


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_clipping_and_the_schedule_through_a_pipeline_run_verify_on_one_process(tmp_path):
    """pp=2 (TinyGPT's tied embedding has a copy on each stage) with warm-up, cosine decay and clipping: --verify
    re-runs the steps on one process, with the same clipping and learning rates, and finds the same numbers."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "fourfold", "train", "--nproc", "2", "--pp", "2", "--microbatches", "2",
           "--steps", "3", "--dtype", "float64", "--n-layer", "2", "--d-model", "32", "--n-head", "2", "--seq-len",
           "16", "--batch-size", "8", "--no-progress", "--device", "cpu", "--lr", "0.01", "--warmup-steps", "1",
           "--lr-decay", "cosine", "--min-lr", "0.001", "--max-grad-norm", "0.5", "--verify", "3", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "verify: OK, every difference within tolerance" in output and "tolerance 1e-10" in output, output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows] == pytest.approx([0.01, 0.0055, 0.001])  # warm-up 1 step, then cosine
    assert all(r["grad_norm"] > 0.5 for r in rows), [r["grad_norm"] for r in rows]  # every step clipped
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["optim"]["max_grad_norm"] == 0.5 and run["config"]["optim"]["lr_decay"] == "cosine"


def test_a_resume_names_a_changed_schedule_and_the_decays_new_end():
    from fourfold.config import Config
    from fourfold.run.resume import changed_settings

    was = _config(steps=10, lr_decay="cosine", max_grad_norm=1.0)
    manifest = {"config": was.to_dict()}
    assert changed_settings(was, manifest) == []
    now = _config(steps=20, lr_decay="cosine", max_grad_norm=0.5)
    assert changed_settings(now, manifest) == [
        "max_grad_norm 0.5 (was 1.0)", "steps 20 (was 10: the learning rate's decay now ends there)"]
    older = _config(steps=10).to_dict()  # a checkpoint of a fourfold without these settings
    for key in ("warmup_steps", "lr_decay", "min_lr", "max_grad_norm"):
        del older["optim"][key]
    assert changed_settings(_config(steps=10, max_grad_norm=1.0), {"config": older}) == [
        "max_grad_norm 1.0 (was 0.0)"]  # what it ran with then: the defaults
    constant = Config(train=TrainConfig(steps=20))  # no decay: more steps are the same run, continued
    assert changed_settings(constant, {"config": Config(train=TrainConfig(steps=10)).to_dict()}) == []
    evaluated = Config(train=TrainConfig(steps=20, eval_every=5))
    assert changed_settings(evaluated, {"config": evaluated.record()}) == []
    before = evaluated.record()
    del before["held_out"]  # a run before 2026-11-24 held out the data's end
    assert changed_settings(evaluated, {"config": before}) == [
        "held-out data spread through the data (the checkpoint's run, before 2026-11-24, held out its end: training "
        "reads other windows or documents)"]


def test_a_run_stopped_by_its_gradient_norm_says_so_in_metrics_and_exits_1(tmp_path, monkeypatch, capsys):
    from fourfold import train as train_mod

    real = train_mod.update

    def nan_at_step_2(engine, opt, t, step):
        if step == 2:
            engine.parameters()[0].grad.fill_(math.nan)
        return real(engine, opt, t, step)

    monkeypatch.setattr(train_mod, "update", nan_at_step_2)
    out = tmp_path / "run"
    argv = ["--steps", "3", "--n-layer", "1", "--d-model", "16", "--n-head", "2", "--seq-len", "8", "--batch-size",
            "4", "--no-progress", "--max-grad-norm", "1.0", "--warmup-steps", "1", "--out", str(out)]
    assert train_mod.main(argv) == 1
    err = capsys.readouterr().err
    assert "step 2: the gradients' norm is nan; training stopped before the optimiser step" in err, err
    assert "--warmup-steps" not in err.split("step 2:")[1]  # already warming up: not advised again
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and math.isfinite(rows[1]["loss"]) and "nan" in rows[1]["error"]


def test_the_schedule_function_refuses_what_it_does_not_know():
    from fourfold.run.optim import learning_rate

    assert learning_rate(3, lr=1.0, steps=10, warmup_steps=4) == 0.75
    for bad in ({"decay": "constant"}, {"warmup_steps": -1}, {"steps": 0}):
        with pytest.raises(ValueError, match="decay must be none, linear or cosine"):
            learning_rate(5, **{"lr": 1.0, "steps": 10, **bad})


def test_bf16_reduced_gradients_are_judged_as_compressed_by_verify():
    from fourfold.run.verify import judged_as

    assert judged_as(Config(parallel=Layout(reduce_dtype="bfloat16"))) == judged_as(
        Config(parallel=Layout(compress="bf16"))) == ("compressed", "bf16")
    assert judged_as(Config(parallel=Layout(reduce_dtype="float16"))) == ("compressed", "fp16")
    assert judged_as(Config(train=TrainConfig(dtype="float64"))) == ("float64", None)
    assert judged_as(Config(parallel=Layout(precision="bf16"))) == ("bf16", None)
    # Gemma's norms compute in float32 whatever the dtype: a float64 Gemma is judged by float32's rounding
    # (a dp2 run's norm weights measured 3.6e-10 off one process, 1e-10 being float64's bound)
    assert judged_as(Config(train=TrainConfig(model="gemma", dtype="float64"))) == ("float32", None)
    assert judged_as(Config(train=TrainConfig(model="llama", dtype="float64"))) == ("float64", None)
