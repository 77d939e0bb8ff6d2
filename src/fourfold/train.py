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
import shutil
import statistics
import sys
import sysconfig
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import torch
from tqdm import tqdm

from fourfold import checkpoint, launch
from fourfold.checkpoint import CheckpointError, save_checkpoint
from fourfold.checkpoint.sharded import io_barrier, io_group
from fourfold.checkpoint.store import set_aside_newer
from fourfold.comm.doctor import HangFound
from fourfold.comm.ledger import LEDGER
from fourfold.comm.wait import CommError, barrier, gather_objects, gather_spans
from fourfold.config import Config
from fourfold.data import (
    BatchLoader,
    DocumentLoader,
)
from fourfold.engine.parallelize import parallelize
from fourfold.engine.step import Engine, bytes_by_axis
from fourfold.files import (
    OUTPUTS,
    drawn_row,
    drop_replaced,
    median_row,
    median_step,
    move_aside,
    open_metrics,
    run_lock,
    steady,
    write_text_atomic,
)
from fourfold.mesh import Mesh
from fourfold.models.build import (
    build_model,
    build_unfilled,
    builds_unfilled,
    built_info,
    first_weights,
    model_info,
    num_parameters,
)
from fourfold.observe.chrome_trace import write_chrome_trace
from fourfold.observe.memory import held_bytes, process_peak
from fourfold.observe.trace import Tracer, hidden_fraction
from fourfold.observe.visualize import draw_step, rank_labels
from fourfold.run.args import parse_args, without_section_flags
from fourfold.run.data import make_loader
from fourfold.run.optim import NonFiniteLoss, keep_flags, lr_at, make_optimizer, update
from fourfold.run.preflight import before_launch_notes, check_data_vocab, preflight
from fourfold.run.resume import continues_run, restart_count, resume_from, same_on_every_rank
from fourfold.run.summary import pipeline_line, ranks_sent, unequal
from fourfold.torchrun import LaunchConfig

__all__ = ["OUTPUTS", "TrainResult", "build_model", "main", "train"]

_LOCK_HELD = "FOURFOLD_OUT_LOCKED"  # set for the ranks we launch: their launcher holds OUT's lock
_LAUNCH = "FOURFOLD_LAUNCH"  # and the launcher's [launch] flags, as JSON, which the ranks are started without


