"""``fourfold train`` survives faults: --resume (in place and under another layout), no rank left training when
the launcher is killed, Ctrl-C, NaN loss, the OUT lock, and bad --resume input refused before start. (A rank
killed or stopped mid-run, under each layout: test_faults.py.)

Reading a failure: a resumed loss that differs from the uninterrupted run's in the last digits means state
missing from the checkpoint (the optimiser's, the RNG's) or the wrong data position; rows missing or doubled in
metrics.jsonl mean the continued file was not cut back to the checkpoint's step.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from fourfold import train as train_mod
from fourfold.testing import run_ranks
from helpers import TOL64, alive, launched, losses, rows, wait_for_rows, workers

SMALL = ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--seq-len", "16", "--batch-size", "8",
         "--no-progress", "--dtype", "float64"]


def _train_on_ranks(ctx, argv: list[str]) -> list[float]:
    from fourfold.run.args import parse_args

    return train_mod.train(parse_args(argv), ctx).losses


@pytest.mark.timeout(180)
def test_resume_continues_in_place_bitwise_and_under_another_layout_exactly(tmp_path):
    full, part, other = tmp_path / "full", tmp_path / "part", tmp_path / "other"
    assert train_mod.main([*SMALL, "--steps", "4", "--out", str(full)]) == 0
    assert train_mod.main([*SMALL, "--steps", "2", "--out", str(part)]) == 0  # checkpoint at the end: step 2
    # the model's flags and dtype are left out: a resumed run takes the checkpoint's
    assert train_mod.main(["--batch-size", "8", "--no-progress", "--steps", "4", "--resume", str(part), "--out",
                           str(part)]) == 0
    assert [r["step"] for r in rows(part)] == [1, 2, 3, 4]  # continued, each step once
    assert losses(part) == losses(full)  # same layout: bitwise
    run = json.loads((part / "run.json").read_text())
    assert run["resumed_from"]["step"] == 2
    # the same checkpoint under tp=2 x pp=2, into a fresh directory
    argv = [*SMALL, "--steps", "4", "--tp", "2", "--pp", "2", "--microbatches", "2", "--resume", str(part / "checkpoints"
            / "step-000002"), "--out", str(other)]
    got = run_ranks(_train_on_ranks, 4, argv, timeout_s=120)[0]
    assert [r["step"] for r in rows(other)] == [3, 4]
    assert max(abs(a - b) for a, b in zip(got, losses(full)[2:], strict=True)) <= TOL64, got


def test_resuming_in_place_from_an_older_checkpoint_sets_the_newer_ones_aside(tmp_path, capsys):
    out = tmp_path / "run"
    argv = [*SMALL, "--checkpoint-every", "1", "--keep", "3", "--out", str(out)]
    assert train_mod.main([*argv, "--steps", "4"]) == 0  # keeps step-2, -3 and -4
    old = (out / "checkpoints" / "step-000004" / "manifest.json").read_text()
    unfinished = out / "checkpoints" / "step-000005"  # a save the disk filled up under: no manifest
    unfinished.mkdir()
    (unfinished / "rank-00000.pt").write_bytes(b"x" * 1000)
    capsys.readouterr()
    assert train_mod.main([*argv, "--steps", "3", "--lr", "1e-3", "--resume", str(out / "checkpoints" /
                                                                                  "step-000002")]) == 0
    assert "resuming step 2 in" in (err := capsys.readouterr().err) and "went on to step-000003, step-000004: " \
        "this run departs from them, so they are kept in checkpoints/.abandoned-" in err, err
    (aside,) = (out / "checkpoints").glob(".abandoned-*")
    assert (aside / "step-000004" / "manifest.json").read_text() == old  # kept whole, out of the way
    assert [r["step"] for r in rows(aside)] == [1, 2, 3, 4]  # with the record of the branch it ends
    assert not unfinished.exists() and not (aside / unfinished.name).exists()  # removed, not kept aside
    assert json.loads((aside / "run.json").read_text())["config"]["train"]["steps"] == 4
    assert [r["step"] for r in rows(out)] == [1, 2, 3]
    # the next resume continues this run (its step 3), not the abandoned step 4
    assert train_mod.main([*argv, "--steps", "5", "--lr", "1e-3", "--resume", str(out)]) == 0
    assert json.loads((out / "run.json").read_text())["resumed_from"]["step"] == 3
    assert [r["step"] for r in rows(out)] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("flags,message", [
    (["--resume", "{tmp}/nowhere"], "does not exist"),
    (["--resume", "{tmp}"], "no complete checkpoint in"),
    (["--resume", "{run}", "--steps", "2"], "is at step 2, got steps=2. Pass --steps 3 or more"),
    (["--resume", "{run}", "--d-model", "64"], "saved from another model: d_model=32 there, 64 here"),
    (["--resume", "{run}", "--verify", "1"], "verify re-runs a run's first steps"),
    (["--resume", "{run}", "--out", "{run}", "--keep", "0"], "keep >= 1"),
])
def test_bad_resume_input_is_refused_before_any_process_starts(tmp_path, capsys, flags, message):
    run = tmp_path / "run"
    assert train_mod.main([*SMALL, "--steps", "2", "--out", str(run)]) == 0
    capsys.readouterr()
    argv = [*SMALL, "--steps", "4", "--nproc", "2", "--out", str(tmp_path / "new"),
            *[f.format(tmp=tmp_path, run=run) for f in flags]]
    start = time.perf_counter()
    assert _exit_code(argv) == 2
    assert message in capsys.readouterr().err
    assert time.perf_counter() - start < 5  # refused in the launcher: no rank was started


def test_resuming_on_data_changed_at_the_same_path_is_said(tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    run = tmp_path / "run"
    assert train_mod.main([*SMALL, "--steps", "1", "--no-trace", "--data", str(text), "--out", str(run)]) == 0
    text.write_text("a different text altogether, read from the same path. " * 200)
    capsys.readouterr()
    assert train_mod.main([*SMALL, "--steps", "2", "--no-trace", "--data", str(text), "--resume", str(run), "--out",
                           str(run)]) == 0
    err = capsys.readouterr().err
    assert "note: resuming step 1 on data whose sha256" in err and "changed since" in err, err


def _agree(ctx, dirs):
    from fourfold.run.resume import same_on_every_rank

    try:
        same_on_every_rank({"dir": dirs[ctx.rank]}, "runs/a")
        return None
    except ValueError as e:
        return str(e)


def test_ranks_that_found_different_checkpoints_to_resume_are_refused_alike():
    """--resume runs/a while runs/a still saves: each rank takes the newest it sees, and two steps' pieces would
    be mixed with nothing to show it."""
    assert run_ranks(_agree, 2, ["a/step-000002", "a/step-000002"], timeout_s=60) == [None, None]
    said = run_ranks(_agree, 2, ["a/step-000002", "a/step-000003"], timeout_s=60)
    assert said[0] == said[1], said
    assert "rank 0 a/step-000002, rank 1: a/step-000003. Either a run is still writing" in said[0], said


def test_resuming_from_what_an_overwrite_run_would_delete_is_refused(tmp_path, capsys):
    """An earlier run an --overwrite run set aside (OUT/.replaced-*/) and did not finish: resuming from it into
    OUT with --overwrite would delete it when the run ends; refused before launch, naming it."""
    run = tmp_path / "run"
    assert train_mod.main([*SMALL, "--steps", "2", "--no-trace", "--out", str(run)]) == 0
    aside = run / ".replaced-20261125-000000-x"
    aside.mkdir()
    for p in list(run.iterdir()):
        if p != aside and not p.name.startswith("."):
            p.rename(aside / p.name)
    capsys.readouterr()
    assert _exit_code([*SMALL, "--steps", "3", "--no-trace", "--resume", str(aside), "--out", str(run),
                       "--overwrite"]) == 2
    assert f"lies in {aside}, which this --overwrite run in {run} moves aside" in capsys.readouterr().err
    assert (aside / "checkpoints").is_dir()
    assert train_mod.main([*SMALL, "--steps", "3", "--no-trace", "--resume", str(aside), "--out",
                           str(tmp_path / "elsewhere")]) == 0  # into another --out: as the message says


def test_a_resumed_run_trains_with_the_weight_decay_it_names(tmp_path, capsys):
    """AdamW decays before its update: p <- p (1 - lr wd) - lr u. Resumed from one checkpoint with weight decay
    0.1 and 0, step 2 differs by exactly lr * 0.1 * p1 (the update u is the same)."""
    import torch

    from fourfold.checkpoint import load_checkpoint

    run = tmp_path / "run"
    assert train_mod.main([*SMALL, "--steps", "1", "--weight-decay", "0.1", "--no-trace", "--out", str(run)]) == 0
    for wd in ("0.1", "0"):
        assert train_mod.main([*SMALL, "--steps", "2", "--weight-decay", wd, "--no-trace", "--resume", str(run),
                               "--out", str(tmp_path / wd)]) == 0
    assert "weight_decay 0.0 (was 0.1)" in capsys.readouterr().err
    p1, kept, dropped = (load_checkpoint(d / "model.pt")["model"] for d in (run, tmp_path / "0.1", tmp_path / "0"))
    lr = 3e-3  # the default --lr, constant
    for name, w in p1.items():
        if name in kept and w.is_floating_point() and kept[name].shape == w.shape and "weight" in name:
            torch.testing.assert_close(dropped[name] - kept[name], lr * 0.1 * w, rtol=0, atol=1e-12)


def test_a_resumed_run_names_the_training_settings_it_changes(tmp_path, capsys):
    run = tmp_path / "run"
    assert train_mod.main([*SMALL, "--steps", "1", "--no-trace", "--out", str(run)]) == 0
    capsys.readouterr()
    assert train_mod.main([*SMALL, "--steps", "2", "--lr", "1e-3", "--seed", "3", "--no-trace", "--resume",
                           str(run), "--out", str(run)]) == 0
    err = capsys.readouterr().err
    assert "note: resuming step 1 with seed 3 (was 0), lr 0.001 (was 0.003)" in err, err
    from fourfold.run.args import parse_args
    from fourfold.run.resume import changed_settings

    was = {"config": {"train": {"data": "corpus.jsonl"}}}  # no --data now: the built-in corpus, not "None"
    assert "data the built-in corpus (was 'corpus.jsonl')" in changed_settings(parse_args([*SMALL]), was)


def test_a_damaged_checkpoint_found_in_the_ranks_ends_the_run_in_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    assert train_mod.main([*SMALL, "--steps", "2", "--checkpoint-every", "1", "--no-trace", "--out", str(run)]) == 0
    victim = run / "checkpoints" / "step-000002" / "rank-00000.pt"
    victim.write_bytes(victim.read_bytes()[:-1] + b"x")
    capsys.readouterr()
    assert train_mod.main([*SMALL, "--steps", "3", "--no-trace", "--resume", str(run), "--out", str(run)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fourfold train: error: damaged: ") and "Traceback" not in err, err
    assert f"--resume {run / 'checkpoints' / 'step-000001'}" in err, err


@pytest.mark.timeout(180)
def test_what_every_rank_refuses_is_said_once_by_the_launcher_without_the_ranks_echoes(tmp_path):
    """Each rank refuses (too short a text for --seq-len), or one rank (its damaged file) and the other loses its
    peer: one line for the run, not one per rank, and no 'a peer's connection broke' echo beneath it."""
    run = tmp_path / "run"
    assert train_mod.main([*SMALL, "--nproc", "2", "--steps", "2", "--checkpoint-every", "2", "--no-trace",
                           "--out", str(run)]) == 0
    victim = run / "checkpoints" / "step-000002" / "rank-00001.pt"
    victim.write_bytes(victim.read_bytes()[:-1] + b"x")
    (tmp_path / "short.txt").write_text("hi\n")
    cases = {"damaged": (["--resume", str(run)], 1, "fourfold train: error: damaged: "),
             "short": (["--data", str(tmp_path / "short.txt")], 2, "fourfold train: error: corpus must hold at least "
                                                                   "seq_len+1=17 tokens, got 3")}
    for name, (flags, code, said) in cases.items():
        with launched([*SMALL, "--nproc", "2", "--steps", "3", "--no-trace", *flags,
                       "--out", str(tmp_path / name)]) as proc:
            output, _ = proc.communicate(timeout=120)
        assert proc.returncode == code, output
        assert output.count(said) == 1 and output.count("fourfold train: error") == 1, output
        assert "connection broke" not in output and "Traceback" not in output, output
        assert output.strip().splitlines()[-1].endswith("; its error is printed above."), output


