"""End to end: ``fourfold train`` on one process and on two ranks through torchrun.

Reading a failure: a loss mismatch between layouts means data sharding or gradient averaging is wrong; a
non-loopback socket means a single-machine run was reachable from the network.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import torch

from fourfold import train as train_mod
from fourfold.checkpoint import CheckpointError, find_latest, load_checkpoint
from fourfold.mesh import Mesh
from helpers import process_tree

SMALL = ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--seq-len", "16", "--batch-size", "8",
         "--no-progress"]


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _check_chrome_trace(path: Path, ranks: int) -> None:
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    # "rank 1" alone on one process, "rank 1: dp 1" (its place on the mesh) on several
    assert {n.split(":")[0] for n in names} == {f"rank {r}" for r in range(ranks)}
    spans = [e for e in events if e["ph"] == "X"]
    assert spans and all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert {"forward", "backward", "optimizer"} <= {e["name"] for e in spans}


def test_three_float64_steps_are_finite_traced_saved_and_repeatable(tmp_path, capsys):
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        assert train_mod.main(["--steps", "3", "--dtype", "float64", "--out", str(out), *SMALL]) == 0
        losses = _losses(out)
        assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert all(r["tokens_per_s"] > 0 and r["step_time_s"] > 0 for r in rows)
        _check_chrome_trace(out / "trace.json", ranks=1)
        ckpt = load_checkpoint(out / "model.pt")
        assert ckpt["step"] == 3 and ckpt["config"]["train"]["dtype"] == "float64"
        assert all(v.dtype == torch.float64 for v in ckpt["model"].values())
        runs.append(losses)
    assert runs[0] == runs[1]  # bitwise: same seed, same batches, same weights
    assert "trained TinyGPT" in capsys.readouterr().out


def test_an_earlier_run_is_never_overwritten_silently(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--steps", "1", "--out", str(out), "--no-trace", *SMALL]
    assert train_mod.main(args) == 0
    before = (out / "model.pt").read_bytes()
    assert train_mod.main(args) == 2
    assert "already holds an earlier run's checkpoints, metrics.jsonl, model.pt" in capsys.readouterr().err
    assert (out / "model.pt").read_bytes() == before
    assert train_mod.main([*args, "--overwrite"]) == 0


def test_an_overwrite_run_keeps_the_earlier_run_aside_until_it_finishes(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--steps", "2", "--out", str(out), "--no-trace", "--dtype", "float64", *SMALL]
    assert train_mod.main(args) == 0
    first = (out / "metrics.jsonl").read_text()
    assert train_mod.main([*args, "--overwrite", "--lr", "1e300"]) == 1  # crashes at a NaN loss
    aside = list(out.glob(".replaced-*"))
    assert len(aside) == 1 and (aside[0] / "metrics.jsonl").read_text() == first  # the earlier run, whole
    assert not (out / "model.pt").exists()  # and nothing of it mixed with the crashed run's files
    assert "is kept in .replaced-" in capsys.readouterr().err
    # its checkpoints are named where a resume looks for them
    with pytest.raises(CheckpointError, match=rf"{aside[0].name}/checkpoints holds the checkpoints of an earlier run "
                                              "an --overwrite run set aside and did not finish"):
        find_latest(out)
    # the hint's commands work as written, even with unfinished saves of the crashed run in OUT/checkpoints
    had = (out / "checkpoints").exists()
    (out / "checkpoints" / "step-000009").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"move its files back \((mv .*)\) and --resume") as e:
        find_latest(out)
    restore = re.search(r"move its files back \((mv .*)\) and --resume", str(e.value)).group(1)
    tried = tmp_path / "tried"
    shutil.copytree(out, tried, symlinks=True)
    subprocess.run(restore.replace(str(out), str(tried)), shell=True, check=True)
    assert (tried / "metrics.jsonl").read_text() == first and find_latest(tried).parent == tried / "checkpoints"
    (out / "checkpoints" / "step-000009").rmdir()
    if not had:
        (out / "checkpoints").rmdir()
    # a run without --overwrite keeps it, and says so before it starts (OUT holds no run: the crashed one's files
    # gone, as when an --overwrite run fails before it writes any, on bad data say)
    for name in ("metrics.jsonl", "run.json"):
        (out / name).unlink()
    assert train_mod.main([*args, "--checkpoint-every", "0"]) == 0
    assert list(out.glob(".replaced-*")) == aside and (aside[0] / "metrics.jsonl").read_text() == first
    assert f"{aside[0].name}/ holds an earlier run that an --overwrite run set aside and did not finish " \
           "(checkpoints, metrics.jsonl, model.pt, run.json); it is kept" in (err := capsys.readouterr().err), err
    assert train_mod.main([*args, "--overwrite"]) == 0  # an --overwrite run that finishes replaces them all
    assert not list(out.glob(".replaced-*")) and (out / "model.pt").exists()


def test_overwrite_never_takes_files_of_yours_that_share_an_outputs_name(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "run.json").write_text('{"my": "notes"}')
    (out / "model.pt").write_bytes(b"my weights")
    assert train_mod.main(["--steps", "1", "--out", str(out), "--overwrite", "--no-trace", *SMALL]) == 2
    assert "but no run.json a fourfold run wrote, so they may be files of yours" in capsys.readouterr().err
    assert (out / "model.pt").read_bytes() == b"my weights" and not list(out.glob(".replaced-*"))


def test_an_out_under_a_file_is_refused_before_start(tmp_path, capsys):
    (tmp_path / "file").write_text("mine")
    assert train_mod.main(["--out", str(tmp_path / "file" / "run"), "--steps", "1", *SMALL]) == 2
    assert "which is under the file" in capsys.readouterr().err
    assert (tmp_path / "file").read_text() == "mine"


def _alone(tmp_path, node_rank: int, timeout_s: int) -> list[str]:
    """``fourfold train`` flags for machine ``node_rank`` of 2, whose rendezvous is a free port nobody joins."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return ["--nnodes", "2", "--node-rank", str(node_rank), "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-timeout", str(timeout_s), "--steps", "1", "--out", str(tmp_path / "run"), *SMALL]


