"""Mixed precision (``Layout(precision="bf16")``, ``--precision bf16``): float32 master weights and optimiser
state, forward under bfloat16 autocast; gradients reduced in float32 or, by choice, bfloat16 (half the bytes).

Tolerances: bf16 keeps 8 bits of mantissa, so a layout is held to the one-process bf16 run's losses within
1e-2 (relative), and 200 steps of training to within 2 % of float32's final loss.
"""

from __future__ import annotations

import functools

import pytest
import torch

from fourfold import Layout, Mesh, parallelize
from fourfold.models import GPTConfig, TinyGPT
from fourfold.observe.trace import Tracer
from fourfold.testing import run_ranks
from helpers import batches, optimizer, shard, train_corpus

CFG = GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=16)


def _train_corpus(precision: str, steps: int = 200) -> tuple[list[float], TinyGPT]:
    cfg = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=2, d_model=64)
    engine = parallelize(TinyGPT(cfg, seed=0), None, Layout(precision=precision))
    return train_corpus(engine, steps), engine.model


@pytest.mark.timeout(300)
def test_bf16_trains_like_float32_with_float32_masters():
    full, _ = _train_corpus("full")
    mixed, model = _train_corpus("bf16")
    end_full, end_mixed = sum(full[-10:]) / 10, sum(mixed[-10:]) / 10  # the last 10 steps' mean: less noise
    assert end_full < 0.8 * full[0], f"float32 did not learn: {full[0]:.3f} -> {end_full:.3f}"
    assert abs(end_mixed - end_full) <= 0.02 * end_full, f"bf16 ends at {end_mixed:.4f}, float32 at {end_full:.4f}"
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the master weights stay float32


def test_bf16_forward_computes_in_bf16():
    engine = parallelize(TinyGPT(CFG, seed=0), None, Layout(precision="bf16"))
    seen = []
    engine.model.blocks[0].mlp.fc.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    x, y = batches(CFG, steps=1)[0]
    engine.step(x, y)
    assert seen == [torch.bfloat16]
    assert all(p.grad.dtype == torch.float32 for p in engine.parameters())


def test_bf16_refuses_a_float64_model():
    with pytest.raises(ValueError, match="float32 master weights"):
        parallelize(TinyGPT(CFG, seed=0, dtype=torch.float64), None, Layout(precision="bf16"))


def _layouts(ctx) -> list[dict]:
    out = []
    for label, options in (("dp2 ring fp32-reduce", {"allreduce": "ring"}),
                           ("dp2 ring bf16-reduce", {"allreduce": "ring", "reduce_dtype": "bfloat16"}),
                           ("dp2 zero2 ring bf16-reduce", {"allreduce": "ring", "zero": 2,
                                                           "reduce_dtype": "bfloat16"})):
        tracer = Tracer(ctx.rank)
        ranks = Mesh.for_world(2, dp=2).build(30, tracer)
        engine = parallelize(TinyGPT(CFG, seed=0), ranks, Layout(precision="bf16", **options))
        opt = optimizer(engine.parameters())
        losses, sent = [], []
        for x, y in batches(CFG):
            before = engine.dp.stats.sent_bytes
            losses.append(engine.step(shard(x, ctx.rank, 2), shard(y, ctx.rank, 2)).item())
            sent.append(engine.dp.stats.sent_bytes - before)
            opt.step()
            opt.zero_grad(set_to_none=True)
        out.append({"label": label, "losses": losses, "sent": sent,
                    "masters": sorted({str(p.dtype) for p in engine.parameters()})})
    return out


@functools.cache
def _spawned() -> list[list[dict]]:
    return run_ranks(_layouts, 2, timeout_s=180)


def _one_process() -> list[float]:
    engine = parallelize(TinyGPT(CFG, seed=0), None, Layout(precision="bf16"))
    opt = optimizer(engine.parameters())
    losses = []
    for x, y in batches(CFG):
        losses.append(engine.step(x, y).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bf16_data_parallel_equals_one_process_and_bf16_reduce_halves_the_bytes():
    want = _one_process()
    runs = _spawned()[0]
    for got in runs:
        for a, b in zip(got["losses"], want, strict=True):
            assert abs(a - b) <= 1e-2 * abs(b), f"{got['label']}: {got['losses']} vs one process {want}"
        assert got["masters"] == ["torch.float32"], got
    fp32, bf16 = runs[0]["sent"], runs[1]["sent"]
    assert [b * 2 for b in bf16] == fp32, f"bf16 reduce sent {bf16}, float32 {fp32}"
