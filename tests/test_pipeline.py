"""Pipeline and model parallelism: any schedule on pp ranks trains exactly like one process.

Spawns are the expensive part, so each is read by several tests (module-level caches):

* ``pp2`` (2 ranks): every schedule (naive, gpipe, 1f1b, interleaved v=2, zb) and ``--strategy model`` train a
  float64 TinyGPT with a tied head for ``STEPS`` AdamW steps; 1f1b in float32; a traced 1f1b and zb step; a
  larger model with m = 8 under naive, gpipe and 1f1b for memory and bubble; and the batch-size refusal.
* ``pp4`` (4 ranks): naive, gpipe, 1f1b and zb in float64.
* one spawn each for the failures: ranks whose models disagree at a stage boundary, a stage whose output
  changed shape, a silent peer. Each must end in a named error within the runtime's timeout.

Reading a failure: labels are ``<schedule> pp=<p> <dtype>``. A step-0 loss already wrong means forward or
the micro-batch split is wrong (the 1/m scale, or micro-batches out of order); right losses with wrong weights
mean backward: only ``embed.wte.weight`` / ``head.lm_head.weight`` wrong points at the tied-gradient sum, only
zb wrong at the B/W split. ``compute spans ... differ from the schedule`` means the executor ran actions out of
the schedule's order. Peak counts that differ from ``peak_in_flight`` mean activations are freed too late (or
early: then backward would have failed).
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
from torch import nn

from fourfold.models import GPTConfig, TinyGPT
from fourfold.observe.trace import Tracer
from fourfold.parallel.model import MultiDeviceModel, model_parallel
from fourfold.parallel.pipeline.p2p import HEADER_INTS
from fourfold.parallel.pipeline.runtime import Pipeline, build_pipeline
from fourfold.parallel.pipeline.split import partition, plan, split_model
from fourfold.parallel.schedule import make_schedule
from fourfold.parallel.timeline import peak_in_flight
from fourfold.testing import RankError, run_ranks
from helpers import TOL64, batches, optimizer, reference_run

CFG = GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=16)  # 4 blocks, tied head
BIG = GPTConfig(vocab_size=64, seq_len=32, n_layer=2, n_head=2, d_model=64)  # memory and bubble, m = 8
BATCH, MICRO, STEPS = 8, 4, 3
# float32: micro-batching adds m per-micro-batch means instead of one mean over the batch, so gradients differ
# from one process by a few ulps, and Adam turns a gradient at rounding level (the key bias, whose exact gradient
# is 0) into a full-size update. As in test_data_parallel, each tensor's yardstick is how far float32 rounding
# alone puts one process from float64: |pp - one process| <= 1e-6 + F32_SLACK * |one process f32 - f64|.
F32_SLACK = 4.0
LOSS_TOL32 = 1e-5  # losses ~ln(64) = 4.2: ~20 float32 ulps
SCHEDULES_PP2 = [("naive", 1), ("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1)]
SCHEDULES_PP4 = [("naive", 1), ("gpipe", 1), ("1f1b", 1), ("zb", 1)]


def _batches(cfg: GPTConfig = CFG, batch: int = BATCH, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return batches(cfg, batch, steps)


_optimizer = optimizer


@functools.cache
def _reference(dtype_name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the whole batch: the losses and final state every layout must reproduce."""
    return reference_run(CFG, _batches(), getattr(torch, dtype_name))


def _train(pipe: Pipeline, steps: list) -> tuple[list[float], dict[str, torch.Tensor], object]:
    opt = _optimizer(pipe.parameters())
    losses, result = [], None
    for x, y in steps:
        result = pipe.step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(result.loss)
    return losses, pipe.gather_state_dict(), result


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float("inf") if got.shape != want.shape else (got.double() - want.double()).abs().max().item()


def _check_parity(label: str, per_rank_losses: list[list[float]], state: dict, dtype_name: str) -> None:
    want_losses, want = _reference(dtype_name)
    if dtype_name == "float64":
        loss_tol, tol = TOL64, dict.fromkeys(want, TOL64)
    else:
        exact = _reference("float64")[1]
        loss_tol, tol = LOSS_TOL32, {k: 1e-6 + F32_SLACK * _err(want[k], exact[k]) for k in want}
    for r, losses in enumerate(per_rank_losses):
        errs = [abs(a - b) for a, b in zip(losses, want_losses, strict=True)]
        assert max(errs) <= loss_tol, f"{label} rank {r}: losses {losses} vs one process {want_losses}"
    assert list(state) == list(want), f"{label}: gathered state dict keys {list(state)} vs {list(want)}"
    bad = {k: f"{_err(state[k], want[k]):.3g} > {tol[k]:.3g}" for k in want if not _err(state[k], want[k]) <= tol[k]}
    assert not bad, f"{label}: final weights off one process (max |error| per tensor): {bad}"