def test_a_restart_passes_over_a_damaged_newest_checkpoint_to_the_one_before(tmp_path, capsys, monkeypatch):
    from fourfold.checkpoint.store import starting_manifest

    run = tmp_path / "run"
    assert train_mod.main([*SMALL, "--steps", "2", "--checkpoint-every", "1", "--no-trace", "--out", str(run)]) == 0
    victim = run / "checkpoints" / "step-000002" / "rank-00000.pt"
    victim.write_bytes(victim.read_bytes()[:100])  # truncated: every attempt would fail on it again
    capsys.readouterr()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # as torchrun's next attempt sees it
    assert starting_manifest(None, run)["step"] == 1
    err = capsys.readouterr().err
    assert "note: restart 1 resumes from step-000001: the newer step-000002 cannot be read (rank-00000.pt holds " \
           "100 bytes, its manifest " in err, err
    assert train_mod.main([*SMALL, "--steps", "3", "--no-trace", "--out", str(run)]) == 0  # the attempt itself
    assert [r["step"] for r in rows(run)] == [1, 2, 3]
    # every checkpoint damaged (the other machines' files missing, say): refused, not started over past them
    for victim in (run / "checkpoints").glob("step-*/rank-00000.pt"):
        victim.write_bytes(b"")
    from fourfold.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match=r"restart 1: every checkpoint in .* fails its check \(step-000003, "
                                              r"step-00000\d; .*so the run stops here rather than start over"):
        starting_manifest(None, run)


