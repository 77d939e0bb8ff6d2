"""Training checkpoints: saved under one layout, resumed under any other, equal to the uninterrupted run.

* The resume matrix: 2 AdamW steps under each of {one process, dp2, tp2, pp2 1f1b, dp2 x tp2}, checkpoint, then
  step 3 resumed under each layout from each checkpoint: the loss and every final parameter equal the
  uninterrupted one-process run to 1e-10 (float64). Spawns: one per world size to save, one per world size to
  resume (each runs every layout of its size).
* Same layout in float32 (dp2, pp2): the resumed step is bitwise the uninterrupted one.
* One process, no spawn: a damaged file, a missing manifest, a model that does not match, pruning to ``keep``.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
from pathlib import Path

import pytest
import torch

from fourfold import Layout, Mesh, parallelize
from fourfold.checkpoint import CheckpointError, find_latest, load, save
from fourfold.models import GPTConfig, TinyGPT
from fourfold.testing import run_ranks
from helpers import TOL64, batches, max_error, optimizer, reference_run, shard

CFG = GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=16)
LAYOUTS = {"one": (1, 1, 1), "dp2": (2, 1, 1), "tp2": (1, 2, 1), "pp2": (1, 1, 2), "dp2tp2": (2, 2, 1)}
BY_WORLD = {w: [n for n, (dp, tp, pp) in LAYOUTS.items() if dp * tp * pp == w] for w in (1, 2, 4)}
SAVE_AT = 2


def _engine(ctx, name: str, dtype: torch.dtype = torch.float64, seed: int = 0):
    dp, tp, pp = LAYOUTS[name]
    ranks = Mesh.for_world(ctx.world_size, dp=dp, tp=tp, pp=pp).build(30)
    engine = parallelize(TinyGPT(CFG, seed=seed, dtype=dtype), ranks,
                         Layout(dp=dp, tp=tp, pp=pp, schedule="1f1b", microbatches=2))
    return engine, optimizer(engine.parameters()), ranks.coord.dp, dp


def _steps(engine, opt, dp_rank: int, dp: int, first: int, last: int) -> list[float]:
    losses = []
    for x, y in batches(CFG)[first:last]:
        loss = engine.step(shard(x, dp_rank, dp), shard(y, dp_rank, dp))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _save_all(ctx, root: str) -> dict:
    out = {}
    for name in BY_WORLD[ctx.world_size]:
        engine, opt, dp_rank, dp = _engine(ctx, name)
        out[name] = _steps(engine, opt, dp_rank, dp, 0, SAVE_AT)
        save(Path(root) / name, SAVE_AT, engine, opt, config={"layout": name})
    for name in ("dp2", "pp2") if ctx.world_size == 2 else ():  # float32: save at 2, go on to 3
        engine, opt, dp_rank, dp = _engine(ctx, name, torch.float32)
        _steps(engine, opt, dp_rank, dp, 0, SAVE_AT)
        save(Path(root) / f"{name}-f32", SAVE_AT, engine, opt, config={"layout": name})
        out[f"{name}-f32"] = _steps(engine, opt, dp_rank, dp, SAVE_AT, 3)[0], engine.state_dict()
    if ctx.world_size == 2:  # two machines, each with an --out of its own: rank 0 sees only its own file
        engine, opt, _, _ = _engine(ctx, "dp2")
        said = io.StringIO()
        with contextlib.redirect_stderr(said):
            for step in (1, 2):
                save(Path(root) / f"apart-{ctx.rank}", step, engine, opt, config={"layout": "dp2"})
        out[f"apart rank {ctx.rank}"] = said.getvalue(), str(Path(root) / f"apart-{ctx.rank}")
    return out


def _resume_all(ctx, root: str) -> dict:
    out = {}
    for name in BY_WORLD[ctx.world_size]:
        for saved in LAYOUTS:
            engine, opt, dp_rank, dp = _engine(ctx, name, seed=99)  # other weights: the load must replace them
            step = load(Path(root) / saved, engine, opt)["step"]
            loss = _steps(engine, opt, dp_rank, dp, step, 3)
            state = engine.state_dict()  # a collective: every rank gathers, rank 0 reports
            out[f"{saved} -> {name}"] = loss, state if ctx.rank == 0 else None
    for name in ("dp2", "pp2") if ctx.world_size == 2 else ():
        engine, opt, dp_rank, dp = _engine(ctx, name, torch.float32, seed=99)
        step = load(Path(root) / f"{name}-f32", engine, opt)["step"]
        out[f"{name}-f32"] = _steps(engine, opt, dp_rank, dp, step, 3)[0], engine.state_dict()
    return out


@functools.cache
def _matrix(root: str) -> tuple[dict, dict]:
    saved, resumed = {}, {}
    for world in (1, 2, 4):
        per_rank = run_ranks(functools.partial(_save_all, root=root), world, timeout_s=120)
        saved.update({k: v for got in per_rank for k, v in got.items() if k.startswith("apart")}, **per_rank[0])
    for world in (1, 2, 4):
        resumed.update(run_ranks(functools.partial(_resume_all, root=root), world, timeout_s=180)[0])
    return saved, resumed


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    return _matrix(str(tmp_path_factory.mktemp("checkpoints")))


@pytest.mark.timeout(600)
def test_checkpoints_of_machines_with_their_own_out_are_said_to_need_their_files_together(matrix):
    saved, _ = matrix
    said, root = saved["apart rank 0"]
    assert said.count("warning: checkpoint step-000001 is not complete") == 1 and "(ranks 1)" in said, said
    assert said.count("warning") == 1 and saved["apart rank 1"][0] == "", said  # once, by rank 0
    # the manifest still lists every rank's file: brought together, the checkpoint is whole
    newest = find_latest(root)
    assert set(json.loads((newest / "manifest.json").read_text())["files"]) == {"rank-00000.pt", "rank-00001.pt"}
    assert not (newest / "rank-00001.pt").exists() and (Path(saved["apart rank 1"][1]) / newest.name /
                                                         "rank-00001.pt").is_file()


@pytest.mark.timeout(600)
def test_every_layout_resumes_every_other_layouts_checkpoint_exactly(matrix):
    saved, resumed = matrix
    want_losses, want_state = reference_run(CFG, batches(CFG))
    failures = []
    for name in LAYOUTS:
        if max(abs(a - b) for a, b in zip(saved[name], want_losses[:SAVE_AT], strict=True)) > TOL64:
            failures.append(f"{name}: steps 1-2 {saved[name]} != {want_losses[:SAVE_AT]}")
    assert len(resumed) >= len(LAYOUTS) ** 2
    for label, (losses, state) in resumed.items():
        if label.endswith("-f32"):
            continue
        if abs(losses[0] - want_losses[SAVE_AT]) > TOL64:
            failures.append(f"{label}: step 3 loss {losses[0]!r} != {want_losses[SAVE_AT]!r}")
        worst, err = max_error(state, want_state)
        if err > TOL64:
            failures.append(f"{label}: {worst} off by {err:.3g} after step 3")
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["dp2", "pp2"])
def test_same_layout_resume_is_bitwise_in_float32(matrix, name):
    saved, resumed = matrix
    want_loss, want_state = saved[f"{name}-f32"]
    got_loss, got_state = resumed[f"{name}-f32"]
    assert got_loss == want_loss, f"{name} float32: resumed step 3 loss {got_loss!r}, uninterrupted {want_loss!r}"
    for key, w in want_state.items():
        assert torch.equal(got_state[key], w), f"{name} float32: {key} differs after the resumed step"


def _slow_writer(ctx, root: str) -> float:
    """Rank 0 (dp 0) takes 15 s over its file, past the run's 10-s timeout; rank 1 (another replica: nothing to
    write) waits for it in the save's gathers, then both load it."""
    import time

    from fourfold.checkpoint import sharded

    engine, opt, _, _ = _engine(ctx, "dp2")
    if ctx.rank == 0:
        checksum = sharded.sha256_file

        def slow(path):
            time.sleep(15)
            return checksum(path)

        sharded.sha256_file = slow
    start = time.monotonic()
    where = save(Path(root), 1, engine, opt, config={"layout": "dp2"})
    waited = time.monotonic() - start
    assert load(where, engine, opt)["step"] == 1
    return waited


