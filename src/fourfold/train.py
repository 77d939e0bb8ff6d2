"""Train a model (TinyGPT by default; GPT-2, Llama or your own with ``--model``) on one process or many.

    fourfold train --steps 50                            # one process
    fourfold train --nproc 2 --steps 50                  # two data-parallel ranks, started through torchrun
    fourfold train --nproc 2 --model gpt2 --model-config tiny.json --tp 2   # Hugging Face GPT-2, sharded
    torchrun --nproc-per-node 2 -m fourfold.train ...    # the same, launched by hand
    fourfold train --config run.toml --lr 1e-3           # defaults < file < flags

Outputs in ``--out``:

* ``run.json``: the full config, the layout, and the corpus's name and sha256 (which text was trained on);
* ``metrics.jsonl``: one JSON object per step: ``step``, ``loss`` (always the mean over the *global* batch,
  whatever the layout, so runs compare line by line), ``tokens_per_s``, ``step_time_s``, and where the time and
  bytes went (``compute_s``, ``comm_s``, ``wait_s``; ``bytes_by_axis`` and their sum ``comm_bytes``, what rank
  0 sent, and ``comm_messages``; a ``native`` all-reduce's bytes are the backend's and not counted);
* ``trace-rank<r>.jsonl`` per rank and ``trace.json``, the merged timeline (open it in ui.perfetto.dev);
* ``model.pt``: the final weights under the model's own names, and the config, loadable with
  ``fourfold.checkpoint.load_checkpoint`` (``GPT2LMHeadModel(config).load_state_dict(ckpt["model"])``).

The same ``--seed`` and ``--batch-size`` give the same initial weights and the same global batches under every
layout; that is what makes "the same numbers as one process" testable.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import sysconfig
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from fourfold import checkpoint, launch
from fourfold.checkpoint import CheckpointError
from fourfold.comm.doctor import HangFound
from fourfold.comm.ledger import LEDGER
from fourfold.comm.wait import CommError, barrier
from fourfold.config import Config
from fourfold.files import (
    OUTPUTS,
    drop_replaced,
    open_metrics,
    run_lock,
)
from fourfold.models.build import (
    build_model,
)
from fourfold.observe.memory import held_bytes
from fourfold.run.args import parse_args, without_section_flags
from fourfold.run.metrics import held_out_loss, step_row, stop, synchronize
from fourfold.run.optim import NonFiniteLoss, lr_at, update
from fourfold.run.out import write_outputs
from fourfold.run.preflight import before_launch_notes, preflight
from fourfold.run.setup import setup
from fourfold.run.summary import TrainResult
from fourfold.torchrun import LaunchConfig, is_worker

__all__ = ["OUTPUTS", "TrainResult", "build_model", "main", "train"]

_LOCK_HELD = "FOURFOLD_OUT_LOCKED"  # set for the ranks we launch: their launcher holds OUT's lock
_LAUNCH = "FOURFOLD_LAUNCH"  # and the launcher's [launch] flags, as JSON, which the ranks are started without


class _Bar(tqdm):
    monitor_interval = 0  # no monitor thread: one left running would keep this process from forking its ranks


def train(cfg: Config, ctx: launch.DistContext | None = None) -> TrainResult:
    """Train with ``cfg`` on the current process group (created from the environment if ``ctx`` is None)."""
    own = ctx is None
    ctx = ctx or launch.init(cfg.train.device, timeout_s=cfg.train.timeout, hang_s=cfg.train.hang_threshold)
    finished = False
    try:
        result = _train(cfg, ctx)
        if own and ctx.world_size > 1:  # every rank done before any tears its connections down
            barrier("finish the run together")
        finished = True
        return result
    except Exception as e:
        if ctx.doctor is not None and ctx.doctor.verdict_given():  # a consequence: the finder's line says why
            raise HangFound(f"rank {ctx.rank}: ended by the hang doctor ({type(e).__name__}: {e})") from e
        raise
    finally:
        if own:  # after an error, nothing in flight is waited for: its peer may never send it
            ctx.close(settle=finished)


def _train(cfg: Config, ctx: launch.DistContext) -> TrainResult:
    """Set the run up (:func:`fourfold.run.setup.setup`), step it, write its outputs."""
    t, run = cfg.train, setup(cfg, ctx)
    engine, optimizer, tracer, result = run.engine, run.optimizer, run.tracer, run.result
    metrics_file = open_metrics(run.out / "metrics.jsonl", run.first - 1 if run.continuing else 0) \
        if ctx.is_main else None
    bar = _Bar(total=t.steps, initial=run.first - 1, desc="train", unit="step", file=sys.stderr,
               disable=not (ctx.is_main and cfg.output.progress), dynamic_ncols=True,
               mininterval=0.2 if sys.stderr.isatty() else 10.0)
    held: dict[str, int] | None = None
    barrier("start the clock")
    tracer.start()  # after the barrier, so every rank's t=0 is (nearly) the same instant
    try:
        for step in range(run.first, t.steps + 1):
            tracer.set_step(step)
            LEDGER.step = step
            first_span = len(tracer.spans)
            start = time.perf_counter()
            batch = run.loader.batch(step - 1)  # windows of a stream, or packed documents
            args, kwargs = batch.step_args(ctx.device)
            loss = engine.step(*args, **kwargs)
            try:
                grad_norm = update(engine, optimizer, cfg, step)  # clip, the step's learning rate, the optimiser step
            except NonFiniteLoss as e:  # a NaN or infinite gradient: no update made; every rank stops here
                stop(metrics_file, {"step": step, "loss": loss.item()}, str(e), e)  # (the loss all-reduce waited)
            if held is None:  # parameters, gradients and optimiser state: fixed from the first step on
                held = held_bytes(engine.parameters(), optimizer)
            optimizer.zero_grad(set_to_none=True)
            global_loss = loss.item()  # the loss all-reduce ran during the optimiser step
            synchronize(ctx.device)  # time the step, not the launch of its kernels
            row = step_row(step, loss, global_loss, time.perf_counter() - start, batch.stats, tracer, first_span,
                           lr_at(cfg, step), grad_norm, held, ctx.device,
                           every_rank=step in (run.first, t.steps) and ctx.world_size > 1)
            if not math.isfinite(global_loss):  # every rank has the same global loss: all stop here together
                stop(metrics_file, row, f"non-finite loss {global_loss}", NonFiniteLoss(
                    f"step {step}: the loss is {global_loss}; training stopped (the weights are no longer usable). "
                    f"Lower --lr (now {cfg.optim.lr:g}), or resume from an earlier checkpoint with --resume."))
            if t.eval_every and (step % t.eval_every == 0 or step == t.steps):
                row["eval_loss"] = held_out_loss(engine, run.loader, t.eval_batches, ctx.device, tracer)
            if step <= t.verify:  # the whole model after this step, for the one-process re-run to compare
                result.snapshots.append(engine.state_dict(to=0))  # rank 0 re-runs them alone
            result.losses.append(global_loss)
            result.metrics.append(row)
            if metrics_file is not None:
                metrics_file.write(json.dumps(row) + "\n")
                metrics_file.flush()
            if step == t.steps or (cfg.checkpoint.checkpoint_every and step % cfg.checkpoint.checkpoint_every == 0):
                checkpoint.save(run.out / "checkpoints", step, engine, optimizer, keep=cfg.checkpoint.keep,
                                config={**cfg.record(), "corpus_sha256": run.source.get("sha256")})
            bar.update(1)
            bar.set_postfix(**_shown(row, global_loss, batch.documents is None), refresh=False)
    finally:
        bar.close()
        if metrics_file is not None:
            metrics_file.close()
    result.chose = [f"cp auto chose {name}: {why}" for name, why in getattr(engine.sequence, "picks", {}).values()]
    write_outputs(cfg, ctx, engine, tracer, run.out, result)
    if ctx.is_main and cfg.output.overwrite:  # this run is complete: the earlier ones it replaces can go (only then: a
        drop_replaced(run.out)  # run without --overwrite keeps what a failed --overwrite set aside)
    return result


def _shown(row: dict[str, Any], loss: float, windows: bool) -> dict[str, str]:
    """The progress bar's figures for a step."""
    shown = {"loss": f"{loss:.4f}"}
    shown.update({"tok_s": f"{row['tokens_per_s']:,.0f}"} if windows else {
        "real_tok_s": f"{row['real_tokens_per_s']:,.0f}", "pad": f"{row['padding_fraction']:.0%}"})
    if "eval_loss" in row:
        shown["eval"] = f"{row['eval_loss']:.4f}"
    return shown


