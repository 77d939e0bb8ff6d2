"""What one pipeline step measured: each rank's own figures, gathered over the pipeline group into a
:class:`StepResult` (the loss from the last stage, the bubble as the schedule's simulation defines it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fourfold.comm.wait import bounded_wait

__all__ = ["RankFigures", "StepResult", "gather_step"]


@dataclass(frozen=True)
class StepResult:
    """One step, measured. ``*_by_rank``: every rank of the pipeline group (gathered at the step's end)."""

    loss: float                     # mean loss over the batch (computed on the last stage; every rank has it)
    bubble: float                   # this rank: 1 - its F, B, W time / the slowest rank's step (idle, tail too)
    busy: float                     # this rank: time in F, B, W / its own step time
    step_s: float
    wait_s: float
    compute_s: float
    peak_activation_bytes: int      # this rank: the most saved-activation bytes held at once
    peak_in_flight: int             # this rank: the most (stage, micro-batch) held at once
    sent_bytes: int                 # headers included
    messages: int
    bubble_by_rank: tuple[float, ...] = ()
    peak_activation_bytes_by_rank: tuple[int, ...] = ()
    peak_in_flight_by_rank: tuple[int, ...] = ()
    wait_by_rank: tuple[float, ...] = ()  # time blocked on receives and sends / the rank's own step


@dataclass(frozen=True)
class RankFigures:
    """One rank's step before the gather: times in ns, bytes, and the loss (meaningful on the last stage)."""

    loss: float
    wait_ns: int
    peak_bytes: int
    peak_in_flight: int
    compute_ns: int
    step_ns: int
    sent_bytes: int
    messages: int


def gather_step(mine: RankFigures, *, last: int, pp_rank: int, group: dist.ProcessGroup | None,
                ranks: list[int], rank: int, timeout_s: float, device: torch.device) -> StepResult:
    """Every rank's figures on every rank of the pipeline group (a collective); ``last``: the last stage's
    group rank, whose loss is the step's."""
    row = torch.tensor([mine.loss, mine.wait_ns / mine.step_ns, mine.peak_bytes, mine.peak_in_flight,
                        mine.compute_ns, mine.step_ns], dtype=torch.float64, device=device)
    everyone = [torch.empty_like(row) for _ in ranks]
    work = dist.all_gather(everyone, row, group=group, async_op=True)
    bounded_wait(work, timeout_s, rank=rank, op="step end", awaited="gather the step's loss and "
                 "figures with the pipeline group of", group_ranks=ranks)
    rows = [t.tolist() for t in everyone]
    # The bubble as the schedule's simulation defines it: the share of the step a rank is not computing, the
    # step being the slowest rank's (the ranks start together: the last step ended in this gather). A rank's
    # wait in receives alone leaves out its idle tail, which a model-parallel rank spends waiting for the
    # others to finish (in the tied weights' sum, or here).
    window = max(r[5] for r in rows)
    bubbles = tuple(max(0.0, 1.0 - r[4] / window) for r in rows)
    return StepResult(
        loss=rows[last][0], bubble=bubbles[pp_rank],
        busy=mine.compute_ns / mine.step_ns, step_s=mine.step_ns / 1e9, wait_s=mine.wait_ns / 1e9,
        compute_s=mine.compute_ns / 1e9, peak_activation_bytes=mine.peak_bytes, peak_in_flight=mine.peak_in_flight,
        sent_bytes=mine.sent_bytes, messages=mine.messages, bubble_by_rank=bubbles,
        peak_activation_bytes_by_rank=tuple(int(r[2]) for r in rows),
        peak_in_flight_by_rank=tuple(int(r[3]) for r in rows), wait_by_rank=tuple(r[1] for r in rows))