@pytest.mark.timeout(120)
def test_a_save_waits_for_a_writer_slower_than_the_runs_timeout(tmp_path):
    """A large model on a slow filesystem writes for minutes; the ranks with nothing to write must wait for it
    (sharded.IO_TIMEOUT_S), not fail after --timeout and lose the run at its checkpoint."""
    waited = run_ranks(_slow_writer, 2, str(tmp_path), timeout_s=100, dist_timeout_s=10)
    assert min(waited) >= 15, waited  # rank 1 waited out rank 0's 15 s


# ------------------------------------------------------------------ one process: what a bad checkpoint does


def _one(tmp: Path, cfg: GPTConfig = CFG, step: int = 1, keep: int = 2):
    engine = parallelize(TinyGPT(cfg, seed=0, dtype=torch.float64))
    opt = optimizer(engine.parameters())
    _steps(engine, opt, 0, 1, 0, 1)
    return save(tmp, step, engine, opt, config={}, keep=keep), engine, opt


def test_a_damaged_file_is_refused_naming_it_both_checksums_and_the_checkpoint_before_it(tmp_path):
    earlier, *_ = _one(tmp_path, step=1)
    where, engine, opt = _one(tmp_path, step=2)
    victim = where / "rank-00000.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    want = json.loads((where / "manifest.json").read_text())["files"]["rank-00000.pt"]["sha256"]
    with pytest.raises(CheckpointError, match=r"damaged: .*rank-00000\.pt: sha256 expected " + want + ", got") as e:
        load(where, engine, opt)
    assert str(e.value).endswith(f"Restore the file, or resume from the checkpoint before it: --resume {earlier}")


