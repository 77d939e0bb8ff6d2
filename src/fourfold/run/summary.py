"""The lines a run's summary adds where one figure would mislead: each pipeline stage's blocks and the bubble
beside its theory, and each rank's bytes where ranks send unequally (a single master's root, a pipeline's
stages). Read by :meth:`fourfold.train.TrainResult.summary`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fourfold.parallel.schedule import theory_bubble

__all__ = ["block_range", "pipeline_line", "ranks_sent", "unequal"]


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
