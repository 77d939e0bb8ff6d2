"""The fault suite (``pytest -m faults``; part of ``make test``): for each layout (dp, tp, pp, dp x tp x pp), a
launched ``fourfold train`` with one rank

* SIGKILLed mid-run with ``--max-restarts 1``: the run comes back from its last checkpoint by itself and its
  metrics equal the uninterrupted run's (float64, 1e-10);
* SIGSTOPped mid-run: the hang doctor ends the job within ``--hang-threshold`` + 10 s, and the launcher's last
  line names the stopped rank; the rank that found it names the operation it waited in.

and, without restarts, a SIGKILLed rank is named with its signal in the launcher's last line.

Reading a failure: a restarted run whose losses differ means the checkpoint lost state (see test_checkpoint.py);
a stopped run that outlives the limit means the doctor did not look (its heartbeat thread died, or the wait
never entered the ledger) or the launcher did not kill the stopped rank (torchrun alone waits 30 s).
(SIGKILL during a checkpoint save: test_checkpoint.py.)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from fourfold import train as train_mod
from helpers import TOL64, launched, losses, rank_of, rows, wait_for_rows, workers

pytestmark = [pytest.mark.faults, pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux /proc")]

SMALL = ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--seq-len", "16", "--batch-size", "8",
         "--no-progress", "--dtype", "float64"]
LAYOUTS = {
    "dp": ["--nproc", "2"],
    "tp": ["--nproc", "2", "--tp", "2"],
    "pp": ["--nproc", "2", "--pp", "2", "--schedule", "1f1b", "--microbatches", "2"],
    "3d": ["--nproc", "8", "--dp", "2", "--tp", "2", "--pp", "2", "--schedule", "1f1b", "--microbatches", "2"],
}
HANG_S = 3.0


def _last_rank(launcher: int) -> tuple[int, int]:
    """(pid, rank) of the highest rank of a launched run."""
    ranks = {rank_of(p): p for p in workers(launcher)}
    top = max(r for r in ranks if r is not None)
    return ranks[top], top


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_killed_rank_is_restarted_from_the_last_checkpoint_and_the_curve_is_unchanged(tmp_path, layout):
    steps = ["--steps", "40", "--checkpoint-every", "5"]
    ref = tmp_path / "ref"
    assert train_mod.main([*SMALL, *steps, "--no-trace", "--out", str(ref)]) == 0
    out = tmp_path / "killed"
    with launched([*SMALL, *steps, *LAYOUTS[layout], "--max-restarts", "1", "--out", str(out)]) as proc:
        wait_for_rows(out, 8, proc)
        pid, _ = _last_rank(proc.pid)
        os.kill(pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output
    run = json.loads((out / "run.json").read_text())
    assert run["restarts"] == 1 and run["resumed_from"]["step"] >= 5, run
    said = f"fourfold train: restart 1 of 1: resuming from step {run['resumed_from']['step']} "
    assert output.count(said) == 1, output  # once, by rank 0
    if "--pp" in LAYOUTS[layout]:  # the schedule that ran, and the blocks each stage held
        cut = run["pipeline"].pop("cut")
        assert run["pipeline"] == {"schedule": "1f1b", "microbatches": 2, "virtual": 1, "stages": 2}, run
        assert len(cut) == 2 and cut[0][0] == "embed" and cut[-1][-1] == "head", cut
    else:
        assert run["pipeline"] is None, run
    launch = run["config"]["launch"]  # the launcher's flags, though its ranks are started without them
    assert launch["nproc"] == int(LAYOUTS[layout][1]) and launch["max_restarts"] == 1, launch
    assert [r["step"] for r in rows(out)] == list(range(1, 41))
    got, want = losses(out), losses(ref)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= TOL64


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_stopped_rank_is_named_and_the_job_ends_within_the_threshold(tmp_path, layout):
    out = tmp_path / "stopped"
    argv = [*SMALL, "--steps", "100000", "--no-trace", "--hang-threshold", str(HANG_S), *LAYOUTS[layout],
            "--out", str(out)]
    with launched(argv) as proc:
        wait_for_rows(out, 3, proc)
        pid, victim = _last_rank(proc.pid)
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        output, _ = proc.communicate(timeout=HANG_S + 60)
        took = time.monotonic() - stopped
    assert proc.returncode == 1, output
    assert took <= HANG_S + 10, f"the job took {took:.1f} s to end after rank {victim} stopped:\n{output}"
    last = output.strip().splitlines()[-1]
    assert f"rank {victim} is stopped" in last and last.startswith("fourfold: hang:"), output
    found = [line for line in output.splitlines() if "has waited" in line and "never entered it" in line]
    assert len(found) == 1, output  # one rank reports; the others end quietly
    assert f"rank {victim} never entered it: it is stopped" in found[0], found[0]


@pytest.mark.timeout(120)
def test_a_killed_rank_without_restarts_is_named_with_its_signal_in_the_last_line(tmp_path):
    out = tmp_path / "killed"
    with launched([*SMALL, "--steps", "100000", "--no-trace", *LAYOUTS["dp"], "--out", str(out)]) as proc:
        wait_for_rows(out, 3, proc)
        pid, victim = _last_rank(proc.pid)
        os.kill(pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, output
    last = output.strip().splitlines()[-1]
    assert last == f"fourfold: rank {victim} was killed by signal 9 (SIGKILL); the others were stopped with it.", \
        output
    assert "failed (exitcode" not in output, output  # torchrun's own line for it, which says less


@pytest.mark.timeout(120)
def test_a_run_stopped_by_sigterm_says_what_to_resume_from(tmp_path):
    out = tmp_path / "stopped"
    argv = [*SMALL, "--steps", "100000", "--no-trace", "--checkpoint-every", "2", *LAYOUTS["dp"], "--out", str(out)]
    with launched(argv) as proc:
        wait_for_rows(out, 5, proc)  # step 4's checkpoint is complete
        os.kill(proc.pid, signal.SIGTERM)  # the launcher: a scheduler's or a user's kill
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, output
    last = output.strip().splitlines()[-1]
    assert last.startswith("fourfold: stopped by signal SIGTERM; the ranks were stopped with it; the newest "
                           "complete checkpoint is step "), output
    assert last.endswith(f"continue with the same flags and --resume {out}."), output


@pytest.mark.timeout(120)
def test_an_error_every_rank_raises_is_printed_once_and_one_ranks_own_under_its_rank(tmp_path, monkeypatch):
    # a bug in the user's forward, mid-run: on every rank, then on rank 1 only (the other then loses its peer)
    (tmp_path / "buggy.py").write_text(
        "import os\nfrom torch import nn\n\n\n"
        "class Buggy(nn.Sequential):\n"
        "    calls = 0\n\n"
        "    def forward(self, ids):\n"
        "        Buggy.calls += 1\n"
        "        if Buggy.calls > 3 and os.environ['RANK'] in os.environ['BUGGY_RANKS'].split(','):\n"
        "            once = os.environ.get('BUGGY_ONCE')\n"
        "            if once is None or not os.path.exists(once):\n"
        "                if once is not None:\n"
        "                    open(once, 'w').close()\n"
        "                raise KeyError('token ' + 'not in the vocabulary')\n"
        "        return super().forward(ids)\n\n\n"
        "def build():\n"
        "    return Buggy(nn.Embedding(256, 8), nn.Linear(8, 256))\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    argv = ["--model", "buggy:build", "--steps", "6", "--seq-len", "8", "--batch-size", "4", "--no-progress",
            "--no-trace", "--nproc", "2"]
    for ranks, heading in (("0,1", "fourfold: ranks 0, 1 raised (the same error):"), ("1", "fourfold: rank 1 raised:")):
        monkeypatch.setenv("BUGGY_RANKS", ranks)
        with launched([*argv, "--out", str(tmp_path / f"run{ranks}")]) as proc:
            output, _ = proc.communicate(timeout=90)
        assert proc.returncode == 1, output
        assert output.count("Traceback (most recent call last)") == 1, output
        assert heading in output and "buggy.py" in output and "KeyError: 'token not in the vocabulary'" in output, \
            output
        assert "[rank0]" not in output and "[rank1]" not in output, output  # torch's per-rank copies
        assert output.strip().splitlines()[-1].endswith("failed (exit code 1); its error is printed above."), output
    # an attempt the launcher restarts (--max-restarts) is never reported by it: the rank prints its own
    monkeypatch.setenv("BUGGY_ONCE", str(tmp_path / "raised"))
    with launched([*argv, "--max-restarts", "1", "--checkpoint-every", "1", "--out", str(tmp_path / "restarted")]) \
            as proc:
        output, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, output
    assert output.count("KeyError: 'token not in the vocabulary'") == 1, output
