"""What a run produced (:class:`TrainResult`) and its summary, with the lines it adds where one figure would
mislead: each pipeline stage's blocks and the bubble beside its theory, and each rank's bytes where ranks send
unequally (a single master's root, a pipeline's stages)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fourfold.engine.sent import COUNTED
from fourfold.files import drawn_row, median_row, steady, steady_rate
from fourfold.mesh import Mesh
from fourfold.parallel.timeline import theory_bubble

__all__ = ["TrainResult", "block_range", "pipeline_line", "ranks_sent", "unequal"]


def unequal(sent: Sequence[int]) -> bool:
    """Ranks that send differently enough to say: more than 1 % apart (a ring's ranks differ by a few bytes where
    the bucket does not divide by the ranks, which is no asymmetry worth a line)."""
    return bool(sent) and max(sent) - min(sent) > 0.01 * max(sent)


def ranks_sent(sent: Sequence[int]) -> str:
    """``[1422336, 485376, 485376, 485376]`` -> ``"rank 0 1,389.0 KB, ranks 1-3 474.0 KB"``: each rank's bytes,
    runs of ranks that sent alike joined."""
    out, start = [], 0
    for r in range(1, len(sent) + 1):
        if r == len(sent) or sent[r] != sent[start]:
            who = f"rank {start}" if r - 1 == start else f"ranks {start}-{r - 1}"
            out.append(f"{who} {sent[start] / 1024:,.1f} KB")
            start = r
    return ", ".join(out)


def pipeline_line(pipeline: dict[str, Any] | None, row: dict[str, Any]) -> str:
    """The summary's line for a pipeline run: what each stage holds, and the drawn step's bubble per rank
    beside the schedule's theory (equal stages, free messages), so an uneven cut or slow messages show."""
    if pipeline is None or "bubble_by_rank" not in row:
        return ""
    s, pp = pipeline, len(row["bubble_by_rank"])
    theory = theory_bubble(s["schedule"], pp, s["microbatches"], s["virtual"])
    cut = " | ".join(f"{k}: {block_range(names)}" for k, names in enumerate(s.get("cut", []))) or \
        f"{s['stages']} (their blocks not known)"
    bubbles = " / ".join(f"{b:.0%}" for b in row["bubble_by_rank"])
    return (f"pipeline {s['schedule']}, {s['microbatches']} micro-batch{'es' * (s['microbatches'] != 1)}, stages "
            f"{cut}\nbubble per pp rank {bubbles} (theory with equal stages and free messages "
            f"{theory:.0%}; see timeline.png)\n")


def block_range(names: Sequence[str]) -> str:
    """``["blocks.0", "blocks.1", "blocks.2", "head"]`` -> ``"blocks.0-2, head"``: a stage's blocks, runs of
    one container's numbered children joined."""
    out: list[str] = []
    run: tuple[str, int, int] | None = None  # (prefix, first, last)
    for name in [*names, ""]:
        prefix, _, index = name.rpartition(".")
        if run is not None and prefix == run[0] and index.isdigit() and int(index) == run[2] + 1:
            run = (run[0], run[1], int(index))
            continue
        if run is not None:
            out.append(f"{run[0]}.{run[1]}" + (f"-{run[2]}" if run[2] > run[1] else ""))
            run = None
        if prefix and index.isdigit():
            run = (prefix, int(index), int(index))
        elif name:
            out.append(name)
    return ", ".join(out) or "(the whole model)"


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
    chose: list[str] = field(default_factory=list)  # what an auto setting chose, and why (--cp-algorithm auto)

    def summary(self) -> str:
        m = self.mesh
        row = median_row(self.metrics)  # the typical step (after the first, which warms up): one step's figures
        drawn = drawn_row(self.metrics)  # the step timeline.png draws (not the last, whose trace holds the end)
        assert row is not None and drawn is not None
        # the pace: every steady step's tokens over their total time (packed steps hold unequal real tokens)
        speed = f"{steady_rate(self.metrics):,.0f} tokens/s"
        if "documents" in row:  # packed: what was learned from, and what padding cost
            padding = statistics.mean(r["padding_fraction"] for r in steady(self.metrics))
            speed = (f"{steady_rate(self.metrics, 'real_tokens_per_s'):,.0f} real tokens/s of "
                     f"{steady_rate(self.metrics):,.0f} ({padding:.1%} padding)")
        ms = 1e3 * row["step_time_s"]
        by_axis = {a: statistics.median(r["bytes_by_axis"].get(a, 0) for r in steady(self.metrics)) for a in COUNTED}
        # a dp group that sent nothing counted used the backend's own all-reduce, whose bytes it does not report
        axes = [f"{axis} {by_axis[axis] / 1024:,.1f} KB" if by_axis[axis] or axis != "dp" else
                "dp not counted (--allreduce native)"
                for axis in COUNTED if getattr(m, axis) > 1]
        if not self.traced:
            axes = ["not counted (--no-trace)"] if axes else []
        sent = f"rank 0 sent per step: {', '.join(axes)}\n" if axes else ""
        uneven = [f"{axis}: {ranks_sent([b.get(axis, 0) for _, b in sorted(self.sent_by_rank.items())])}"
                  for axis in COUNTED if getattr(m, axis) > 1 and self.traced
                  and unequal([b.get(axis, 0) for b in self.sent_by_rank.values()])]
        if uneven:  # a master's root, a pipeline's last stage: rank 0 alone would not show it
            sent += f"each rank sent in step {drawn['step']}: {'; '.join(uneven)}\n"
        steps = f"{len(self.losses)} step{'s' if len(self.losses) != 1 else ''}"
        evals = [r["eval_loss"] for r in self.metrics if "eval_loss" in r]
        held = f", held-out loss {evals[-1]:.4f}" if evals else ""
        return (f"trained {self.label} ({self.num_parameters / 1e6:.2f} M parameters) for {steps} on "
                f"{m.world_size} rank(s) ({m.describe()}): loss {self.losses[0]:.4f} -> "
                f"{self.losses[-1]:.4f}{held}, {speed}, {ms:.1f} ms/step\n{sent}"
                f"{''.join(line + chr(10) for line in self.chose)}{pipeline_line(self.pipeline, drawn)}"
                f"{self.outputs()}")

    def outputs(self) -> str:
        """The line naming what the run wrote (only what is there: --no-save writes no model.pt)."""
        if self.out is None:
            return ""
        notes = {"trace.json": "trace.json (open in https://ui.perfetto.dev)",
                 "checkpoints": "checkpoints/ (resume with --resume)"}
        names = [notes.get(n, n) for n in ("metrics.jsonl", "trace.json", "timeline.png", "model.pt", "checkpoints",
                                           "run.json") if (self.out / n).exists()]
        return f"outputs in {self.out}: {', '.join(names)}"
