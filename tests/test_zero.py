"""ZeRO stages 1-3 (``Layout(zero=k)``, :mod:`fourfold.parallel.zero`) equal plain data parallelism and one
process, send exactly the bytes the theory says, and hold what the formula says.

Two spawns (module-level caches): 4 ranks (dp=4 every stage, ring and native; dp=2 x pp=2 every schedule at
stages 2 and 3; dp=2 x tp=2 with sequence parallelism at stage 3) and 2 ranks (dp=2 every stage; a checkpoint
saved under one stage and loaded under another). float64, 3 AdamW steps, TinyGPT with its tied head; the gradients clipped by their global norm before each.

Reading a failure: right losses but wrong ``embed.wte.weight`` under a pipeline points at the tied copies (summed
across stages before their reduce-scatter, as late parameters); wrong only at stage 3 without a pipeline at the
per-block gather/free hooks; wrong bytes at the padding (each bucket a multiple of G).
"""

from __future__ import annotations

import functools
import tempfile

import pytest
import torch

from fourfold import Layout, Mesh, parallelize
from fourfold.engine.sent import bytes_by_axis
from fourfold.models import GPTConfig, TinyGPT
from fourfold.observe.memory import held_bytes
from fourfold.observe.trace import Tracer
from fourfold.parallel.buckets import padded
from fourfold.parallel.shards import theory_bytes
from fourfold.parallel.zero import ShardedDataParallel
from fourfold.testing import run_ranks
from helpers import TOL64, batches, max_error, optimizer, reference_eval, reference_run, shard

CFG = GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=16)
MAX_NORM = 0.7  # every run clips its gradients' global norm as torch clips one process's (steps 1-2 clip)


def _train(ctx, dp: int, tp: int, pp: int, label: str, between: bool = False, **options) -> dict:
    tracer = Tracer(ctx.rank)
    ranks = Mesh.for_world(ctx.world_size, dp=dp, tp=tp, pp=pp).build(30, tracer)
    engine = parallelize(TinyGPT(CFG, seed=0, dtype=torch.float64), ranks,
                         Layout(dp=dp, tp=tp, pp=pp, microbatches=2, **options))
    opt = optimizer(engine.parameters())
    losses, sent, held, traced, norms = [], [], None, 0, []
    x, y = batches(CFG, steps=1, seed=99)[0]
    held_out = (shard(x, ranks.coord.dp, dp), shard(y, ranks.coord.dp, dp))
    for x, y in batches(CFG):
        before, first = engine.dp.stats.sent_bytes, len(tracer.spans)
        loss = engine.step(shard(x, ranks.coord.dp, dp), shard(y, ranks.coord.dp, dp))
        norms.append(engine.clip_grad_norm_(MAX_NORM))  # each rank's segments: weighted by the copies they have
        if between:  # evaluated between backward and the optimiser: the next forward must not see stale weights
            engine.evaluate(*held_out)
        opt.step()
        held = held_bytes(engine.parameters(), opt)
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        sent.append(engine.dp.stats.sent_bytes - before)
        traced = bytes_by_axis(tracer.spans[first:])["dp"]
    evaluated = [engine.evaluate(*held_out).item() for _ in "ab"]  # forward only, gathered for it and freed after
    dp_module = engine.dp
    assert isinstance(dp_module, ShardedDataParallel)
    return {"label": label, "losses": losses, "state": engine.state_dict(), "sent": sent, "norms": norms,
            "evaluated": evaluated,
            "traced": traced, "numels": [b.numel for b in dp_module.buckets],
            "held": held, "estimate": engine.memory_estimate(), "dp": dp, "pp": pp, "zero": options["zero"],
            "accum": options.get("grad_accum", 1),
            "counted": engine.counters()["parameter_bytes"]["total"],  # run.json's parameter_bytes_rank0
            "adds_up": (lambda b: b["before_zero3"] > b["total"] if options["zero"] == 3 else
                        b["before_zero3"] == b["total"])(engine.counters()["parameter_bytes"]),
            "algorithm": options.get("allreduce", "native") if not between else "evaluated between",
            "model_grads": [n for n, p in engine.named_parameters() if p.grad is not None]}