def test_a_machine_with_no_peer_says_it_waits_and_gives_up(tmp_path, capsys):
    start = time.perf_counter()
    argv = _alone(tmp_path, 0, 2)
    assert train_mod.main(argv) == 1
    err = capsys.readouterr().err
    assert "machine 0 of 2: waiting up to 2 s for the others" in err
    assert "not every machine joined within 2 s" in err
    assert time.perf_counter() - start < 30


@pytest.mark.timeout(120)
def test_a_machine_other_than_0_gives_up_in_one_line_without_cpp_frames(tmp_path):
    import subprocess

    argv = [sys.executable, "-m", "fourfold.cli", "train", *_alone(tmp_path, 1, 2)]
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=90, env=env)
    assert done.returncode == 1, done.stderr
    assert "not every machine joined within 2 s (nnodes=2, this is node 1)" in done.stderr, done.stderr
    assert "frame #" not in done.stderr and "TCPStore.cpp" not in done.stderr, done.stderr  # the retries' stacks


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the watch reads /proc")
@pytest.mark.timeout(120)
def test_ctrl_c_ends_a_machine_waiting_for_the_others_at_once(tmp_path):
    import signal
    import subprocess

    argv = [sys.executable, "-m", "fourfold.cli", "train", *_alone(tmp_path, 1, 60)]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stderr is not None
    for line in proc.stderr:  # the rendezvous has begun: the main thread waits inside the store's C++ code
        if "waiting up to 60 s for the others" in line:
            break
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    start = time.perf_counter()
    rest = proc.stderr.read()
    assert proc.wait(timeout=30) == 130, rest
    assert time.perf_counter() - start < 10, "Ctrl-C waited for the rendezvous timeout"  # it waited 60 s before
    assert "interrupted while machine 1 waited for the others; no rank was started" in rest, rest


