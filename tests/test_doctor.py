"""The hang doctor's reasoning (:func:`fourfold.comm.doctor.diagnose`) on hand-made heartbeats, and its account
inside a timed-out wait's error on real ranks. (A stopped rank in a launched run, per layout: test_faults.py.)

Reading a failure: a wrong culprit means the chain of waits was followed wrongly (a rank that arrived in the same
collective counted as missing, or a waiting rank not followed to the rank it waits for).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from fourfold.comm.doctor import diagnose
from fourfold.comm.ledger import Ledger, describe
from fourfold.comm.wait import CommError, bounded_wait
from fourfold.testing import run_ranks

NOW = 1000.0


def _wait(op: str, *, group=None, peer=None, seq=1, since=NOW - 12, awaited="receive from", direction=None,
          message=None):
    return {"op": op, "awaited": awaited, "peer": peer, "group": group, "seq": seq, "shape": [2, 8],
            "dtype": "float64", "since": since, "direction": direction, "message": message}


def _beat(now=None, *, last=None, step=3, stack="train.py:200 _train"):
    return {"n": 7, "t": NOW, "host": "h", "pid": 1, "step": step, "now": now, "last": last,
            "idle_since": NOW - 5, "stack": "" if now else stack}


def test_a_stopped_rank_is_found_and_its_last_entry_named():
    me = _wait("loss all-reduce", group=[0, 1], seq=7)
    beats = {1: _beat(last=_wait("bucket 0", group=[0, 1], seq=6, since=NOW - 20))}
    f = diagnose(0, me, beats, {1: 11.0}, hang_s=10, now=NOW)
    assert f is not None and f.fatal and f.faulty == [1] and f.stopped == [("h", 1)]
    assert "rank 1 never entered it: it is stopped (no heartbeat for 11.0 s" in f.line
    assert "'bucket 0' (collective #6 of ranks [0, 1]" in f.line and "at step 3" in f.line
    assert f.summary.startswith("rank 1 is stopped (no heartbeat for 11 s; last computing at step 3)")


def test_the_chain_of_waits_is_followed_to_the_stopped_rank():
    me = _wait("0B2", peer=1)                                    # 0 waits for 1
    beats = {1: _beat(_wait("1B2", peer=2, since=NOW - 11)),     # 1 waits for 2 ...
             2: _beat(_wait("2F3", peer=3, since=NOW - 20)),     # 2 waits for 3 ...
             3: _beat()}                                         # ... which is stopped
    f = diagnose(0, me, beats, {3: 12.0}, hang_s=10, now=NOW)
    assert f is not None and f.faulty == [3]
    assert f.line.index("rank 1 never entered") < f.line.index("rank 2 never entered") < f.line.index(
        "rank 3 never entered it: it is stopped")


def test_ranks_waiting_on_each_other_are_a_deadlock():
    me = _wait("all-reduce A", group=[0, 1], seq=4)
    beats = {1: _beat(_wait("all-reduce B", group=[1, 0, 2], seq=2, since=NOW - 11)),
             2: _beat(_wait("all-reduce B", group=[1, 0, 2], seq=2, since=NOW - 11))}
    f = diagnose(0, me, beats, {}, hang_s=10, now=NOW)
    assert f is not None and f.fatal and f.faulty == [0, 1]  # 1 waits in B for 0, which waits in A for 1
    assert "rank 0 and rank 1 are in a deadlock" in f.line
    assert f.summary.startswith("ranks 0 and 1 are deadlocked in 'all-reduce A' and 'all-reduce B'")


def test_a_peer_receiving_from_this_rank_has_not_arrived_at_its_send():
    """Pipeline stage 0 waits for the gradient of stage 1, whose last beat shows it waiting for an activation
    from stage 0: the two waits are opposite ends of different messages. Counted as an arrival, the doctor
    never looked further and a stopped last stage ran to --timeout (a flaky fault test, found this way)."""
    me = _wait("0B1", peer=1, direction="recv")
    receiving = _beat(_wait("1F1", peer=0, direction="recv", since=NOW - 20))
    f = diagnose(0, me, {1: receiving}, {1: 9.0}, hang_s=10, now=NOW)
    assert f is not None and f.faulty == [1] and "rank 1 never entered it: it is stopped" in f.line
    f = diagnose(0, me, {1: _beat(_wait("1F1", peer=0, direction="recv", since=NOW - 11))}, {}, hang_s=10, now=NOW)
    assert f is not None and f.faulty == [0, 1] and "deadlock" in f.line  # alive, both receiving: a deadlock
    sending = _beat(_wait("1B1", peer=0, direction="send", since=NOW - 11))
    assert diagnose(0, me, {1: sending}, {}, hang_s=10, now=NOW) is None  # the other end of the same transfer


def test_a_peer_sending_another_message_has_not_arrived():
    """Rank 1 stuck sending message 1B1 while rank 0 waits to receive 1B2 from it: opposite ends, but of two
    messages; 1B2 comes only after 1B1 is taken, so rank 1 is not at the other end of rank 0's wait."""
    me = _wait("0B2", peer=1, direction="recv", message="1B2")
    other = _beat(_wait("1B1", peer=0, direction="send", message="1B1", since=NOW - 11))
    f = diagnose(0, me, {1: other}, {}, hang_s=10, now=NOW)
    assert f is not None and f.faulty == [0, 1] and "deadlock" in f.line, f
    same = _beat(_wait("1B2", peer=0, direction="send", message="1B2", since=NOW - 11))
    assert diagnose(0, me, {1: same}, {}, hang_s=10, now=NOW) is None
    unnamed = _beat(_wait("1B1", peer=0, direction="send", since=NOW - 11))  # a wait that names no message
    assert diagnose(0, me, {1: unnamed}, {}, hang_s=10, now=NOW) is None


