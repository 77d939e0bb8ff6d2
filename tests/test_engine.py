"""``fourfold.parallelize``: every layout, through the one engine, equals one process on the same global batch.

Spawns are the expensive part, so each runs several layouts (module-level caches):

Every layout clips its gradients' global norm (``engine.clip_grad_norm_``) before each AdamW step, and its
norms must equal torch's ``clip_grad_norm_`` on one process: a wrong count of tp-replicated parameters, tied
copies or ZeRO segments shows up there first.

* ``three_d`` (8 ranks, dp=2 x tp=2 x pp=2): gpipe, 1f1b, interleaved (v=2) and zb, float64, 3 AdamW steps;
  1f1b with fourfold's ring all-reduce and sequence parallelism too.
* ``four`` (4 ranks): tp=2 x pp=2 with and without sequence parallelism; dp=2 x pp=2 with the ring all-reduce
  (1f1b and zb); dp=2 x tp=2 + sequence parallelism, also with 2 micro-batches of gradient accumulation.

Targets are padded (-100, nothing to predict) unequally: the replicas keep different counts, and in the first
step a replica's first pipeline micro-batch keeps none. One process's loss is the mean over the kept targets of
the whole batch; each layout must give it, not a mean of the replicas' and micro-batches' means.

Reading a failure: labels are ``dp x tp x pp schedule``. Right losses but wrong weights only in
``embed.wte.weight`` / ``head.lm_head.weight`` point at the tied copies (summed across stages after the dp
buckets); wrong weights only with dp > 1 under a pipeline point at the gated buckets (a stage's gradients
released before its last backward); only with sequence_parallel at the partial-gradient sum over tp.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from fourfold import Layout, Mesh, Split, parallelize
from fourfold.engine.sent import bytes_by_axis
from fourfold.mesh import RankMesh
from fourfold.models import GPTConfig, TinyGPT
from fourfold.observe.trace import Span, Tracer
from fourfold.testing import run_ranks
from helpers import TOL64, batches, max_error, one_process, optimizer, reference_eval, reference_run, shard

CFG = GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=16)  # 4 blocks, tied head
MICRO = 2


def _padded(steps: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batches with their rows' ends padded (-100) by a different length each; step 0's rows 0 and 1 (dp
    rank 0's first micro-batch) are all padding."""
    out = []
    for i, (x, y) in enumerate(steps):
        y = y.clone()
        for r in range(y.size(0)):
            y[r, (3 * r + i) % y.size(1) + 1:] = -100
        if i == 0:
            y[:2] = -100
        out.append((x, y))
    return out


STEPS = _padded(batches(CFG))
EVAL_BATCH = _padded(batches(CFG, steps=1, seed=99))[0]  # every layout evaluates its final weights on it
PARTIAL = (5, 1)  # the held-out batch's last 5 rows (replicas 3 and 2) and last 1 (a replica has none), padded
MAX_NORM = 0.7  # every layout clips its gradients by their global norm, as torch clips one process's


def _train_layout(ctx, dp: int, tp: int, pp: int, label: str, **options) -> dict:
    """One layout for 3 steps; rank 0 returns its losses, the gathered state, and the last step's bytes."""
    mesh = Mesh.for_world(ctx.world_size, dp=dp, tp=tp, pp=pp)
    tracer = Tracer(ctx.rank)
    ranks = mesh.build(30, tracer)
    engine = parallelize(TinyGPT(CFG, seed=0, dtype=torch.float64), ranks,
                         Layout(dp=dp, tp=tp, pp=pp, microbatches=MICRO, **options))
    opt = optimizer(engine.parameters())
    losses = []
    norms = []
    for x, y in STEPS:
        first = len(tracer.spans)
        loss = engine.step(shard(x, ranks.coord.dp, dp), shard(y, ranks.coord.dp, dp))
        norms.append(engine.clip_grad_norm_(MAX_NORM))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    x, y = EVAL_BATCH
    evaluated = engine.evaluate(shard(x, ranks.coord.dp, dp), shard(y, ranks.coord.dp, dp)).item()
    partial = [engine.evaluate(*(t[-n:].tensor_split(dp)[ranks.coord.dp] for t in EVAL_BATCH)).item()
               for n in PARTIAL]  # a validation set's last batches: rows the micro-batches do not divide
    state = engine.state_dict()
    groups = {axis: ranks.group(axis) is not None for axis in ("dp", "tp", "pp")}
    return {"label": label, "losses": losses, "state": state if ctx.rank == 0 else None, "groups": groups,
            "bytes": bytes_by_axis(tracer.spans[first:]), "norms": norms,
            "forwards": sum(s.name == "forward" for s in tracer.spans[first:]), "evaluated": evaluated,
            "partial": partial}


