"""Pipeline schedules as data (pure: no processes, no torch).

How to read a failure: a broken schedule raises ``ScheduleError`` whose message holds the rank x step grid with
the failing step marked ``>1B3<``; a golden-grid mismatch prints both grids, one row per rank, so the first
differing cell is the first action a generator placed differently from the hand-drawn picture.

Cost convention in these tests: f, b, w are forward, input-gradient and weight-gradient times of one
micro-batch through one rank's share of the model; a schedule that does not split backward runs B = b + w.
The golden grids below were drawn by hand, one action per time slot, from the rules each schedule is defined
by (see docs/pipeline-schedules.md), not printed from the code.
"""

from __future__ import annotations

import itertools
import random
import time

import pytest

from fourfold.parallel.schedule import (
    SCHEDULES,
    Action,
    Schedule,
    ScheduleError,
    format_grid,
    gpipe,
    interleaved,
    make_schedule,
    naive,
    one_f_one_b,
    parse_actions,
    validate,
    zero_bubble,
)
from fourfold.parallel.timeline import peak_in_flight, simulate, theory_bubble

COSTS = [(1.0, 1.0, 1.0), (1.0, 2.0, 0.0), (1.0, 0.5, 0.5), (2.0, 1.0, 3.0), (1.0, 3.0, 1.0)]


def cells(grid: str) -> list[list[str]]:
    """The grid's cells, one list per rank (the header and the ``rank r`` labels dropped)."""
    return [line.split()[2:] for line in grid.splitlines()[1:]]


def hand(*rows: str) -> list[list[str]]:
    return [row.split() for row in rows]


def build(name: str, pp: int, m: int, virtual: int, *rows: str, split: bool = False) -> Schedule:
    return Schedule(name, pp, m, virtual, tuple(parse_actions(r) for r in rows), split_backward=split)


# ---------------------------------------------------------------------------------------------------------
# actions

def test_action_prints_and_parses_like_1F3():
    a = Action(1, "F", 3)
    assert str(a) == "1F3"
    assert Action.parse("1F3") == a
    assert Action.parse("12W10") == Action(12, "W", 10)
    assert parse_actions("0F0 0B0") == (Action(0, "F", 0), Action(0, "B", 0))
    with pytest.raises(ValueError, match="<stage><F|B|W><microbatch>, e.g. 1F3, got '1X3'"):
        Action.parse("1X3")


# ---------------------------------------------------------------------------------------------------------
# every generator, every small size: valid, or refused naming the numbers

@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_and_size_is_valid_or_refused_with_both_numbers(name):
    for pp, m, v in itertools.product(range(1, 5), range(1, 9), (1, 2)):
        refused = (name != "interleaved" and v != 1) or (name == "interleaved" and (v < 2 or m % pp))
        if not refused:
            schedule = make_schedule(name, pp, m, v)  # validates
            assert (schedule.pp, schedule.microbatches, schedule.virtual) == (pp, m, v)
            assert schedule.split_backward == (name == "zb")
            continue
        with pytest.raises(ValueError) as e:
            make_schedule(name, pp, m, v)
        text = str(e.value)
        assert not isinstance(e.value, ScheduleError), text  # refused up front, not built broken
        if name == "interleaved" and v >= 2:
            assert f"microbatches={m}" in text and f"pp={pp}" in text, text
        else:
            assert f"virtual={v}" in text and f"pp={pp}" in text, text


def test_bad_sizes_and_names_are_refused():
    with pytest.raises(ValueError, match="pp must be a positive integer, got pp=0"):
        gpipe(0, 4)
    with pytest.raises(ValueError, match="microbatches must be a positive integer, got microbatches=0"):
        one_f_one_b(2, 0)
    with pytest.raises(ValueError, match="got microbatches=6 and pp=4: use 4 or 8 micro-batches"):
        interleaved(4, 6, 2)
    with pytest.raises(ValueError, match="got microbatches=3 and pp=4: use 4 micro-batches"):
        interleaved(4, 3, 2)
    with pytest.raises(ValueError, match="Did you mean '1f1b'"):
        make_schedule("1fb1", 2, 4)
    with pytest.raises(ValueError, match="one action list per rank, got 1 lists for pp=2"):
        Schedule("x", 2, 1, 1, ((Action(0, "F", 0),),))