def _four(ctx) -> list[dict]:
    out = [_train(ctx, 4, 1, 1, f"dp4 zero{z} ring", zero=z, allreduce="ring") for z in (1, 2, 3)]
    out.append(_train(ctx, 4, 1, 1, "dp4 zero3 native", zero=3, allreduce="native"))
    out += [_train(ctx, 2, 1, 2, f"dp2 pp2 {s} zero{z}", zero=z, allreduce="ring", schedule=s)
            for z in (2, 3) for s in ("gpipe", "1f1b", "interleaved", "zb")]
    out.append(_train(ctx, 2, 2, 1, "dp2 tp2 sp zero3", zero=3, allreduce="ring", sequence_parallel=True))
    return out


def _two(ctx, root: str) -> list[dict]:
    out = [_train(ctx, 2, 1, 1, f"dp2 zero{z} ring", zero=z, allreduce="ring") for z in (1, 2, 3)]
    out.append(_train(ctx, 2, 1, 1, "dp2 zero2 native", zero=2, allreduce="native"))
    out += [_train(ctx, 2, 1, 1, f"dp2 zero{z} ring accum2", zero=z, allreduce="ring", grad_accum=2)
            for z in (1, 2, 3)]
    out += [_train(ctx, 2, 1, 1, f"dp2 zero{z} evaluated between", between=True, zero=z, allreduce="ring")
            for z in (1, 3)]  # (their bytes include the evaluation's gather: not checked)
    out.append(_resumed(ctx, root))
    return out


def _resumed(ctx, root: str) -> dict:
    """2 steps at stage 3, a checkpoint (model and the optimiser's gathered state), then the last step in a new
    engine at stage 1 from it: the same as 3 steps uninterrupted."""
    from fourfold.checkpoint.sharded import load, save

    ranks = Mesh.for_world(2, dp=2).build(30)
    steps = batches(CFG)
    losses = []
    for zero, todo in ((3, steps[:2]), (1, steps[2:])):
        # then seed 5: the checkpoint must decide the weights
        engine = parallelize(TinyGPT(CFG, seed=0 if zero == 3 else 5, dtype=torch.float64), ranks,
                             Layout(zero=zero, allreduce="ring"))
        opt = optimizer(engine.parameters())
        if zero == 1:
            load(f"{root}/step-000002", engine, opt)
        for x, y in todo:
            losses.append(engine.step(shard(x, ranks.coord.dp, 2), shard(y, ranks.coord.dp, 2)).item())
            engine.clip_grad_norm_(MAX_NORM)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if zero == 3:
            save(root, 2, engine, opt, config={})
    return {"label": "dp2 zero3 -> checkpoint -> zero1", "losses": losses, "state": engine.state_dict(),
            "sent": None, "norms": None, "evaluated": None, "zero": 1, "algorithm": "resumed", "model_grads": [], "held": None}


@functools.cache
def _spawn(name: str) -> list[list[dict]]:
    if name == "four":
        return run_ranks(_four, 4, timeout_s=240)
    with tempfile.TemporaryDirectory() as root:
        return run_ranks(_two, 2, root, timeout_s=240)


@functools.cache
def _reference() -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    norms: list[float] = []
    losses, state = reference_run(CFG, batches(CFG), max_norm=MAX_NORM, norms=norms)
    assert min(norms) < MAX_NORM < max(norms), f"norms {norms}: the test should clip some steps, not all"
    return losses, state, norms


@functools.cache
def _reference_eval() -> float:
    return reference_eval(CFG, _reference()[1], batches(CFG, steps=1, seed=99)[0])