def _three_d(ctx) -> list[dict]:
    out = [_train_layout(ctx, 2, 2, 2, f"2x2x2 {s}", schedule=s) for s in ("gpipe", "1f1b", "interleaved", "zb")]
    out.append(_train_layout(ctx, 2, 2, 2, "2x2x2 1f1b ring sp", schedule="1f1b", allreduce="ring",
                             sequence_parallel=True))
    out.append(_train_layout(ctx, 2, 2, 2, "2x2x2 zb ring sp zero3", schedule="zb", allreduce="ring",
                             sequence_parallel=True, zero=3))  # ZeRO-3 inside 3D: tied and partial sums first
    return out


def _four(ctx) -> list[dict]:
    return [_train_layout(ctx, 1, 2, 2, "1x2x2 1f1b", schedule="1f1b"),
            _train_layout(ctx, 1, 2, 2, "1x2x2 1f1b sp", schedule="1f1b", sequence_parallel=True),
            _train_layout(ctx, 2, 1, 2, "2x1x2 1f1b ring", schedule="1f1b", allreduce="ring"),
            _train_layout(ctx, 2, 1, 2, "2x1x2 zb ring", schedule="zb", allreduce="ring"),
            _train_layout(ctx, 2, 2, 1, "2x2x1 ring sp", allreduce="ring", sequence_parallel=True),
            _train_layout(ctx, 2, 2, 1, "2x2x1 ring sp accum2", allreduce="ring", sequence_parallel=True,
                          grad_accum=2)]


@functools.cache
def _spawn(name: str) -> list[list[dict]]:
    fn, world = {"three_d": (_three_d, 8), "four": (_four, 4)}[name]
    return run_ranks(fn, world, timeout_s=240)


@functools.cache
def _reference() -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    norms: list[float] = []
    losses, state = reference_run(CFG, STEPS, max_norm=MAX_NORM, norms=norms)
    assert max(norms) > MAX_NORM, f"the reference never clipped (norms {norms}): the test would not test clipping"
    return losses, state, norms


@functools.cache
def _reference_eval() -> tuple[float, list[float]]:
    state = _reference()[1]
    return (reference_eval(CFG, state, EVAL_BATCH),
            [reference_eval(CFG, state, tuple(t[-n:] for t in EVAL_BATCH)) for n in PARTIAL])


def _check(per_rank: list[list[dict]], index: int) -> None:
    want_losses, want, want_norms = _reference()
    label = per_rank[0][index]["label"]
    for r, layouts in enumerate(per_rank):
        errs = [abs(a - b) for a, b in zip(layouts[index]["losses"], want_losses, strict=True)]
        assert max(errs) <= TOL64, f"{label} rank {r}: losses {layouts[index]['losses']} vs one process {want_losses}"
        errs = [abs(a - b) for a, b in zip(layouts[index]["norms"], want_norms, strict=True)]
        assert max(errs) <= TOL64, f"{label} rank {r}: gradient norms {layouts[index]['norms']} vs one process's " \
                                   f"{want_norms}"
    forwards = 2 if "accum2" in label else 1 if label.split()[0].endswith("x1") else 0  # pipelines: F spans
    assert forwards == 0 or per_rank[0][index]["forwards"] == forwards, (label, per_rank[0][index]["forwards"])
    want_eval, want_partial = _reference_eval()
    for r, layouts in enumerate(per_rank):  # evaluate(): the final weights' loss on a held-out batch, forward only
        got = layouts[index]
        assert abs(got["evaluated"] - want_eval) <= TOL64, (label, r, got["evaluated"], want_eval)
        assert max(abs(a - b) for a, b in zip(got["partial"], want_partial, strict=True)) <= TOL64, \
            (label, r, "partial batches", got["partial"], want_partial)
    state = per_rank[0][index]["state"]
    assert list(state) == list(want), f"{label}: state names {list(state)} vs the model's {list(want)}"
    name, err = max_error(state, want)
    assert err <= TOL64, f"{label}: final weights off one process, worst {name}: {err:.3g}"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(6))