# ---------------------------------------------------------------------------------------------------------
# golden grids, drawn by hand (one slot per action; "." = idle)

def test_gpipe_2x2_grid():
    # all forwards, then all backwards; rank 1's B0 may start as soon as its F1 is done
    assert cells(format_grid(gpipe(2, 2))) == hand(
        "0F0 0F1  .   .  0B0 0B1",
        " .  1F0 1F1 1B0 1B1  . ")


def test_naive_2x2_grid_runs_one_device_at_a_time():
    assert cells(format_grid(naive(2, 2))) == hand(
        "0F0  .   .  0B0 0F1  .   .  0B1",
        " .  1F0 1B0  .   .  1F1 1B1  . ")


def test_1f1b_2x4_grid():
    # rank 0 warms up with pp-1-0 = 1 forward, then alternates; rank 1 (the last) alternates from the start
    assert cells(format_grid(one_f_one_b(2, 4))) == hand(
        "0F0 0F1  .  0B0 0F2 0B1 0F3 0B2  .  0B3",
        " .  1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3  . ")


def test_1f1b_4x8_orders():
    # rank r: pp-1-r warm-up forwards, then F/B pairs until the forwards run out, then the backwards left
    assert [" ".join(map(str, row)) for row in one_f_one_b(4, 8).ranks] == [
        "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7",
        "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7",
        "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7",
        "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7",
    ]


def test_interleaved_2x2_v2_grid():
    # stages 0, 2 on rank 0 and 1, 3 on rank 1. Rank 0 warms up with 2(pp-1-0) + (v-1)pp = 4 forwards: all
    # of them, micro-batches 0, 1 through chunk 0 then chunk 1; rank 1 with 2: then 3F0 3B0 3F1 3B1, then
    # chunk 0's backwards
    assert cells(format_grid(interleaved(2, 2, 2))) == hand(
        "0F0 0F1 2F0 2F1  .  2B0  .  2B1 0B0 0B1",
        " .  1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1  . ")


def test_zero_bubble_2x2_grid():
    # 1F1B's F/B order; B sends its gradient at once; a W fills a slot where nothing else can start, and no
    # rank holds more than pp = 2 micro-batches between F and W (so rank 1 runs F1 before W0)
    assert cells(format_grid(zero_bubble(2, 2))) == hand(
        "0F0 0F1  .  0B0 0W0 0B1 0W1",
        " .  1F0 1B0 1F1 1B1 1W0 1W1")


def test_grid_marks_a_step():
    grid = format_grid(one_f_one_b(2, 4), mark=(1, 2))  # rank 1's third action, 1F1, in time slot 3
    assert cells(grid)[1][3] == ">1F1<"
    assert cells(format_grid(one_f_one_b(2, 4), mark=(1, 2), columns="step"))[1][2] == ">1F1<"
    assert grid.splitlines()[0].split()[:3] == ["time", "0", "1"]


# ---------------------------------------------------------------------------------------------------------
# broken schedules are caught, with the grid printed and the failing step marked

def _broken(schedule: Schedule) -> ScheduleError:
    with pytest.raises(ScheduleError) as e:
        validate(schedule)
    err = e.value
    assert "step " in str(err) and "rank 0" in str(err)  # the grid is in the message
    if err.rank is not None:
        row = [line for line in str(err).splitlines() if line.startswith(f"rank {err.rank} ")][0]
        assert row.split()[2 + err.step].startswith(">"), str(err)
    return err


def test_a_broken_schedule_prints_by_step_and_cannot_be_simulated():
    broken = build("gpipe", 2, 2, 1, "0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1")
    assert format_grid(broken).splitlines()[0].startswith("step")
    with pytest.raises(ScheduleError):
        simulate(broken)
    assert issubclass(ScheduleError, ValueError)
    with pytest.raises(ValueError, match="costs must be >= 0 with f \\+ b \\+ w > 0, got f=-1"):
        simulate(gpipe(2, 2), f=-1)


def test_swapping_two_actions_into_a_deadlock_is_caught():
    # gpipe 2x2 with rank 0's 0F1 and 0B0 swapped: rank 0 waits for 1B0, which waits (behind 1F1 on rank 1)
    # for 0F1, which is behind 0B0 on rank 0
    err = _broken(build("gpipe", 2, 2, 1, "0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"))
    assert "deadlock" in str(err)
    assert "rank 0 waits at step 1 (0B0) for the gradient of 1B0" in str(err)
    assert "rank 1 waits at step 1 (1F1) for the activation of 0F1" in str(err)
    assert (err.rank, err.step) == (0, 1) and ">0B0<" in str(err)