def _interrupted_note(cfg: Config) -> str:
    """What an interrupted run left to resume from: its newest complete checkpoint, or that there is none."""
    out = cfg.output.out
    try:
        manifest = checkpoint.read_manifest(out)
    except CheckpointError:
        every = cfg.checkpoint.checkpoint_every
        why = (f"--checkpoint-every {every}: none reached yet" if every else
               "--checkpoint-every 0, the default, writes none until the run ends")
        return (f"no checkpoint to resume from in {out} ({why}). Pass --checkpoint-every N to keep one every N "
                "steps.")
    return (f"the newest complete checkpoint is step {manifest['step']} ({manifest['dir']}): continue with the "
            f"same flags and --resume {out}.")


def _launched_as() -> LaunchConfig:
    """A rank's [launch] section, for run.json and checkpoints (only a record: it never fails): its launcher's
    flags (ranks are started without them), or under a hand-run torchrun what its environment says."""
    try:
        if _LAUNCH in os.environ:
            return LaunchConfig(**json.loads(os.environ[_LAUNCH]))
        env = os.environ.get
        local = int(env("LOCAL_WORLD_SIZE", "1"))
        nodes = int(env("GROUP_WORLD_SIZE", "0")) or max(int(env("WORLD_SIZE", "1")) // local, 1)
        endpoint = f"{env('MASTER_ADDR')}:{env('MASTER_PORT')}" if env("MASTER_ADDR") else None
        return LaunchConfig(nproc=local, nnodes=nodes, node_rank=int(env("GROUP_RANK", "0")),
                            rdzv_endpoint=endpoint if nodes > 1 else None)
    except (ValueError, TypeError):  # machines of different sizes, or a variable of another launcher
        return LaunchConfig()


def _raised_by_fourfold(e: BaseException) -> bool:
    """True when ``e`` was raised for fourfold's own code: a refusal that names the value and the fix, printed in
    one line. The innermost frame outside the libraries (the standard library's, site-packages') decides: in
    fourfold (itself, or numpy or json refusing a file fourfold handed them), one line; in the user's model or
    data code (or torch inside it), the traceback, which ends there."""
    frames = []
    tb = e.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not name.startswith("<"):  # <frozen importlib._bootstrap>, <string>: Python's own
            frames.append(Path(name).resolve())
        tb = tb.tb_next
    for path in reversed(frames):
        if path.is_relative_to(_PACKAGE):
            return True
        if not any(path.is_relative_to(lib) for lib in _LIBRARIES):
            return False  # the user's own file
    return True


_PACKAGE = Path(__file__).resolve().parent
_LIBRARIES = {Path(p).resolve() for key in ("stdlib", "platstdlib", "purelib", "platlib")
              if (p := sysconfig.get_paths().get(key))}


def _uncaught(error: Exception, worker: bool) -> int:
    """An error with a traceback to show. A rank that fourfold's launcher started leaves it to the launcher, which
    prints each different traceback once with the ranks that raised it; otherwise it is raised here."""
    from fourfold.torchrun import report_error

    if worker and report_error(error):
        return 1
    raise error


def _said(line: str, error: Exception, worker: bool, code: int, echo: bool = False) -> int:
    """A refusal's one line. A rank that fourfold's launcher started leaves it to the launcher, which prints each
    different line once (every rank refusing the same data would print it once per rank), a lost peer's echo only
    when no rank said more; otherwise it is printed here. ``code``: the exit status."""
    from fourfold.torchrun import report_error

    if not (worker and report_error(error, line, echo=echo)):
        print(line, file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    """``fourfold train``: launch ``--nproc`` ranks through torchrun, or train in this process."""
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = parse_args(argv)
    worker = is_worker()  # started by torchrun (ours or the user's)
    if worker:
        cfg = replace(cfg, launch=_launched_as())
    main_rank = int(os.environ.get("RANK", "0")) == 0 and (worker or cfg.launch.node_rank == 0)
    # One run per OUT: the process that starts the run holds the lock (ranks we launch inherit it; with a
    # hand-run torchrun, rank 0 takes it); on several machines, machine 0's launcher (OUT may be shared).
    lock = (run_lock(cfg.output.out) if main_rank and os.environ.get(_LOCK_HELD) != cfg.output.out
            else contextlib.nullcontext())
    try:
        if not worker and cfg.launch.nproc > 1 and cfg.launch.nnodes == 1:
            from fourfold.torchrun import warm

            warm()  # the server the ranks are forked from imports torch while the preflight runs
        if not worker:  # the checks that need no process group, before any rank starts
            mesh = preflight(cfg, cfg.launch.world_size)
            before_launch_notes(cfg, mesh, cfg.launch.world_size)
        if not worker and cfg.launch.world_size > 1:
            from fourfold.torchrun import launch_workers

            with lock:
                os.environ[_LOCK_HELD] = cfg.output.out
                os.environ[_LAUNCH] = json.dumps(cfg.to_dict()["launch"])
                # Workers need no launch flags (and torchrun's parser would trip over --nproc).
                return launch_workers("fourfold.train", without_section_flags(argv, "launch"), cfg.launch,
                                      stopped=lambda: _interrupted_note(cfg))
        with lock:
            result = train(cfg)
    except ValueError as e:
        if not _raised_by_fourfold(e):
            return _uncaught(e, worker)  # in your model, your data code or a library: the traceback says where
        return _said(f"fourfold train: error: {e}", e, worker, 2)
    except CheckpointError as e:  # found by the rank that opened the file: the others stop with the job
        return _said(f"fourfold train: error: {e}", e, worker, 1)
    except CommError as e:
        if not e.peer_gone:
            return _uncaught(e, worker)  # a timeout: the traceback shows where this rank waited
        return _said(f"fourfold train: {e}", e, worker, 1, echo=True)  # another rank's failure: one line
    except HangFound:
        return 1  # the rank that found the hang printed the one line; the launcher's last line names the rank
    except NonFiniteLoss as e:
        if main_rank:
            print(f"fourfold train: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if worker:  # a rank about to exit: a second SIGINT (the launcher's to its workers) must not break the
            # exit itself (it raised inside the progress bar's __del__ once, a traceback in the message's place)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        if main_rank and not worker:
            print(f"fourfold train: interrupted (Ctrl-C); {_interrupted_note(cfg)}", file=sys.stderr, flush=True)
        return 130
    except Exception as e:  # a bug in your model or data code (or in fourfold): its traceback
        return _uncaught(e, worker)
    finally:
        if not worker:
            os.environ.pop(_LOCK_HELD, None)
            os.environ.pop(_LAUNCH, None)
    if result.rank != 0:
        return 0
    print(result.summary(), flush=True)
    if cfg.train.verify:  # after the run: the process group is gone, this is one process now
        from fourfold.run.verify import verify

        ok, text = verify(cfg, result.losses, result.snapshots)
        print(text, flush=True)
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