def test_dp2_tp2_pp2_every_schedule_equals_one_process(index):
    _check(_spawn("three_d"), index)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(6))
def test_two_axes_at_a_time_equal_one_process(index):
    _check(_spawn("four"), index)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_axes_of_size_one_get_no_process_group_and_send_nothing():
    per_rank = _spawn("four")
    for layouts in per_rank:
        for got in layouts:
            dp, tp, pp = (int(x) for x in got["label"].split()[0].split("x"))
            assert got["groups"] == {"dp": dp > 1, "tp": tp > 1, "pp": pp > 1}, got["label"]
            for axis, size in (("tp", tp), ("pp", pp)):
                assert (got["bytes"][axis] > 0) == (size > 1), (got["label"], got["bytes"])
            assert (got["bytes"]["dp"] > 0) == (dp > 1), (got["label"], got["bytes"])  # ring counts its bytes


def test_one_process_engine_is_plain_training():
    engine = parallelize(TinyGPT(CFG, seed=0, dtype=torch.float64))  # no mesh: nothing applied
    opt = optimizer(engine.parameters())
    losses = []
    for x, y in STEPS:
        loss = engine.step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    want_losses, want = reference_run(CFG, STEPS)
    assert losses == want_losses  # bitwise: the same forward and backward
    assert max_error(engine.state_dict(), want)[1] == 0.0


def test_gradient_accumulation_is_the_whole_batchs_step_with_half_the_activations():
    runs = {}
    for k in (1, 2):
        tracer = Tracer(0)
        engine = parallelize(TinyGPT(CFG, seed=0, dtype=torch.float64), RankMesh.single(tracer),
                             Layout(grad_accum=k))
        opt = optimizer(engine.parameters())
        losses, saved = [], []
        for x, y in STEPS:
            loss = engine.step(x, y)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            saved.append(loss.activation_bytes)
        forwards = sum(s.name == "forward" for s in tracer.spans) / len(losses)
        runs[k] = losses, engine.state_dict(), saved[-1], forwards
    (l1, s1, a1, f1), (l2, s2, a2, f2) = runs[1], runs[2]
    assert max(abs(a - b) for a, b in zip(l1, l2, strict=True)) <= 1e-12, (l1, l2)
    assert max_error(s2, s1)[1] <= TOL64
    assert (f1, f2) == (1, 2) and 0.4 < a2 / a1 < 0.6, (f1, f2, a1, a2)  # two forwards, each of half the batch
    with pytest.raises(ValueError, match="a batch of a multiple of 3 rows per rank"):
        parallelize(TinyGPT(CFG, seed=0), None, Layout(grad_accum=3)).step(*batches(CFG)[0])
    with pytest.raises(ValueError, match="grad_accum must be an integer >= 1"):
        parallelize(TinyGPT(CFG, seed=0), None, Layout(grad_accum=0))


def test_evaluate_is_the_eval_mode_loss_and_leaves_training_as_it_was():
    import dataclasses

    cfg = dataclasses.replace(CFG, dropout=0.2)  # dropout: train and eval mode differ, and draw from the RNG
    steps = batches(cfg)
    runs = []
    for evaluate in (False, True):
        torch.manual_seed(7)
        engine = parallelize(TinyGPT(cfg, seed=0, dtype=torch.float64))
        opt = optimizer(engine.parameters())
        losses, evaluated = [], []
        for x, y in steps:
            losses.append(engine.step(x, y).item())
            opt.step()
            opt.zero_grad(set_to_none=True)
            if evaluate:
                evaluated.append(engine.evaluate(*EVAL_BATCH).item())
        runs.append((losses, evaluated, engine))
    (plain, _, _), (losses, evaluated, engine) = runs
    assert losses == plain  # bitwise: evaluating drew nothing from the RNG and put train mode back
    assert engine.model.training
    assert evaluated[-1] == reference_eval(cfg, engine.state_dict(), EVAL_BATCH)
    assert all(p.grad is None for p in engine.parameters())  # nothing accumulated for a backward