def test_interleaved_stage_order_on_one_rank_is_a_deadlock():
    err = _broken(build("interleaved", 2, 2, 2, "2F0 0F0 0F1 2F1 2B0 0B0 2B1 0B1",
                        "1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1"))
    assert "deadlock" in str(err) and ">2F0<" in str(err)


def test_dropped_action_is_caught_at_the_step_that_needs_it():
    err = _broken(build("1f1b", 2, 2, 1, "0F0 0F1 0B0 0B1", "1F0 1B0 1F1"))
    assert "first 1B1 (it belongs on rank 1)" in str(err) and ">0B1<" in str(err)
    err = _broken(build("1f1b", 2, 2, 1, "0F0 0F1 0B0", "1F0 1B0 1F1 1B1"))  # nothing waits for 0B1
    assert "first 0B1" in str(err) and err.rank is None


def test_action_on_the_wrong_rank_is_caught():
    err = _broken(build("1f1b", 2, 2, 1, "0F0 0F1 0B0 1B1", "1F0 1F1 1B0 0B1"))
    assert "1B1 at rank 0 step 3 is on the wrong rank: stage 1 lives on rank 1" in str(err)
    assert ">1B1<" in str(err)


def test_backward_before_forward_is_caught():
    err = _broken(build("1f1b", 2, 2, 1, "0F0 0F1 0B0 0B1", "1F0 1B1 1F1 1B0"))
    assert "1B1 at rank 1 step 1 comes before 1F1 (it comes later, at step 2)" in str(err)


def test_weight_gradient_rules():
    err = _broken(build("1f1b", 2, 1, 1, "0F0 0B0", "1F0 1B0 1W0"))
    assert "does not split backward" in str(err) and ">1W0<" in str(err)
    err = _broken(build("zb", 2, 1, 1, "0F0 0B0 0W0", "1F0 1W0 1B0", split=True))
    assert "1W0 at rank 1 step 1 comes before 1B0" in str(err)
    err = _broken(build("zb", 2, 1, 1, "0F0 0B0 0W0", "1F0 1B0", split=True))
    assert "first 1W0" in str(err)


def test_duplicate_and_out_of_range_actions_are_caught():
    err = _broken(build("gpipe", 1, 2, 1, "0F0 0F1 0F1 0B0 0B1"))
    assert "0F1 at rank 0 step 2 appears twice: also at rank 0 step 1" in str(err)
    err = _broken(build("gpipe", 1, 2, 1, "0F0 0F1 0F2 0B0 0B1"))
    assert "out of range" in str(err) and ">0F2<" in str(err)


# ---------------------------------------------------------------------------------------------------------
# simulated time: the rules, and the textbook bubbles

def test_simulation_keeps_every_dependency_and_never_overlaps_a_rank():
    rng = random.Random(0)
    for name, pp, m in itertools.product(SCHEDULES, (1, 2, 3, 4), (1, 2, 4, 8)):
        v = 2 if name == "interleaved" else 1
        if name == "interleaved" and m % pp:
            continue
        f, b, w, comm = (rng.uniform(0.1, 2) for _ in range(4))
        t = simulate(make_schedule(name, pp, m, v), f, b, w, comm)
        at = {x.action: x for row in t.ranks for x in row}
        for row in t.ranks:
            assert all(prev.end <= nxt.start + 1e-12 for prev, nxt in itertools.pairwise(row))
            for x in row:
                s, i = x.action.stage, x.action.microbatch
                hop = comm if pp > 1 else 0.0
                if x.action.op == "F" and s > 0:
                    assert x.start >= at[Action(s - 1, "F", i)].end + hop - 1e-9
                if x.action.op == "B":
                    assert x.start >= at[Action(s, "F", i)].end - 1e-9
                    if s < pp * v - 1:
                        assert x.start >= at[Action(s + 1, "B", i)].end + hop - 1e-9
                if x.action.op == "W":
                    assert x.start >= at[Action(s, "B", i)].end - 1e-9
        assert t.makespan == max(x.end for row in t.ranks for x in row)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(name):
    # exact for any f, b, w with equal stages and comm = 0 (the fill costs (p-1)f, the drain (p-1)(b+w))
    for pp, m, (f, b, w) in itertools.product(range(1, 5), range(1, 9), COSTS):
        t = simulate(make_schedule(name, pp, m), f, b, w)
        assert t.bubble == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12), (pp, m, f, b, w)
        assert t.bubble_by_rank == pytest.approx([t.bubble] * pp)
        assert t.makespan == pytest.approx((m + pp - 1) * (f + b + w))


