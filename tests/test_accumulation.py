"""Gradient accumulation (``--grad-accum N``, ``Layout(grad_accum=N)``): without a pipeline, each
data-parallel shard runs as N micro-batches, gradients synchronised once.

The engine's layouts with accumulation equal one process in ``test_engine`` (dp 2 x tp 2 + sequence
parallelism) and ``test_zero`` (ZeRO-1 and ZeRO-3, with their bytes); here: the flags, the refusals before
launch, the memory estimate that counts one micro-batch, and one run through ``fourfold train`` that
``--verify`` checks against one process training on the whole batch at once.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fourfold import Layout
from fourfold.config import Config, OutputConfig, TrainConfig
from fourfold.run.preflight import preflight


def test_grad_accum_with_a_pipeline_is_refused_naming_microbatches():
    with pytest.raises(ValueError, match="Pass --microbatches 8 instead of --grad-accum"):
        Layout(pp=2, grad_accum=2, microbatches=4)
    with pytest.raises(ValueError, match="grad_accum must be an integer >= 1"):
        Layout(grad_accum=0)


def test_a_shard_that_does_not_cut_into_the_micro_batches_is_refused_before_launch(tmp_path):
    cfg = Config(train=TrainConfig(batch_size=6), output=OutputConfig(out=str(tmp_path / "run")),
                 parallel=Layout(grad_accum=4))
    with pytest.raises(ValueError, match=r"3 sequences per shard .*Pass --batch-size 8 or --grad-accum 3"):
        preflight(cfg, 2)


def test_the_memory_estimate_holds_one_micro_batch_and_suggests_accumulation():
    from fourfold.models import GPTConfig, TinyGPT
    from fourfold.models import shard_plan as plan_of
    from fourfold.plan.estimate import estimate_memory, probe_activations, suggest

    model = TinyGPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32), seed=0)
    blocks = list(model.blocks)
    probe = probe_activations(model, blocks, 16, plan_of(model))
    options = {"batch_size": 16, "checkpoint_every": 1, "probe": probe, "shards": plan_of(model)}
    whole = estimate_memory(model, blocks, **options)[0]
    half = estimate_memory(model, blocks, **options, microbatches=2)[0]
    assert half.activations * 2 == whole.activations and half.parameters == whole.parameters

    def estimate(opts):
        return estimate_memory(model, blocks, **opts)

    # room for the held terms and a quarter of the activations (one rank, checkpointed already): 4 micro-batches
    room = whole.parameters + whole.gradients + whole.optimizer + whole.activations // 4
    said = suggest(estimate, room, options)
    assert said.startswith("--grad-accum 4"), said


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_accumulation_through_train_verifies_against_the_whole_batch_on_one_process(tmp_path):
    """dp=2, ZeRO-1, 2 micro-batches per shard, clipping too: --verify's one process takes the whole global
    batch in one forward, so it checks that the accumulated step is that step."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "fourfold", "train", "--nproc", "2", "--grad-accum", "2", "--zero", "1",
           "--allreduce", "ring", "--steps", "3", "--dtype", "float64", "--n-layer", "2", "--d-model", "32",
           "--n-head", "2", "--seq-len", "16", "--batch-size", "8", "--no-progress", "--device", "cpu",
           "--max-grad-norm", "0.5", "--verify", "3", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "verify: OK, every difference within tolerance" in output and "tolerance 1e-10" in output, output
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["parallel"]["grad_accum"] == 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["grad_norm"] > 0.5 for r in rows), [r["grad_norm"] for r in rows]  # clipped: verified too
    spans = [e for e in json.loads((out / "trace.json").read_text())["traceEvents"]
             if e.get("name") == "forward" and e.get("ph") == "X"]
    assert len(spans) == 3 * 2 * 2, len(spans)  # 3 steps x 2 ranks x 2 micro-batches