def test_evaluate_pads_a_partial_batch_exactly_and_refuses_it_under_a_loss_fn_of_yours():
    from fourfold.loss import lm_loss

    engine = parallelize(TinyGPT(CFG, seed=0, dtype=torch.float64), None, Layout(grad_accum=3))
    for n in (5, 1):  # 3 parts of a batch of 5 rows (1 padded), and of 1 (2 padded)
        x, y = (t[-n:] for t in EVAL_BATCH)
        assert abs(engine.evaluate(x, y).item() - reference_eval(CFG, engine.state_dict(), (x, y))) <= TOL64
        kept = y.clamp_min(0)  # targets a uint8 can hold; the padding rows' -100 it cannot
        for ids in (torch.int32, torch.uint8):
            assert engine.evaluate(x, kept.to(ids)).item() == engine.evaluate(x, kept).item(), ids
    mine = parallelize(TinyGPT(CFG, seed=0, dtype=torch.float64), None, Layout(grad_accum=3), loss_fn=lm_loss)
    with pytest.raises(ValueError, match="got 5 rows; with a loss_fn of your own .* Pass a multiple of 3 rows"):
        mine.evaluate(*(t[-5:] for t in EVAL_BATCH))


def test_int32_targets_train_as_int64_and_others_and_unshifted_ones_are_refused_before_any_forward():
    runs = []
    for dtype in (torch.int64, torch.int32):  # numpy's and some tokenizers' ids come as int32
        engine = parallelize(TinyGPT(CFG, seed=0, dtype=torch.float64))
        runs.append([engine.step(x, y.to(dtype)).item() for x, y in STEPS[:2]])
    assert runs[0] == runs[1]
    x, y = STEPS[0]
    for bad in (y.float(), y > 0):
        with pytest.raises(TypeError, match=f"targets must be integer token ids .*got a {bad.dtype} tensor"):
            engine.step(x, bad)
    # Hugging Face's labels = input_ids habit: the loss would teach the model to copy its input
    with pytest.raises(ValueError, match=r"targets equal the inputs \(shape .*inputs = ids\[:, :-1\], targets = "
                                         r"ids\[:, 1:\]"):
        engine.step(x, x.clone())
    padded = x.clone()
    padded[:, -2:] = -100  # equal at every real target: still unshifted
    with pytest.raises(ValueError, match=r"targets equal the inputs"):
        engine.step(x, padded)
    same = torch.full_like(x, 3)  # one token repeated: shifted or not, the same rows
    assert math.isfinite(engine.step(same, same).item())


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_one_process_clip_grad_norm_is_torchs(norm_type):
    x, y = batches(CFG)[0]
    model = TinyGPT(CFG, seed=0, dtype=torch.float64)
    model(x, y)[1].backward()
    want = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1, norm_type).item()
    engine = parallelize(TinyGPT(CFG, seed=0, dtype=torch.float64))
    engine.step(x, y)
    assert engine.grad_norm(norm_type) == pytest.approx(want, rel=1e-12)
    assert engine.clip_grad_norm_(0.1, norm_type) == pytest.approx(want, rel=1e-12)
    for (name, p), q in zip(model.named_parameters(), engine.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-15, msg=name)
    assert engine.grad_norm(norm_type) == pytest.approx(0.1, rel=1e-5)  # clipped to max_norm
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="max_norm must be > 0"):
            engine.clip_grad_norm_(bad)