def test_naive_runs_one_rank_at_a_time():
    for pp, m in itertools.product(range(1, 5), range(1, 5)):
        t = simulate(naive(pp, m), 1.0, 2.0, 0.5)
        assert t.makespan == pytest.approx(m * pp * 3.5)
        assert t.bubble == pytest.approx(theory_bubble("naive", pp, m)) == pytest.approx((pp - 1) / pp)


def test_messages_add_their_time_on_the_way_forward_and_back():
    # gpipe: the fill crosses p-1 links, and so does the drain
    for pp, m in ((2, 2), (4, 8)):
        t = simulate(gpipe(pp, m), 1.0, 1.0, 1.0, comm=0.25)
        assert t.makespan == pytest.approx((m + pp - 1) * 3 + 2 * (pp - 1) * 0.25)


def test_ranks_sharing_cores_slow_each_other_only_while_they_compute_at_once():
    # one core shared fairly (each of k computing ranks at 1/k): the core never idles while any rank can run,
    # so every schedule takes all its work, and a naive one (one rank at a time) takes no longer than alone
    one_core = lambda k: 1.0 / k  # noqa: E731
    for name, pp, m in itertools.product(("gpipe", "1f1b", "zb"), (2, 3), (2, 4)):
        t = simulate(make_schedule(name, pp, m), 1.0, 2.0, 0.5, speed=one_core)
        assert t.makespan == pytest.approx(pp * m * 3.5), (name, pp, m)
        assert t.makespan >= simulate(make_schedule(name, pp, m), 1.0, 2.0, 0.5).makespan
    alone = simulate(naive(3, 2), 1.0, 2.0, 0.5)
    assert simulate(naive(3, 2), 1.0, 2.0, 0.5, speed=one_core).makespan == pytest.approx(alone.makespan)
    # enough cores for everyone: the same timeline as a device each
    free = simulate(make_schedule("1f1b", 4, 8), 1.0, 2.0, 0.5, comm=0.1, speed=lambda k: 1.0)
    assert free.ranks == simulate(make_schedule("1f1b", 4, 8), 1.0, 2.0, 0.5, comm=0.1).ranks


def test_the_waiting_part_of_an_action_uses_no_core():
    # (computing, waiting) costs on one core shared fairly: the wait goes at full speed and leaves the core to
    # the other rank. naive runs one rank at a time, so nothing changes; gpipe's waits overlap the other's work
    one_core = lambda k: 1.0 / k  # noqa: E731
    s = make_schedule("naive", 2, 1)
    both = simulate(s, cost=lambda a: (1.0, 0.5), speed=one_core)
    assert both.makespan == pytest.approx(4 * 1.5)  # alone on the core: compute, then wait
    plain = simulate(s, cost=lambda a: 1.5, speed=one_core)
    assert plain.ranks == both.ranks  # one rank at a time: where the wait sits does not matter
    g = make_schedule("gpipe", 2, 4)
    waits = simulate(g, cost=lambda a: (1.0, 1.0), speed=one_core).makespan
    assert waits < simulate(g, cost=lambda a: 2.0, speed=one_core).makespan  # waits overlap the other's compute
    assert waits >= 2 * 4 * 2  # the core's work: 16 actions of 1


def test_interleaved_bubble_is_smaller_and_follows_its_formula():
    for pp, k, v in itertools.product((2, 3, 4), (1, 2, 3), (2, 3)):
        m = k * pp
        t = simulate(interleaved(pp, m, v))
        assert t.bubble == pytest.approx((pp - 1) / (v * m + pp - 1), abs=1e-12)
        assert t.bubble == pytest.approx(theory_bubble("interleaved", pp, m, v))
        assert t.bubble < simulate(one_f_one_b(pp, m)).bubble


