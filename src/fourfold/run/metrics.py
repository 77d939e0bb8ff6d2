"""A step's row of metrics.jsonl: its loss, speed, where the time and bytes went, memory, the pipeline's bubble;
the held-out loss; and the row a run stops on."""

from __future__ import annotations

import json
import math
from typing import Any, NoReturn

import torch

from fourfold.comm.wait import gather_objects
from fourfold.data import BatchLoader, DocumentLoader
from fourfold.engine.sent import bytes_by_axis
from fourfold.engine.step import Engine, Loss
from fourfold.observe.memory import process_peak
from fourfold.observe.trace import Tracer, hidden_fraction
from fourfold.run.optim import NonFiniteLoss

__all__ = ["held_out_loss", "step_row", "stop", "synchronize"]


def step_row(step: int, loss: Loss, global_loss: float, elapsed: float, stats: dict[str, Any], tracer: Tracer,
             first_span: int, lr: float, grad_norm: float | None, held: dict[str, int], device: torch.device,
             every_rank: bool) -> dict[str, Any]:
    """Step ``step``'s row: rank 0's figures (its spans from ``first_span`` on), the global loss; with
    ``every_rank``, every rank's memory too (a collective: the first and the last step)."""
    spans = tracer.spans[first_span:]
    row = _metrics_row(step, global_loss, elapsed, stats, tracer.totals(first_span), lr)
    if grad_norm is not None:
        row["grad_norm"] = grad_norm  # before clipping: the same on every rank
    row["comm_hidden_fraction"] = hidden_fraction(spans)
    row["bytes_by_axis"] = bytes_by_axis(spans)
    row["comm_bytes"] = sum(row["bytes_by_axis"].values())  # one count of what was sent: tp as a ring
    row["memory_bytes"] = {**held, "activations": loss.activation_bytes,  # this rank's (rank 0 writes)
                           **process_peak(device)}
    if every_rank:
        row["memory_bytes_by_rank"] = gather_objects(row["memory_bytes"], op="gather every rank's memory")
    if loss.pipeline is not None:  # the pipeline's figures of this step
        res = loss.pipeline
        row.update({"bubble": res.bubble, "bubble_by_rank": list(res.bubble_by_rank),
                    "peak_activation_bytes_by_rank": list(res.peak_activation_bytes_by_rank),
                    "peak_in_flight_by_rank": list(res.peak_in_flight_by_rank)})
    return row


def _metrics_row(step: int, loss: float, elapsed: float, data: dict[str, Any], totals: dict[str, Any],
                 lr: float) -> dict[str, Any]:
    packed = {"documents": data["documents"], "split_documents": data["split"]} if "documents" in data else {}
    return {"step": step, "loss": loss, "tokens_per_s": data["slots"] / elapsed,
            "real_tokens_per_s": data["real_tokens"] / elapsed, "padding_fraction": data["padding_fraction"],
            **packed, "step_time_s": elapsed, "lr": lr,
            "compute_s": totals.get("compute_s", 0.0), "comm_s": totals.get("comm_s", 0.0),
            "wait_s": totals.get("wait_s", 0.0), "comm_messages": totals.get("messages", 0)}


def stop(metrics_file: Any, row: dict[str, Any], error: str, e: NonFiniteLoss) -> NoReturn:
    """Stop the run at this step, ``e`` raised on every rank alike: rank 0 writes the step's row with ``error``
    first, its loss ``null`` when not finite (metrics.jsonl stays JSON: NaN is not)."""
    if metrics_file is not None:
        loss = row["loss"]
        metrics_file.write(json.dumps({**row, "loss": loss if math.isfinite(loss) else None, "error": error}) + "\n")
    raise e


def held_out_loss(engine: Engine, loader: BatchLoader | DocumentLoader, batches: int, device: torch.device,
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


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device).synchronize(device)
