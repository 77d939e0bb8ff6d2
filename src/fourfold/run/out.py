"""What a run writes in OUT besides its metrics: run.json, the traces and the timeline, model.pt; and the note
for newer checkpoints a resume in place sets aside."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from fourfold.checkpoint import save_checkpoint
from fourfold.checkpoint.sharded import io_barrier
from fourfold.checkpoint.store import set_aside_newer
from fourfold.comm.wait import gather_spans
from fourfold.config import Config
from fourfold.engine.sent import bytes_by_axis
from fourfold.engine.step import Engine
from fourfold.files import median_step, write_text_atomic
from fourfold.launch import DistContext
from fourfold.observe.chrome_trace import write_chrome_trace
from fourfold.observe.trace import Tracer
from fourfold.observe.visualize import draw_step, rank_labels
from fourfold.run.summary import TrainResult

__all__ = ["set_aside_newer_note", "write_outputs", "write_run_json"]


def write_run_json(out: Path, run: dict[str, Any]) -> None:
    """run.json: the config, the layout, the corpus, and where the run resumed from (rank 0)."""
    write_text_atomic(out / "run.json", json.dumps(run, indent=2) + "\n")


def set_aside_newer_note(out: Path, step: int) -> None:
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


def write_outputs(cfg: Config, ctx: DistContext, engine: Engine, tracer: Tracer, out: Path,
                   result: TrainResult) -> None:
    if cfg.output.trace:
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
    if ctx.is_main and cfg.output.save:
        save_checkpoint(out / "model.pt", result.state, config=cfg.record(), step=cfg.train.steps)
    io_barrier("finish the run (rank 0 writes model.pt)")  # as long as a checkpoint's write may take
