"""Dropout under a layout (fourfold.parallel.rng, fourfold.parallel.tensor.dropout): each rank draws from streams
of its own, shared over its tp group where the activations are replicated and its own inside the regions, others
on other pipeline stages and replicas; an activation-checkpointed block's recompute draws the same masks again;
a resumed run continues the streams; the caller's generator is left alone.

Which stream a draw comes from is read off ``torch.initial_seed()``, which follows the generator's state: each
stream is seeded with a seed of its own (``stream_seed``)."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from fourfold import Layout, Mesh, parallelize
from fourfold.checkpoint import load, save
from fourfold.models import GPTConfig, TinyGPT
from fourfold.parallel.rng import SHARDED, SHARED, Streams, stream_seed
from fourfold.testing import run_ranks
from helpers import batches, max_error, optimizer, shard

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=16, dropout=0.1)
SEED = 7


class _Coord:
    def __init__(self, dp: int = 0, pp: int = 0, tp: int = 0) -> None:
        self.dp, self.pp, self.tp = dp, pp, tp


# ------------------------------------------------------------------------------------------ one process


def test_streams_are_the_ranks_own_and_shared_over_tp_only():
    seeds = {c: (stream_seed(SEED, SHARED, c[0], c[1]), stream_seed(SEED, SHARDED, *c))
             for c in [(dp, pp, tp) for dp in (0, 1) for pp in (0, 1) for tp in (0, 1)]}
    shared = {c: s for c, (s, _) in seeds.items()}
    sharded = [s for _, s in seeds.values()]
    assert shared[(0, 0, 0)] == shared[(0, 0, 1)] and shared[(1, 1, 0)] == shared[(1, 1, 1)]  # over tp: equal
    assert len(set(shared.values())) == 4  # per (dp, pp)
    assert len(set(sharded)) == 8 and not set(sharded) & set(shared.values())


def test_a_step_draws_from_its_streams_and_leaves_the_callers_generator_alone():
    streams = Streams(SEED, _Coord(dp=1))
    streams.bind(torch.device("cpu"))
    torch.manual_seed(99)
    before = torch.get_rng_state()
    drawn = []
    for _ in range(2):
        with streams.stepping():
            assert torch.initial_seed() == stream_seed(SEED, SHARED, 1, 0)
            a = torch.rand(3)
            streams.into_shard()
            assert torch.initial_seed() == stream_seed(SEED, SHARDED, 1, 0, 0)
            b = torch.rand(3)
            streams.out_of_shard()
            drawn.append((a, b, torch.rand(3)))
        assert torch.equal(torch.get_rng_state(), before) and torch.initial_seed() == 99
    (a0, b0, c0), (a1, b1, c1) = drawn
    assert not torch.equal(a0, a1) and not torch.equal(b0, b1)  # the second step goes on, it does not replay
    want = torch.Generator().manual_seed(stream_seed(SEED, SHARED, 1, 0))
    assert torch.equal(torch.cat([a0, c0, a1, c1]), torch.rand(12, generator=want))  # one stream, interrupted
    with pytest.raises(RuntimeError, match="boom"), streams.stepping():  # a failing step puts everything back
        streams.into_shard()
        raise RuntimeError("boom")
    assert streams.depth == 0 and torch.equal(torch.get_rng_state(), before)


def test_a_recompute_draws_again_what_its_forward_drew():
    streams = Streams(SEED, _Coord(tp=1))
    streams.bind(torch.device("cpu"))
    with streams.stepping():
        fwd = torch.get_rng_state()  # what torch's checkpoint keeps for the recompute
        again = streams.capture()
        with again():  # the forward itself: nothing re-entered
            streams.into_shard()
            first = torch.rand(4)
            streams.out_of_shard()
        after = torch.rand(4)
        with torch.random.fork_rng(devices=[]):  # the recompute, as torch runs it
            torch.set_rng_state(fwd)
            with again():
                streams.into_shard()
                assert torch.equal(torch.rand(4), first)
                streams.out_of_shard()
        assert not torch.equal(torch.rand(4), after)  # the live streams went on, untouched by the recompute
        streams.into_shard()
        assert not torch.equal(torch.rand(4), first)  # and the sharded one from where the forward left it
        streams.out_of_shard()


def test_saved_streams_continue_and_others_start_afresh_from_the_step():
    streams = Streams(SEED, _Coord())
    streams.bind(torch.device("cpu"))
    with streams.stepping():
        torch.rand(5)
    state = streams.state_dict()
    assert state["device"] == "cpu"
    with streams.stepping():
        want = torch.rand(3)
    other = Streams(0, _Coord())
    other.bind(torch.device("cpu"))
    other.resume(state, step=2)
    with other.stepping():
        assert torch.equal(torch.rand(3), want)
    # another layout (None), a checkpoint from before the streams (None), another kind of device: afresh
    for saved in (None, {**state, "device": "cuda"}):
        other.resume(saved, step=2)
        with other.stepping():
            assert torch.initial_seed() == stream_seed(SEED, SHARED, 0, 0, "step", 2)


def test_a_contained_module_leaves_the_streams_as_it_found_them():
    """A pipeline stage ending in a column layer (a vocabulary-split head) must not leave the next stage call in
    the sharded stream; nor a forward that raises."""
    from fourfold.parallel.tensor.dropout import contain

    streams = Streams(SEED, _Coord())
    streams.bind(torch.device("cpu"))

    class EndsSharded(nn.Module):
        def forward(self, x):
            streams.into_shard()
            if x.sum() < 0:
                raise ValueError("negative")
            return x

    stage = EndsSharded()
    contain([stage], streams)
    with streams.stepping():
        stage(torch.ones(2))
        assert streams.current == SHARED and streams.depth == 1
        with pytest.raises(ValueError, match="negative"):
            stage(-torch.ones(2))
        assert streams.current == SHARED and streams.depth == 1


def test_one_process_draws_from_the_callers_generator_as_plain_pytorch():
    x, y = batches(CFG, steps=1)[0]
    torch.manual_seed(3)
    engine = parallelize(TinyGPT(CFG, seed=0, dtype=torch.float64))
    assert engine.streams is None
    got = engine.step(x, y).item()
    torch.manual_seed(3)
    model = TinyGPT(CFG, seed=0, dtype=torch.float64)
    assert got == model(x, y)[1].item()


# ------------------------------------------------------------------------------------------ on ranks

LAYOUTS = {"tp2": (1, 2, 1, {}), "tp2 sp": (1, 2, 1, {"sequence_parallel": True}), "dp2": (2, 1, 1, {}),
           "pp2": (1, 1, 2, {"schedule": "1f1b", "microbatches": 2})}


def _record(model: nn.Module, seen: list[tuple[str, int]]) -> None:
    """Which stream each dropout module (and each row layer's input: after attention's own dropout, before the
    sum) draws from, by name."""
    def hook(name):
        return lambda *a: seen.append((name, torch.initial_seed()))

    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout) or name.endswith(("attn.proj", "mlp.proj", "attn.c_proj", "mlp.c_proj")):
            module.register_forward_pre_hook(hook(name))


def _gpt2(dropout: float):
    from fourfold.models.hf import build_hf

    return build_hf("gpt2", overrides=dict(vocab_size=64, n_positions=16, n_layer=2, n_head=2, n_embd=16,
                                          resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout),
                    dtype=torch.float64)


def _run(ctx, model_name: str, dp: int, tp: int, pp: int, options: dict, checkpointing: str = "none",
         steps: int = 2, record: bool = False) -> dict:
    ranks = Mesh.for_world(ctx.world_size, dp=dp, tp=tp, pp=pp).build(30)
    model = TinyGPT(CFG, seed=0, dtype=torch.float64) if model_name == "tiny" else _gpt2(0.1)
    torch.manual_seed(1234 + ctx.rank)  # the caller's own generator, other on every rank: never drawn from
    caller = torch.get_rng_state()
    engine = parallelize(model, ranks, Layout(dp=dp, tp=tp, pp=pp, activation_checkpointing=checkpointing,
                                              **options)).manual_seed(SEED)
    seen: list[tuple[str, int]] = []
    if record:
        _record(engine.model if pp == 1 else nn.ModuleList(engine.pipeline.stages), seen)
    opt = optimizer(engine.parameters())
    losses = []
    for x, y in batches(CFG, steps=steps):
        losses.append(engine.step(shard(x, ranks.coord.dp, dp), shard(y, ranks.coord.dp, dp)).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    c = ranks.coord
    return {"losses": losses, "seen": seen, "untouched": torch.equal(torch.get_rng_state(), caller),
            "state": {k: v.clone() for k, v in engine.local_state_dict().items()},
            "replicated": [n for n, lay in engine.layouts.items() if lay.dim is None],
            "shared": stream_seed(SEED, SHARED, c.dp, c.pp), "sharded": stream_seed(SEED, SHARDED, c.dp, c.pp, c.tp)}


def _draws(ctx) -> dict:
    out = {label: _run(ctx, "tiny", *lay, record=True) for label, lay in LAYOUTS.items()}
    for sp in (False, True):  # a Hugging Face family: regions, and its own dropout modules
        out[f"gpt2 tp2{' sp' if sp else ''}"] = _run(ctx, "gpt2", 1, 2, 1, {"sequence_parallel": sp}, record=True)
    for label, (model, sp) in {"tp2": ("tiny", False), "tp2 sp": ("tiny", True), "gpt2 tp2 sp": ("gpt2", True),
                               }.items():
        out[f"{label} checkpointed"] = _run(ctx, model, 1, 2, 1, {"sequence_parallel": sp}, checkpointing="full")
    with warnings.catch_warnings(record=True) as caught:  # a plan function of yours that names no shards
        warnings.simplefilter("always")
        parallelize(TinyGPT(CFG, seed=0), Mesh.for_world(ctx.world_size, tp=2).build(30),
                    Layout(tp=2, sequence_parallel=True), plan=_plan_naming_none)
    out["unnamed"] = [str(w.message) for w in caught]
    return out


def _plan_naming_none(model, group, **kwargs):
    from fourfold.models.gpt_plan import parallelize_tinygpt
    from fourfold.parallel.rng import SEQUENCE_SHARDED

    sharded = parallelize_tinygpt(model, group, **kwargs)
    delattr(sharded, SEQUENCE_SHARDED)
    return sharded


@functools.cache
def _spawn() -> list[dict]:
    pytest.importorskip("transformers")
    return run_ranks(_draws, 2, timeout_s=200)


def _streams_at(result: dict, site: str) -> set[str]:
    names = {result["shared"]: "shared", result["sharded"]: "sharded"}
    return {names.get(seed, f"other {seed}") for name, seed in result["seen"] if name.endswith(site)}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("label", ["tp2", "gpt2 tp2"])
def test_tensor_parallel_masks_agree_where_replicated_and_differ_inside_the_regions(label):
    r0, r1 = _spawn()[0][label], _spawn()[1][label]
    assert r0["shared"] == r1["shared"] and r0["sharded"] != r1["sharded"]
    between = ("drop", "resid_drop", "resid_dropout", "mlp.dropout")  # after the row layer's all-reduce
    inside = ("attn.proj", "attn.c_proj", "mlp.proj", "mlp.c_proj")  # attention's dropout drew before these
    for r in (r0, r1):
        assert r["seen"] and r["untouched"]
        assert set().union(*(_streams_at(r, s) for s in between)) == {"shared"}, r["seen"]
        assert set().union(*(_streams_at(r, s) for s in inside)) == {"sharded"}, r["seen"]
    # the replicated parameters saw the same masks on both ranks: still equal, bit for bit, after 2 steps
    for name in r0["replicated"]:
        assert torch.equal(r0["state"][name], r1["state"][name]), name


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("label", ["tp2 sp", "gpt2 tp2 sp"])
def test_sequence_parallel_blocks_draw_per_rank_throughout(label):
    r0, r1 = _spawn()[0][label], _spawn()[1][label]
    for r in (r0, r1):
        blocks = [(n, s) for n, s in r["seen"] if ".h." in n or "blocks." in n]
        assert blocks and {s for _, s in blocks} == {r["sharded"]}, r["seen"]
        assert r["untouched"]
    if label == "tp2 sp":  # TinyGPT's embedding makes this rank's positions only
        assert _streams_at(r0, "embed.drop") == {"sharded"}
    else:  # GPT-2's is whole (split at the first block): the same mask on both ranks
        assert _streams_at(r0, "transformer.drop") == {"shared"}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_sequence_parallel_plan_of_yours_that_names_no_shards_is_warned_about():
    for r in _spawn():
        assert any("named no modules that run on sequence shards" in w for w in r["unnamed"]), r["unnamed"]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("label", ["dp2", "pp2"])
def test_replicas_and_stages_draw_other_streams(label):
    r0, r1 = _spawn()[0][label], _spawn()[1][label]
    assert r0["shared"] != r1["shared"]
    for r in (r0, r1):
        assert r["seen"] and {s for _, s in r["seen"]} == {r["shared"]} and r["untouched"]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("label", ["tp2", "tp2 sp", "gpt2 tp2 sp"])
def test_checkpointed_blocks_draw_the_same_masks_again_under_tensor_parallelism(label):
    for rank in (0, 1):
        plain = _spawn()[rank][label]
        got = _spawn()[rank][f"{label} checkpointed"]
        assert got["losses"] == plain["losses"], label  # with dropout on: the masks are the same ones
        worst, err = max_error(got["state"], plain["state"])
        assert err == 0.0, f"{label} rank {rank}: {worst} off by {err:.3g}"


def _pipeline(ctx) -> dict:
    """tp2 x pp2 (4 ranks): the stack of streams on entering each stage call, and sequence-parallel zero-bubble
    with and without checkpointing; Hugging Face's own gradient checkpointing refused under tp."""
    ranks = Mesh.for_world(ctx.world_size, tp=2, pp=2).build(30)
    out: dict = {}
    for policy in ("none", "full"):
        engine = parallelize(TinyGPT(CFG, seed=0, dtype=torch.float64), ranks,
                             Layout(tp=2, pp=2, schedule="zb", microbatches=4, sequence_parallel=True,
                                    activation_checkpointing=policy)).manual_seed(SEED)
        depths: list[int] = []
        for stage in engine.pipeline.stages:
            stage.register_forward_pre_hook(lambda *a, d=depths, s=engine.streams: d.append(s.depth))
        opt = optimizer(engine.parameters())
        losses = []
        for x, y in batches(CFG, steps=2):
            losses.append(engine.step(x, y).item())
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[policy] = {"losses": losses, "depths": depths, "state": engine.local_state_dict()}
    # a boundary of yours between a column layer and its row layer: stage 1 starts on per-rank activations
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.5), nn.Linear(32, 16),
                        nn.Dropout(0.5), nn.Linear(16, 64))
    seen: list[tuple[str, int]] = []
    for i in (3, 5):
        mlp[i].register_forward_pre_hook(lambda *a, i=i: seen.append((str(i), torch.initial_seed())))
    x, y = batches(CFG, steps=1)[0]
    engine = parallelize(mlp, ranks, Layout(tp=2, pp=2, boundaries=(3,), microbatches=2),
                         example=x[:4]).manual_seed(SEED)
    seen.clear()  # the split's check and trace ran the model whole, before any stream
    engine.step(x, y)
    c = ranks.coord
    out["boundary"] = {"seen": seen, "shared": stream_seed(SEED, SHARED, c.dp, c.pp),
                       "sharded": stream_seed(SEED, SHARDED, c.dp, c.pp, c.tp), "pp": c.pp}
    hf = _gpt2(0.1)
    (getattr(hf, "activation_checkpointing_enable", None) or hf.gradient_checkpointing_enable)()
    try:
        parallelize(hf, Mesh.for_world(ctx.world_size, tp=2, pp=2).build(30))
    except ValueError as e:
        out["refused"] = str(e)
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_pipeline_stages_start_in_the_shared_stream_and_recompute_the_same_masks():
    pytest.importorskip("transformers")
    for rank, r in enumerate(run_ranks(_pipeline, 4, timeout_s=200)):
        for policy in ("none", "full"):  # 2 steps x 4 micro-batches x the forwards of each call (zb: no re-entry)
            assert r[policy]["depths"] and set(r[policy]["depths"]) == {1}, (rank, policy, r[policy]["depths"])
        assert r["full"]["losses"] == r["none"]["losses"]
        worst, err = max_error(r["full"]["state"], r["none"]["state"])
        assert err == 0.0, f"rank {rank}: {worst} off by {err:.3g} with checkpointing"
        refused = r["refused"]
        assert "Call model.activation_checkpointing_disable()" in refused, refused
        assert "pass activation_checkpointing='full'" in refused, refused
        b = r["boundary"]
        if b["pp"] == 1:  # the dropout before the row layer on per-rank activations, the one after it replicated
            assert set(b["seen"]) == {("3", b["sharded"]), ("5", b["shared"])}, b


