"""BatchNorm under data parallelism: without sync a warning names the layers (each rank normalises its own
shard); with ``sync_batchnorm=True`` two data-parallel ranks train exactly as one process on the whole batch:
losses, parameters and running statistics (float64, 3 AdamW steps, 1e-10), on CPU with gloo. Under model
parallelism (one micro-batch) the same, with no sync needed; under a pipeline of micro-batches a warning."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fourfold import Layout, Mesh, parallelize
from fourfold.testing import run_ranks
from helpers import max_error, one_process, optimizer

TOL = 1e-10
B = 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    # No bias before a BatchNorm (it would be removed with the mean: a zero gradient, which Adam turns into
    # steps of size lr in the direction of rounding noise, different in every run).
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(64, 8, bias=False), nn.BatchNorm1d(8, momentum=None), nn.ReLU(),
                         nn.Linear(8, 3)).double()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(B, 2, 4, 4, generator=g, dtype=torch.float64) * 3 + 1,
             torch.randn(B, 3, generator=g, dtype=torch.float64)) for _ in range(3)]


def _train(ctx, sync: bool, zero: int = 0, allreduce: str = "ring", compress: str = "none") -> dict:
    ranks = Mesh.for_world(ctx.world_size, dp=2).build(30)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = parallelize(_model(), ranks, Layout(allreduce=allreduce, sync_batchnorm=sync, zero=zero,
                                                     compress=compress), loss_fn=F.mse_loss)
    opt = optimizer(engine.parameters())
    losses = []
    lo = ranks.coord.dp * B // 2
    for x, y in _batches():
        losses.append(engine.step(x[lo:lo + B // 2], y[lo:lo + B // 2]).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "state": engine.state_dict(), "warnings": [str(w.message) for w in caught]}


def _pipelined(ctx, microbatches: int) -> dict:
    ranks = Mesh.for_world(ctx.world_size, pp=2).build(30)
    x0 = _batches()[0][0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layout = Layout(pp=2, strategy="model" if microbatches == 1 else "pipeline", microbatches=microbatches)
        engine = parallelize(_model(), ranks, layout, loss_fn=F.mse_loss, example=x0[:B // microbatches])
    opt = optimizer(engine.parameters())
    losses = []
    for x, y in _batches():
        losses.append(engine.step(x, y).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "state": engine.state_dict(), "warnings": [str(w.message) for w in caught]}


def _both(ctx) -> dict:
    # ZeRO's and compression's collectives run on a communication thread while SyncBatchNorm's run in forward
    # and backward: on groups of their own, or the ranks could issue them in different orders (gloo aborts, or a
    # hang)
    return {"sync": _train(ctx, True), "plain": _train(ctx, False), "model parallel": _pipelined(ctx, 1),
            "pipeline m2": _pipelined(ctx, 2),
            "sync zero2 native": _train(ctx, True, zero=2, allreduce="native"),
            "sync zero3 native": _train(ctx, True, zero=3, allreduce="native"),
            # PowerSGD's first steps reduce exactly, on the communication thread: beside SyncBatchNorm too
            "sync powersgd native": _train(ctx, True, allreduce="native", compress="powersgd")}


@pytest.mark.timeout(120)
def test_sync_batchnorm_on_two_ranks_equals_one_process_and_plain_batchnorm_is_named():
    per_rank = run_ranks(_both, 2, timeout_s=90)
    want, reference = one_process(_model(), _batches(), F.mse_loss)
    for rank, got in enumerate(per_rank):
        for run in ("sync", "sync zero2 native", "sync zero3 native", "sync powersgd native"):
            sync = got[run]
            assert max(abs(a - b) for a, b in zip(sync["losses"], want, strict=True)) <= TOL, (rank, run, sync)
            assert list(sync["state"]) == list(reference)  # BatchNorm's own names, running statistics included
            name, err = max_error(sync["state"], reference)
            assert err <= TOL, f"rank {rank}, {run}: {name} off one process by {err:.3g}"
            assert not any("BatchNorm" in w for w in sync["warnings"]), sync["warnings"]
        plain = got["plain"]
        named = [w for w in plain["warnings"] if "BatchNorm layers 1, 5 normalise each data-parallel rank's" in w]
        if rank == 0:  # once per job
            assert named and "--sync-batchnorm" in named[0], plain["warnings"]
        else:
            assert not named, plain["warnings"]
        # and it matters: without sync the running statistics are this rank's shard's, not the batch's
        assert max_error(plain["state"], reference)[1] > 1e-3
    # model parallelism (one micro-batch): BatchNorm sees the whole batch, and nothing else: the split's trace
    # on the example input does not count in the running statistics (num_batches_tracked stays 3)
    mp = per_rank[0]["model parallel"]
    assert max(abs(a - b) for a, b in zip(mp["losses"], want, strict=True)) <= TOL, mp["losses"]
    name, err = max_error(mp["state"], reference)
    assert err <= TOL, f"model parallel: {name} off one process by {err:.3g}"
    assert not any("BatchNorm" in w for w in mp["warnings"]), mp["warnings"]
    assert any("normalise each of the pipeline's 2 micro-batches" in w for w in per_rank[0]["pipeline m2"]["warnings"])
