"""What every parity test needs, in one place: seeded batches, the optimiser, the one-process reference run,
and the error measure. A layout passes when its losses and final state equal :func:`reference_run`'s.

    from helpers import TOL64, batches, max_error, reference_run

    want_losses, want_state = reference_run(CFG, batches(CFG))       # one process, the whole batch
    name, err = max_error(layout_state, want_state)                   # the worst tensor and its max |error|
    assert err <= TOL64, f"{name}: {err:.3g}"
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from fourfold.models import GPTConfig, TinyGPT

__all__ = ["LR", "TOL64", "WEIGHT_DECAY", "batches", "max_error", "optimizer", "process_tree", "reference_run",
           "launched", "alive", "wait_for_rows", "workers", "rank_of", "rows", "losses",
           "shard"]

LR, WEIGHT_DECAY = 1e-2, 0.1
TOL64 = 1e-10  # float64: every layout equals one process to this, losses and every parameter


def batches(cfg: GPTConfig, batch: int = 8, steps: int = 3, seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of random token ids, (batch, seq_len) inputs and targets."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g),
             torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)) for _ in range(steps)]


def train_corpus(engine, steps: int, dp_rank: int = 0, dp_size: int = 1, lr: float = 3e-3) -> list[float]:
    """``steps`` AdamW steps of ``engine`` on the built-in corpus (batches of 16 x the model's seq_len, this dp
    rank's shard): the losses. The loop the long training tests (bf16, compression) share."""
    from fourfold.data import BatchLoader, load_corpus

    loader = BatchLoader(load_corpus(max_bytes=2**20), 16, engine.model.config.seq_len, seed=0,
                         dp_rank=dp_rank, dp_size=dp_size)
    opt = torch.optim.AdamW(engine.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = loader.shard(step)
        losses.append(engine.step(x, y).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def shard(batch: torch.Tensor, dp_rank: int, dp: int) -> torch.Tensor:
    """Data-parallel rank ``dp_rank``'s equal, contiguous share of a global batch."""
    n = batch.size(0) // dp
    return batch[dp_rank * n:(dp_rank + 1) * n]


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def reference_run(cfg: GPTConfig, steps: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype = torch.float64,
                  seed: int = 0, max_norm: float | None = None,
                  norms: list[float] | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the whole batch, the model's own forward: the losses and final state to reproduce.
    ``max_norm``: torch's own ``clip_grad_norm_`` before each optimiser step, its norms appended to ``norms``."""
    model = TinyGPT(cfg, seed=seed, dtype=dtype)
    opt = optimizer(model.parameters())
    losses = []
    for x, y in steps:
        _, loss = model(x, y)
        loss.backward()
        if max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
            if norms is not None:
                norms.append(norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def one_process(model: torch.nn.Module, steps: list[tuple], loss_fn) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A model of yours trained in one process on the whole batches with the seeded optimiser, ``loss_fn(model(x),
    y)`` each step: the losses and the final state."""
    opt = optimizer(model.parameters())
    losses = []
    for x, y in steps:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_eval(cfg: GPTConfig, state: dict[str, torch.Tensor], batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    """One process's eval-mode loss of ``batch`` under ``state``: what ``engine.evaluate`` must give."""
    model = TinyGPT(cfg, seed=0, dtype=next(iter(state.values())).dtype).eval()
    model.load_state_dict(state)
    with torch.no_grad():
        return model(*batch)[1].item()


def max_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[str, float]:
    """The tensor of ``want`` that ``got`` misses by most, and by how much (inf: missing or reshaped)."""
    worst, err = "", -1.0
    for name, w in want.items():
        g = got.get(name)
        e = float("inf") if g is None or g.shape != w.shape else (g.double() - w.double()).abs().max().item()
        if e > err:
            worst, err = name, e
    return worst, err


def process_tree(pid: int) -> set[int]:
    """``pid`` and all its descendants, from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        found.add(p)
        todo.extend(children.get(p, []))
    return found


def rows(out: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in rows(out)]


@contextlib.contextmanager
def launched(argv: list[str]) -> Iterator[subprocess.Popen]:
    """``fourfold train ARGV`` in a session of its own; whatever of it is left is killed on the way out."""
    proc = subprocess.Popen([sys.executable, "-m", "fourfold", "train", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        yield proc
    finally:  # the test's own cleanup, not the feature under test
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for_rows(out: Path, n: int, proc: subprocess.Popen, limit_s: float = 90) -> None:
    """Until OUT/metrics.jsonl has ``n`` rows (the run reached step n), or fail with the run's output."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if len((out / "metrics.jsonl").read_text().splitlines()) >= n:
                return
        except OSError:
            pass
        time.sleep(0.01)
    raise AssertionError(f"the run did not reach {n} steps (exit {proc.poll()}): "
                         f"{proc.stdout.read() if proc.poll() is not None and proc.stdout else ''}")


def workers(launcher: int) -> list[int]:
    """The processes a launcher started (its descendants), in pid order."""
    return sorted(process_tree(launcher) - {launcher})


def rank_of(pid: int) -> int | None:
    """The rank of a worker: a forked rank's name (``fourfold-rank3``), else the RANK its command started with
    (None: not a rank)."""
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    if name.startswith("fourfold-rank") and name[13:].isdigit():
        return int(name[13:])
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    found = [int(e[5:]) for e in env if e.startswith(b"RANK=")]
    return found[0] if found else None