@dataclass
class TrainResult:
    """What a run produced, as seen by this rank."""

    rank: int
    mesh: Mesh
    losses: list[float] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    num_parameters: int = 0
    label: str = "TinyGPT"  # the model, as the summary names it
    out: Path | None = None
    state: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)  # the final weights, on rank 0 only
    snapshots: list[dict[str, torch.Tensor]] = field(default_factory=list, repr=False)  # --verify: per step, rank 0
    traced: bool = True  # --no-trace: no spans, so no bytes counted either
    pipeline: dict[str, Any] | None = None  # the schedule run and the stages' cut (run.json's "pipeline")
    sent_by_rank: dict[int, dict[str, int]] = field(default_factory=dict)  # rank 0: each rank's bytes per axis
    # in the drawn step (files.drawn_row: the one timeline.png shows)

    def summary(self) -> str:
        m = self.mesh
        row = median_row(self.metrics)  # the typical step (after the first, which warms up): one step's figures
        drawn = drawn_row(self.metrics)  # the step timeline.png draws (not the last, whose trace holds the end)
        assert row is not None and drawn is not None
        speed = f"median {row['tokens_per_s']:,.0f} tokens/s"
        if "documents" in row:  # packed: what was learned from, and what padding cost
            speed = (f"median {row['real_tokens_per_s']:,.0f} real tokens/s of {row['tokens_per_s']:,.0f} "
                     f"({row['padding_fraction']:.1%} padding)")
        ms = 1e3 * row["step_time_s"]
        by_axis = {a: statistics.median(r["bytes_by_axis"][a] for r in steady(self.metrics))
                   for a in ("dp", "tp", "pp")}
        # a dp group that sent nothing counted used the backend's own all-reduce, whose bytes it does not report
        axes = [f"{axis} {by_axis[axis] / 1024:,.1f} KB" if by_axis[axis] or axis != "dp" else
                "dp not counted (--allreduce native)"
                for axis in ("dp", "tp", "pp") if getattr(m, axis) > 1]
        if not self.traced:
            axes = ["not counted (--no-trace)"] if axes else []
        sent = f"rank 0 sent per step: {', '.join(axes)}\n" if axes else ""
        uneven = [f"{axis}: {ranks_sent([b[axis] for _, b in sorted(self.sent_by_rank.items())])}"
                  for axis in ("dp", "tp", "pp") if getattr(m, axis) > 1 and self.traced
                  and unequal([b[axis] for b in self.sent_by_rank.values()])]
        if uneven:  # a master's root, a pipeline's last stage: rank 0 alone would not show it
            sent += f"each rank sent in step {drawn['step']}: {'; '.join(uneven)}\n"
        steps = f"{len(self.losses)} step{'s' if len(self.losses) != 1 else ''}"
        evals = [r["eval_loss"] for r in self.metrics if "eval_loss" in r]
        held = f", held-out loss {evals[-1]:.4f}" if evals else ""
        return (f"trained {self.label} ({self.num_parameters / 1e6:.2f} M parameters) for {steps} on "
                f"{m.world_size} rank(s) (dp={m.dp} tp={m.tp} pp={m.pp}): loss {self.losses[0]:.4f} -> "
                f"{self.losses[-1]:.4f}{held}, {speed}, {ms:.1f} ms/step\n{sent}"
                f"{pipeline_line(self.pipeline, drawn)}{self.outputs()}")

    def outputs(self) -> str:
        """The line naming what the run wrote (only what is there: --no-save writes no model.pt)."""
        if self.out is None:
            return ""
        notes = {"trace.json": "trace.json (open in https://ui.perfetto.dev)",
                 "checkpoints": "checkpoints/ (resume with --resume)"}
        names = [notes.get(n, n) for n in ("metrics.jsonl", "trace.json", "timeline.png", "model.pt", "checkpoints",
                                           "run.json") if (self.out / n).exists()]
        return f"outputs in {self.out}: {', '.join(names)}"


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
    t = cfg.train
    mesh = preflight(cfg, ctx.world_size, scan_data=False)  # every rank fails alike, never a hang
    barrier("check OUT before writing")  # nobody writes to OUT before every rank has checked it
    tracer = Tracer(ctx.rank, enabled=t.trace)
    ranks = mesh.build(t.timeout, tracer)
    if ctx.world_size > 1:
        io_group()  # checkpoints' own group, made while every rank is here (a collective)
    out = Path(t.out)
    resume = resume_from(cfg)
    same_on_every_rank(resume, t.resume)
    continuing = resume is not None and continues_run(cfg, resume)
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        if not continuing:  # a fresh run (--overwrite): the earlier run is moved aside until this one ends
            move_aside(out)
    # The weights: filled once the layout has cut the model, each rank the tensors it keeps, into zeros whose
    # memory is used only where written: the checkpoint's, --init-from's, a Hugging Face model's seeded ones; a
    # TinyGPT or a model of your own starts as built
    later = builds_unfilled(cfg, resuming=resume is not None)
    model = build_unfilled(cfg, ctx.device) if later else build_model(cfg, ctx.device)
    filling = first_weights(cfg, model) if later and resume is None else None
    known = model_info(cfg)
    info = built_info(known, model)  # a model of your own: its vocabulary, known only now
    if known.vocab_size is None:
        check_data_vocab(cfg, info, scan=False)
    loader, source = make_loader(cfg, out, dp_rank=ranks.coord.dp, dp_size=mesh.dp, vocab_size=info.vocab_size,
                                 is_main=ctx.is_main, wait=barrier)
    if ctx.is_main and isinstance(loader, DocumentLoader) and loader.docs_per_step and \
            loader.docs_per_step > loader.order.n:  # the documents training visits (the held-out ones not)
        print(f"fourfold train: note: the data holds {loader.order.n} document(s) to train on and each step takes "
              f"{loader.docs_per_step} (--batch-size): documents repeat within every step (the epochs are "
              "shuffled and run on end to end). Lower --batch-size, or pass more documents.",
              file=sys.stderr, flush=True)
    count = num_parameters(model)
    example = None if t.model == "tinygpt" else loader.batch(0).inputs[:1].to(ctx.device)  # the split's check
    engine = parallelize(model, ranks, cfg.parallel, example=example).manual_seed(t.seed)
    if filling is not None:
        with filling as weights:
            engine.load_state_dict(weights)
    optimizer = make_optimizer(cfg, engine.parameters())
    result = TrainResult(ctx.rank, mesh, num_parameters=count, label=info.label, out=out, traced=t.trace,
                         pipeline=engine.runner.record())
    first = 1
    if resume is not None:  # every rank: its own pieces, cut for this layout
        first = checkpoint.load(resume["dir"], engine, optimizer)["step"] + 1
        keep_flags(optimizer, cfg)  # the checkpoint's weight decay gives way to this run's --weight-decay
    same_path = resume is not None and resume["config"].get("train", {}).get("data") == t.data  # else noted already
    was = resume["config"].get("corpus_sha256") if resume is not None and same_path else None
    if ctx.is_main and was is not None and was != source.get("sha256"):  # the same path, other contents
        print(f"fourfold train: note: resuming step {first - 1} on data whose sha256 {source.get('sha256')} is not "
              f"the checkpoint's run's ({was}): {source.get('name')} changed since, so the batches from here are not "
              "those that run would have read.", file=sys.stderr, flush=True)
    if ctx.is_main and continuing:  # resumed in place from an older checkpoint: the newer ones are another branch
        _set_aside_newer(out, first - 1)
    if ctx.is_main and restart_count() > 0:  # torchrun's agent restarted the ranks and says nothing of it
        print(f"fourfold train: restart {restart_count()} of {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}: "
              + (f"resuming from step {first - 1} ({resume['dir']})." if resume is not None else
                 "no checkpoint was written before the failure: starting again from step 1."),
              file=sys.stderr, flush=True)
    if ctx.is_main:
        run = {"config": cfg.record(), "world_size": ctx.world_size, "mesh": {"dp": mesh.dp, "tp": mesh.tp,
               "pp": mesh.pp}, "corpus": source,
               "num_parameters": result.num_parameters, "torch": torch.__version__, "backend": ctx.backend,
               "parameter_bytes_rank0": engine.counters()["parameter_bytes"],
               "pipeline": result.pipeline,
               "resumed_from": {"dir": resume["dir"], "step": first - 1} if resume is not None else None,
               "restarts": restart_count()}
        write_text_atomic(out / "run.json", json.dumps(run, indent=2) + "\n")
    metrics_file = open_metrics(out / "metrics.jsonl", first - 1 if continuing else 0) if ctx.is_main else None
    bar = tqdm(total=t.steps, initial=first - 1, desc="train", unit="step", disable=not (ctx.is_main and t.progress),
               file=sys.stderr, dynamic_ncols=True, mininterval=0.2 if sys.stderr.isatty() else 10.0)
    held: dict[str, int] | None = None
    barrier("start the clock")
    tracer.start()  # after the barrier, so every rank's t=0 is (nearly) the same instant
    try:
        for step in range(first, t.steps + 1):
            tracer.set_step(step)
            LEDGER.step = step
            first_span = len(tracer.spans)
            start = time.perf_counter()
            batch = loader.batch(step - 1)  # windows of a stream, or packed documents
            args, kwargs = batch.step_args(ctx.device)
            loss = engine.step(*args, **kwargs)
            try:
                grad_norm = update(engine, optimizer, t, step)  # clip, the step's learning rate, the optimiser step
            except NonFiniteLoss as e:  # a NaN or infinite gradient: no update made; every rank stops here
                _stop(metrics_file, {"step": step, "loss": loss.item()}, str(e), e)  # (the loss all-reduce waited)
            if held is None:  # parameters, gradients and optimiser state: fixed from the first step on
                held = held_bytes(engine.parameters(), optimizer)
            optimizer.zero_grad(set_to_none=True)
            global_loss = loss.item()  # the loss all-reduce ran during the optimiser step
            _synchronize(ctx.device)  # time the step, not the launch of its kernels
            elapsed = time.perf_counter() - start
            spans = tracer.spans[first_span:]
            row = _metrics_row(step, global_loss, elapsed, batch.stats, tracer.totals(first_span), lr_at(t, step))
            if grad_norm is not None:
                row["grad_norm"] = grad_norm  # before clipping: the same on every rank
            row["comm_hidden_fraction"] = hidden_fraction(spans)
            row["bytes_by_axis"] = bytes_by_axis(spans)
            row["comm_bytes"] = sum(row["bytes_by_axis"].values())  # one count of what was sent: tp as a ring
            row["memory_bytes"] = {**held, "activations": loss.activation_bytes,  # this rank's (rank 0 writes)
                                   **process_peak(ctx.device)}
            if step in (first, t.steps) and ctx.world_size > 1:  # every rank's, on the first and the last step
                row["memory_bytes_by_rank"] = gather_objects(row["memory_bytes"], op="gather every rank's memory")
            if loss.pipeline is not None:
                res = loss.pipeline
                row.update({"bubble": res.bubble, "bubble_by_rank": list(res.bubble_by_rank),
                            "peak_activation_bytes_by_rank": list(res.peak_activation_bytes_by_rank),
                            "peak_in_flight_by_rank": list(res.peak_in_flight_by_rank)})
            if not math.isfinite(global_loss):  # every rank has the same global loss: all stop here together
                _stop(metrics_file, row, f"non-finite loss {global_loss}", NonFiniteLoss(
                    f"step {step}: the loss is {global_loss}; training stopped (the weights are no longer usable). "
                    f"Lower --lr (now {t.lr:g}), or resume from an earlier checkpoint with --resume."))
            if t.eval_every and (step % t.eval_every == 0 or step == t.steps):
                row["eval_loss"] = _evaluate(engine, loader, t.eval_batches, ctx.device, tracer)
            if step <= t.verify:  # the whole model after this step, for the one-process re-run to compare
                result.snapshots.append(engine.state_dict(to=0))  # rank 0 re-runs them alone
            result.losses.append(global_loss)
            result.metrics.append(row)
            if metrics_file is not None:
                metrics_file.write(json.dumps(row) + "\n")
                metrics_file.flush()
            if step == t.steps or (t.checkpoint_every and step % t.checkpoint_every == 0):
                checkpoint.save(out / "checkpoints", step, engine, optimizer, keep=t.keep,
                                config={**cfg.record(), "corpus_sha256": source.get("sha256")})
            bar.update(1)
            shown = {"tok_s": f"{row['tokens_per_s']:,.0f}"} if batch.documents is None else {
                "real_tok_s": f"{row['real_tokens_per_s']:,.0f}", "pad": f"{row['padding_fraction']:.0%}"}
            if "eval_loss" in row:
                shown["eval"] = f"{row['eval_loss']:.4f}"
            bar.set_postfix(loss=f"{global_loss:.4f}", **shown, refresh=False)
    finally:
        bar.close()
        if metrics_file is not None:
            metrics_file.close()
    _write_outputs(cfg, ctx, engine, tracer, out, result)
    if ctx.is_main and t.overwrite:  # this run is complete: the earlier ones it replaces can go (only then: a
        drop_replaced(out)  # run without --overwrite keeps what a failed --overwrite set aside)
    return result


