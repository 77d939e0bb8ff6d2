"""The Runner: how one rank's step runs its forwards and backwards, chosen once, when the engine is built.

* :class:`Plain` (no pipeline): the model's forward and backward, in ``grad_accum`` equal parts of the batch
  whose gradients accumulate, synchronised once (ZeRO-2/3: reduce-scattered after each part).
* :class:`Piped` (a pipeline): the schedule's F/B/W actions over its micro-batches, gradients released to the
  data-parallel buckets at each stage's last backward, tied copies summed across stages.

Both answer the same methods, so :class:`~fourfold.engine.step.Engine` never asks which it holds. ``compute``
is what every forward runs inside (mixed precision); ``documents`` (packed batches) is made current for each
part's forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import nn

from fourfold.data.packing import document_layout
from fourfold.engine.batch import Batch, chunk, leaves, rows
from fourfold.engine.losses import LossFn
from fourfold.observe.memory import saved_bytes_once
from fourfold.observe.trace import Tracer
from fourfold.parallel.data import DataParallel
from fourfold.parallel.pipeline import Pipeline, StepResult
from fourfold.parallel.pipeline.blocks import output_tensor
from fourfold.parallel.pipeline.state import gather_stages

__all__ = ["Piped", "Plain", "Runner"]

Compute = Callable[[], contextlib.AbstractContextManager[Any]]
Whole = Callable[[dict[str, torch.Tensor], bool], dict[str, torch.Tensor]]


class Runner(Protocol):
    parts: int  # the equal parts a rank's batch is cut into: grad_accum, or the pipeline's micro-batches

    def step(self, inputs: Batch, targets: torch.Tensor, loss_fn: LossFn, documents: torch.Tensor | None,
             tokens: bool, compute: Compute) -> tuple[torch.Tensor, StepResult | None, int]:
        """Forward and backward of this rank's batch: (its loss, float64 (1,) on the CPU; the pipeline's figures
        or None; the activation bytes saved for backward at the peak)."""
        ...

    def evaluate(self, inputs: Batch, targets: torch.Tensor, loss_fn: LossFn, documents: torch.Tensor | None,
                 tokens: bool, compute: Compute) -> torch.Tensor: ...
    def parameters(self) -> list[nn.Parameter]: ...
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...
    def state_dict(self) -> dict[str, torch.Tensor]: ...
    def whole_state(self, whole: Whole, keep: bool, to: int | None, timeout_s: float,
                    device: torch.device) -> dict[str, torch.Tensor]: ...
    def copies(self, over_tp: Callable[[str], int]) -> dict[int, int]: ...
    def train(self, mode: bool) -> None: ...
    @property
    def training(self) -> bool: ...
    def record(self) -> dict[str, Any] | None: ...


class Plain:
    """No pipeline: ``grad_accum`` forwards and backwards one after another (one without accumulation)."""

    def __init__(self, model: nn.Module, dp: DataParallel | None, grad_accum: int, tracer: Tracer,
                 weights: set[int], finish: Callable[[], None]) -> None:
        self.model, self.dp, self.parts, self.tracer = model, dp, grad_accum, tracer
        self.finish = finish  # the engine's finish_backward
        self._param_storages = weights  # the storages of what the optimiser steps: weights are not activations
        self._activations: dict[Any, int] = {}  # input shapes -> bytes saved for backward, measured once

    def step(self, inputs: Batch, targets: torch.Tensor, loss_fn: LossFn, documents: torch.Tensor | None,
             tokens: bool, compute: Compute) -> tuple[torch.Tensor, StepResult | None, int]:
        """One forward and backward, or with ``grad_accum`` k, k in turn over equal parts of the batch, each mean
        loss divided by k (a token-normalised one is the global batch's already), the gradients accumulating.
        dp synchronises them once, in the last backward; ZeRO-2 and -3 reduce-scatter every part's into the
        shards instead (the owner's ``microbatch``), so no rank ever holds the whole gradient."""
        parts = self._parts(inputs, targets, documents)
        k, dp = len(parts), self.dp
        weights: set[int] | Callable[[], set[int]] = self._param_storages
        if dp is not None and dp.zero == 3:  # the parameters are gathered afresh per unit
            def moving() -> set[int]:
                return self._param_storages | dp.storages()

            weights = moving
        total = torch.zeros(1, dtype=torch.float64)
        key: Any = None
        for i, (x, y, d) in enumerate(parts):
            quiet = dp.microbatch(last=i == k - 1) if dp is not None else contextlib.nullcontext()
            key = (tuple((path, tuple(t.shape)) for path, t in leaves(x)), d is not None, torch.is_grad_enabled())
            which = {"microbatch": i} if k > 1 else {}
            with quiet:
                with self.tracer.span("compute", "forward", **which), document_layout(d), \
                        saved_bytes_once(self._activations, key, weights) as saved, compute():
                    out = dp(x) if dp is not None else self.model(x)
                    loss = loss_fn(output_tensor(out), y)  # a Hugging Face output: its .logits
                    if k > 1 and not tokens:
                        loss = loss / k
                with self.tracer.span("compute", "backward", **which):
                    loss.backward()  # bucket all-reduces start inside the last, as gradients become ready
            total += loss.detach().to(torch.float64).reshape(1).cpu()
            if saved is not None:  # this shape's first step: measured (the same bytes every step after)
                self._activations[key] = sum(saved.values())
        self.finish()
        return total, None, self._activations[key]

    def evaluate(self, inputs: Batch, targets: torch.Tensor, loss_fn: LossFn, documents: torch.Tensor | None,
                 tokens: bool, compute: Compute) -> torch.Tensor:
        parts = self._parts(inputs, targets, documents)  # as step() cuts them: every rank as many forwards
        total = torch.zeros(1, dtype=torch.float64)
        # through the data-parallel wrapper, not syncing: ZeRO gathers what a forward needs, and no more
        forward = self.dp if self.dp is not None else self.model
        with self.dp.forward_only() if self.dp is not None else contextlib.nullcontext():
            for x, y, d in parts:
                with document_layout(d), compute():
                    loss = loss_fn(output_tensor(forward(x)), y)
                total += loss.to(torch.float64).reshape(1).cpu() / (1 if tokens else len(parts))
        return total

    def _parts(self, inputs: Batch, targets: torch.Tensor, documents: torch.Tensor | None
               ) -> list[tuple[Any, torch.Tensor, torch.Tensor | None]]:
        """The batch as the ``grad_accum`` equal micro-batches it is cut into, (inputs, targets, documents)
        each; a batch they do not divide is refused."""
        k = self.parts
        n = rows(inputs)  # a tensor, or a dict / list / tuple of them (fourfold.engine.batch)
        if n % k:
            raise ValueError(f"grad_accum={k} cuts this rank's batch into {k} equal micro-batches, got a batch of "
                             f"{n} rows. Pass a batch of a multiple of {k} rows per rank (fourfold "
                             f"train: --batch-size a multiple of dp x {k}).")
        docs = documents.chunk(k) if documents is not None else [None] * k
        return list(zip(chunk(inputs, k), chunk(targets, k), docs, strict=True))

    def parameters(self) -> list[nn.Parameter]:
        return list(self.model.parameters())

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        yield from self.model.named_parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def whole_state(self, whole: Whole, keep: bool, to: int | None, timeout_s: float,
                    device: torch.device) -> dict[str, torch.Tensor]:
        return whole(self.model.state_dict(), keep)  # (dp, tp) name a rank: kept on ``to`` alone

    def copies(self, over_tp: Callable[[str], int]) -> dict[int, int]:
        return {id(p): over_tp(n) for n, p in self.model.named_parameters()}

    def train(self, mode: bool) -> None:
        self.model.train(mode)

    @property
    def training(self) -> bool:
        return self.model.training

    def record(self) -> dict[str, Any] | None:
        return None


class Piped:
    """A pipeline: its schedule's actions over the micro-batches (:class:`~fourfold.parallel.pipeline.Pipeline`).
    ``gathered``: ZeRO's whole parameters around an evaluation (stages gathered once, as in a step)."""

    def __init__(self, pipeline: Pipeline, gathered: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
        self.pipeline, self._gathered = pipeline, gathered
        self.parts = pipeline.schedule.microbatches

    def step(self, inputs: Batch, targets: torch.Tensor, loss_fn: LossFn, documents: torch.Tensor | None,
             tokens: bool, compute: Compute) -> tuple[torch.Tensor, StepResult | None, int]:
        """F/B/W of every micro-batch; the dp buckets and the tied sums inside."""
        result = self.pipeline.step(inputs, targets, loss_fn=loss_fn, mean=not tokens,
                                    around=self._around(documents, compute))
        return torch.tensor([result.loss], dtype=torch.float64), result, result.peak_activation_bytes

    def evaluate(self, inputs: Batch, targets: torch.Tensor, loss_fn: LossFn, documents: torch.Tensor | None,
                 tokens: bool, compute: Compute) -> torch.Tensor:
        with self._gathered():
            value = self.pipeline.evaluate(inputs, targets, loss_fn=loss_fn, mean=not tokens,
                                           around=self._around(documents, compute))
        return torch.tensor([value], dtype=torch.float64)

    def _around(self, documents: torch.Tensor | None,
                compute: Compute) -> Callable[[int], contextlib.AbstractContextManager[Any]]:
        """What the pipeline enters around micro-batch i's forward: ``compute``, and its documents made current
        (cut as the pipeline cuts the inputs)."""
        parts = self.pipeline.microbatches("documents", documents, need=False)

        @contextlib.contextmanager
        def around(i: int) -> Iterator[None]:
            with compute(), document_layout(parts[i] if parts is not None else None):
                yield

        return around

    def parameters(self) -> list[nn.Parameter]:
        return self.pipeline.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        yield from self.pipeline.named_parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.pipeline.state_dict()

    def whole_state(self, whole: Whole, keep: bool, to: int | None, timeout_s: float,
                    device: torch.device) -> dict[str, torch.Tensor]:
        """Each stage made whole over tp, then the stages gathered over pp, in stage order (with ``to``, onto
        that rank only)."""
        mine = [(st.index, whole(st.model_state_dict(), keep)) for st in self.pipeline.stages]
        return gather_stages(mine, self.pipeline.group, dst=to, timeout_s=timeout_s,
                             device=device) if keep else {}

    def copies(self, over_tp: Callable[[str], int]) -> dict[int, int]:
        """A tied weight's copy counts once per stage holding one."""
        out: dict[int, int] = {}
        for st in self.pipeline.stages:
            for local, p in st.named_parameters():
                holders = st.tied[local][1] if local in st.tied else (st.index,)
                out[id(p)] = over_tp(st.model_name(local)) * len(holders)
        return out

    def train(self, mode: bool) -> None:
        self.pipeline.train(mode)

    @property
    def training(self) -> bool:
        return self.pipeline.stages[0].training

    def record(self) -> dict[str, Any] | None:
        """The schedule the run used, as run.json records it (``--strategy model`` runs ``naive`` on one
        micro-batch whatever --microbatches says), and the stages' cut."""
        s = self.pipeline.schedule
        return {"schedule": s.name, "microbatches": s.microbatches, "virtual": s.virtual, "stages": s.stages,
                "cut": [list(names) for names in self.pipeline.cut]}