@pytest.mark.parametrize("flags,message", [
    (["--nproc", "3"], "batch_size must be divisible by dp, got batch_size=8, dp=3. Pass --batch-size 9"),
    (["--nproc", "3", "--tp", "2"], "divisible by tp*pp, got world_size=3"),
    (["--data", "/nonexistent/file.txt"], "data must be a readable file or folder"),
    (["--sequence-parallel"], "sequence_parallel needs tensor parallelism, got tp=1"),
    (["--nproc", "2", "--pp", "2", "--microbatches", "3"], "got 8 sequences per shard and microbatches=3. Pass "
     "--microbatches 4"),
    (["--nproc", "2", "--pp", "2", "--schedule", "interleaved", "--microbatches", "1"], "microbatches"),
    (["--strategy", "model"], "strategy 'model' places layers on pipeline ranks, got pp=1"),
    (["--nproc", "2", "--tp", "2", "--n-head", "3", "--d-model", "33"], "divisible by tp"),
    (["--vocab-size", "100"], "tokenizer makes ids 0..255, got vocab_size=100 in TinyGPT. Pass --vocab-size 256"),
    # one process draws other dropout masks than the ranks: a correct layout would be called a mismatch
    (["--nproc", "2", "--dropout", "0.1", "--verify", "1"], "verify compares the layout with one process, which "
     "draws other dropout masks, so any dropout makes them differ however right the layout is, got dropout=0.1, "
     "embed.drop (p=0.1)"),
])
def test_bad_layouts_fail_before_any_process_starts(tmp_path, capsys, flags, message):
    start = time.perf_counter()
    try:  # refused by the checks before launch, or already by the flags' Layout (argparse exits 2 itself)
        code = train_mod.main(["--out", str(tmp_path), *SMALL, *flags])
    except SystemExit as e:
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err
    assert time.perf_counter() - start < 5  # no process was spawned


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: --device cuda is a fine choice here")
def test_cuda_on_a_machine_without_it_is_refused_first(tmp_path, capsys):
    """Before the memory line and before any rank starts (each rank used to refuse it alike)."""
    assert train_mod.main(["--out", str(tmp_path), *SMALL, "--nproc", "2", "--device", "cuda"]) == 2
    out, err = capsys.readouterr()
    assert "device must be available, got 'cuda' on a machine without CUDA. Pass --device cpu" in err
    assert "memory per rank" not in out + err


def _listening_addresses(pids: set[int]) -> set[str]:
    """Local addresses of the TCP sockets in LISTEN state owned by ``pids``."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                found.add(cols[1].split(":")[0])
    return found


LOOPBACK = {"0100007F",                                     # 127.0.0.1
            "00000000000000000000000001000000",             # ::1
            "0000000000000000FFFF00000100007F"}             # ::ffff:127.0.0.1


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc to list sockets")
def _run_listening_on_loopback_only(cmd: list[str], ranks: set[int] | None = None,
                                    env: dict[str, str] | None = None) -> str:
    """Run ``cmd`` (with ``env`` added to ours) to its end, watching the listening sockets of its process tree;
    its output. ``ranks``: filled with the ranks seen among its processes by their names (forked ranks are named
    ``fourfold-rankN``)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    seen: set[str] = set()
    try:
        while proc.poll() is None:
            tree = process_tree(proc.pid)
            seen |= _listening_addresses(tree)
            for pid in tree if ranks is not None else ():
                with contextlib.suppress(OSError):
                    name = Path(f"/proc/{pid}/comm").read_text().strip()
                    if name.startswith("fourfold-rank"):
                        ranks.add(int(name[13:]))
            time.sleep(0.05)
        output = proc.stdout.read()
    finally:
        proc.kill()
    assert proc.returncode == 0, output
    assert seen, "no listening socket was observed during the run"
    assert seen <= LOOPBACK, f"a single-machine run listened beyond loopback: {seen - LOOPBACK}"
    return output


@pytest.mark.timeout(120)
def test_torchrun_by_hand_with_the_loopback_rendezvous_listens_on_loopback_only(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend",
           "fourfold-loopback", "--rdzv-endpoint", "127.0.0.1:0", "-m", "fourfold.train", "--steps", "2",
           "--no-trace", *SMALL, "--out", str(tmp_path / "run")]
    assert "on 2 rank(s) (dp=2 tp=1 pp=1)" in _run_listening_on_loopback_only(cmd)


