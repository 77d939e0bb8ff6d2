"""A checkpoint on disk: ``ROOT/step-NNNNNN/`` holding one file per rank and ``manifest.json``, written last.

A directory without its manifest is not a checkpoint (a save that did not finish). Files are checked against
the manifest's sha256 the first time they are opened, and loaded with ``weights_only=True`` (data, never code).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fourfold.files import set_aside

__all__ = ["FORMAT", "MANIFEST", "CheckpointError", "find_latest", "prune", "read_manifest", "restart_count",
           "set_aside_newer", "sha256_file", "starting_manifest"]

FORMAT = "fourfold-checkpoint/1"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"step-(\d+)")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, damaged, or does not match the model it is loaded into."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def prune(root: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` complete checkpoints, and incomplete ones older than the newest."""
    complete = _complete(root)
    newest = complete[-1][0] if complete else -1
    for _, path in complete[:-keep] if keep > 0 else []:
        _remove(path)
    for path in root.iterdir():
        m = _STEP_DIR.fullmatch(path.name)
        if m and int(m.group(1)) < newest and not (path / MANIFEST).exists():
            _remove(path)


def _remove(path: Path) -> None:
    """Delete a checkpoint folder, its manifest first: a crash midway leaves no checkpoint, not half of one.

    A link in its place goes as a link: what it points to (a checkpoint elsewhere) is not this run's to delete.
    A folder whose manifest cannot be removed (made read-only, say) is kept whole, and said so, rather than
    half deleted or failing the save that pruned it."""
    if path.is_symlink():
        path.unlink(missing_ok=True)
        return
    if not path.is_dir():
        return
    try:
        (path / MANIFEST).unlink(missing_ok=True)
    except OSError as e:
        print(f"fourfold: checkpoint {path} could not be removed ({e.strerror or e}); it is kept.",
              file=sys.stderr, flush=True)
        return
    shutil.rmtree(path, ignore_errors=True)


def set_aside_newer(root: Path, step: int) -> Path | None:
    """Move the checkpoints in ``root`` past ``step`` into ``root/.abandoned-<time>/``: a run resumed in place from
    an older checkpoint departs from them, and left where they were the next ``--resume`` would take the newest of
    them, and ``prune`` would delete the one this run started from. Kept, not deleted; None when there were none.
    Incomplete ones (saves that never finished: a full disk) are removed, as :func:`prune` removes them: kept,
    they would hold the space the next save needs, and every restart would fail again."""
    newer = [p for p in root.iterdir() if (m := _STEP_DIR.fullmatch(p.name)) and int(m.group(1)) > step] \
        if root.is_dir() else []
    unfinished = [p for p in newer if not (p / MANIFEST).is_file()]  # a save the disk filled up under, say
    for p in unfinished:
        _remove(p)
    newer = [p for p in newer if p not in unfinished]
    if not newer:
        return None
    aside = Path(tempfile.mkdtemp(prefix=f".abandoned-{time.strftime('%Y%m%d-%H%M%S')}-", dir=root))
    for p in sorted(newer):
        p.rename(aside / p.name)
    return aside


def _complete(root: Path) -> list[tuple[int, Path]]:
    found = []
    for path in root.iterdir() if root.is_dir() else []:
        m = _STEP_DIR.fullmatch(path.name)
        if m and (path / MANIFEST).is_file():
            found.append((int(m.group(1)), path))
    return sorted(found)


