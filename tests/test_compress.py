"""Gradient compression (``fourfold.comm.compress``, ``--compress``): int8 with error feedback and PowerSGD.

Compression is lossy, so these tests check what it promises instead of equality with one process:

* every rank ends with bitwise the same gradient (replicas never drift);
* the counted bytes equal the formula (int8: 2(G-1) packed segments; PowerSGD: the ring's cost of (n + m) r
  elements per matrix), >= 3x fewer than a float32 ring;
* error feedback loses nothing: reducing the same gradients K times, the mean of the results approaches the
  exact sum as 1/K; PowerSGD is exact when the summed gradient has rank <= r, and exact during its warm-up;
* TinyGPT trained 300 steps on dp=2 with each compression ends no worse than 1 % above the uncompressed run's
  loss (the mean of the last 50 steps; two uncompressed runs that differ only in rounding already differ by
  about 1 %, so the test bounds the harm, not the noise).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from fourfold import Layout, Mesh, parallelize
from fourfold.comm import Communicator, ring
from fourfold.comm.compress import BLOCK, Int8, PowerSGD, _dequantize, _layout, _quantize, make_compressor
from fourfold.models import GPTConfig, TinyGPT
from fourfold.testing import run_ranks
from helpers import train_corpus


def test_int8_quantization_rounds_to_nearest_within_half_a_step_per_block():
    x = torch.randn(1000, dtype=torch.float64) * torch.logspace(-3, 1, 1000, dtype=torch.float64)
    segs, size = _layout(1000, 1)
    out = torch.empty(size, dtype=torch.int8)
    back = _quantize(x, out)
    assert torch.equal(back, _dequantize(out, 1000, torch.float64))  # what the receiver reads is what is kept
    for start in range(0, 1000, BLOCK):  # each block: error <= half its own step (max |x| / 127 / 2)
        block = slice(start, start + BLOCK)
        step = x[block].abs().max() / 127
        assert (back[block] - x[block]).abs().max() <= step / 2 * (1 + 1e-6)
    assert size == 1024 + 4 * 4 and segs == [(0, 1000)]
    zeros = _quantize(torch.zeros(5), torch.empty(BLOCK + 4, dtype=torch.int8))
    assert torch.equal(zeros, torch.zeros(5))


def test_int8_layout_covers_the_tensor_in_equal_packed_segments():
    for numel in (1, 5, 255, 256, 257, 1000, 10**5 + 3):
        for g in (1, 2, 3, 4, 7):
            segs, size = _layout(numel, g)
            assert sum(n for _, n in segs) == numel and segs[0][0] == 0
            assert all(o + n == segs[j + 1][0] or segs[j + 1][1] == 0 for j, (o, n) in enumerate(segs[:-1]))
            span = size * BLOCK // (BLOCK + 4)
            assert span % BLOCK == 0 and all(n <= span for _, n in segs)
            assert span < -(-numel // g) + BLOCK  # padding: less than one block per segment


def _reduce(ctx) -> dict:
    """int8 and PowerSGD on real ranks: results, digests, counted bytes."""
    g, me = dist.get_world_size(), ctx.rank
    out: dict = {"int8": [], "feedback": None, "power": {}}
    for numel in (1, 7, 300, 5000):
        gen = torch.Generator().manual_seed(100 * me + numel)
        x = torch.randn(numel, generator=gen, dtype=torch.float64)
        exact = x.clone()
        dist.all_reduce(exact)
        comm = Communicator(timeout_s=30)
        got = x.clone()
        Int8().reduce(comm, 0, got, [(0, got.shape)], "ring")
        everyone = [torch.empty_like(got) for _ in range(g)]
        dist.all_gather(everyone, got)
        out["int8"].append({"numel": numel, "error": float((got - exact).abs().max()),
                            "bound": float(g * exact.abs().max() / 127),  # G quantizations, half a step each
                            "same": all(torch.equal(e, everyone[0]) for e in everyone),
                            "sent": comm.stats.sent_bytes, "messages": comm.stats.sent_messages})
    # Error feedback: the same gradient reduced K times; the mean of what arrived approaches the exact sum.
    x = torch.randn(2000, generator=torch.Generator().manual_seed(me), dtype=torch.float64)
    exact = x.clone()
    dist.all_reduce(exact)
    comp, comm, acc, errors = Int8(), Communicator(timeout_s=30), torch.zeros_like(x), {}
    for k in range(1, 65):
        got = x.clone()
        comp.reduce(comm, 0, got, [(0, got.shape)], "ring")
        acc += got
        if k in (1, 4, 16, 64):
            errors[k] = float((acc / k - exact).abs().max())
    out["feedback"] = errors
    # PowerSGD: a bucket of two matrices and a vector, the matrices' sum over ranks of rank <= 2.
    shapes = [(0, torch.Size([24, 40])), (960, torch.Size([40])), (1000, torch.Size([32, 16]))]
    gen = torch.Generator().manual_seed(7 + me)
    flat = torch.cat([torch.outer(torch.randn(24, generator=gen, dtype=torch.float64),
                                  torch.randn(40, generator=gen, dtype=torch.float64)).view(-1),
                      torch.randn(40, generator=gen, dtype=torch.float64),
                      torch.outer(torch.randn(32, generator=gen, dtype=torch.float64),
                                  torch.randn(16, generator=gen, dtype=torch.float64)).view(-1)])
    exact = flat.clone()
    dist.all_reduce(exact)
    comp, comm = PowerSGD(rank=2, warmup=1), Communicator(timeout_s=30)
    for call in (1, 2, 3):
        before = comm.stats.sent_bytes
        got = flat.clone()
        comp.reduce(comm, 0, got, shapes, "ring")
        everyone = [torch.empty_like(got) for _ in range(g)]
        dist.all_gather(everyone, got)
        out["power"][call] = {"error": float((got - exact).abs().max()), "sent": comm.stats.sent_bytes - before,
                              "same": all(torch.equal(e, everyone[0]) for e in everyone)}
    out["power_elements"] = comp.theory(shapes, flat.numel())
    return out


@functools.cache
def _reduced(g: int) -> list[dict]:
    return run_ranks(_reduce, g, timeout_s=120)


@pytest.mark.parametrize("g", [2, 3])
def test_int8_sums_within_its_rounding_bitwise_alike_with_the_counted_bytes(g):
    for rank, result in enumerate(_reduced(g)):
        for row in result["int8"]:
            label = f"G={g} n={row['numel']} rank {rank}"
            assert row["same"], f"{label}: ranks differ"
            assert row["error"] <= row["bound"], f"{label}: error {row['error']:.3g} > {row['bound']:.3g}"
            assert (row["sent"], row["messages"]) == Int8.theory(row["numel"], g), label
            fp32_ring = ring.theory(row["numel"], g, rank, 4)[0]
            if row["numel"] >= 300 * g:  # past the per-block scales' and padding's fixed cost
                assert fp32_ring >= 3 * row["sent"], f"{label}: {row['sent']} B vs the float32 ring's {fp32_ring}"


@pytest.mark.parametrize("g", [2, 3])
def test_int8_error_feedback_loses_nothing_over_steps(g):
    errors = _reduced(g)[0]["feedback"]
    assert errors[1] > 0  # one reduction is lossy...
    assert errors[64] <= errors[1] / 16, errors  # ...the running mean converges (about 1/K)
    assert errors[16] < errors[4] < errors[1], errors


@pytest.mark.parametrize("g", [2, 3])
def test_powersgd_is_exact_in_warmup_and_for_low_rank_sums_with_its_bytes(g):
    result = _reduced(g)
    power = result[0]["power"]
    assert all(r["same"] for rank in result for r in rank["power"].values())
    assert power[1]["error"] < 1e-12  # the warm-up step: an exact ring all-reduce
    for call in (2, 3):  # rank(sum of G rank-1 matrices) <= G <= r... for G = 2; for G = 3 at most 3 > r = 2
        if g <= 2:
            assert power[call]["error"] < 1e-10, power
    elements = 2 * 24 + 2 * 40 + 40 + 2 * 32 + 2 * 16  # (n + m) r per matrix, and the vector
    assert result[0]["power_elements"] == elements
    full = sum(ring.theory(1512, g, r, 8)[0] for r in range(g))  # the warm-up's exact ring, over the ranks
    assert sum(rank["power"][1]["sent"] for rank in result) == full
    # After the warm-up: two ring all-reduces (P and the vector, then Q), each 2(G-1)/G of its elements.
    p_part, q_part = 2 * 24 + 2 * 32 + 40, 2 * 40 + 2 * 16
    want = sum(ring.theory(p_part, g, r, 8)[0] + ring.theory(q_part, g, r, 8)[0] for r in range(g))
    assert sum(rank["power"][2]["sent"] for rank in result) == want
    assert 3 * want <= full


CFG = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=2, d_model=64)


def _train(ctx, steps: int) -> dict:
    out = {}
    for name in ("none", "bf16", "int8", "powersgd"):
        ranks = Mesh.for_world(2, dp=2).build(30)
        engine = parallelize(TinyGPT(CFG, seed=0), ranks, Layout(allreduce="ring", compress=name))
        losses = train_corpus(engine, steps, ctx.rank, 2)
        weights = torch.cat([p.detach().reshape(-1) for p in engine.parameters()])
        everyone = [torch.empty_like(weights) for _ in range(2)]
        dist.all_gather(everyone, weights)
        out[name] = {"end": sum(losses[-50:]) / 50, "first": losses[0], "sent": engine.dp.stats.sent_bytes,
                     "same": torch.equal(everyone[0], everyone[1])}
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tinygpt_trains_300_steps_with_each_compression_to_the_uncompressed_loss():
    runs = run_ranks(_train, 2, 300, timeout_s=550)[0]
    base = runs["none"]
    assert base["end"] < 0.6 * base["first"], base  # it learned
    for name in ("bf16", "int8", "powersgd"):
        run = runs[name]
        assert run["same"], f"{name}: the replicas' weights differ"
        assert run["end"] <= 1.01 * base["end"], f"{name} ends at {run['end']:.4f}, uncompressed {base['end']:.4f}"
    assert runs["bf16"]["sent"] * 2 == base["sent"]
    assert base["sent"] >= 3 * runs["int8"]["sent"], runs
    assert base["sent"] >= 3 * runs["powersgd"]["sent"], runs


def test_compress_refusals_name_the_fix():
    with pytest.raises(ValueError, match="compress must be one of"):
        make_compressor("int4")
    with pytest.raises(ValueError, match="rank >= 1"):
        PowerSGD(rank=0)
    with pytest.raises(ValueError, match="ZeRO"):
        Layout(compress="int8", zero=2, allreduce="ring")
    with pytest.raises(ValueError, match="Leave --reduce-dtype auto"):
        Layout(compress="int8", reduce_dtype="bfloat16")
    with pytest.raises(ValueError, match="powersgd_rank"):
        Layout(compress="powersgd", powersgd_rank=0)
    with pytest.raises(ValueError, match="ZeRO"):
        parallelize(TinyGPT(GPTConfig(vocab_size=16, seq_len=4, n_layer=1, n_head=1, d_model=8)), None,
                    Layout(compress="int8", zero=1, allreduce="ring"))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_train_compresses_a_pipelines_gradients_and_verify_judges_them(tmp_path):
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "fourfold.cli", "train", "--nproc", "4", "--dp", "2", "--pp", "2", "--steps", "3",
           "--compress", "powersgd", "--powersgd-warmup", "1", "--allreduce", "ring", "--batch-size", "8",
           "--verify", "2", "--no-memory-check", "--out", str(out)]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gradients compressed with powersgd, the reference uncompressed" in proc.stdout
    assert "verify: OK" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    dp = [r["bytes_by_axis"]["dp"] for r in rows]
    assert dp[1] < dp[0] / 3, dp  # step 1 exact (warm-up), then factors: far fewer bytes
    assert json.loads((out / "run.json").read_text())["config"]["parallel"]["compress"] == "powersgd"