def _exit_code(argv: list[str]) -> int:
    """main()'s return value, or its SystemExit code (flags argparse refuses)."""
    try:
        return train_mod.main(argv)
    except SystemExit as e:
        return int(e.code or 0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux /proc")
@pytest.mark.timeout(120)
def test_killing_the_launcher_leaves_no_rank_training(tmp_path):
    out = tmp_path / "orphans"
    with launched([*SMALL, "--steps", "100000", "--nproc", "2", "--no-trace", "--out", str(out)]) as proc:
        wait_for_rows(out, 3, proc)
        started = workers(proc.pid)
        assert started, "no worker processes found"
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(alive(w) for w in started):
            time.sleep(0.1)
        left = [w for w in started if alive(w)]
    assert not left, f"ranks {left} kept running after the launcher was killed"


def test_a_non_finite_loss_stops_the_run_at_its_step_and_metrics_stay_json(tmp_path, capsys):
    out = tmp_path / "nan"
    assert train_mod.main([*SMALL, "--steps", "5", "--lr", "1e300", "--no-trace", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    table = rows(out)  # every line parses as JSON
    assert table[-1]["loss"] is None and "non-finite loss" in table[-1]["error"]
    assert f"step {table[-1]['step']}: the loss is nan" in err and len(table) < 5


def test_a_second_run_on_the_same_out_is_refused_while_the_first_holds_it(tmp_path, capsys):
    from fourfold.files import run_lock

    out = tmp_path / "busy"
    with run_lock(out):  # as a running `fourfold train --out busy` holds it
        assert train_mod.main([*SMALL, "--steps", "1", "--out", str(out)]) == 2
        assert f"out {out} is in use by another run (pid {os.getpid()}" in capsys.readouterr().err
    assert train_mod.main([*SMALL, "--steps", "1", "--no-trace", "--out", str(out)]) == 0  # released


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux /proc")
@pytest.mark.timeout(120)
def test_ctrl_c_prints_one_line_and_exits_130(tmp_path):
    out = tmp_path / "interrupted"
    with launched([*SMALL, "--steps", "100000", "--nproc", "2", "--no-trace", "--checkpoint-every", "1", "--out",
                   str(out)]) as proc:
        wait_for_rows(out, 3, proc)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output
    assert "Traceback" not in output, output
    assert output.count("interrupted (Ctrl-C)") == 1, output
    assert "the newest complete checkpoint is step " in output and f"--resume {out}" in output, output


def test_an_interrupted_run_without_checkpoints_says_there_is_none(tmp_path):
    from fourfold.run.args import parse_args

    cfg = parse_args([*SMALL, "--out", str(tmp_path / "none")])
    note = train_mod._interrupted_note(cfg)
    assert note.startswith(f"no checkpoint to resume from in {tmp_path / 'none'}") and "--checkpoint-every N" in note


@pytest.mark.timeout(240)
@pytest.mark.parametrize("compress", [["--compress", "int8"],
                                      ["--compress", "powersgd", "--powersgd-rank", "1", "--powersgd-warmup", "1"]])
def test_a_compressed_run_resumes_exactly_its_errors_fed_back_restored(tmp_path, compress):
    """int8's and PowerSGD's errors fed back (and PowerSGD's factors and warm-up count) live on each rank: a
    checkpoint keeps them, so a resumed run continues bit for bit; without them step 3 would differ."""
    full, part = tmp_path / "full", tmp_path / "part"
    flags = [*SMALL, "--nproc", "2", "--dp", "2", *compress]
    want = run_ranks(_train_on_ranks, 2, [*flags, "--steps", "4", "--out", str(full)], timeout_s=120)[0]
    run_ranks(_train_on_ranks, 2, [*flags, "--steps", "2", "--out", str(part)], timeout_s=120)
    got = run_ranks(_train_on_ranks, 2, [*flags, "--steps", "4", "--resume", str(part), "--out", str(part)],
                    timeout_s=120)[0]
    assert got == want[2:], (got, want)
    assert [r["step"] for r in rows(part)] == [1, 2, 3, 4]


def test_a_compressed_run_resumed_under_another_layout_is_told_its_errors_start_afresh(tmp_path, capsys):
    from fourfold.mesh import Mesh
    from fourfold.run.args import parse_args
    from fourfold.run.preflight import _resume_note

    part = tmp_path / "part"
    assert train_mod.main([*SMALL, "--steps", "1", "--out", str(part)]) == 0  # a checkpoint of 1 rank
    capsys.readouterr()
    for flags, said in [(["--compress", "int8"], True), (["--compress", "powersgd"], True),
                        (["--compress", "bf16"], False)]:  # stateless
        cfg = parse_args([*SMALL, "--nproc", "2", "--steps", "3", "--resume", str(part), *flags])
        _resume_note(cfg, Mesh.for_world(2, dp=2), 2)
        err = capsys.readouterr().err
        assert ("restored only under the checkpoint's layout (1 ranks" in err) == said, (flags, err)
    _resume_note(parse_args([*SMALL, "--nproc", "2", "--steps", "3", "--compress", "int8"]),
                 Mesh.for_world(2, dp=2), 2)
    assert capsys.readouterr().err == ""  # nothing resumed


def test_a_run_with_dropout_resumed_under_another_layout_is_told_its_streams_start_afresh(tmp_path, capsys,
                                                                                         monkeypatch):
    from fourfold.mesh import Mesh
    from fourfold.run.args import parse_args
    from fourfold.run.preflight import _resume_note

    part = tmp_path / "part"
    assert train_mod.main([*SMALL, "--dropout", "0.1", "--steps", "1", "--out", str(part)]) == 0  # 1 rank
    capsys.readouterr()
    for nproc, said in [(2, True), (1, False)]:  # another layout: afresh; the same one: continued
        cfg = parse_args([*SMALL, "--nproc", str(nproc), "--steps", "3", "--resume", str(part)])
        _resume_note(cfg, Mesh.for_world(nproc, dp=nproc), nproc)
        err = capsys.readouterr().err
        assert ("the model's dropout (dropout=0.1, embed.drop (p=0.1)) draws from each rank's "
                "own streams, continued only under the checkpoint's layout (1 ranks" in err) == said, (nproc, err)
    # one process from a checkpoint of 2 ranks: its ranks' streams, and torch's generator, which load reseeds
    import fourfold.run.preflight as preflight

    cfg = parse_args([*SMALL, "--steps", "3", "--resume", str(part)])
    two = {**preflight.resume_from(cfg), "world_size": 2, "mesh": {"dp": 2, "tp": 1, "pp": 1}}
    monkeypatch.setattr(preflight, "resume_from", lambda _: two)
    _resume_note(cfg, Mesh.for_world(1), 1)
    assert "draws from its ranks' own streams (one process: torch's), continued only under the checkpoint's " \
           "layout (2 ranks" in capsys.readouterr().err


def test_a_restarted_resumed_run_comes_back_from_its_own_progress_not_the_resumed_checkpoint(tmp_path,
                                                                                             monkeypatch):
    from fourfold.run.args import parse_args
    from fourfold.run.resume import resume_from

    run, fresh = tmp_path / "run", tmp_path / "fresh"
    assert train_mod.main([*SMALL, "--steps", "1", "--no-trace", "--out", str(run)]) == 0
    first = str(run / "checkpoints" / "step-000001")
    assert train_mod.main(["--steps", "3", "--checkpoint-every", "1", "--no-trace", "--no-progress", "--batch-size",
                           "8", "--resume", first, "--out", str(run)]) == 0  # 2 and 3 kept: step 1 is pruned
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # as torchrun's agent sets it after a restart
    restarted = parse_args(["--steps", "5", "--resume", first, "--out", str(run)])  # --resume's is gone
    assert resume_from(restarted)["step"] == 3  # its own newest: steps 2 and 3 are not trained again
    assert restarted.model.d_model == 32  # the model's flags, from the checkpoint it will load
    early = parse_args(["--steps", "5", "--resume", str(run), "--out", str(fresh)])
    assert resume_from(early)["step"] == 3  # restarted before its first checkpoint: --resume's


def test_checkpoints_from_before_model_config_values_still_resume(tmp_path, monkeypatch):
    from fourfold.run.args import parse_args
    from fourfold.run.resume import check_resume

    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.json").write_text(json.dumps({"n_layer": 2}))
    here = parse_args(["--model", "gpt2", "--model-config", "cfg.json", "--steps", "4"])
    saved = here.to_dict()
    saved["train"]["model_config"] = "cfg.json"  # recorded as typed, without its JSON object
    check_resume(here, {"config": saved, "dir": "old", "step": 2})  # the same file: accepted
    where = tmp_path / "old" / "step-000002"
    where.mkdir(parents=True)
    del saved["train"]["model"], saved["train"]["model_config"]  # older still: no --model at all (TinyGPT's)
    (where / "manifest.json").write_text(json.dumps({"format": "fourfold-checkpoint/1", "step": 2, "config": saved}))
    assert parse_args(["--resume", str(where), "--steps", "4"]).train.model == "tinygpt"


def test_a_model_config_edited_since_the_checkpoint_is_refused_naming_the_keys(tmp_path, monkeypatch):
    """The resumed run reads --model-config from the checkpoint's path again: a file edited since (dropout set to 0)
    would build another model silently. Compared by contents, the keys that differ named, the checkpoint's own
    given to write back."""
    from fourfold.run.args import parse_args
    from fourfold.run.resume import check_resume

    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.json").write_text(json.dumps({"n_layer": 2, "attn_pdrop": 0.1}))
    then = parse_args(["--model", "gpt2", "--model-config", "cfg.json", "--steps", "4"])
    manifest = {"config": then.record(), "dir": "ck", "step": 2}
    check_resume(parse_args(["--model", "gpt2", "--model-config", "cfg.json", "--steps", "4"]), manifest)
    (tmp_path / "cfg.json").write_text(json.dumps({"n_layer": 2, "attn_pdrop": 0.0}))
    with pytest.raises(ValueError, match=r"resume: the checkpoint ck's model was built from other --model-config keys "
                                         r"than .*cfg.json holds now: attn_pdrop=0.1 there, 0.0 here\. Write the "
                                         r'checkpoint\'s \(\{"n_layer": 2, "attn_pdrop": 0.1\}\) to a file'):
        check_resume(parse_args(["--model", "gpt2", "--model-config", "cfg.json", "--steps", "4"]), manifest)
    (tmp_path / "moved.json").write_text(json.dumps({"attn_pdrop": 0.1, "n_layer": 2}))  # the same keys elsewhere
    check_resume(parse_args(["--model", "gpt2", "--model-config", "moved.json", "--steps", "4"]), manifest)


def test_a_hugging_face_run_records_no_tinygpt_sizes_and_older_records_of_them_still_resume(tmp_path, monkeypatch):
    """run.json once said n_layer 4, dropout 0.0 for any Hugging Face model (TinyGPT's defaults): read as the
    model's. They are left out now; a checkpoint that recorded them resumes as before."""
    from fourfold.run.args import parse_args
    from fourfold.run.resume import check_resume

    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.json").write_text(json.dumps({"n_layer": 2}))
    cfg = parse_args(["--model", "gpt2", "--model-config", "cfg.json", "--steps", "4"])
    assert cfg.record()["model"] == {"seq_len": cfg.model.seq_len}
    assert parse_args(["--steps", "4"]).record()["model"]["n_layer"] == 4  # TinyGPT's own
    older = {**cfg.record(), "model": cfg.to_dict()["model"]}
    check_resume(cfg, {"config": older, "dir": "ck", "step": 2})


def test_another_dropout_on_resume_is_a_training_change_named_not_another_model():
    from fourfold.run.args import parse_args
    from fourfold.run.resume import changed_settings, check_resume

    then = parse_args([*SMALL, "--dropout", "0.1", "--steps", "4"])
    manifest = {"config": then.record(), "dir": "ck", "step": 2}
    lower = parse_args([*SMALL, "--dropout", "0.05", "--steps", "4"])
    check_resume(lower, manifest)  # accepted: dropout shapes nothing
    assert changed_settings(lower, manifest) == ["dropout 0.05 (was 0.1)"]
    assert changed_settings(parse_args([*SMALL, "--dropout", "0.1", "--steps", "4"]), manifest) == []


def test_a_tokenizer_file_recorded_as_typed_is_the_same_setting_recorded_absolute(tmp_path, monkeypatch):
    # runs before 2026-11-24 recorded --tokenizer as typed; later ones absolute: a resume compares the files
    from fourfold.run.resume import changed_settings
    from fourfold.train import parse_args

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tok.json").write_text("{}")
    cfg = parse_args(["--tokenizer", "tok.json"])
    assert cfg.data.tokenizer == str(tmp_path / "tok.json")
    older = {"config": {"train": {**cfg.to_dict()["train"], "tokenizer": "tok.json"}}}  # before [data] too
    assert changed_settings(cfg, older) == []
    assert parse_args(["--tokenizer", "bpe:300"]).data.tokenizer == "bpe:300"  # not a file: as given


@pytest.mark.timeout(240)
def test_a_fused_weight_of_unequal_blocks_saved_sharded_resumes_whole_exactly(tmp_path):
    """Phi-3's q|k|v (4 query, 2 key/value heads: blocks 2:1:1) saved by tp=2 ranks, each holding its slice of
    each block; resumed in one process, the pieces are put back block by block: the losses of a run never cut."""
    pytest.importorskip("transformers")
    config = os.path.join(os.path.dirname(__file__), "..", "examples", "phi3-tiny.json")
    phi3 = ["--model", "phi3", "--model-config", config, "--seq-len", "16", "--batch-size", "4", "--no-progress",
            "--dtype", "float64"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert train_mod.main([*phi3, "--steps", "3", "--out", str(full)]) == 0
    run_ranks(_train_on_ranks, 2, [*phi3, "--steps", "2", "--tp", "2", "--out", str(part)], timeout_s=180)
    manifest = json.loads(next((part / "checkpoints").glob("step-*/manifest.json")).read_text())
    assert manifest["pieces"]["model/model.layers.0.self_attn.qkv_proj.weight#1"]["parts"] == [2, 1, 1]
    assert train_mod.main(["--batch-size", "4", "--no-progress", "--steps", "3", "--resume", str(part), "--out",
                           str(part)]) == 0
    assert [r["step"] for r in rows(part)] == [1, 2, 3]
    assert max(abs(a - b) for a, b in zip(losses(part), losses(full), strict=True)) <= TOL64