def _set_aside_newer(out: Path, step: int) -> None:
    """Keep OUT's checkpoints past ``step``, which this run resumed in place from, out of the next resume's way."""
    aside = set_aside_newer(out / "checkpoints", step)
    if aside is not None:
        steps = ", ".join(sorted(p.name for p in aside.iterdir()))
        for name in ("metrics.jsonl", "run.json"):  # the branch's own record, before this run cuts and rewrites them
            if (out / name).is_file():
                shutil.copy2(out / name, aside / name)
        print(f"fourfold train: note: resuming step {step} in {out}, whose checkpoints went on to {steps}: this run "
              f"departs from them, so they are kept in {aside.relative_to(out)}/ with the metrics.jsonl and run.json "
              f"they went with, where --resume does not look (metrics.jsonl past step {step} is this run's).",
              file=sys.stderr, flush=True)


def _stop(metrics_file: Any, row: dict[str, Any], error: str, e: NonFiniteLoss) -> NoReturn:
    """Stop the run at this step, ``e`` raised on every rank alike: rank 0 writes the step's row with ``error``
    first, its loss ``null`` when not finite (metrics.jsonl stays JSON: NaN is not)."""
    if metrics_file is not None:
        loss = row["loss"]
        metrics_file.write(json.dumps({**row, "loss": loss if math.isfinite(loss) else None, "error": error}) + "\n")
    raise e