def test_bad_layouts_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="sequence_parallel needs tensor parallelism"):
        parallelize(TinyGPT(CFG, seed=0), Mesh(), Layout(sequence_parallel=True))
    with pytest.raises(TypeError, match="mesh must be a RankMesh, a Mesh or None"):
        parallelize(TinyGPT(CFG, seed=0), "dp=2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"find_unused_parameters works with plain data parallelism, got zero=1"):
        parallelize(TinyGPT(CFG, seed=0), Mesh(), Layout(zero=1, find_unused_parameters=True))
    from fourfold.run.args import parse_args
    assert parse_args(["--nproc", "2", "--find-unused-parameters"]).parallel.find_unused_parameters
    with pytest.raises(SystemExit):  # before launch, from the flags (or TOML) alike
        parse_args(["--nproc", "4", "--pp", "2", "--find-unused-parameters"])
    from fourfold.models import tensor_plan

    with pytest.raises(ValueError, match="tp_plan="):
        tensor_plan(torch.nn.Linear(2, 2))


def test_bytes_by_axis_sorts_spans_by_the_axis_that_sent_them():
    def span(name: str, nbytes: int, kind: str = "comm", ranks: int = 2) -> Span:
        return Span(0, kind, name, 0, 1, nbytes, 0, None, 1, None, {"ranks": ranks})

    spans = [span("tp.all_reduce", 10), span("send", 100), span("tied_grads", 5), span("allreduce:ring", 1000),
             span("allreduce:native", 0), span("loss_all_reduce", 0), span("F", 7, kind="compute")]
    assert bytes_by_axis(spans) == {"dp": 1000, "tp": 10, "pp": 105, "cp": 0}  # a ring all-reduce over 2: 2(p-1)/p = 1
    # tp counts what a ring sends: an all-reduce of N over 4 ranks sends 1.5 N; sequence parallelism's halves,
    # a reduce-scatter of N and an all-gather of its N/4 shard, send 0.75 N each: the same bytes
    plain = bytes_by_axis([span("tp.all_reduce", 4000, ranks=4)])["tp"]
    halves = bytes_by_axis([span("tp.reduce_scatter", 4000, ranks=4), span("tp.all_gather", 1000, ranks=4)])["tp"]
    assert plain == halves == 6000


def _differently_built(ctx) -> None:
    ranks = Mesh.for_world(2, tp=2).build(30)
    parallelize(TinyGPT(CFG, seed=ctx.rank), ranks)  # seeded by rank: two different models


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ranks_that_built_different_models_are_refused_under_tp():
    from fourfold.testing import RankError

    with pytest.raises(RankError, match=r"the tp ranks built different models \(embed.wte.weight differs.*"
                                        r"torch.manual_seed\(0\) before building it"):
        run_ranks(_differently_built, 2, timeout_s=60)


def _rows_by_global_rank(ctx) -> dict:
    """Each rank given rows by its global rank, as DistributedSampler would: under tp and under pp."""
    out = {}
    for label, layout in (("tp2", {"tp": 2}), ("pp2", {"pp": 2})):
        mesh = Mesh.for_world(2, **layout)
        engine = parallelize(TinyGPT(CFG, seed=0), mesh.build(30), Layout(microbatches=2).for_mesh(mesh))
        x, y = batches(CFG, steps=2)[ctx.rank]
        try:
            engine.step(x, y)
            out[label] = "stepped"
        except ValueError as e:
            out[label] = str(e)
        x, y = batches(CFG, steps=1)[0]
        out[f"{label} same rows"] = engine.step(x, y).item()  # the same rows then: it trains (checked once)
    return out


@pytest.mark.timeout(120)
def test_a_replicas_ranks_given_other_rows_are_refused_naming_them():
    for got in run_ranks(_rows_by_global_rank, 2, timeout_s=100):
        for label, axis in (("tp2", "tp"), ("pp2", "pp")):
            assert got[label].startswith("every tp, cp and pp rank of a data-parallel replica must step on the same "
                                         "rows (cp ranks cut the sequences themselves), got other inputs on rank 1 "
                                         "than on rank 0 "), got[label]
            assert f"({axis} group of ranks [0, 1]). Shard the batch by the replica, ranks.coord.dp" in got[label]
            assert math.isfinite(got[f"{label} same rows"])


class _Tabular(torch.nn.Module):
    """A model whose forward takes a dict of tensors: float features and category ids."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.cat_emb = torch.nn.Embedding(10, 8, dtype=torch.float64)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).double()

    def forward(self, batch: dict) -> torch.Tensor:
        return self.mlp(torch.cat([batch["num"], self.cat_emb(batch["cat"])], -1))


def _tabular_batches() -> list[tuple[dict, torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    return [({"num": torch.randn(8, 4, generator=g, dtype=torch.float64), "cat": torch.randint(0, 10, (8,), generator=g)},
             torch.randint(0, 2, (8,), generator=g)) for _ in range(2)]


def _tabular(ctx) -> dict:
    import torch.nn.functional as F

    out = {}
    for label, layout, settings, options in (
            ("dp2 accum2", {"dp": 2}, {"grad_accum": 2}, {}),
            ("tp2", {"tp": 2}, {}, {"plan": {"mlp.0": "column", "mlp.2": "row"}}),
            ("pp2", {"pp": 2}, {}, {"split": Split(blocks=["mlp.0", "mlp.1", "mlp.2"], before=lambda m, b:
                                                   torch.cat([b["num"], m.cat_emb(b["cat"])], -1))})):
        ranks = Mesh.for_world(2, **layout).build(30)
        dp, r = ranks.mesh.dp, ranks.coord.dp
        example = {k: v[:1] for k, v in _tabular_batches()[0][0].items()}
        try:
            engine = parallelize(_Tabular(), ranks, Layout(microbatches=1, **settings).for_mesh(ranks.mesh),
                                 loss_fn=F.cross_entropy, example=example, **options)
            opt = optimizer(engine.parameters())
            losses = []
            for x, y in _tabular_batches():
                losses.append(engine.step({k: shard(v, r, dp) for k, v in x.items()}, shard(y, r, dp)).item())
                opt.step()
                opt.zero_grad(set_to_none=True)
            out[label] = {"losses": losses, "state": engine.state_dict()}
        except (TypeError, ValueError) as e:
            out[label] = str(e)
    return out


@pytest.mark.timeout(120)
def test_a_model_taking_a_dict_of_tensors_trains_as_one_process_under_dp_and_tp():
    import torch.nn.functional as F

    want, reference = one_process(_Tabular(), _tabular_batches(), F.cross_entropy)
    for got in run_ranks(_tabular, 2, timeout_s=100):
        for label in ("dp2 accum2", "tp2"):
            assert max(abs(a - b) for a, b in zip(got[label]["losses"], want, strict=True)) <= TOL64, (label, got)
            name, err = max_error(got[label]["state"], reference)
            assert err <= TOL64, (label, name, err)
        assert "a pipeline's inputs must be one tensor (its stages send tensors), got dict" in got["pp2"], got["pp2"]



def _loss_edges(ctx) -> dict:
    from fourfold.comm.wait import settle_pending

    ranks = Mesh.for_world(2, dp=2).build(30)
    engine = parallelize(TinyGPT(CFG, seed=0, dtype=torch.float64), ranks)
    x, y = (shard(t, ranks.coord.dp, 2) for t in STEPS[0])
    dropped = engine.step(x, y)
    work = dropped.work.work  # the dp all-reduce, in flight until read
    del dropped  # never read: waited for as it goes
    out = {"dropped": work.is_completed()}
    kept = engine.evaluate(x, y)
    settle_pending()  # what a clean exit runs before destroying the process group
    out["kept"] = kept.work is None or kept.work.work is None
    out["value"] = kept.item()
    mine = int((y != -100).sum())  # this replica's count, not the global batch's: refused on the first step
    try:
        engine.step(x, y, num_tokens=mine)
        out["local"] = "not refused"
    except ValueError as e:
        out["local"] = str(e)
    engine.model.zero_grad(set_to_none=True)
    out["none"] = engine.step(x, torch.full_like(y, -100), num_tokens=0).item()  # nothing to predict: loss 0
    return out


@functools.cache
def _edges() -> list[dict]:
    return run_ranks(_loss_edges, 2, timeout_s=100)


@pytest.mark.timeout(120)
def test_a_loss_never_read_is_waited_for_before_the_group_goes():
    """gloo aborts a process (SIGABRT, 'terminate called without an active exception') whose group is destroyed
    under an all-reduce still running: the loss's, when a loop never reads it. Dropped, it is waited for at
    once; kept, before launch.init's clean exit destroys the group."""
    for got in _edges():
        assert got["dropped"] and got["kept"] and math.isfinite(got["value"]), got


@pytest.mark.timeout(120)
def test_num_tokens_must_be_the_global_count_and_may_be_zero():
    for got in _edges():
        assert "num_tokens must be the whole global batch's count of real targets, the same on every rank, got " \
               "counts from " in got["local"], got["local"]
        assert got["none"] == 0.0, got


def test_a_family_model_given_a_dict_of_inputs_is_told_it_takes_ids():
    """A Hugging Face habit, step({"input_ids": ..., "attention_mask": ...}): the family's models are called
    model(ids), where the dict would reach input_ids and fail deep inside the forward."""
    x, y = STEPS[0]
    with pytest.raises(ValueError, match=r"TinyGPT is called model\(ids\): inputs must be one \(B, T\) tensor of "
                                         r"token ids, got a dict with keys \['attention_mask', 'input_ids'\]"):
        parallelize(TinyGPT(CFG, seed=0)).step({"input_ids": x, "attention_mask": torch.ones_like(x)}, y)