def find_latest(path: str | Path) -> Path:
    """The checkpoint ``path`` names: a checkpoint directory, or a run's ``OUT`` (or its ``checkpoints/``),
    whose newest complete checkpoint is taken. Raises :class:`CheckpointError` saying what was found."""
    p = Path(path)
    if (p / MANIFEST).is_file():
        return p
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    if not p.exists():
        raise CheckpointError(f"resume: {p} does not exist. Pass a run's --out directory or one checkpoint in it.")
    complete = _complete(root)
    if not complete:
        partial = sorted(q.name for q in root.iterdir() if _STEP_DIR.fullmatch(q.name)) if root.is_dir() else []
        extra = f" ({', '.join(partial)} have no {MANIFEST}: saves that did not finish)" if partial else ""
        out = root.parent if root.name == "checkpoints" else root
        aside = [a for a in set_aside(out) if (a / "checkpoints").is_dir()]
        if aside:
            # mv cannot put a folder over a non-empty one: this run's checkpoints/ (unfinished saves) goes first
            clear = f"mv {root} {root}.unfinished; " if root.name == "checkpoints" and root.is_dir() else ""
            extra += (f"; {out / aside[-1].name}/checkpoints holds the checkpoints of an earlier run an --overwrite "
                      f"run set aside and did not finish: move its files back ({clear}mv {out / aside[-1].name}/* "
                      f"{out}/) and --resume {out}, or resume from it into another --out")
        raise CheckpointError(f"resume: no complete checkpoint in {root}{extra}. Train with --checkpoint-every N "
                              "to write some.")
    return complete[-1][1]


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of the checkpoint :func:`find_latest` finds for ``path`` (its directory under ``"dir"``)."""
    where = find_latest(path)
    try:
        manifest = json.loads((where / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"damaged: {where / MANIFEST} cannot be read ({e}).") from e
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{where / MANIFEST}: format must be {FORMAT!r}, got {manifest.get('format')!r}.")
    return {**manifest, "dir": str(where)}


def restart_count() -> int:
    """How many times torchrun's agent has restarted this job's ranks (``--max-restarts``)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def starting_manifest(resume: str | Path | None, out: str | Path) -> dict[str, Any] | None:
    """The manifest of the checkpoint a run starts from: after an automatic restart, ``out``'s newest (the run's
    own progress; ``resume``'s may have been pruned since), else ``resume``'s (:class:`CheckpointError` if it is
    missing or damaged); None when there is neither (a run restarted before its first checkpoint starts over).
    A restart whose checkpoints all fail their check is refused (:class:`CheckpointError`), not started over."""
    if restart_count() > 0:
        passed: list[tuple[Path, str]] = []  # newer checkpoints that cannot be read, and why
        for _, where in reversed(_complete(Path(out) / "checkpoints")):
            try:
                manifest = read_manifest(where)
            except CheckpointError as e:
                passed.append((where, str(e)))
                continue
            damaged = _damaged(where, manifest["files"])
            if damaged is not None:
                passed.append((where, damaged))
                continue
            if passed and os.environ.get("RANK", "0") == "0" and str(where) not in _NOTED:  # once, by rank 0
                _NOTED.add(str(where))
                print(f"fourfold train: note: restart {restart_count()} resumes from {where.name}: the newer "
                      f"{', '.join(p.name for p, _ in passed)} cannot be read ({passed[0][1]}).",
                      file=sys.stderr, flush=True)
            return manifest
        if passed:  # checkpoints were written, and none can be read: never start over silently past them
            raise CheckpointError(f"restart {restart_count()}: every checkpoint in {Path(out) / 'checkpoints'} fails "
                                  f"its check ({', '.join(p.name for p, _ in passed)}; the newest: {passed[0][1]}), "
                                  "so the run stops here rather than start over. Restore the files (a run over "
                                  "several machines needs an --out they share) and --resume it by hand")
        # none written yet: --resume's, or from the start
    return read_manifest(resume) if resume is not None else None


_NOTED: set[str] = set()  # the checkpoints a restart note was printed for: once per process


def _damaged(where: Path, files: dict[str, dict[str, Any]]) -> str | None:
    """What makes a checkpoint unreadable at a glance (a file its manifest lists missing, or of another size; the
    sha256 is checked as each file is read), or None. A restart passes over such a checkpoint to the one before,
    rather than failing on it again at every attempt."""
    for name, want in sorted(files.items()):
        path = where / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != want["bytes"]:
            return f"{name} holds {path.stat().st_size} bytes, its manifest {want['bytes']}"
    return None


class CheckedFiles:
    """The checkpoint's files, each checked against the manifest's sha256 the first time it is opened."""

    def __init__(self, where: Path, files: dict[str, dict[str, Any]]) -> None:
        self.where, self.files = where, files
        self.open: dict[str, dict[str, Any]] = {}

    def _instead(self) -> str:
        """What to resume from instead of a damaged checkpoint: the newest complete one before it, if any."""
        earlier = [p for _, p in _complete(self.where.parent) if p.name < self.where.name]
        if not earlier:
            return " Restore the file; no earlier checkpoint is left beside it."
        return f" Restore the file, or resume from the checkpoint before it: --resume {earlier[-1]}"

    def get(self, name: str) -> dict[str, Any]:
        if name not in self.open:
            path, want = self.where / name, self.files.get(name)
            if want is None or not path.is_file():
                raise CheckpointError(f"damaged: {path} is missing (the manifest lists {sorted(self.files)})."
                                      f"{self._instead()}")
            got = sha256_file(path)
            if got != want["sha256"]:
                raise CheckpointError(f"damaged: {path}: sha256 expected {want['sha256']}, got {got} "
                                      f"({path.stat().st_size} bytes, expected {want['bytes']}).{self._instead()}")
            self.open[name] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return self.open[name]