# ------------------------------------------------------------------------------------------ the spawns

def _run_schedules(ctx, pp: int, schedules: list[tuple[str, int]]) -> dict:
    out = {}
    for name, virtual in schedules:
        schedule = make_schedule(name, pp, MICRO, virtual)
        pipe = build_pipeline(TinyGPT(CFG, seed=0, dtype=torch.float64), schedule, timeout_s=30)
        losses, state, result = _train(pipe, _batches())
        out[(name, "float64")] = {"losses": losses, "state": state,
                                  "peak_in_flight": result.peak_in_flight_by_rank}
    return out


def _pp2(ctx) -> dict:
    rank = ctx.rank
    out = _run_schedules(ctx, 2, SCHEDULES_PP2)
    pipe = build_pipeline(TinyGPT(CFG, seed=0), make_schedule("1f1b", 2, MICRO), timeout_s=30)
    losses, state, _ = _train(pipe, _batches())
    out[("1f1b", "float32")] = {"losses": losses, "state": state if rank == 0 else None}
    pipe = model_parallel(TinyGPT(CFG, seed=0, dtype=torch.float64), timeout_s=30)  # --strategy model
    losses, state, _ = _train(pipe, _batches())
    out[("model", "float64")] = {"losses": losses, "state": state if rank == 0 else None}
    for name in ("1f1b", "zb"):  # a traced step: the spans, in order
        tracer = Tracer(rank)
        pipe = build_pipeline(TinyGPT(CFG, seed=0, dtype=torch.float64), make_schedule(name, 2, MICRO),
                              tracer=tracer, timeout_s=30)
        tracer.start()
        pipe.step(*_batches(steps=1)[0])
        out[("trace", name)] = tracer.spans
    out["local W"] = pipe.local_weight_grads  # zb on TinyGPT: every stage's W runs per module call
    timed = build_pipeline(TinyGPT(CFG), make_schedule("gpipe", 2, MICRO), balance="time")
    out["timed"] = [st.names for st in timed.stages]  # rank 0 measured, every rank cut there
    torch.manual_seed(0)
    data = [(torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)) for _ in range(STEPS)]
    want = _twice_model()
    opt = _optimizer(want.parameters())
    for x, y in data:
        nn.functional.mse_loss(want(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    pipe = build_pipeline(_twice_model(), make_schedule("zb", 2, MICRO), example=data[0][0],
                          loss_fn=nn.functional.mse_loss)
    _, state, _ = _train(pipe, data)
    out["twice"] = (pipe.local_weight_grads, max(_err(state[k], v) for k, v in want.state_dict().items()))
    x, y = _batches(steps=1)[0]
    try:  # refused on every rank before any message
        pipe.step(x[:7], y[:7])
    except ValueError as e:
        out["refusal"] = str(e)
    try:
        Pipeline(split_model(TinyGPT(CFG), 3), make_schedule("1f1b", 2, MICRO))
    except ValueError as e:
        out["wrong split"] = str(e)
    again = build_pipeline(TinyGPT(CFG, seed=7, dtype=torch.float64), make_schedule("gpipe", 2, MICRO))
    again.load_state_dict({k: v + rank for k, v in out[("gpipe", "float64")]["state"].items()})
    out["reloaded"] = again.gather_state_dict()
    big = _batches(BIG, batch=16, steps=2)
    for name in ("naive", "gpipe", "1f1b"):  # m = 8: memory (exact) and bubble (a figure)
        pipe = build_pipeline(TinyGPT(BIG, seed=0), make_schedule(name, 2, 8), timeout_s=30)
        for x, y in big:  # the last step counts: the first warms up
            pipe.tracer = tracer = Tracer(rank)
            result = pipe.step(x, y)
            for p in pipe.parameters():
                p.grad = None
        # on one machine perf_counter is one clock for every process: spans in absolute time compare across ranks
        compute = [(s.start_ns + tracer.origin_ns, s.end_ns + tracer.origin_ns) for s in tracer.spans
                   if s.kind == "compute"]
        out[("big", name)] = {"result": result, "compute": compute}
    return out


class _Twice(nn.Module):
    """One Linear applied twice: its weight gradient is not one call's, so zb's W must walk the stage again."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


def _twice_model() -> nn.Sequential:
    g = torch.Generator().manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 8), _Twice(), nn.Linear(8, 8), nn.Linear(8, 4)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) / 3)
    return model


def _pp4(ctx) -> dict:
    return _run_schedules(ctx, 4, SCHEDULES_PP4)


@functools.cache
def _spawn(pp: int) -> list[dict]:
    return run_ranks(_pp2 if pp == 2 else _pp4, pp, timeout_s=100)


CASES = [(2, n, "float64") for n, _ in SCHEDULES_PP2] + [(4, n, "float64") for n, _ in SCHEDULES_PP4] + \
        [(2, "model", "float64"), (2, "1f1b", "float32")]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[1]}-pp{c[0]}-{c[2]}")
def test_trains_like_one_process(case):
    pp, name, dtype_name = case
    per_rank = [r[(name, dtype_name)] for r in _spawn(pp)]
    _check_parity(f"{name} pp={pp} {dtype_name}", [r["losses"] for r in per_rank], per_rank[0]["state"],
                  dtype_name)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", [c for c in CASES if c[1] != "model" and c[2] == "float64"],
                         ids=lambda c: f"{c[1]}-pp{c[0]}")
def test_measured_in_flight_equals_schedule(case):
    """The runtime holds exactly the (stage, micro-batch) pairs the schedule says (zb: until W)."""
    pp, name, _ = case
    virtual = 2 if name == "interleaved" else 1
    want = peak_in_flight(make_schedule(name, pp, MICRO, virtual), until="W")
    assert _spawn(pp)[0][(name, "float64")]["peak_in_flight"] == tuple(want)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", ["1f1b", "zb"])
def test_spans_follow_the_schedule(name):
    schedule = make_schedule(name, 2, MICRO)
    per_rank = _spawn(2)
    for r, res in enumerate(per_rank):
        spans = res[("trace", name)]
        compute = [(s.name, s.args["stage"], s.microbatch) for s in spans if s.kind == "compute"]
        assert compute == [(a.op, a.stage, a.microbatch) for a in schedule.ranks[r]], \
            f"{name} rank {r}: compute spans {compute} differ from the schedule"
        recvs = [s for s in spans if s.kind == "comm" and s.name == "recv"]
        waits = [s for s in spans if s.kind == "wait"]
        assert len(recvs) == MICRO and all(s.peer == 1 - r and s.microbatch is not None for s in recvs)
        activation = BATCH // MICRO * CFG.seq_len * CFG.d_model * 8  # one (b, T, C) float64 micro-batch
        header = HEADER_INTS * 8
        assert {s.recv_bytes for s in recvs} == {activation + header}, "payload + the header"
        assert sum(s.bytes for s in spans if s.name == "send") == MICRO * (activation + header)
        tied = [s for s in spans if s.name == "tied_grads"]
        assert tied, "the tied head's gradient exchange is traced"
        # and the time blocked in it is a wait (the other stage's backward, mostly), as a receive's is
        assert any(w.args.get("what") == "tied gradients" and tied[0].start_ns <= w.start_ns
                   and w.end_ns == tied[0].end_ns for w in waits), (r, tied, waits[-3:])
        assert waits and all(s.end_ns >= s.start_ns for s in waits)


@pytest.mark.timeout(150)
def test_zero_bubble_weight_gradients_per_module_or_walked_again():
    """zb's W: per module call where every parameter's uses lie in one call of its module (TinyGPT); a stage
    with a module applied twice walks the stage again instead; both train like one process."""
    for r, res in enumerate(_spawn(2)):
        assert res["local W"] == {r: True}, f"rank {r}: {res['local W']}"
        local, err = res["twice"]
        assert local == {r: r == 1} and err <= TOL64, f"rank {r}: local W {local}, max |error| {err:.3g}"


@pytest.mark.timeout(150)
def test_timeline_picture(tmp_path):
    pytest.importorskip("matplotlib")
    from fourfold.observe.visualize import timeline

    spans = {r: res[("trace", "zb")] for r, res in enumerate(_spawn(2))}
    timeline(spans, tmp_path / "zb.png", color_by="microbatch")
    assert (tmp_path / "zb.png").stat().st_size > 0


@pytest.mark.timeout(150)
def test_activation_memory_1f1b_holds_p_gpipe_m():
    """Measured saved-activation bytes: 1F1B at most p/m of GPipe's (+10%), p = 2, m = 8."""
    p, m = 2, 8
    gpipe = _spawn(2)[0][("big", "gpipe")]["result"]
    one_f = _spawn(2)[0][("big", "1f1b")]["result"]
    assert gpipe.peak_in_flight_by_rank == (m, m) and one_f.peak_in_flight_by_rank == (2, 1)
    for r in range(p):
        got, bound = one_f.peak_activation_bytes_by_rank[r], 1.1 * p / m * gpipe.peak_activation_bytes_by_rank[r]
        assert 0 < got <= bound, f"rank {r}: 1F1B holds {got} bytes, GPipe {gpipe.peak_activation_bytes_by_rank[r]}"


@pytest.mark.timeout(150)
def test_bubble_is_measured():
    """Timing on a shared 2-core box is not asserted; the structure is: bubbles in [0, 1), and naive's ranks
    never compute at the same time (each waits for the other), which is its (p-1)/p idle time: the bubble
    counts a rank's idle tail too, so naive's two bubbles add up to about 1."""
    per_rank = _spawn(2)
    figures = {}
    for name in ("naive", "gpipe", "1f1b"):
        result = per_rank[0][("big", name)]["result"]
        assert len(result.bubble_by_rank) == 2 and all(0 <= b < 1 for b in result.bubble_by_rank), result
        assert 0 < result.busy <= 1 and result.loss > 0
        figures[name] = [round(b, 3) for b in result.bubble_by_rank]
    print(f"measured bubble by rank (pp=2, m=8; theory naive 0.5, gpipe/1f1b {1 / 9:.3f}): {figures}")
    naive = per_rank[0][("big", "naive")]["result"]
    assert sum(naive.bubble_by_rank) > 0.9, naive  # each rank computes while the other waits: ~1 in all
    assert all(0 <= w <= b + 1e-9 for w, b in zip(naive.wait_by_rank, naive.bubble_by_rank, strict=True)), naive
    spans = sorted(s for r in per_rank for s in r[("big", "naive")]["compute"])
    overlaps = [(a, b) for a, b in zip(spans, spans[1:], strict=False) if b[0] < a[1]]
    assert not overlaps, f"naive: compute spans of two ranks overlap in time: {overlaps[:3]}"


@pytest.mark.timeout(150)
def test_refusals_on_every_rank():
    for r, res in enumerate(_spawn(2)):
        assert "microbatches=4" in res["refusal"] and "batch size 7" in res["refusal"], (r, res["refusal"])
        assert "split into 2 stages (pp * virtual = 2 * 1), got stages [0, 1, 2] of a split into 3" in \
            res["wrong split"], (r, res["wrong split"])


@pytest.mark.timeout(150)
def test_time_balanced_cut_is_rank_0s_on_every_rank():
    """Timings differ between ranks; the stages must not: together they are every block once, in order."""
    (first,), (second,) = (res["timed"] for res in _spawn(2))
    assert first and second and first + second == ("embed", "blocks.0", "blocks.1", "head"), (first, second)


@pytest.mark.timeout(150)
def test_gathered_state_loads_back():
    """load_state_dict(whole model) puts each rank's part back: rank r loads the trained state + r, and the
    gathered state is rank 0's half + 0 and rank 1's half + 1."""
    trained = _spawn(2)[0][("gpipe", "float64")]["state"]
    for r, res in enumerate(_spawn(2)):
        got = res["reloaded"]
        assert list(got) == list(trained)
        for k in got:
            want = trained[k] + (0 if k.startswith(("embed.", "blocks.0.")) else 1)
            assert torch.equal(got[k], want), f"rank {r}: {k} not loaded"


def _one_rank(ctx) -> dict:
    out = {}
    for name, virtual in (("gpipe", 1), ("interleaved", 2)):  # interleaved: stages 0 and 1 on the one rank
        pipe = build_pipeline(TinyGPT(CFG, seed=0, dtype=torch.float64), make_schedule(name, 1, MICRO, virtual))
        losses, state, _ = _train(pipe, _batches())
        out[name] = (losses, state)
    return out


@pytest.mark.timeout(60)
def test_one_rank_holds_every_stage():
    """pp = 1: activations pass between stages on one rank without messages; tied copies summed locally."""
    for name, (losses, state) in run_ranks(_one_rank, 1, timeout_s=40)[0].items():
        _check_parity(f"{name} pp=1 float64", [losses], state, "float64")


# ------------------------------------------------------------------------------------------ failures

def _disagreeing_models(ctx) -> None:
    width = 16 if ctx.rank == 0 else 12  # rank 1 was launched with another config
    model = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 4)).double()
    pipe = build_pipeline(model, make_schedule("gpipe", 2, 2), boundaries=[2], example=torch.zeros(2, 8,
                          dtype=torch.float64), loss_fn=nn.functional.mse_loss, timeout_s=3)
    pipe.step(torch.zeros(4, 8, dtype=torch.float64), torch.zeros(4, 4, dtype=torch.float64))