def test_a_checkpoint_without_its_manifest_does_not_exist(tmp_path):
    first, engine, opt = _one(tmp_path, step=1)
    second, *_ = _one(tmp_path, step=2)
    (second / "manifest.json").unlink()  # as if the save of step 2 was killed before its last write
    assert find_latest(tmp_path) == first
    assert load(tmp_path, engine, opt)["step"] == 1
    (first / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"no complete checkpoint .*step-000001, step-000002 have no manifest"):
        find_latest(tmp_path)


def test_a_checkpoint_of_another_model_is_refused_naming_the_tensors(tmp_path):
    where, *_ = _one(tmp_path)
    bigger = GPTConfig(vocab_size=64, seq_len=8, n_layer=3, n_head=2, d_model=16)
    engine = parallelize(TinyGPT(bigger, seed=0, dtype=torch.float64))
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: blocks\.2\."):
        load(where, engine)
    wider = GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=32)
    engine = parallelize(TinyGPT(wider, seed=0, dtype=torch.float64))
    with pytest.raises(CheckpointError, match=r"different: .*qkv\.weight float64\[48, 16\] in the checkpoint, "
                       r"float64\[96, 32\] in the model.* and \d+ more"):
        load(where, engine)


def test_only_the_newest_keep_checkpoints_stay(tmp_path):
    for step in (1, 2, 3):
        _one(tmp_path, step=step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002", "step-000003"]


def test_prune_removes_a_linked_checkpoint_as_a_link_and_keeps_one_it_cannot_remove(tmp_path, capsys, monkeypatch):
    """A step folder that is a link to a checkpoint elsewhere: the prune removes the link, never the checkpoint
    it points to. One whose manifest cannot be removed stays whole (not half deleted), and the save that pruned it
    goes through."""
    elsewhere, *_ = _one(tmp_path / "elsewhere", step=1)
    root = tmp_path / "run"
    root.mkdir()
    (root / "step-000001").symlink_to(elsewhere, target_is_directory=True)
    _one(root, step=2, keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["step-000002"]
    assert find_latest(tmp_path / "elsewhere") == elsewhere  # its manifest and files untouched
    assert (elsewhere / "rank-00000.pt").is_file()

    unlink = Path.unlink

    def read_only(self, missing_ok=False):  # a folder made read-only (root ignores modes, so say it here)
        if self == root / "step-000002" / "manifest.json":
            raise PermissionError(13, "Permission denied")
        return unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", read_only)
    _one(root, step=3, keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["step-000002", "step-000003"]
    assert find_latest(root / "step-000002") == root / "step-000002"  # whole, still a checkpoint
    assert "step-000002 could not be removed (Permission denied); it is kept" in capsys.readouterr().err


def test_a_checkpoint_is_on_the_disk_before_an_older_one_is_pruned(tmp_path, monkeypatch):
    """Without a flush, a power loss after the prune could leave the new checkpoint's files empty and the old
    ones gone. Every file and folder entry of step 2 is flushed before step 1 (keep=1) is deleted."""
    import os
    import shutil

    events = []
    fsync, rmtree = os.fsync, shutil.rmtree
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 fsync(fd))[1])
    monkeypatch.setattr(shutil, "rmtree", lambda path, *a, **k: (events.append(("prune", str(path))),
                                                                 rmtree(path, *a, **k))[1])
    _one(tmp_path, step=1, keep=1)
    events.clear()
    _one(tmp_path, step=2, keep=1)
    prune = events.index(("prune", str(tmp_path / "step-000001")))
    flushed = {Path(p).name for kind, p in events[:prune] if kind == "fsync"}
    tmp_names = {n for n in flushed if n.endswith(".tmp")}  # the files, flushed under their temporary names
    assert any(n.startswith(".rank-00000.pt.") for n in tmp_names), events
    assert any(n.startswith(".manifest.json.") for n in tmp_names), events
    assert {"step-000002", tmp_path.name} <= flushed, events  # the files' entries, and the step folder's own
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002"]


def test_what_the_engine_does_not_hold_travels_in_config(tmp_path):
    """README's own-loop block: a scheduler's state and the data's position, saved in config, come back in the
    manifest that load returns (load takes the run's folder: its newest complete checkpoint)."""
    engine = parallelize(TinyGPT(CFG, seed=0, dtype=torch.float64))
    opt = optimizer(engine.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
    _steps(engine, opt, 0, 1, 0, 2)
    sched.step()
    sched.step()
    save(tmp_path / "checkpoints", 2, engine, opt, config={"scheduler": sched.state_dict(), "batches_read": 2})
    fresh = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
    manifest = load(tmp_path, engine, opt)
    fresh.load_state_dict(manifest["config"]["scheduler"])
    assert (manifest["step"], manifest["config"]["batches_read"], fresh.last_epoch) == (2, 2, 2)
    assert fresh.get_last_lr() == sched.get_last_lr()


def test_a_filesystem_that_cannot_flush_a_folder_still_saves(tmp_path, monkeypatch):
    import errno
    import os

    fsync = os.fsync

    def picky(fd):
        if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(errno.EINVAL, "Invalid argument")  # some FUSE, CIFS and NFS mounts
        fsync(fd)

    monkeypatch.setattr(os, "fsync", picky)
    where, *_ = _one(tmp_path, step=1)
    assert find_latest(tmp_path) == where


_SAVER = """
import sys, torch
from fourfold import parallelize
from fourfold.checkpoint import save
from fourfold.models import GPTConfig, TinyGPT
engine = parallelize(TinyGPT(GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=16), seed=0))
opt = torch.optim.AdamW(engine.parameters())
print("ready", flush=True)
for step in range(1, 100000):
    save(sys.argv[1], step, engine, opt, config={}, keep=2)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("after_s", [0.3, 0.75])
def test_a_save_killed_midway_leaves_the_newest_complete_checkpoint_loadable(tmp_path, after_s):
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(after_s)  # somewhere inside a save: rank file, manifest or pruning
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    where = find_latest(tmp_path)
    engine = parallelize(TinyGPT(CFG, seed=1, dtype=torch.float32))
    opt = torch.optim.AdamW(engine.parameters())
    manifest = load(where, engine, opt)  # every file checked against its sha256
    assert manifest["step"] >= 1 and where.name == f"step-{manifest['step']:06d}"