def test_arrived_ranks_are_not_blamed_and_a_computing_rank_is_slow_not_hung():
    me = _wait("loss all-reduce", group=[0, 1, 2], seq=5)
    arrived = _beat(_wait("loss all-reduce", group=[0, 1, 2], seq=5, since=NOW - 11))
    assert diagnose(0, me, {1: arrived, 2: arrived}, {}, hang_s=10, now=NOW) is None
    f = diagnose(0, me, {1: arrived, 2: _beat()}, {}, hang_s=10, now=NOW)
    assert f is not None and not f.fatal
    assert "rank 2 has not entered it yet: it is computing" in f.line and "train.py:200 _train" in f.line


def test_a_rank_that_never_started_or_left_is_named():
    me = _wait("recv", peer=1)
    assert diagnose(0, me, {1: None}, {}, hang_s=10, now=NOW).faulty == [1]
    f = diagnose(0, me, {1: {"exited": True, "n": 3}}, {}, hang_s=10, now=NOW)
    assert f.faulty == [1] and "has left the run" in f.line


def test_the_ledger_numbers_waits_per_group_and_names_shape_and_dtype():
    ledger = Ledger()
    ledger.reset(rank=2)
    a = ledger.enter("x", "the group of", group=(0, 2), tensor=torch.zeros(3, 4))
    ledger.leave(a)
    b = ledger.enter("y", "the group of", group=(0, 2))
    assert (a.seq, b.seq, ledger.current) == (1, 2, b)
    assert describe(a.as_dict()) == "'x' (collective #1 of ranks [0, 2], float32[3, 4])"
    ledger.leave(b)
    assert ledger.current is None and ledger.last is b


