"""Everything a run does before its first step, on every rank: the checks, the mesh, OUT, the model built and
filled, the data, the engine and optimiser, a checkpoint resumed, run.json written. :func:`setup` returns it as
one :class:`Run` for ``fourfold train``'s loop."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fourfold import checkpoint
from fourfold.checkpoint.sharded import io_group
from fourfold.comm.wait import barrier
from fourfold.config import Config, recorded_settings
from fourfold.data import BatchLoader, DocumentLoader
from fourfold.engine.parallelize import parallelize
from fourfold.engine.step import Engine
from fourfold.files import move_aside
from fourfold.launch import DistContext
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
from fourfold.observe.trace import Tracer
from fourfold.run.data import make_loader
from fourfold.run.optim import keep_flags, make_optimizer
from fourfold.run.out import set_aside_newer_note, write_run_json
from fourfold.run.preflight import check_data_vocab, preflight
from fourfold.run.resume import continues_run, restart_count, resume_from, same_on_every_rank
from fourfold.run.summary import TrainResult

__all__ = ["Run", "setup"]


@dataclass
class Run:
    """A run, set up on this rank: what its loop steps, reads and writes."""

    out: Path
    mesh: Mesh
    tracer: Tracer
    engine: Engine
    optimizer: torch.optim.Optimizer
    loader: BatchLoader | DocumentLoader
    source: dict[str, Any]  # the corpus: its name and sha256, as run.json records it
    result: TrainResult
    first: int  # the first step to run (after a resumed checkpoint's)
    continuing: bool  # the run goes on in its own OUT (its metrics.jsonl continued)


def setup(cfg: Config, ctx: DistContext) -> Run:
    """The run of ``cfg`` on this rank, ready for its first step (collectives: every rank calls it)."""
    t = cfg.train
    mesh = preflight(cfg, ctx.world_size, scan_data=False)  # every rank fails alike, never a hang
    barrier("check OUT before writing")  # nobody writes to OUT before every rank has checked it
    tracer = Tracer(ctx.rank, enabled=cfg.output.trace)
    ranks = mesh.build(t.timeout, tracer)
    if ctx.world_size > 1:
        io_group()  # checkpoints' own group, made while every rank is here (a collective)
    out = Path(cfg.output.out)
    resume = resume_from(cfg)
    same_on_every_rank(resume, cfg.checkpoint.resume)
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
    result = TrainResult(ctx.rank, mesh, num_parameters=count, label=info.label, out=out, traced=cfg.output.trace,
                         pipeline=engine.runner.record())
    first = 1
    if resume is not None:  # every rank: its own pieces, cut for this layout
        first = checkpoint.load(resume["dir"], engine, optimizer)["step"] + 1
        keep_flags(optimizer, cfg)  # the checkpoint's weight decay gives way to this run's --weight-decay
    if ctx.is_main:
        _resumed_notes(resume, cfg.data.data, source, first, out, continuing)
        write_run_json(out, {
            "config": cfg.record(), "world_size": ctx.world_size, "mesh": mesh.record(), "corpus": source,
            "num_parameters": result.num_parameters, "torch": torch.__version__,
            "backend": ctx.backend, "parameter_bytes_rank0": engine.counters()["parameter_bytes"],
            "pipeline": result.pipeline,
            "resumed_from": {"dir": resume["dir"], "step": first - 1} if resume is not None else None,
            "restarts": restart_count()})
    return Run(out, mesh, tracer, engine, optimizer, loader, source, result, first, continuing)


def _resumed_notes(resume: dict[str, Any] | None, data: str | None, source: dict[str, Any], first: int, out: Path,
                   continuing: bool) -> None:
    """Rank 0's notes on where the run starts: data changed under the checkpoint, newer checkpoints set aside, a
    restart by torchrun's agent."""
    same_path = resume is not None and recorded_settings(resume["config"]).get("data") == data  # else noted already
    was = resume["config"].get("corpus_sha256") if resume is not None and same_path else None
    if was is not None and was != source.get("sha256"):  # the same path, other contents
        print(f"fourfold train: note: resuming step {first - 1} on data whose sha256 {source.get('sha256')} is not "
              f"the checkpoint's run's ({was}): {source.get('name')} changed since, so the batches from here are not "
              "those that run would have read.", file=sys.stderr, flush=True)
    if continuing:  # resumed in place from an older checkpoint: the newer ones are another branch
        set_aside_newer_note(out, first - 1)
    if restart_count() > 0:  # torchrun's agent restarted the ranks and says nothing of it
        print(f"fourfold train: restart {restart_count()} of {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}: "
              + (f"resuming from step {first - 1} ({resume['dir']})." if resume is not None else
                 "no checkpoint was written before the failure: starting again from step 1."),
              file=sys.stderr, flush=True)