CASES = [("four", i) for i in range(13)] + [("two", i) for i in range(10)]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("spawn,index", CASES)
def test_zero_equals_one_process_and_sends_the_theory(spawn, index):
    per_rank = _spawn(spawn)
    want_losses, want, want_norms = _reference()
    label = per_rank[0][index]["label"]
    for r, runs in enumerate(per_rank):
        got = runs[index]
        errs = [abs(a - b) for a, b in zip(got["losses"], want_losses, strict=True)]
        assert max(errs) <= TOL64, f"{label} rank {r}: losses {got['losses']} vs {want_losses}"
        if got["norms"] is not None:
            errs = [abs(a - b) for a, b in zip(got["norms"], want_norms, strict=True)]
            assert max(errs) <= TOL64, f"{label} rank {r}: gradient norms {got['norms']} vs one process's {want_norms}"
        name, err = max_error(got["state"], want)
        assert err <= TOL64, f"{label} rank {r}: worst {name}: {err:.3g}"
        if got["evaluated"] is not None:  # twice: the first evaluation left the shards as they were
            want_eval = _reference_eval()
            assert all(abs(e - want_eval) <= TOL64 for e in got["evaluated"]), (label, got["evaluated"], want_eval)
        assert got["model_grads"] == [], f"{label}: the model's parameters keep no gradient under ZeRO"
        # Bytes: exactly one reduce-scatter and one all-gather per bucket per step (two gathers at stage 3
        # without a pipeline: forward and backward), (G-1)/G of each padded bucket each.
        if got["algorithm"] == "ring":  # (the resumed run's bytes are not per step)
            # With k micro-batches of gradient accumulation stages 2-3 reduce-scatter per micro-batch (and stage 3
            # gathers per micro-batch), keeping gradients and weights sharded; stage 1 syncs once.
            gathers = 2 if got["zero"] == 3 and got["pp"] == 1 else 1
            rounds = got["accum"] if got["zero"] >= 2 else 1
            want_bytes = theory_bytes(got["numels"], 8, got["dp"], gathers) + (rounds - 1) * theory_bytes(
                got["numels"], 8, got["dp"], gathers if got["zero"] == 3 else 0)
            assert got["sent"] == [want_bytes] * 3, f"{label} rank {r}: sent {got['sent']} vs theory {want_bytes}"
            assert got["traced"] == want_bytes, f"{label}: the trace's dp bytes {got['traced']} vs {want_bytes}"
            if got["dp"] > 1 and all(n % got["dp"] == 0 for n in got["numels"]):  # no padding: 2Ψ(G-1)/G, 3Ψ
                psi = sum(got["numels"])
                passes = (1 + gathers) + (rounds - 1) * (1 + (gathers if got["zero"] == 3 else 0))
                assert want_bytes == passes * psi * (got["dp"] - 1) // got["dp"] * 8
        # Memory: what the rank holds between steps, within 5 % of the formula.
        for term in () if got["held"] is None else ("parameters", "gradients", "optimizer"):
            measured, estimate = got["held"][term], got["estimate"][term]
            assert abs(measured - estimate) <= 0.05 * estimate, \
                f"{label} rank {r}: {term} {measured} measured vs {estimate} estimated"
        if got["held"] is not None:  # what run.json records is what the rank holds (ZeRO-3: its shards)
            assert got["counted"] == got["held"]["parameters"], (label, got["counted"], got["held"])
            assert got["adds_up"], label


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_each_stage_holds_less():
    """Stage 1 shards the optimiser state, 2 also the gradients, 3 also the parameters (dp=4: a quarter)."""
    runs = _spawn("four")[1]
    by = {g["label"]: g["held"] for g in runs[:3]}
    s1, s2, s3 = by["dp4 zero1 ring"], by["dp4 zero2 ring"], by["dp4 zero3 ring"]
    assert s1["parameters"] == s2["parameters"] > 3.5 * s3["parameters"]
    assert s1["gradients"] > 3.5 * s2["gradients"] and s2["gradients"] == s3["gradients"]
    assert abs(s1["optimizer"] - s3["optimizer"]) <= 16 and s1["optimizer"] == s2["optimizer"]  # + a step
    # counter per bucket (stage 3 buckets per block)


def test_padding_and_theory():
    assert padded(10, 4) == 12 and padded(12, 4) == 12 and padded(0, 3) == 0
    # 2 buckets of 6 and 10 elements over G=4: padded to 8 + 12 = 20; one reduce-scatter and one all-gather
    # each send 3/4 of it: 2 * 15 elements of 8 bytes.
    assert theory_bytes([6, 10], 8, 4) == 2 * 15 * 8
    assert theory_bytes([6, 10], 8, 4, gathers=2) == 3 * 15 * 8


def test_zero_needs_a_reduce_scatter():
    with pytest.raises(ValueError, match="allreduce ring or native"):
        parallelize(TinyGPT(CFG, seed=0), None, Layout(zero=2, allreduce="tree"))
    with pytest.raises(ValueError, match="zero must be 0"):
        parallelize(TinyGPT(CFG, seed=0), None, Layout(zero=4))