class _Shrinks(nn.Module):
    """Drops a feature in training mode only: the split traced it in eval mode, so its output changed shape."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :-1] if self.training else x


def _changed_shape(ctx) -> None:
    model = nn.Sequential(nn.Linear(8, 16), _Shrinks(), nn.Linear(16, 4)).double().eval()
    pipe = build_pipeline(model, make_schedule("1f1b", 2, 2), boundaries=[2], example=torch.zeros(2, 8,
                          dtype=torch.float64), loss_fn=nn.functional.mse_loss, timeout_s=3).train()
    pipe.step(torch.zeros(4, 8, dtype=torch.float64), torch.zeros(4, 4, dtype=torch.float64))


def _silent_peer(ctx) -> None:
    if ctx.rank == 0:
        time.sleep(3)  # never sends its activation
        return
    pipe = build_pipeline(TinyGPT(CFG, seed=0), make_schedule("gpipe", 2, 2), timeout_s=1)
    x, y = _batches(steps=1)[0]
    pipe.step(x, y)


@pytest.mark.timeout(60)
def test_models_that_disagree_fail_named():
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_disagreeing_models, 2, timeout_s=30)
    text = str(info.value)
    assert info.value.rank == 1 and "PipelineError" in text, text
    first = text.splitlines()[0]
    for words in ("1F0", "stage 1 expects the activation of micro-batch 0", "(*, 12) float64", "(2, 16) float64",
                  "rank 0"):
        assert words in first, f"{words!r} not in {first!r}"
    # the sender sent what its own model traced; it learns from its next receive, which fails as rank 1 exits
    assert "also failed: rank 0: fourfold.comm.wait.CommError: rank 0: 0B0: receive the gradient of 1B0 from " \
           "rank 1" in text, text
    assert time.monotonic() - start < 20


@pytest.mark.timeout(60)
def test_changed_shape_fails_named_on_both_ranks():
    with pytest.raises(RankError) as info:
        run_ranks(_changed_shape, 2, timeout_s=30)
    text = str(info.value)
    assert sorted(info.value.ranks) == [0, 1], text
    assert "stage 0's activation for micro-batch 0 is (2, 15) float64, but stage 1 expects (*, 16) float64" \
        in text, text
    assert "Pass parallelize's example= with the training inputs' shape" in text, text  # the likely cause
    assert "stage 1 expects the activation of micro-batch 0 from stage 0 (rank 0) to be (*, 16) float64, got " \
           "(2, 15) float64" in text, text


@pytest.mark.timeout(60)
def test_silent_peer_times_out_named():
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_silent_peer, 2, timeout_s=30)
    first = str(info.value).splitlines()[0]
    assert info.value.rank == 1 and "CommError" in first, first
    for words in ("rank 1: 1F0", "receive the activation of 0F0 from rank 0", "within 1 s"):
        assert words in first, f"{words!r} not in {first!r}"
    assert time.monotonic() - start < 20


# ------------------------------------------------------------------------------------------ in-process

@pytest.mark.timeout(30)
def test_partition_minimises_the_largest_stage():
    assert partition([1, 1, 1, 1], 2) == (0, 2)
    assert partition([4, 1, 1, 1, 1], 2) == (0, 1)
    assert partition([1, 2, 3, 4, 5], 3) == (0, 3, 4)  # 6 | 4 | 5
    assert partition([7], 1) == (0,)
    with pytest.raises(ValueError, match="stages=3 for 2 blocks"):
        partition([1, 1], 3)


@pytest.mark.timeout(30)
def test_split_tinygpt_balanced_named_and_refused():
    model = TinyGPT(GPTConfig(vocab_size=64, seq_len=8, n_layer=4, n_head=2, d_model=16))
    stages = split_model(model, 2)
    assert [s.names for s in stages] == [("embed", "blocks.0", "blocks.1"), ("blocks.2", "blocks.3", "head")]
    assert [(s.is_first, s.is_last) for s in stages] == [(True, False), (False, True)]
    assert str(stages[0].out_spec) == "(*, *, 16) float32" and stages[1].in_spec == stages[0].out_spec
    wte, head = stages[0].blocks[0].wte.weight, stages[1].blocks[-1].lm_head.weight
    assert head is not wte and torch.equal(head, wte), "the last stage holds its own copy of the tied weight"
    assert stages[0].tied == {"blocks.0.wte.weight": (0, (0, 1))} == {"blocks.0.wte.weight": stages[1].tied[
        "blocks.2.lm_head.weight"]}
    assert list({k: 0 for s in stages for k in s.model_state_dict()}) == list(TinyGPT(model.config).state_dict())
    named = split_model(TinyGPT(model.config), 3, boundaries=["blocks.1", 4])
    assert [s.names for s in named] == [("embed", "blocks.0"), ("blocks.1", "blocks.2"), ("blocks.3", "head")]
    with pytest.raises(ValueError, match=r"stages=7 for 6 blocks \(embed, blocks.0, .*head\)"):
        split_model(TinyGPT(model.config), 7)
    with pytest.raises(ValueError, match="strictly increasing"):
        plan(model, 3, boundaries=[3, 2])
    with pytest.raises(ValueError, match="must name a block"):
        plan(model, 2, boundaries=["blocks.9"])


class _Sleep(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


@pytest.mark.timeout(30)
def test_split_by_time_and_blocks_that_do_not_compose():
    model = nn.Sequential(_Sleep(0.02), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    assert plan(model, 2) == (0, 2)  # by parameters the sleeper weighs nothing
    assert plan(model, 2, balance="time", example=torch.zeros(1, 4)) == (0, 1)
    with pytest.raises(ValueError, match="needs an example"):
        plan(model, 2, balance="time")
    with pytest.raises(ValueError, match=r"block 1 \(1\) fails on the output of block 0 \(0\), shape \(2, 16\)"):
        split_model(nn.Sequential(nn.Linear(8, 16), nn.Linear(12, 4)), 2, example=torch.zeros(2, 8))


def test_a_module_at_several_positions_is_a_block_each_time_and_one_stage_per_rank():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(nn.Linear(4, 4), shared, shared, nn.Linear(4, 4))
    weight = shared.weight
    stages = split_model(model, 2, held=[1])  # pp2: a rank each; the second stage's copy is a tied weight
    assert [s.names for s in stages] == [("0", "1"), ("2", "3")]
    assert set(stages[1].tied) == {"blocks.0.weight", "blocks.0.bias"}
    assert stages[1].blocks[0].weight is not weight and torch.equal(stages[1].blocks[0].weight, weight)
    # described by a Split, each piece holds the module at the path it names, not at the first one's
    from fourfold import Split
    from fourfold.parallel.pipeline.blocks import resolve_split

    for split in (Split.sequential(["0", "1", "2", "3"]),
                  Split(blocks=["1", "2"], before=lambda m, x: m[0](x), after=lambda m, h: m[3](h))):
        assert [s.paths for s in resolve_split(model, split, torch.zeros(2, 4))] == [("0",), ("1",), ("2",), ("3",)]
    # interleaved: one rank would hold both of its stages, and one module cannot be two stages' copies
    with pytest.raises(ValueError, match=r"block 3 of stage 3 holding the same Linear as block 1 of stage 1, both "
                                         r"held here \(stages \[1, 3\]\)\. Pass virtual=1"):
        split_model(nn.Sequential(nn.Linear(4, 4), shared, nn.Linear(4, 4), shared), 4, held=[1, 3])


class _TitanLike(nn.Module):
    """torchtitan's Llama 3 layout: blocks in a ModuleDict keyed "0", "1", ..., run in insertion order."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(16, 4)
        self.layers = nn.ModuleDict({str(i): nn.Linear(4, 4) for i in range(3)})
        self.output = nn.Linear(4, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(ids)
        for layer in self.layers.values():
            h = torch.tanh(layer(h))
        return self.output(h)


def test_blocks_in_a_module_dict_are_refused_without_a_split_and_named_by_one():
    """A root attribute ``layers`` that is a ModuleDict (or ModuleList) was called as TinyGPT's layers() method:
    NotImplementedError from deep inside. Now a refusal saying how to name them, and a Split naming the
    ModuleDict takes its blocks in order, checked against the model's own forward."""
    from fourfold import Split
    from fourfold.parallel.pipeline.blocks import resolve_split
    from fourfold.parallel.pipeline.split import named_blocks

    model = _TitanLike()
    with pytest.raises(TypeError, match=r"got _TitanLike \(its layers is a ModuleDict of blocks: "
                                        r"Split\(blocks='layers', \.\.\.\) names them\)"):
        named_blocks(model)
    split = Split(blocks="layers", before=lambda m, ids: m.tok_embeddings(ids),
                  block=lambda m, layer, h: torch.tanh(layer(h)), after=lambda m, h: m.output(h))
    specs = resolve_split(model, split, torch.zeros(2, 3, dtype=torch.long))
    assert [s.block for s in specs if s.block] == ["layers.0", "layers.1", "layers.2"], specs


@pytest.mark.timeout(30)
def test_multi_device_single_process_equals_one_process():
    model = MultiDeviceModel(TinyGPT(CFG, seed=0, dtype=torch.float64), ["cpu", "cpu"])
    assert [s.names for s in model.stages] == [("embed", "blocks.0"), ("blocks.1", "head")]
    opt = _optimizer(model.parameters())
    losses = []
    for x, y in _batches():
        _, loss = model(x, y)
        loss.backward()
        model.finish()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    _check_parity("multi-device cpu,cpu", [losses], model.model_state_dict(), "float64")


# ------------------------------------------------------------------------------------------ messages

def _links(ctx, schedule):
    """Rank ctx.rank's pipeline links of ``schedule`` on 2 ranks, alone: the tests drive them by hand."""
    from fourfold.parallel.pipeline.p2p import Links

    return Links(schedule, None, ranks=[0, 1], device=torch.device("cpu"), timeout_s=10,
                 tracer=Tracer(ctx.rank, enabled=False))


def _gradient_posted_ahead(ctx) -> dict:
    """Stage 0 posts the payload receive of a gradient before its header comes (its shape is its F's output's);
    a gradient that disagrees is refused by the sender's check and named by the receiver's header check."""
    import torch.distributed as dist

    from fourfold.parallel.pipeline.p2p import GRADIENT, PipelineError
    from fourfold.parallel.pipeline.split import TensorSpec

    schedule = make_schedule("gpipe", 2, 2)
    links = _links(ctx, schedule)
    spec = TensorSpec((2, 3), torch.float64)
    links.begin(schedule.ranks[ctx.rank], lambda a: spec if a.op == "B" else None)
    out: dict = {}
    if ctx.rank == 0:
        links.prefetch()
        posted = links.recvs[(GRADIENT, 1, 0)]
        out["posted_before_header"] = posted.payload_work is not None and not posted.checked
    dist.barrier()  # rank 1 sends only now: no header can have come above
    b0, b1 = (a for a in schedule.ranks[ctx.rank] if a.op == "B")
    if ctx.rank == 1:
        links.send(b0, GRADIENT, torch.full((2, 3), 7.0, dtype=torch.float64), 0, spec)
        try:
            links.send(b1, GRADIENT, torch.zeros(3, 3, dtype=torch.float64), 0, spec)
        except PipelineError as e:
            out["sender"] = str(e)
        links.complete_send((GRADIENT, 1, 0), "test")
    else:
        out["value"] = links.recv(b0, GRADIENT, 1, spec).tolist()
        try:
            links.recv(b1, GRADIENT, 1, spec)
        except PipelineError as e:
            out["receiver"] = str(e)
    dist.barrier()
    return out


@pytest.mark.timeout(60)
def test_gradient_receive_is_posted_before_its_header():
    first, second = run_ranks(_gradient_posted_ahead, 2, timeout_s=40)
    assert first["posted_before_header"], first
    assert first["value"] == [[7.0] * 3] * 2, first
    assert "expects (2, 3) float64" in second["sender"], second
    assert "expects the gradient of micro-batch 1 from stage 1 (rank 1) to be (2, 3) float64, got (3, 3) float64" \
        in first["receiver"], first


def _activation_guessed(ctx) -> dict:
    """Stage 1 posts activation i's payload receive at i-1's shape before i's header comes; a sender whose
    activation changed shape moves it one tag on and fills the guessed receive with one byte, whether the
    receiver had posted it (micro-batch 1) or not (micro-batch 2)."""
    import torch.distributed as dist

    from fourfold.parallel.pipeline.p2p import ACTIVATION

    schedule = make_schedule("gpipe", 2, 3)
    links = _links(ctx, schedule)
    hold = {"mb2": True}
    links.begin(schedule.ranks[ctx.rank], lambda a: False if a.microbatch == 2 and hold["mb2"] else None)
    f0, f1, f2 = (a for a in schedule.ranks[ctx.rank] if a.op == "F")
    sent = [torch.arange(6.0).reshape(2, 3), torch.arange(9.0).reshape(3, 3), torch.arange(4.0).reshape(2, 2)]
    out: dict = {}
    if ctx.rank == 0:
        links.send(f0, ACTIVATION, sent[0], 1, None)
    else:
        out["0"] = links.recv(f0, ACTIVATION, 0, None).tolist()  # its header is seen: 1's is guessed from it
        r = links.recvs[(ACTIVATION, 0, 1)]
        out["guessed"] = r.payload_work is not None and not r.checked
    dist.barrier()
    if ctx.rank == 0:
        links.send(f1, ACTIVATION, sent[1], 1, None)
        links.send(f2, ACTIVATION, sent[2], 1, None)
        links.complete_send((ACTIVATION, 0, 0), "test")
        links.complete_send((ACTIVATION, 0, 1), "test")
        links.complete_send((ACTIVATION, 0, 2), "test")
        out["messages"] = links.messages
    else:
        out["1"] = links.recv(f1, ACTIVATION, 0, None).tolist()
        time.sleep(0.2)  # 2's header is in: gloo says so only when waited on, which the receive below does
        out["2 not guessed"] = links.recvs[(ACTIVATION, 0, 2)].payload_work is None
        hold["mb2"] = False
        out["2"] = links.recv(f2, ACTIVATION, 0, None).tolist()
    dist.barrier()
    return out


@pytest.mark.timeout(60)
def test_activation_receive_is_posted_at_the_last_shape_and_moved_when_it_changed():
    sender, receiver = run_ranks(_activation_guessed, 2, timeout_s=40)
    assert receiver["guessed"], receiver
    assert receiver["2 not guessed"], receiver
    want = [torch.arange(6.0).reshape(2, 3), torch.arange(9.0).reshape(3, 3), torch.arange(4.0).reshape(2, 2)]
    for i, t in enumerate(want):
        assert receiver[str(i)] == t.tolist(), (i, receiver)
    assert sender["messages"] == 2 + 3 + 3, "micro-batches 1 and 2 changed shape: header, one byte, payload"


def _first_activation_guessed_from_the_last_step(ctx) -> dict:
    """A step's first activation is guessed at the last step's last shape: its payload receive is posted when the
    step begins, before its header comes; a first activation whose shape changed is moved, as any other."""
    import torch.distributed as dist

    from fourfold.parallel.pipeline.p2p import ACTIVATION

    schedule = make_schedule("gpipe", 2, 2)
    links = _links(ctx, schedule)
    forwards = [a for a in schedule.ranks[ctx.rank] if a.op == "F"]
    steps = [[torch.arange(6.0).reshape(2, 3), torch.ones(2, 3)], [torch.arange(6.0).reshape(2, 3) + 1,
                                                                     torch.zeros(2, 3)],
             [torch.arange(8.0).reshape(2, 4), torch.zeros(2, 4)]]
    out: dict = {"got": [], "posted": [], "messages": []}
    for batch in steps:
        links.begin(forwards, lambda a: None)
        if ctx.rank == 1:
            out["posted"].append(links.recvs[(ACTIVATION, 0, 0)].payload_work is not None)
        dist.barrier()  # the sender sends only now: no header can have come above
        if ctx.rank == 0:
            for a, t in zip(forwards, batch, strict=True):
                links.send(a, ACTIVATION, t, 1, None)
            links.end()
            out["messages"].append(links.messages)
        else:
            out["got"].append([links.recv(a, ACTIVATION, 0, None).tolist() for a in forwards])
            links.end()
    return out


@pytest.mark.timeout(60)
def test_a_steps_first_activation_is_posted_at_the_last_steps_shape():
    sender, receiver = run_ranks(_first_activation_guessed_from_the_last_step, 2, timeout_s=40)
    assert receiver["posted"] == [False, True, True], receiver  # nothing to guess from in the first step
    assert receiver["got"] == [[torch.arange(6.0).reshape(2, 3).tolist(), torch.ones(2, 3).tolist()],
                               [(torch.arange(6.0).reshape(2, 3) + 1).tolist(), torch.zeros(2, 3).tolist()],
                               [torch.arange(8.0).reshape(2, 4).tolist(), torch.zeros(2, 4).tolist()]], receiver
    assert sender["messages"] == [4, 4, 5], "the third step's first activation changed shape: moved, one byte more"


def _lengths(steps: list) -> list:
    """The steps cut to 8, 5 and 8 positions: each step's first activation changes shape, then changes back."""
    return [(x[:, :t], y[:, :t]) for (x, y), t in zip(steps, (8, 5, 8), strict=True)]


def _lengths_change(ctx) -> dict:
    out = {}
    for name, virtual in (("1f1b", 1), ("interleaved", 2)):
        pipe = build_pipeline(TinyGPT(CFG, seed=0, dtype=torch.float64), make_schedule(name, 2, MICRO, virtual),
                              timeout_s=30)
        losses, state, _ = _train(pipe, _lengths(_batches()))
        out[name] = (losses, state if ctx.rank == 0 else None)
    return out


@pytest.mark.timeout(90)
def test_sequence_length_changing_between_steps_trains_like_one_process():
    """A step whose activations are shorter than the last step's (moved, with the guess posted ahead), and the
    step after it, longer again: the same losses and weights as one process, float64."""
    want_losses, want = reference_run(CFG, _lengths(_batches()))
    ranks = run_ranks(_lengths_change, 2, timeout_s=60)
    for name in ("1f1b", "interleaved"):
        for r, got in enumerate(ranks):
            losses = got[name][0]
            assert max(abs(a - b) for a, b in zip(losses, want_losses, strict=True)) <= TOL64, (name, r, losses)
        state = ranks[0][name][1]
        assert max(_err(state[k], want[k]) for k in want) <= TOL64, name