def test_zero_bubble_is_smaller_than_1f1b_and_follows_zb_h1():
    for pp, m in itertools.product(range(2, 6), range(1, 11)):
        for f, b, w in COSTS:
            zb, ofob = simulate(zero_bubble(pp, m), f, b, w), simulate(one_f_one_b(pp, m), f, b, w)
            assert zb.makespan <= ofob.makespan + 1e-12
            if w > 0:
                assert zb.bubble < ofob.bubble, (pp, m, f, b, w)
            if m >= pp and w <= min(f, b):  # ZB-H1: each rank idles (p-1)(f+b-w); a W fits any gap
                assert zb.bubble == pytest.approx(theory_bubble("zb", pp, m, 1, f, b, w), abs=1e-12)
                assert zb.makespan == pytest.approx(m * (f + b + w) + (pp - 1) * (f + b - w))


# ---------------------------------------------------------------------------------------------------------
# memory: micro-batches in flight

def test_peak_in_flight():
    for pp, m in itertools.product(range(1, 5), range(1, 9)):
        assert peak_in_flight(gpipe(pp, m)) == [m] * pp
        assert peak_in_flight(naive(pp, m)) == [1] * pp
        ofob = peak_in_flight(one_f_one_b(pp, m))
        assert ofob == [min(pp - r, m) for r in range(pp)] and max(ofob) <= pp
        zb = zero_bubble(pp, m)
        assert peak_in_flight(zb) == ofob  # 1F1B's F/B order
        assert max(peak_in_flight(zb, until="W")) <= min(pp, m)  # held until W, still within 1F1B's peak
        assert peak_in_flight(gpipe(pp, m), until="W") == [m] * pp  # no W: counted until B
    # interleaved counts (stage, micro-batch) pairs, each 1/virtual of a rank's layers: rank 0 warms up with
    # 2(pp-1) + (v-1)pp forwards and holds one more in the first steady step
    assert peak_in_flight(interleaved(4, 8, 2)) == [11, 9, 7, 5]


# ---------------------------------------------------------------------------------------------------------
# the command

def test_schedule_command_prints_and_draws(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from fourfold.cli.schedule import main

    png = tmp_path / "1f1b.png"
    assert main(["--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--out", str(png)]) == 0
    out = capsys.readouterr().out
    assert "rank 0  0F0  0F1  0F2  0F3" in out
    assert "bubble 27.3% (theory (p-1)/(m+p-1) = 27.3%)" in out
    assert f"picture: {png}" in out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000

    png = tmp_path / "all.png"
    assert main(["--schedule", "all", "--pp", "2", "--microbatches", "3", "--out", str(png)]) == 0
    out = capsys.readouterr().out
    assert "interleaved: skipped: interleaved needs microbatches divisible by pp" in out
    assert "zb: ZB-H1" in out and png.exists()


def test_schedule_command_refuses_what_cannot_run(capsys):
    from fourfold.cli.schedule import main

    with pytest.raises(SystemExit):
        main(["--schedule", "interleaved", "--pp", "4", "--microbatches", "6"])
    assert "got microbatches=6 and pp=4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--schedule", "1f1b", "--comm", "-1"])
    assert "costs must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--schedule", "1f1b", "--microbatchs", "6"])
    assert "Did you mean '--microbatches'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--schedule", "1f1b", "--f", "inf"])
    assert "--f must be a finite time, got inf" in capsys.readouterr().err


def test_schedule_command_refuses_huge_sizes_at_once(capsys):
    from fourfold.cli.schedule import main

    start = time.perf_counter()
    with pytest.raises(SystemExit):
        main(["--schedule", "all", "--pp", "64", "--microbatches", "4096"])
    assert "makes 1,572,864 actions to place and draw" in capsys.readouterr().err
    assert time.perf_counter() - start < 5  # refused before building them (building takes minutes)


@pytest.mark.parametrize("name,virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1)])
def test_an_action_sends_exactly_the_messages_other_ranks_wait_for(name, virtual):
    from fourfold.parallel.schedule.order import _inputs

    s = make_schedule(name, 2, 4, virtual)
    sent = {(a.stage, a.op, a.microbatch) for row in s.ranks for a in row if s.sends(a)}
    awaited = {key for row in s.ranks for a in row for key, message in _inputs(a, s.stages)
               if message and s.owner(key[0]) != s.owner(a.stage)}
    assert sent == awaited and all(not s.sends(a) for row in s.ranks for a in row if a.op == "W")