@pytest.mark.timeout(180)
def test_two_ranks_through_torchrun_match_one_process_and_listen_on_loopback_only(tmp_path):
    common = ["--steps", "3", "--dtype", "float64", *SMALL]
    one = tmp_path / "one"
    assert train_mod.main([*common, "--out", str(one)]) == 0

    two = tmp_path / "two"
    cmd = [sys.executable, "-m", "fourfold", "train", "--nproc", "2", "--allreduce", "ring", *common, "--out",
           str(two)]
    forked: set[int] = set()
    output = _run_listening_on_loopback_only(cmd, forked)
    assert "on 2 rank(s) (dp=2 tp=1 pp=1)" in output
    assert forked == {0, 1}  # forked from the server by default, named after their rank
    a, b = _losses(one), _losses(two)
    assert len(b) == 3
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-10, (a, b)
    _check_chrome_trace(two / "trace.json", ranks=2)
    w1, w2 = load_checkpoint(one / "model.pt")["model"], load_checkpoint(two / "model.pt")["model"]
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-10
    # rank 0's counted bytes per step: the ring's theory for the one 25 MB bucket holding every gradient
    from fourfold.comm import ring
    from fourfold.models import GPTConfig, TinyGPT

    model = TinyGPT(GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16), dtype=torch.float64)
    expected = ring.theory(model.num_parameters(), 2, 0, 8)[0]
    rows = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    assert all(r["comm_bytes"] == expected for r in rows), (rows[0]["comm_bytes"], expected)
    assert all(0.0 <= r["comm_hidden_fraction"] <= 1.0 for r in rows)
    # every rank's memory on the first and the last step; the replicas hold the same parameters
    assert [("memory_bytes_by_rank" in r) for r in rows] == [True, False, True]
    by_rank = rows[-1]["memory_bytes_by_rank"]
    assert len(by_rank) == 2 and by_rank[0]["parameters"] == by_rank[1]["parameters"] > 0