def _resume(ctx, root: str) -> dict:
    ranks = Mesh.for_world(ctx.world_size, tp=2).build(30)

    def engine_and_optimizer():
        engine = parallelize(TinyGPT(CFG, seed=0, dtype=torch.float64), ranks).manual_seed(SEED)
        return engine, optimizer(engine.parameters())

    def steps(engine, opt, which):
        out = []
        for x, y in [batches(CFG, steps=3)[i] for i in which]:
            out.append(engine.step(x, y).item())
            opt.step()
            opt.zero_grad(set_to_none=True)
        return out

    engine, opt = engine_and_optimizer()
    whole = steps(engine, opt, [0, 1, 2])
    engine, opt = engine_and_optimizer()
    steps(engine, opt, [0, 1])
    where = save(Path(root), 2, engine, opt, config={})
    engine, opt = engine_and_optimizer()
    load(where, engine, opt)
    return {"whole": whole, "resumed": steps(engine, opt, [2])}


@pytest.mark.timeout(120)
def test_a_resumed_run_continues_its_dropout_streams(tmp_path):
    for r in run_ranks(_resume, 2, str(tmp_path), timeout_s=100):
        assert r["resumed"] == r["whole"][2:]  # bit for bit: the masks of step 3 are the uninterrupted run's
    # one process resumed from those ranks (another layout): torch's generator is reseeded from the seed and the
    # step, the same way every time, not left where the first steps' masks were drawn
    engine = parallelize(TinyGPT(CFG, seed=0, dtype=torch.float64), Mesh())
    draws = []
    for _ in range(2):
        torch.manual_seed(SEED)
        load(tmp_path, engine, optimizer(engine.parameters()))
        draws.append(torch.rand(4))
    torch.manual_seed(SEED)
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], torch.rand(4))