def _evaluate(engine: Engine, loader: BatchLoader | DocumentLoader, batches: int, device: torch.device,
              tracer: Tracer) -> float:
    """The mean loss per held-out token (``--eval-batches``), forward only (:meth:`Engine.evaluate`), untraced:
    a step's spans and time are its training's alone. Windows' batches hold equal numbers of targets; packed
    ones are weighted by their real tokens, so each token counts once whatever batch it fell in."""
    total = weight = 0.0
    with tracer.paused():
        for i in range(batches):
            batch = loader.eval_batch(i)
            args, kwargs = batch.step_args(device)
            tokens = float(batch.num_tokens) if batch.num_tokens is not None else 1.0
            total += engine.evaluate(*args, **kwargs).item() * tokens
            weight += tokens
    return total / weight


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device).synchronize(device)


def _metrics_row(step: int, loss: float, elapsed: float, data: dict[str, Any], totals: dict[str, Any],
                 lr: float) -> dict[str, Any]:
    packed = {"documents": data["documents"], "split_documents": data["split"]} if "documents" in data else {}
    return {"step": step, "loss": loss, "tokens_per_s": data["slots"] / elapsed,
            "real_tokens_per_s": data["real_tokens"] / elapsed, "padding_fraction": data["padding_fraction"],
            **packed, "step_time_s": elapsed, "lr": lr,
            "compute_s": totals.get("compute_s", 0.0), "comm_s": totals.get("comm_s", 0.0),
            "wait_s": totals.get("wait_s", 0.0), "comm_messages": totals.get("messages", 0)}