def test_cli_help_reads_well():
    out = subprocess.run([sys.executable, "-m", "fourfold", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "train" in out.stdout and "demo" in out.stdout
    out = subprocess.run([sys.executable, "-m", "fourfold", "train", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for flag in ("--steps", "--batch-size", "--seq-len", "--seed", "--dtype", "--lr", "--out", "--config",
                 "--nproc"):
        assert flag in out.stdout
    out = subprocess.run([sys.executable, "-m", "fourfold", "trian"], capture_output=True, text=True)
    assert out.returncode == 2 and "Did you mean 'train'" in out.stderr


def _train_on_ranks(ctx, argv: list[str]):
    """A rank of the in-harness runs below: train with these flags on the harness's process group."""
    from fourfold.run.args import parse_args
    from fourfold.train import train

    result = train(parse_args(argv), ctx)
    return result.losses, result.state if ctx.rank == 0 else None


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", [["--tp", "2"], ["--tp", "2", "--sequence-parallel"],
                                    ["--tp", "2", "--dp", "2", "--sequence-parallel", "--allreduce", "ring"],
                                    ["--pp", "2", "--schedule", "1f1b", "--microbatches", "4"],
                                    ["--pp", "2", "--schedule", "zb", "--microbatches", "2"],
                                    ["--pp", "2", "--strategy", "model"],
                                    ["--pp", "2", "--dp", "2", "--schedule", "gpipe", "--microbatches", "2",
                                     "--allreduce", "ring"]])
def test_tensor_pipeline_and_data_parallel_layouts_match_one_process(tmp_path, layout):
    from fourfold.testing import run_ranks

    common = ["--steps", "3", "--dtype", "float64", *SMALL]
    assert train_mod.main([*common, "--out", str(tmp_path / "one")]) == 0
    reference = load_checkpoint(tmp_path / "one" / "model.pt")["model"]
    world = 4 if "--dp" in layout else 2
    results = run_ranks(_train_on_ranks, world, [*common, *layout, "--out", str(tmp_path / "many")],
                        timeout_s=150)
    want = _losses(tmp_path / "one")
    for losses, _ in results:
        assert max(abs(a - b) for a, b in zip(losses, want, strict=True)) < 1e-10, (losses, want)
    state = results[0][1]
    assert set(state) == set(reference)  # the gathered tensor-parallel state is a plain TinyGPT checkpoint
    assert max((state[k] - reference[k]).abs().max().item() for k in reference) < 1e-10
    saved = load_checkpoint(tmp_path / "many" / "model.pt")["model"]
    assert max((saved[k] - reference[k]).abs().max().item() for k in reference) < 1e-10


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_3d_run_through_torchrun_equals_one_process_draws_its_stages_and_verifies(tmp_path):
    """dp=2 x tp=2 x pp=2 with zero-bubble on 8 ranks through the CLI: the same numbers as one process, a
    timeline grouped by stage, bytes per axis in metrics.jsonl, and --verify's own table saying so."""
    common = ["--steps", "3", "--dtype", "float64", *SMALL, "--device", "cpu"]
    one = tmp_path / "one"
    assert train_mod.main([*common, "--out", str(one)]) == 0
    three = tmp_path / "three"
    cmd = [sys.executable, "-m", "fourfold", "train", "--nproc", "8", "--dp", "2", "--tp", "2", "--pp", "2",
           "--schedule", "zb", "--microbatches", "2", "--allreduce", "ring", "--verify", "2", *common,
           "--out", str(three)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "on 8 rank(s) (dp=2 tp=2 pp=2)" in output and "rank 0 sent per step: dp " in output, output
    assert "verify: OK, every difference within tolerance" in output and "tolerance 1e-10" in output, output
    a, b = _losses(one), _losses(three)
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-10, (a, b)
    w1, w3 = load_checkpoint(one / "model.pt")["model"], load_checkpoint(three / "model.pt")["model"]
    assert list(w1) == list(w3) and max((w1[k] - w3[k]).abs().max().item() for k in w1) < 1e-10
    rows = [json.loads(line) for line in (three / "metrics.jsonl").read_text().splitlines()]
    assert all(r["bytes_by_axis"]["dp"] > 0 and r["bytes_by_axis"]["tp"] > 0 and r["bytes_by_axis"]["pp"] > 0
               for r in rows), rows[0]["bytes_by_axis"]
    names = {e["args"]["name"] for e in json.loads((three / "trace.json").read_text())["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert "rank 0: stage 0 dp 0 tp 0" in names and "rank 7: stage 1 dp 1 tp 1" in names, names
    assert (three / "timeline.png").stat().st_size > 10_000


def test_verify_names_the_step_and_parameter_that_differ():
    from fourfold.run.verify import compare, report

    start = {"a": torch.zeros(2), "b": torch.zeros(3)}
    want = {"a": torch.full((2,), 1e-3), "b": torch.full((3,), 1e-3)}  # one step of lr 1e-3 from start
    got = {"a": want["a"], "b": torch.tensor([1e-3, 2e-3, 1e-3])}
    rows = compare([1.0, 2.0], [want, got], [1.0, 2.0], [start, want, want], "float64")
    assert [r.ok for r in rows] == [True, False] and rows[1].worst == "b" and rows[1].param_diff == pytest.approx(1e-3)
    text = report(rows, "float64")
    assert "MISMATCH at step(s) [2]" in text and "b   <-- beyond tolerance" in text
    # float32: judged against the update. One weight of five a whole lr off is 0.45 of this tiny update, beyond
    # 1e-3; across a real model's millions of weights the few that Adam moves on rounding noise weigh little
    rows = compare([1.0], [got], [1.0], [start, want], "float32")
    assert not rows[0].ok and rows[0].relative == pytest.approx((1e-6 / 5e-6) ** 0.5)
    near = {"a": want["a"], "b": want["b"] * (1 + 1e-4)}  # rounding-sized differences everywhere
    rows = compare([1.0], [near], [1.0 + 1e-6], [start, want], "float32")
    assert rows[0].ok and rows[0].relative < 1e-3, rows[0]
    assert "diff/update 1e-3 (float32 rounding)" in report(rows, "float32")
    # bf16: a quarter of the update; compressed gradients: lossy by design, parameters shown and not judged
    assert not compare([1.0], [got], [1.0], [start, want], "bf16")[0].ok
    rows = compare([1.0], [got], [1.0 + 5e-3], [start, want], "compressed")
    assert rows[0].ok and "parameters shown, not judged" in report(rows, "compressed")
    # a causal mask's -inf is equal to itself, first in the state or not; a NaN the reference lacks is the worst
    mask = torch.triu(torch.full((2, 2), float("-inf")), 1)
    for order in (("mask", "a"), ("a", "mask")):
        def state(a, m, order=order):
            return {k: {"mask": m, "a": a}[k] for k in order}

        rows = compare([1.0], [state(want["a"], mask)], [1.0], [state(start["a"], mask), state(want["a"], mask)],
                       kind="float64")
        assert rows[0].ok and rows[0].param_diff == 0 and rows[0].relative == 0, (order, rows[0])
        broken = state(want["a"].clone().fill_(float("nan")), mask)
        for kind in ("float64", "float32"):
            rows = compare([1.0], [broken], [1.0], [state(start["a"], mask), state(want["a"], mask)], kind)
            assert not rows[0].ok and rows[0].worst == "a", (order, kind, rows[0])
    from fourfold.config import TrainConfig

    with pytest.raises(ValueError, match="verify must be between 0 and steps"):
        TrainConfig(steps=2, verify=3)


def test_the_timeline_draws_the_median_step_not_the_last():
    from fourfold.files import median_step

    rows = [{"step": s, "step_time_s": t} for s, t in [(1, 9.0), (2, 0.3), (3, 0.1), (4, 0.2), (5, 0.5)]]
    assert median_step(rows) == 4  # of steps 2-4 (the first warms up, the last also ends the run): 0.3, 0.1, 0.2
    assert median_step(rows[:3]) == 2  # step 3 is the faster of 2 and 3, but the last
    assert median_step(rows[:2]) == 2 and median_step(rows[:1]) == 1 and median_step([]) is None


def test_the_summary_reads_one_typical_step_so_its_tokens_per_s_and_ms_per_step_agree():
    from fourfold.files import median_row

    # tokens/s of each step as the loop writes it: tokens / step time (the first step warms up)
    rows = [{"step": s, "step_time_s": t, "tokens_per_s": 64 / t} for s, t in [(1, 9.0), (2, 0.2), (3, 0.6),
                                                                                 (4, 0.3)]]
    typical = median_row(rows)
    assert typical is not None and typical["step"] == 4  # of 0.2, 0.6, 0.3 seconds
    assert typical["tokens_per_s"] * typical["step_time_s"] == pytest.approx(64)
    assert median_row([]) is None


def test_the_summary_says_bytes_not_counted_rather_than_zero():
    from fourfold.mesh import Mesh

    def row(dp: int, tp: int) -> dict:
        return {"tokens_per_s": 1000.0, "step_time_s": 0.05, "bytes_by_axis": {"dp": dp, "tp": tp, "pp": 0}}

    native = train_mod.TrainResult(0, Mesh(dp=2, tp=2), losses=[2.0, 1.0], metrics=[row(0, 4096)] * 2)
    text = native.summary()
    assert "rank 0 sent per step: dp not counted (--allreduce native" in text and "tp 4.0 KB" in text, text
    ring = train_mod.TrainResult(0, Mesh(dp=2), losses=[2.0, 1.0], metrics=[row(2048, 0)] * 2)
    assert "rank 0 sent per step: dp 2.0 KB\n" in ring.summary()
    untraced = train_mod.TrainResult(0, Mesh(tp=2), losses=[2.0, 1.0], metrics=[row(0, 0)] * 2, traced=False)
    assert "rank 0 sent per step: not counted (--no-trace)\n" in untraced.summary()  # not "tp 0.0 KB"


def test_the_summary_names_only_the_files_the_run_wrote(tmp_path):
    for name in ("metrics.jsonl", "run.json"):  # --no-save --no-trace: no model.pt, no trace
        (tmp_path / name).write_text("{}")
    (tmp_path / "checkpoints").mkdir()
    from fourfold.mesh import Mesh

    result = train_mod.TrainResult(0, Mesh(), out=tmp_path)
    assert result.outputs() == f"outputs in {tmp_path}: metrics.jsonl, checkpoints/ (resume with --resume), run.json"


def test_a_pipeline_runs_summary_names_each_stages_blocks_and_the_bubble_beside_its_theory():
    """A learner's pp4 run of a 2-layer model idles 93 % on rank 0 against a theory of 27 %: the summary says
    why (rank 0 holds only the embedding)."""
    from fourfold.run.summary import block_range, pipeline_line

    assert block_range(["blocks.0", "blocks.1", "blocks.2", "head"]) == "blocks.0-2, head"
    assert block_range(["model.embed_tokens", "model.layers.0"]) == "model.embed_tokens, model.layers.0"
    assert block_range(["layers.1", "layers.3", "layers.4"]) == "layers.1, layers.3-4"
    run = {"schedule": "1f1b", "microbatches": 8, "virtual": 1, "stages": 4,
           "cut": [["embed"], ["blocks.0"], ["blocks.1"], ["head"]]}
    assert pipeline_line(run, {"bubble_by_rank": [0.93, 0.41, 0.48, 0.88]}) == (
        "pipeline 1f1b, 8 micro-batches, stages 0: embed | 1: blocks.0 | 2: blocks.1 | 3: head\n"
        "bubble per pp rank 93% / 41% / 48% / 88% (theory with equal stages and free messages 27%; see "
        "timeline.png)\n")
    assert pipeline_line(None, {}) == "" and pipeline_line(run, {}) == ""  # no pipeline; no step measured


def test_the_summary_shows_every_ranks_bytes_where_ranks_send_unequally():
    """--allreduce master at G = 4: the root sends (G-1)N, every other rank N. 'rank 0 sent' alone hides the
    asymmetry that is the master's lesson; a ring's ranks send alike and get no extra line."""
    from fourfold.run.summary import ranks_sent
    from fourfold.train import TrainResult

    assert ranks_sent([3 * 1024, 1024, 1024, 1024]) == "rank 0 3.0 KB, ranks 1-3 1.0 KB"
    assert ranks_sent([1024, 2048, 1024]) == "rank 0 1.0 KB, rank 1 2.0 KB, rank 2 1.0 KB"
    rows = [{"step": k, "step_time_s": 0.1, "tokens_per_s": 1.0, "bytes_by_axis": {"dp": 3072, "tp": 0, "pp": 0}}
            for k in (1, 2, 3)]
    master = TrainResult(0, Mesh(dp=4), losses=[2.0, 1.0, 0.5], metrics=rows,  # draws step 2
                         sent_by_rank={r: {"dp": 3072 if r == 0 else 1024, "tp": 0, "pp": 0} for r in range(4)})
    assert "each rank sent in step 2: dp: rank 0 3.0 KB, ranks 1-3 1.0 KB\n" in master.summary()
    ring = TrainResult(0, Mesh(dp=4), losses=[2.0, 1.0, 0.5], metrics=rows,
                       sent_by_rank={r: {"dp": 1536, "tp": 0, "pp": 0} for r in range(4)})
    assert "each rank sent" not in ring.summary()
    # a ring whose bucket does not divide by 3 ranks: a few bytes apart, which is no asymmetry
    ring3 = TrainResult(0, Mesh(dp=3), losses=[2.0, 1.0, 0.5], metrics=rows,
                        sent_by_rank=dict(enumerate({"dp": n, "tp": 0, "pp": 0} for n in (4449620, 4449624, 4449620))))
    assert "each rank sent" not in ring3.summary()


def test_flags_the_layout_does_not_read_are_named_before_launch():
    from fourfold.mesh import Mesh
    from fourfold.run.args import parse_args
    from fourfold.run.preflight import unused_flags

    def unused(*flags: str, **mesh: int) -> list[str]:
        return unused_flags(parse_args(list(flags)), Mesh(**mesh))

    assert unused("--schedule", "interleaved", "--zero", "1", "--allreduce", "ring") == [
        "--schedule interleaved (pp=1: no pipeline)", "--allreduce ring (dp=1: no gradient sync)",
        "--zero 1 (dp=1: no gradient sync)"]  # one process: no pipeline, no data parallelism
    assert unused("--microbatches", "8") == [  # the learner's flag for accumulation is --grad-accum
        "--microbatches 8 (pp=1: no pipeline; --grad-accum N cuts each step into N micro-batches without one)"]
    assert unused("--pp", "2", "--strategy", "model", "--microbatches", "8", pp=2) == [
        "--microbatches 8 (--strategy model runs one micro-batch)"]
    assert unused("--schedule", "zb", "--virtual", "3", pp=2) == [
        "--virtual 3 (only --schedule interleaved reads it, got --schedule zb)"]
    assert unused("--schedule", "interleaved", "--virtual", "3", "--powersgd-rank", "2", pp=2, dp=2) == [
        "--powersgd-rank 2 (only --compress powersgd reads it, got --compress none)"]
    assert unused("--n-layer", "2", "--allreduce", "ring", dp=2) == []


def test_a_hang_threshold_the_timeout_would_beat_is_named_before_launch(capsys):
    from fourfold.mesh import Mesh
    from fourfold.run.args import parse_args
    from fourfold.run.preflight import before_launch_notes

    cfg = parse_args(["--nproc", "2", "--timeout", "5", "--hang-threshold", "10", "--no-memory-check"])
    before_launch_notes(cfg, Mesh(dp=2), 2)
    assert "--hang-threshold 10 s is not below --timeout 5 s" in capsys.readouterr().err
    before_launch_notes(parse_args(["--nproc", "2", "--no-memory-check"]), Mesh(dp=2), 2)
    assert "hang-threshold" not in capsys.readouterr().err


def test_a_rank_records_its_launch_whatever_launched_it(monkeypatch):
    from fourfold.train import _launched_as

    monkeypatch.delenv("FOURFOLD_LAUNCH", raising=False)
    for name, value in {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4", "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1",
                        "MASTER_PORT": "29400"}.items():
        monkeypatch.setenv(name, value)  # a hand-run torchrun on two machines of 2
    got = _launched_as()
    assert (got.nproc, got.nnodes, got.node_rank, got.rdzv_endpoint) == (2, 2, 1, "10.0.0.1:29400")
    monkeypatch.setenv("WORLD_SIZE", "3")  # machines of different sizes: recorded as the defaults, never fatal
    assert _launched_as().nproc == 1
    monkeypatch.setenv("FOURFOLD_LAUNCH", '{"nproc": 8, "max_restarts": 2}')  # from fourfold's own launcher
    assert (_launched_as().nproc, _launched_as().max_restarts) == (8, 2)


def test_ranks_come_from_the_fork_server_unless_the_launchers_main_is_a_script_of_yours(monkeypatch, tmp_path):
    """Forked from a server that imported torch where this process's main module may be imported again by each
    rank (a ``python -m`` module such as pytest, an installed command, or none); a script of yours gets fresh
    interpreters unless FOURFOLD_RANK_START says otherwise."""
    import types

    from fourfold.torchrun import RANK_START_ENV, rank_start

    monkeypatch.delenv(RANK_START_ENV, raising=False)
    assert rank_start() == "forkserver"  # python -m pytest
    script = types.ModuleType("__main__")
    script.__file__ = str(tmp_path / "train_mine.py")
    monkeypatch.setitem(sys.modules, "__main__", script)
    assert rank_start() == "exec"
    installed = types.ModuleType("__main__")
    installed.__file__ = str(Path(sysconfig.get_path("scripts")) / "fourfold")
    monkeypatch.setitem(sys.modules, "__main__", installed)
    assert rank_start() == "forkserver"
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # python -c, a notebook
    assert rank_start() == "forkserver"
    monkeypatch.setitem(sys.modules, "__main__", script)
    monkeypatch.setenv(RANK_START_ENV, "forkserver")  # vouching for the script's main guard
    assert rank_start() == "forkserver"
    monkeypatch.setenv(RANK_START_ENV, "exec")
    monkeypatch.setitem(sys.modules, "__main__", installed)
    assert rank_start() == "exec"
    monkeypatch.setenv(RANK_START_ENV, "fork")
    with pytest.raises(ValueError, match="FOURFOLD_RANK_START must be forkserver or exec"):
        rank_start()


def test_the_pace_is_the_steady_steps_tokens_over_their_time_not_one_steps():
    from fourfold.files import steady_rate
    from fourfold.mesh import Mesh

    # packed steps of unequal real tokens: 100 tokens in 1 s, then 300 in 1 s (the first step warms up)
    rows = [{"step": s, "step_time_s": t, "tokens_per_s": n / t, "real_tokens_per_s": n / t / 2,
             "bytes_by_axis": {}, "documents": 4, "padding_fraction": 0.5}
            for s, (n, t) in enumerate([(10, 9.0), (100, 1.0), (300, 1.0)], start=1)]
    assert steady_rate(rows) == pytest.approx(200.0) and steady_rate(rows, "real_tokens_per_s") == pytest.approx(100.0)
    assert steady_rate([]) == 0.0
    text = train_mod.TrainResult(0, Mesh(), losses=[2.0, 1.5, 1.0], metrics=rows).summary()
    assert "100 real tokens/s of 200 (50.0% padding)" in text, text