def _late_peer(ctx):
    """Rank 1 computes (sleeps) past rank 0's timeout; rank 0's error carries the doctor's account."""
    t = torch.ones(4)
    if ctx.rank == 1:
        time.sleep(6)
        return "slept"
    time.sleep(1.5)  # rank 1's doctor has beaten while sleeping
    try:
        bounded_wait(dist.all_reduce(t, async_op=True), 2.0, rank=0, op="loss all-reduce",
                     awaited="the group of", group_ranks=[0, 1])
    except CommError as e:
        return str(e)
    return "completed"


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_timed_out_wait_says_what_the_missing_rank_is_doing():
    message, _ = run_ranks(_late_peer, 2, timeout_s=60, dist_timeout_s=30)
    assert "did not complete within 2 s" in message, message
    assert "Hang doctor:" in message and "rank 1 has not entered it yet: it is computing" in message, message
    assert "_late_peer" in message, message  # its stack


def test_a_silent_but_running_process_is_starved_not_stopped():
    import os
    import signal
    import subprocess
    import sys

    from fourfold.comm.doctor import running

    assert running(os.getpid()) and not running(None) and not running(2**22 + 12345)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert running(child.pid)
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while running(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(child.pid)  # SIGSTOP: the doctor may call it stopped
    finally:
        child.kill()
        child.wait()
    assert not running(child.pid)  # gone


def test_the_heartbeat_outlives_a_failed_store_call_and_stops_when_the_store_is_gone(monkeypatch):
    import json

    from fourfold.comm import doctor as doctor_mod

    monkeypatch.setattr(doctor_mod, "INTERVAL_S", 0.01)
    d = doctor_mod.Doctor(dist.HashStore(), 0, 2, hang_s=0).start()
    real, calls = d._beat, []

    def flaky(fail: int) -> None:
        calls.append(1)
        if len(calls) <= fail:
            raise RuntimeError("the store timed out")
        real()

    try:
        d._beat = lambda: flaky(3)  # three failed beats in a row, then the store answers again
        deadline = time.monotonic() + 10
        while json.loads(d.store.get("0"))["n"] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(calls) > 3 and d._thread.is_alive()  # it went on beating after the failures
        calls.clear()
        d._beat = lambda: flaky(10**9)  # the store is gone for good: the thread ends by itself
        d._thread.join(timeout=10)
        assert not d._thread.is_alive() and len(calls) == doctor_mod.GIVE_UP
    finally:
        d.stop()


class _Broken:
    """A dist.Work whose wait fails as gloo's does when the peer's process is gone (or with ``error``)."""

    def __init__(self, after_s: float, error: str = "Connection closed by peer [127.0.0.1]:1234") -> None:
        self.after_s, self.error = after_s, error

    def wait(self, timeout):
        time.sleep(self.after_s)
        raise RuntimeError(self.error)


def test_a_broken_connection_is_a_peer_gone_echo_and_train_prints_it_in_one_line(tmp_path, monkeypatch, capsys):
    from fourfold import train as train_mod

    with pytest.raises(CommError, match="rank 0: 0F1: send to rank 1 failed after .* a peer's connection broke") as gone:
        bounded_wait(_Broken(0.0), 5.0, rank=0, op="0F1", awaited="send to", peer=1)
    assert gone.value.peer_gone
    with pytest.raises(CommError, match="did not complete within 0.05 s") as late:
        bounded_wait(_Broken(0.06), 0.05, rank=0, op="0F1", awaited="send to", peer=1)
    assert not late.value.peer_gone  # a timeout: its traceback says where the rank waited
    with pytest.raises(CommError) as local:
        bounded_wait(_Broken(0.0, "invalid tensor size"), 5.0, rank=0, op="0F1", awaited="send to", peer=1)
    assert not local.value.peer_gone  # this rank's own failure, not an echo: it keeps its traceback

    def fails(cfg):
        raise gone.value

    monkeypatch.setattr(train_mod, "train", fails)
    capsys.readouterr()
    assert train_mod.main(["--steps", "1", "--no-progress", "--out", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fourfold train: rank 0: 0F1: send to rank 1 failed") and "Traceback" not in err, err