def _write_outputs(cfg: Config, ctx: launch.DistContext, engine: Engine, tracer: Tracer, out: Path,
                   result: TrainResult) -> None:
    if cfg.train.trace:
        if out.is_dir():  # on several machines OUT may exist only on rank 0's
            tracer.write_jsonl(out / f"trace-rank{ctx.rank}.jsonl")
        spans = gather_spans(tracer)
        if spans is not None:
            labels = rank_labels(engine.mesh)
            write_chrome_trace(out / "trace.json", spans, groups=labels)
            shown = median_step(result.metrics) or cfg.train.steps
            result.sent_by_rank = {r: bytes_by_axis([s for s in mine if s.step == shown]) for r, mine in spans.items()}
            draw_step(spans, shown, out / "timeline.png", f"step {shown} (the median step) on every rank",
                      labels=labels, color_by="microbatch" if engine.mesh.pp > 1 else "name")  # a row per rank
    # The whole model's state, unsharded and gathered from every stage (collectives over tp and pp) onto rank 0
    # alone, which writes it: model.pt is the same checkpoint, under the model's own names, whatever the layout.
    result.state = engine.state_dict(to=0)
    if ctx.is_main and cfg.train.save:
        save_checkpoint(out / "model.pt", result.state, config=cfg.record(), step=cfg.train.steps)
    io_barrier("finish the run (rank 0 writes model.pt)")  # as long as a checkpoint's write may take


def _interrupted_note(cfg: Config) -> str:
    """What an interrupted run left to resume from: its newest complete checkpoint, or that there is none."""
    out = cfg.train.out
    try:
        manifest = checkpoint.read_manifest(out)
    except CheckpointError:
        every = cfg.train.checkpoint_every
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
    worker = "RANK" in os.environ  # started by torchrun (ours or the user's)
    if worker:
        cfg = replace(cfg, launch=_launched_as())
    main_rank = int(os.environ.get("RANK", "0")) == 0 and (worker or cfg.launch.node_rank == 0)
    # One run per OUT: the process that starts the run holds the lock (ranks we launch inherit it; with a
    # hand-run torchrun, rank 0 takes it); on several machines, machine 0's launcher (OUT may be shared).
    lock = (run_lock(cfg.train.out) if main_rank and os.environ.get(_LOCK_HELD) != cfg.train.out
            else contextlib.nullcontext())
    try:
        if not worker:  # the checks that need no process group, before any rank starts
            mesh = preflight(cfg, cfg.launch.world_size)
            before_launch_notes(cfg, mesh, cfg.launch.world_size)
        if not worker and cfg.launch.world_size > 1:
            from fourfold.torchrun import launch_workers

            with lock:
                os.environ[_LOCK_HELD] = cfg.train.out
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
