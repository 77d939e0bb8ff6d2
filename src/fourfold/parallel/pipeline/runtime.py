"""The pipeline runtime: one executor that runs any valid :class:`~fourfold.parallel.schedule.Schedule`.

::

    from fourfold.parallel.pipeline.runtime import build_pipeline
    from fourfold.parallel.schedule import make_schedule

    schedule = make_schedule("1f1b", pp=2, microbatches=8)
    pipe = build_pipeline(TinyGPT(cfg, seed=0), schedule, group)   # this rank's stages of the model
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    result = pipe.step(x, y)       # every action of this rank; gradients in p.grad, tied copies summed
    opt.step(); opt.zero_grad(set_to_none=True)
    result.loss, result.bubble_by_rank, result.peak_activation_bytes_by_rank
    state = pipe.gather_state_dict()   # the whole model's state dict, on every rank (a collective)

A step splits the batch into m equal micro-batches along dim 0 and runs this rank's actions in order:

* ``F`` (stage s, micro-batch i): receive the activation from stage s-1's rank (unless s = 0: micro-batch i of
  the batch), run the stage, keep input and output for backward, send the output to stage s+1's rank (unless
  last; the last stage computes ``loss_fn(out, targets_i) / m``, so gradients are the full batch's mean).
* ``B``: receive the output gradient from stage s+1 (unless last), backpropagate, send the input gradient to
  stage s-1 (unless first). With a split backward (zb) B is ``autograd.grad`` w.r.t. the stage input and
  the output of every call of a module that owns parameters (recorded by forward hooks), keeping the graph;
  ``W`` then runs ``autograd.backward(call output, its gradient, inputs=the module's parameters)`` per call:
  only the weight-gradient work B skipped. That is exact when every use of a parameter lies inside one call
  of its module, which :func:`_weight_grads_are_local` checks on the autograd graph of each stage's first
  forward; otherwise (a module applied twice, a shared or functionally used weight) W walks the stage again
  towards its parameters. Either way the numbers equal a fused backward's.

Messages between stages (headers, early receives, bounded waits) are :mod:`~fourfold.parallel.pipeline.p2p`'s;
the split backward's weight step is :mod:`~fourfold.parallel.pipeline.backward`'s.

Measured per step: ``wait`` spans (blocked on a receive or on the last sends) over the step's time is the
bubble; the bytes of tensors autograd saved, summed per micro-batch (a ``saved_tensors_hooks`` count of
distinct storages, parameters excluded, plus the stage output kept as backward's root) and held from F until
its backward frees them, give the peak activation memory: GPipe holds m micro-batches, 1F1B at most p.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from fourfold.comm.wait import broadcast_object
from fourfold.launch import DEFAULT_TIMEOUT_S
from fourfold.loss import lm_loss
from fourfold.observe.memory import parameter_storages, saved_bytes_once
from fourfold.observe.trace import Tracer
from fourfold.parallel import split_backward
from fourfold.parallel.pipeline.backward import Call, activation_grads, weight_grads, weight_grads_are_local
from fourfold.parallel.pipeline.figures import RankFigures, StepResult, gather_step
from fourfold.parallel.pipeline.p2p import ACTIVATION, GRADIENT, Links, PipelineError, describe
from fourfold.parallel.pipeline.split import Balance, Stage, TensorSpec, plan, split_model
from fourfold.parallel.pipeline.state import gather_stages
from fourfold.parallel.schedule import Action, Schedule, validate

__all__ = ["Pipeline", "PipelineError", "StepResult", "build_pipeline"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

PIPELINE_TENSOR = ("a pipeline's {what} must be one tensor (its stages send tensors), got {got}. Pack them into one "
                   "tensor for pp, or train this model with dp and tp, which take a dict, list or tuple of tensors.")


@dataclass
class _Held:
    """What backward needs of one (stage, micro-batch): the stage input and the output (or scaled loss)."""

    input: torch.Tensor
    output: torch.Tensor
    nbytes: int
    grad: torch.Tensor | None = None  # the output gradient B received, kept for W
    calls: list[Call] = field(default_factory=list)  # split backward: each parameter owner's call ...
    call_grads: list[torch.Tensor | None] = field(default_factory=list)  # ... and its output gradient from B


@dataclass
class _StepState:
    held: dict[tuple[int, int], _Held] = field(default_factory=dict)
    loss: torch.Tensor | None = None
    compute_ns: int = 0
    held_bytes: int = 0
    peak_bytes: int = 0
    peak_in_flight: int = 0


class GradSync(Protocol):
    """What the runtime needs of a data-parallel gradient sync (:class:`~fourfold.parallel.data.DataParallel`)."""

    def begin(self, gated: bool = False) -> None: ...

    def release(self, params: Iterable[nn.Parameter]) -> None: ...

    def finish(self) -> None: ...


class Pipeline:
    """This rank's stages of a model, run by ``schedule`` with the other ranks of ``group``.

    ``stages``: the stages this rank holds under the schedule (stage s on group rank s % pp); passing every
    stage is fine, the others are dropped. ``loss_fn(output, targets)`` must be the mean over a micro-batch.
    """

    def __init__(self, stages: Sequence[Stage], schedule: Schedule, group: dist.ProcessGroup | None = None, *,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss,
                 tracer: Tracer | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 device: torch.device | str | None = None, grad_sync: GradSync | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("a Pipeline needs a process group: call fourfold.launch.init() first.")
        validate(schedule)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}.")
        self.schedule, self.group, self.loss_fn, self.timeout_s = schedule, group, loss_fn, timeout_s
        self.grad_sync = grad_sync
        # what ends backward after this rank's last action: the engine's finish_backward (set by parallelize);
        # None: the pipeline's own, its grad_sync's finish and then the tied copies' gradients summed
        self.end_backward: Callable[[], None] | None = None
        self.rank = dist.get_rank()
        self.pp_rank, size = dist.get_rank(group), dist.get_world_size(group)
        if size != schedule.pp:
            raise ValueError(f"the pipeline group must have pp ranks, got {size} ranks for {schedule.name} with "
                             f"pp={schedule.pp}. Build the schedule with pp={size}, or pass the pp group.")
        self.ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
        want = schedule.held(self.pp_rank)
        bad = [st.index for st in stages if st.stages != schedule.stages]
        if bad:
            raise ValueError(f"every stage must come from a split into {schedule.stages} stages (pp * virtual = "
                             f"{schedule.pp} * {schedule.virtual}), got stages {bad} of a split into "
                             f"{stages[0].stages}. Split with split_model(model, {schedule.stages}).")
        mine = sorted((st for st in stages if st.index in want), key=lambda st: st.index)
        if [st.index for st in mine] != want:
            raise ValueError(f"rank {self.rank} (pp rank {self.pp_rank}) must hold stages {want} of "
                             f"{schedule.stages} ({schedule.name}: stage s on pp rank s % {schedule.pp}), got "
                             f"stages {sorted(st.index for st in stages)}. Pass every stage of the split.")
        self.stages: list[Stage] = mine
        names = {st.index: st.names for st in stages}  # every stage's blocks, where the whole split was passed
        self.cut: tuple[tuple[str, ...], ...] = tuple(names[k] for k in range(schedule.stages)) \
            if len(names) == schedule.stages else ()
        self._stage = {st.index: st for st in mine}
        self.actions = schedule.ranks[self.pp_rank]
        first = next((p for st in mine for p in st.parameters()), None)
        self.device = torch.device(device) if device is not None else (
            first.device if first is not None else torch.device("cpu"))
        self.tracer = tracer if tracer is not None else Tracer(self.rank, enabled=False)
        self._s: _StepState = _StepState()
        self.links = Links(schedule, group, ranks=self.ranks, device=self.device, timeout_s=timeout_s,
                           tracer=self.tracer)
        self._params: dict[int, list[nn.Parameter]] = {}
        self._param_storage: set[int] = set()
        self._activations: dict[Any, int] = {}  # (stage, input shape, ...) -> bytes saved for backward
        self._calls: list[Call] | None = None  # recording during a split-backward F
        self._local_w: dict[int, bool] = {}  # stage -> W per module call is exact (decided on its first F)
        self._ncalls: dict[int, int] = {}  # stage -> module calls in that first F
        if schedule.split_backward:
            for st in mine:
                for module in st.modules():
                    if next(module.parameters(recurse=False), None) is not None:
                        module.register_forward_hook(self._record_call)

    # ----------------------------------------------------------------------------------- the model's view

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (a tied weight's copy included), for the optimiser."""
        return [p for st in self.stages for p in st.parameters()]

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the model's own names (``blocks.3.mlp.fc.weight``)."""
        for st in self.stages:
            for name, p in st.named_parameters():
                yield st.model_name(name), p

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's part of the model's state dict, under the model's names."""
        return {k: v for st in self.stages for k, v in st.model_state_dict().items()}

    def gather_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict (CPU tensors, the model's key order) on every rank. A collective."""
        return gather_stages([(st.index, {k: v.detach().cpu() for k, v in st.model_state_dict().items()})
                              for st in self.stages], self.group)

    def load_state_dict(self, full: dict[str, torch.Tensor]) -> None:
        """Load this rank's part from a whole-model state dict (``gather_state_dict``'s, or one process's)."""
        for st in self.stages:
            st.load_state_dict({k: full[st.model_name(k)] for k in st.state_dict()})

    @property
    def local_weight_grads(self) -> dict[int, bool]:
        """Split backward: per stage, whether W runs per module call (True) or walks the stage again (False).

        Decided on each stage's first forward by :func:`_weight_grads_are_local`; empty before that.
        """
        return dict(self._local_w)

    def train(self, mode: bool = True) -> Pipeline:
        for st in self.stages:
            st.train(mode)
        return self

    def eval(self) -> Pipeline:
        return self.train(False)

    # ----------------------------------------------------------------------------------------- one step

    def step(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None, *,
             loss_fn: LossFn | None = None, mean: bool = True,
             around: Callable[[int], AbstractContextManager[Any]] | None = None) -> StepResult:
        """Run every action of this rank on one batch; sum tied copies' gradients; gather the step's figures.

        ``inputs`` is needed where stage 0 lives, ``targets`` where the last stage does; give both everywhere
        (what a data loader hands each rank) and every rank checks the sizes, so a bad batch fails everywhere.
        Gradients accumulate into ``p.grad``: zero them between steps. ``loss_fn`` replaces the pipeline's for
        this step; ``mean=False`` adds the micro-batches' losses instead of averaging them (a loss already
        divided by the global batch's token count); ``around(i)`` is entered around every forward of
        micro-batch i (the engine makes its documents current there).
        """
        xs, ys, m = self._prepare(inputs, targets, loss_fn, mean, around)
        start = time.perf_counter_ns()
        if self.grad_sync is not None:
            self.grad_sync.begin(gated=True)  # (ZeRO: gathers the parameters, so their storages are known after)
        self._param_storage = parameter_storages(p for ps in self._params.values() for p in ps)
        self.links.begin(self.actions, self._expect)
        # The action that adds each stage's last gradient contribution: its last B, or its last W (split).
        grad_op = "W" if self.schedule.split_backward else "B"
        left = Counter(a.stage for a in self.actions if a.op == grad_op)
        for action in self.actions:
            if action.op == grad_op and self.grad_sync is not None:
                left[action.stage] -= 1
                if left[action.stage] == 0:  # its buckets may go as soon as this backward fills them
                    self.grad_sync.release(self._params[action.stage])
            if action.op == "F":
                self._forward(action, xs, ys, m)
            elif action.op == "B":
                self._backward(action)
            else:
                self._weight(action)
        self.links.end()
        if self.end_backward is not None:
            self.end_backward()
        else:
            if self.grad_sync is not None:
                self.grad_sync.finish()  # averaged over data-parallel replicas before tied copies are summed
            self.links.exchange_tied(self.stages)
        end = time.perf_counter_ns()
        return self._result(start, end)

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None, *,
                 loss_fn: LossFn | None = None, mean: bool = True,
                 around: Callable[[int], AbstractContextManager[Any]] | None = None) -> float:
        """The batch's loss, forward only: the schedule's F actions in its order (the B and W left out), no
        gradient, nothing for the data-parallel sync; the loss gathered over the pipeline group as in
        :meth:`step`. Put the stages in eval mode first for dropout-free numbers."""
        xs, ys, m = self._prepare(inputs, targets, loss_fn, mean, around)
        self._param_storage = parameter_storages(p for ps in self._params.values() for p in ps)
        forwards = [a for a in self.actions if a.op == "F"]
        start = time.perf_counter_ns()
        self.links.begin(forwards, self._expect)
        for action in forwards:
            self._forward(action, xs, ys, m)
        self.links.end()
        result = self._result(start, time.perf_counter_ns())
        self._s = _StepState()  # the held outputs go now
        return result.loss

    def _prepare(self, inputs: torch.Tensor | None, targets: torch.Tensor | None, loss_fn: LossFn | None,
                 mean: bool, around: Callable[[int], AbstractContextManager[Any]] | None
                 ) -> tuple[tuple[torch.Tensor, ...] | None, tuple[torch.Tensor, ...] | None, int]:
        """What a step and an evaluation share before their first action: the batch cut into micro-batches
        (checked on every rank), the loss, a fresh step state, each stage's trainable parameters."""
        m = self.schedule.microbatches
        xs = self.microbatches("inputs", inputs, need=0 in self._stage)
        ys = self.microbatches("targets", targets, need=self.schedule.stages - 1 in self._stage)
        self._loss, self._divide, self._around = loss_fn or self.loss_fn, (m if mean else 1), around
        self._s = _StepState()
        self._params = {st.index: [p for p in st.parameters() if p.requires_grad] for st in self.stages}
        return xs, ys, m

    def microbatches(self, what: str, batch: torch.Tensor | None, need: bool) -> tuple[torch.Tensor, ...] | None:
        """``batch`` cut into the schedule's m equal micro-batches along dim 0, on this rank's device (None when
        not given and not ``need``-ed); a batch that does not divide is refused naming ``what``."""
        m = self.schedule.microbatches
        if batch is None:
            if need:
                raise ValueError(f"{what} must be given on rank {self.rank}, which holds stage "
                                 f"{'0' if what == 'inputs' else self.schedule.stages - 1}, got None.")
            return None
        if not isinstance(batch, torch.Tensor):
            raise TypeError(PIPELINE_TENSOR.format(what=what, got=type(batch).__name__))
        size = batch.size(0) if batch.dim() else 0
        if size == 0 or size % m:
            fix = f"a batch size divisible by {m}" + (f", or microbatches dividing {size}" if size else "")
            raise ValueError(f"the batch must split into microbatches={m} equal micro-batches along dim 0, got "
                             f"batch size {size} ({what} shape {tuple(batch.shape)}). Pass {fix}.")
        return batch.to(self.device).split(size // m)

    def _forward(self, a: Action, xs: tuple[torch.Tensor, ...] | None, ys: tuple[torch.Tensor, ...] | None,
                 m: int) -> None:
        st, i, s = self._stage[a.stage], a.microbatch, self._s
        if st.is_first:
            assert xs is not None  # step() refused a missing batch
            x, source = xs[i], ""
        else:
            x = self.links.recv(a, ACTIVATION, a.stage - 1, st.in_spec)
            source = f" from stage {a.stage - 1} on rank {self.links.owner(a.stage - 1)}"
            if x.is_floating_point():
                x.requires_grad_()
        calls: list[Call] = []
        self._calls = calls if self.schedule.split_backward else None
        t0 = time.perf_counter_ns()
        try:
            key = (a.stage, tuple(x.shape), x.dtype, torch.is_grad_enabled())
            with saved_bytes_once(self._activations, key, self._param_storage) as saved, \
                    (self._around(i) if self._around is not None else contextlib.nullcontext()):
                y = st(x)
                out = self._loss(y, ys[i]) / self._divide if st.is_last and ys is not None else y
        except Exception as e:
            raise PipelineError(f"rank {self.rank}: {a}: stage {a.stage} failed on micro-batch {i}, input "
                                f"{describe(x)}{source}: {e}") from e
        finally:
            self._calls = None
        if self.schedule.split_backward and a.stage not in self._local_w and torch.is_grad_enabled():
            self._local_w[a.stage] = weight_grads_are_local(out, calls, self._params[a.stage])
            self._ncalls[a.stage] = len(calls)
        local = self._local_w.get(a.stage, False) and len(calls) == self._ncalls[a.stage]  # same graph as checked
        calls = [c._replace(inputs=()) for c in calls] if local else []  # W needs outputs only
        self._trace_compute(a, t0)
        if saved is not None:  # this stage and shape's first forward: measured (the same every step after)
            if not st.is_last:  # the output stays alive as backward's root
                saved.setdefault(y.untyped_storage().data_ptr(), y.untyped_storage().nbytes())
            self._activations[key] = sum(saved.values())
        if st.is_last:
            s.loss = out.detach() if s.loss is None else s.loss + out.detach()
        nbytes = self._activations[key]
        s.held[(a.stage, i)] = _Held(x, out, nbytes, calls=calls)
        s.held_bytes += nbytes
        s.peak_bytes = max(s.peak_bytes, s.held_bytes)
        s.peak_in_flight = max(s.peak_in_flight, len(s.held))
        if not st.is_last:
            self.links.send(a, ACTIVATION, y, a.stage + 1, st.out_spec)

    def _backward(self, a: Action) -> None:
        st, i = self._stage[a.stage], a.microbatch
        held = self._s.held[(a.stage, i)]
        grad = None
        if not st.is_last:
            grad = self.links.recv(a, GRADIENT, a.stage + 1, TensorSpec(tuple(held.output.shape), held.output.dtype))
            self.links.complete_send((ACTIVATION, a.stage, i), str(a))  # stage s+1 has used it: done
        needs_input = not st.is_first and held.input.requires_grad
        t0 = time.perf_counter_ns()
        try:
            if self.schedule.split_backward:  # activation gradients only; the graph stays for W
                roots = ([held.input] if needs_input else []) + [c.output for c in held.calls]
                with split_backward.phase("B") as gathered:  # collectives on W's paths keep their results
                    grads = activation_grads(held.output, grad, roots)
                dx = grads[0] if needs_input else None
                held.call_grads = list(grads[1 if needs_input else 0:])
                held.grad = grad
                kept = sum(g.nbytes for g in held.call_grads if g is not None) + gathered.bytes  # held until W
                held.nbytes += kept
                self._s.held_bytes += kept
                self._s.peak_bytes = max(self._s.peak_bytes, self._s.held_bytes)
            else:
                torch.autograd.backward(held.output, grad)
                dx = held.input.grad if needs_input else None
        except Exception as e:
            raise PipelineError(f"rank {self.rank}: {a}: backward of stage {a.stage} failed on micro-batch {i}: "
                                f"{e}") from e
        self._trace_compute(a, t0)
        if not self.schedule.split_backward:
            self._release(a)
        if not st.is_first:
            dx = torch.zeros_like(held.input) if dx is None else dx
            self.links.send(a, GRADIENT, dx, a.stage - 1, TensorSpec(tuple(held.input.shape), held.input.dtype))

    def _weight(self, a: Action) -> None:
        held = self._s.held[(a.stage, a.microbatch)]
        t0 = time.perf_counter_ns()
        with split_backward.phase("W"):  # B's results of the collectives on these paths, not new ones
            if held.calls:  # each module's weight gradient from its own output gradient: the matmuls B skipped
                weight_grads(held.calls, held.call_grads)
            elif self._params[a.stage]:  # walk the stage again, towards the parameters only
                torch.autograd.backward(held.output, held.grad, inputs=self._params[a.stage])
        self._trace_compute(a, t0)
        self._release(a)

    def _release(self, a: Action) -> None:
        held = self._s.held.pop((a.stage, a.microbatch))
        self._s.held_bytes -= held.nbytes

    def _record_call(self, module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        if self._calls is not None and isinstance(output, torch.Tensor) and output.requires_grad:
            self._calls.append(Call(module, inputs, output))

    # ------------------------------------------------------------------------------------------- messages

    def _expect(self, a: Action) -> TensorSpec | None | bool:
        """What ``a`` expects to receive: None for anything; False while not yet known (its F has not run)."""
        if a.op == "F":
            return self._stage[a.stage].in_spec
        held = self._s.held.get((a.stage, a.microbatch))
        return False if held is None else TensorSpec(tuple(held.output.shape), held.output.dtype)

    # -------------------------------------------------------------------------------------------- figures

    def _record(self, kind: Any, name: str, t0: int, t1: int, **kwargs: Any) -> None:
        origin = self.tracer.origin_ns
        self.tracer.record(kind, name, t0 - origin, t1 - origin, **kwargs)

    def _trace_compute(self, a: Action, t0: int) -> None:
        t1 = time.perf_counter_ns()
        self._s.compute_ns += t1 - t0
        self._record("compute", a.op, t0, t1, microbatch=a.microbatch, stage=a.stage)


    def _result(self, start: int, end: int) -> StepResult:
        s, links = self._s, self.links
        mine = RankFigures(loss=s.loss.item() if s.loss is not None else 0.0, wait_ns=links.wait_ns,
                           peak_bytes=s.peak_bytes, peak_in_flight=s.peak_in_flight, compute_ns=s.compute_ns,
                           step_ns=max(end - start, 1), sent_bytes=links.sent_bytes, messages=links.messages)
        return gather_step(mine, last=self.schedule.owner(self.schedule.stages - 1), pp_rank=self.pp_rank,
                           group=self.group, ranks=self.ranks, rank=self.rank, timeout_s=self.timeout_s,
                           device=self.device)


def build_pipeline(model: nn.Module | Sequence[nn.Module], schedule: Schedule,
                   group: dist.ProcessGroup | None = None, *, balance: Balance = "params",
                   boundaries: Sequence[int | str] | None = None, example: torch.Tensor | None = None,
                   **kwargs: Any) -> Pipeline:
    """Split ``model`` into ``schedule.stages`` stages and keep this rank's: every rank calls it alike.

    With ``balance="time"`` pp rank 0 measures and broadcasts its cut (timings differ between ranks, and
    every rank must cut the same). ``kwargs`` go to :class:`Pipeline` (``loss_fn``, ``tracer``, ``timeout_s``).
    """
    if boundaries is None and balance == "time":
        mine = plan(model, schedule.stages, balance="time", example=example)[1:] if dist.get_rank(group) == 0 else None
        src = dist.get_process_group_ranks(group)[0] if group is not None else 0
        boundaries = broadcast_object(mine, src, group, op="the stages' cut, timed on pp rank 0")
    held = schedule.held(dist.get_rank(group) if dist.is_initialized() else 0)
    stages = split_model(model, schedule.stages, balance=balance, boundaries=boundaries, example=example, held=held)
    return Pipeline(stages, schedule, group, **kwargs)
