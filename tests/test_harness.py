"""fourfold.testing.run_ranks: results, failures, hangs and crashes of ranks in separate processes.

Starting processes is the expensive part, so each test starts one group of ranks and checks everything it can
about that run. Every rank function is at module level: ranks unpickle it by name. If a test here fails, the
harness itself is broken: read the assertion first, then the ranks' output (lines starting ``[rank r]``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from fourfold.testing import RankError, RankTimeout, run_ranks


def _report(ctx, offset, *, scale):
    print(f"hello from rank {ctx.rank}")
    t = torch.tensor([float(ctx.rank + offset)])
    dist.all_reduce(t)  # the group really works: sum over ranks of (rank + offset)
    flag = os.environ.get("FOURFOLD_FLAG")
    return ctx.rank, ctx.world_size, t.item() * scale, flag, torch.get_num_threads()


def _rank1_raises(ctx):
    if ctx.rank == 1:
        raise ValueError("rank 1 refuses")
    t = torch.ones(1)
    dist.all_reduce(t)  # the other ranks wait in a collective that rank 1 never joins
    return t.item()


def _sleep_forever():
    time.sleep(3600)


def _wait_for_a_message_never_sent():
    dist.recv(torch.zeros(1), src=1)  # rank 1 sleeps: it never sends, and keeps the connection open


def _ranks_1_and_2_hang(ctx):
    if ctx.rank == 1:
        _sleep_forever()
    if ctx.rank == 2:
        _wait_for_a_message_never_sent()
    return ctx.rank


def _rank1_dies(ctx, how):
    if ctx.rank == 1:
        if how == "exit":
            os._exit(3)
        os.abort()  # SIGABRT, as when gloo aborts
    return ctx.rank


@pytest.fixture
def private_tmp(monkeypatch):
    """Records the temp dirs the harness makes, so a test can check they are removed."""
    made, mkdtemp = [], tempfile.mkdtemp

    def recording_mkdtemp(*args, **kwargs):
        made.append(mkdtemp(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(tempfile, "mkdtemp", recording_mkdtemp)
    return made


def _assert_no_rank_left(private_tmp):
    assert mp.active_children() == []  # every rank process was reaped
    ours = [path for path in private_tmp if os.path.basename(path).startswith("fourfold-ranks-")]
    assert ours and not any(os.path.exists(path) for path in ours)  # FileStore, output and stack files gone


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_in_rank_order(world_size, private_tmp, monkeypatch, capfd):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the harness's default, 1 thread, applies
    results = run_ranks(_report, world_size, 1, scale=2.0, env={"FOURFOLD_FLAG": "on"})
    total = 2.0 * sum(rank + 1 for rank in range(world_size))
    assert results == [(rank, world_size, total, "on", 1) for rank in range(world_size)]
    printed = capfd.readouterr().out.splitlines()
    assert sorted(printed) == [f"[rank {rank}] hello from rank {rank}" for rank in range(world_size)], printed
    _assert_no_rank_left(private_tmp)


@pytest.mark.timeout(60)
def test_failing_rank_is_named_with_its_traceback_and_fails_fast(private_tmp):
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_rank1_raises, 3, timeout_s=60.0)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert message.startswith("rank 1 of 3 failed: ValueError: rank 1 refuses"), message
    assert "Traceback (most recent call last)" in message and "_rank1_raises" in message, message
    assert info.value.rank == 1 and info.value.ranks[0] == 1
    assert elapsed < 20.0, f"took {elapsed:.1f} s: the harness waited for the timeout instead of failing fast"
    _assert_no_rank_left(private_tmp)


@pytest.mark.timeout(60)
def test_hung_ranks_are_killed_and_their_stacks_dumped(private_tmp, capfd):
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_ranks(_ranks_1_and_2_hang, 3, timeout_s=8.0, dist_timeout_s=300.0)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert isinstance(info.value, TimeoutError)
    assert message.startswith("ranks 1, 2 of 3 still running after timeout_s=8.0 s"), message
    assert info.value.ranks == [1, 2]
    assert "_sleep_forever" in info.value.stacks[1], info.value.stacks[1]
    assert "_wait_for_a_message_never_sent" in info.value.stacks[2], info.value.stacks[2]
    printed = capfd.readouterr().err
    assert "_sleep_forever" in printed and "_wait_for_a_message_never_sent" in printed, printed
    assert elapsed < 8.0 + 6.0, f"took {elapsed:.1f} s for an 8 s timeout"
    _assert_no_rank_left(private_tmp)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("how", "expected"), [("exit", "exited with code 3"),
                                               ("abort", "killed by signal SIGABRT")])
def test_rank_dying_without_an_exception_is_reported(how, expected, private_tmp):
    with pytest.raises(RankError) as info:
        run_ranks(_rank1_dies, 2, how, timeout_s=60.0)
    message = str(info.value)
    assert message.startswith("rank 1 of 2 failed:") and expected in message, message
    if how == "abort":
        assert "_rank1_dies" in message, message  # faulthandler's stack of the crash
    _assert_no_rank_left(private_tmp)


@pytest.mark.timeout(10)
def test_bad_input_is_refused_before_any_process_starts():
    with pytest.raises(TypeError, match="picklable"):
        run_ranks(lambda ctx: ctx.rank, 2)
    with pytest.raises(ValueError, match="world_size must be"):
        run_ranks(_report, 0, 1, scale=1.0)
    with pytest.raises(ValueError, match="timeout_s must be"):
        run_ranks(_report, 2, 1, scale=1.0, timeout_s=0)
    assert mp.active_children() == []


def test_the_readme_example_runs_as_a_script_and_one_without_the_main_guard_is_told_why(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    start = readme.index("from fourfold.testing import run_ranks")
    example = readme[start:readme.index("```", start)]
    (tmp_path / "guarded.py").write_text(example)
    lines = example.splitlines()
    guard = next(i for i, line in enumerate(lines) if line.startswith("if __name__"))
    unguarded = "\n".join([*lines[:guard], *(line.strip() for line in lines[guard + 1:])])  # the call at top level
    (tmp_path / "unguarded.py").write_text(unguarded)
    ok = subprocess.run([sys.executable, "guarded.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run([sys.executable, "unguarded.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 1 and "call run_ranks under `if __name__ == \"__main__\":`" in bad.stderr, bad.stderr
