"""The pipeline runtime: one executor that runs any valid :class:`~fourfold.parallel.schedule.Schedule`.

::

    from fourfold.parallel.pipeline import build_pipeline
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

Messages. Sends are ``isend`` (never blocking: the schedules' model); receives ``irecv`` waited for at most
``timeout_s``, or :class:`~fourfold.comm.CommError` names this rank, the action (``1F3``), the peer and what
was awaited. Each message has its own tag (kind, stage, micro-batch), so ranks need not post them in the same
order. Each is preceded by a 14-integer header (magic, kind, stage, micro-batch, dtype, ndim, dims): the
receiver allocates exactly what comes, so a wrong size is never gloo's abort on a too-small buffer, and checks
it against what its stage expects (the traced :class:`~fourfold.parallel.split.TensorSpec`, or the output's
shape for a gradient) before the payload: a mismatch is a :class:`PipelineError` naming stage, micro-batch,
expected and got. The sender checks its output against the same spec first; on a mismatch it still sends the
header, so the receiver fails at once too. A header costs one small extra message per transfer.

Activation sends are known complete when the gradient for that micro-batch comes back (so they are waited for
then); gradient sends at the end of the step (gloo reports a send complete only when waited on, so their
buffers live until then).

Receives are posted early: each step posts the header ``irecv`` of every message this rank will receive before
its first action, and after every send and receive posts the payload ``irecv`` of each header that has come.
With gloo a send only announces a message; its data leaves once the receiver has posted the matching receive,
so a receive posted when its action starts costs a round trip (and thread wake-ups) per message.

Measured per step: ``wait`` spans (blocked on a receive or on the last sends) over the step's time is the
bubble; the bytes of tensors autograd saved, summed per micro-batch (a ``saved_tensors_hooks`` count of
distinct storages, parameters excluded, plus the stage output kept as backward's root) and held from F until
its backward frees them, give the peak activation memory: GPipe holds m micro-batches, 1F1B at most p.
"""

from __future__ import annotations

import datetime
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from fourfold.comm import CommError
from fourfold.launch import DEFAULT_TIMEOUT_S
from fourfold.models.gpt import lm_loss
from fourfold.parallel.schedule import Action, Schedule, validate
from fourfold.parallel.split import Balance, Stage, TensorSpec, plan, split_model, sum_tied_grads
from fourfold.trace import Tracer

__all__ = ["Pipeline", "PipelineError", "StepResult", "build_pipeline"]

_MAGIC = 0x46_46_50  # "FFP"
_MAX_DIMS = 8
_HEADER = 6 + _MAX_DIMS
_ACTIVATION, _GRADIENT = 0, 1
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16,
           torch.int32, torch.int64, torch.bool)


class PipelineError(RuntimeError):
    """A stage got (or would send) a tensor its neighbour does not expect, or failed on a micro-batch."""


@dataclass(frozen=True)
class StepResult:
    """One step, measured. ``*_by_rank``: every rank of the pipeline group (gathered at the step's end)."""

    loss: float                     # mean loss over the batch (computed on the last stage; every rank has it)
    bubble: float                   # this rank: time blocked on receives and sends / step time
    busy: float                     # this rank: time in F, B, W / step time
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


@dataclass
class _Held:
    """What backward needs of one (stage, micro-batch): the stage input and the output (or scaled loss)."""

    input: torch.Tensor
    output: torch.Tensor
    nbytes: int
    grad: torch.Tensor | None = None  # the output gradient B received, kept for W
    calls: list[_Call] = field(default_factory=list)  # split backward: each parameter owner's call ...
    call_grads: list[torch.Tensor | None] = field(default_factory=list)  # ... and its output gradient from B


@dataclass
class _Recv:
    """A receive posted before its action: the header's buffer and work, then the payload's once it is posted."""

    action: Action  # the action that will use it (named by its errors)
    header: torch.Tensor
    header_work: Any
    payload: torch.Tensor | None = None
    payload_work: Any = None


class _Call(NamedTuple):
    """One call of a module that owns parameters, recorded in F: what W needs to compute its weight gradient."""

    module: nn.Module
    inputs: tuple[Any, ...]
    output: torch.Tensor


@dataclass
class _StepState:
    held: dict[tuple[int, int], _Held] = field(default_factory=dict)
    sends: dict[tuple[int, int, int], tuple[list[Any], list[torch.Tensor], str, int]] = field(default_factory=dict)
    mailbox: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict)  # messages to this rank
    recvs: dict[tuple[int, int, int], _Recv] = field(default_factory=dict)  # posted, not yet used
    loss: torch.Tensor | None = None
    wait_ns: int = 0
    compute_ns: int = 0
    held_bytes: int = 0
    peak_bytes: int = 0
    peak_in_flight: int = 0
    sent_bytes: int = 0
    messages: int = 0


class Pipeline:
    """This rank's stages of a model, run by ``schedule`` with the other ranks of ``group``.

    ``stages``: the stages this rank holds under the schedule (stage s on group rank s % pp); passing every
    stage is fine, the others are dropped. ``loss_fn(output, targets)`` must be the mean over a micro-batch.
    """

    def __init__(self, stages: Sequence[Stage], schedule: Schedule, group: dist.ProcessGroup | None = None, *,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss,
                 tracer: Tracer | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 device: torch.device | str | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("a Pipeline needs a process group: call fourfold.launch.init() first.")
        validate(schedule)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}.")
        self.schedule, self.group, self.loss_fn, self.timeout_s = schedule, group, loss_fn, timeout_s
        self.rank = dist.get_rank()
        self.pp_rank, size = dist.get_rank(group), dist.get_world_size(group)
        if size != schedule.pp:
            raise ValueError(f"the pipeline group must have pp ranks, got {size} ranks for {schedule.name} with "
                             f"pp={schedule.pp}. Build the schedule with pp={size}, or pass the pp group.")
        self.ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
        want = [s for s in range(schedule.stages) if schedule.owner(s) == self.pp_rank]
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
        self._stage = {st.index: st for st in mine}
        self.actions = schedule.ranks[self.pp_rank]
        first = next((p for st in mine for p in st.parameters()), None)
        self.device = torch.device(device) if device is not None else (
            first.device if first is not None else torch.device("cpu"))
        self.tracer = tracer if tracer is not None else Tracer(self.rank, enabled=False)
        self._s: _StepState = _StepState()
        self._params: dict[int, list[nn.Parameter]] = {}
        self._param_storage: set[int] = set()
        self._calls: list[_Call] | None = None  # recording during a split-backward F
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
        mine = [(st.index, {k: v.detach().cpu() for k, v in st.model_state_dict().items()}) for st in self.stages]
        everyone: list[Any] = [None] * len(self.ranks)
        dist.all_gather_object(everyone, mine, group=self.group)
        out: dict[str, torch.Tensor] = {}
        for _, part in sorted((item for got in everyone for item in got), key=lambda item: item[0]):
            out.update(part)
        return out

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

    def step(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> StepResult:
        """Run every action of this rank on one batch; sum tied copies' gradients; gather the step's figures.

        ``inputs`` is needed where stage 0 lives, ``targets`` where the last stage does; give both everywhere
        (what a data loader hands each rank) and every rank checks the sizes, so a bad batch fails everywhere.
        Gradients accumulate into ``p.grad``: zero them between steps.
        """
        m = self.schedule.microbatches
        xs = self._microbatches("inputs", inputs, need=0 in self._stage)
        ys = self._microbatches("targets", targets, need=self.schedule.stages - 1 in self._stage)
        self._s = s = _StepState()
        self._params = {st.index: [p for p in st.parameters() if p.requires_grad] for st in self.stages}
        self._param_storage = {p.untyped_storage().data_ptr() for ps in self._params.values() for p in ps}
        start = time.perf_counter_ns()
        self._post_recvs()
        for action in self.actions:
            if action.op == "F":
                self._forward(action, xs, ys, m)
            elif action.op == "B":
                self._backward(action)
            else:
                self._weight(action)
        t0 = time.perf_counter_ns()
        for key in list(s.sends):
            self._complete_send(key, "step end")
        self._trace_wait(t0, time.perf_counter_ns(), None, None, "sends")
        assert not s.recvs, f"rank {self.rank}: receives posted but never used: {sorted(s.recvs)}"
        self._sync_tied()
        end = time.perf_counter_ns()
        return self._result(start, end)

    def _microbatches(self, what: str, batch: torch.Tensor | None, need: bool) -> tuple[torch.Tensor, ...] | None:
        m = self.schedule.microbatches
        if batch is None:
            if need:
                raise ValueError(f"{what} must be given on rank {self.rank}, which holds stage "
                                 f"{'0' if what == 'inputs' else self.schedule.stages - 1}, got None.")
            return None
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
            x = self._recv(a, _ACTIVATION, a.stage - 1, st.in_spec)
            source = f" from stage {a.stage - 1} on rank {self._owner(a.stage - 1)}"
            if x.is_floating_point():
                x.requires_grad_()
        saved: dict[int, int] = {}  # storage -> bytes: what autograd keeps of this micro-batch

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in self._param_storage:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        calls: list[_Call] = []
        self._calls = calls if self.schedule.split_backward else None
        t0 = time.perf_counter_ns()
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, _same):
                y = st(x)
                out = self.loss_fn(y, ys[i]) / m if st.is_last and ys is not None else y
        except Exception as e:
            raise PipelineError(f"rank {self.rank}: {a}: stage {a.stage} failed on micro-batch {i}, input "
                                f"{_describe(x)}{source}: {e}") from e
        finally:
            self._calls = None
        if self.schedule.split_backward and a.stage not in self._local_w:
            self._local_w[a.stage] = _weight_grads_are_local(out, calls, self._params[a.stage])
            self._ncalls[a.stage] = len(calls)
        local = self._local_w.get(a.stage, False) and len(calls) == self._ncalls[a.stage]  # same graph as checked
        calls = [c._replace(inputs=()) for c in calls] if local else []  # W needs outputs only
        self._trace_compute(a, t0)
        if not st.is_last:  # the output stays alive as backward's root
            saved.setdefault(y.untyped_storage().data_ptr(), y.untyped_storage().nbytes())
        else:
            s.loss = out.detach() if s.loss is None else s.loss + out.detach()
        nbytes = sum(saved.values())
        s.held[(a.stage, i)] = _Held(x, out, nbytes, calls=calls)
        s.held_bytes += nbytes
        s.peak_bytes = max(s.peak_bytes, s.held_bytes)
        s.peak_in_flight = max(s.peak_in_flight, len(s.held))
        if not st.is_last:
            self._send(a, _ACTIVATION, y, a.stage + 1, st.out_spec)

    def _backward(self, a: Action) -> None:
        st, i = self._stage[a.stage], a.microbatch
        held = self._s.held[(a.stage, i)]
        grad = None
        if not st.is_last:
            grad = self._recv(a, _GRADIENT, a.stage + 1, TensorSpec(tuple(held.output.shape), held.output.dtype))
            self._complete_send((_ACTIVATION, a.stage, i), str(a))  # stage s+1 has used it: done
        needs_input = not st.is_first and held.input.requires_grad
        t0 = time.perf_counter_ns()
        try:
            if self.schedule.split_backward:  # activation gradients only; the graph stays for W
                roots = ([held.input] if needs_input else []) + [c.output for c in held.calls]
                grads = torch.autograd.grad(held.output, roots, grad, retain_graph=True,
                                            allow_unused=True) if roots else ()
                dx = grads[0] if needs_input else None
                held.call_grads = list(grads[1 if needs_input else 0:])
                held.grad = grad
                kept = sum(g.nbytes for g in held.call_grads if g is not None)  # held until W
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
            self._send(a, _GRADIENT, dx, a.stage - 1, TensorSpec(tuple(held.input.shape), held.input.dtype))

    def _weight(self, a: Action) -> None:
        held = self._s.held[(a.stage, a.microbatch)]
        t0 = time.perf_counter_ns()
        if held.calls:  # each module's weight gradient from its own output gradient: the matmuls B skipped
            for call, g in zip(held.calls, held.call_grads, strict=True):
                params = [p for p in call.module.parameters(recurse=False) if p.requires_grad]
                if g is not None and params:
                    torch.autograd.backward(call.output, g, inputs=params, retain_graph=True)
        elif self._params[a.stage]:  # walk the stage again, towards the parameters only
            torch.autograd.backward(held.output, held.grad, inputs=self._params[a.stage])
        self._trace_compute(a, t0)
        self._release(a)

    def _release(self, a: Action) -> None:
        held = self._s.held.pop((a.stage, a.microbatch))
        self._s.held_bytes -= held.nbytes

    def _record_call(self, module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        if self._calls is not None and isinstance(output, torch.Tensor) and output.requires_grad:
            self._calls.append(_Call(module, inputs, output))

    # ------------------------------------------------------------------------------------------- messages

    def _owner(self, stage: int) -> int:
        return self.ranks[self.schedule.owner(stage)]

    def _tag(self, kind: int, stage: int, microbatch: int) -> int:
        return 2 * ((kind * self.schedule.stages + stage) * self.schedule.microbatches + microbatch)

    def _send(self, a: Action, kind: int, tensor: torch.Tensor, to_stage: int, expect: TensorSpec | None) -> None:
        what = ("activation", "gradient")[kind]
        dst, i = self._owner(to_stage), a.microbatch
        tensor = tensor.detach().contiguous()
        if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
            raise PipelineError(f"rank {self.rank}: {a}: a stage boundary must carry a tensor of at most "
                                f"{_MAX_DIMS} dims and dtype in {[str(d) for d in _DTYPES]}, got {_describe(tensor)}.")
        header = torch.tensor([_MAGIC, kind, a.stage, i, _DTYPES.index(tensor.dtype), tensor.dim(),
                               *tensor.shape, *[0] * (_MAX_DIMS - tensor.dim())], dtype=torch.int64,
                              device=tensor.device)
        key = (kind, a.stage, i)
        if dst == self.rank:  # both stages on this rank (pp = 1): no message
            self._s.mailbox[key] = tensor
            return
        t0 = time.perf_counter_ns()
        tag = self._tag(kind, a.stage, i)
        works = [dist.isend(header, dst, group=self.group, tag=tag)]
        if expect is not None and not expect.matches(tensor.shape, tensor.dtype):
            self._wait(works[0], str(a), f"send the {what} header to", dst)  # so the receiver fails at once too
            raise PipelineError(
                f"rank {self.rank}: {a}: stage {a.stage}'s {what} for micro-batch {i} is {_describe(tensor)}, but "
                f"stage {to_stage} expects {expect}. The stage's output changed shape since the split traced it.")
        works.append(dist.isend(tensor, dst, group=self.group, tag=tag + 1))
        nbytes = header.nbytes + tensor.nbytes
        self._s.sends[key] = (works, [header, tensor], what, dst)
        self._s.sent_bytes += nbytes
        self._s.messages += 2
        self._record("comm", "send", t0, time.perf_counter_ns(), bytes=nbytes, microbatch=i, peer=dst,
                     stage=a.stage, what=what)
        self._prefetch()

    def _complete_send(self, key: tuple[int, int, int], label: str) -> None:
        entry = self._s.sends.pop(key, None)
        if entry is not None:
            works, _, what, dst = entry
            for work in works:
                self._wait(work, label, f"send the {what} of {key[1]}{'FB'[key[0]]}{key[2]} to", dst)

    def _post_recvs(self) -> None:
        """Post the header receive of every message this rank receives in this step, in action order."""
        last = self.schedule.stages - 1
        for a in self.actions:
            if a.op == "F" and a.stage > 0:
                kind, from_stage = _ACTIVATION, a.stage - 1
            elif a.op == "B" and a.stage < last:
                kind, from_stage = _GRADIENT, a.stage + 1
            else:
                continue
            src = self._owner(from_stage)
            if src == self.rank:  # from the mailbox
                continue
            header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            work = dist.irecv(header, src, group=self.group, tag=self._tag(kind, from_stage, a.microbatch))
            self._s.recvs[(kind, from_stage, a.microbatch)] = _Recv(a, header, work)

    def _prefetch(self) -> None:
        """Post the payload receive of every header that has come (and can be checked now); never blocks."""
        for key, r in self._s.recvs.items():
            if r.payload_work is None and r.header_work.is_completed() and self._expect(r.action) is not False:
                self._post_payload(key, r)

    def _expect(self, a: Action) -> TensorSpec | None | bool:
        """What ``a`` expects to receive: None for anything; False while not yet known (its F has not run)."""
        if a.op == "F":
            return self._stage[a.stage].in_spec
        held = self._s.held.get((a.stage, a.microbatch))
        return False if held is None else TensorSpec(tuple(held.output.shape), held.output.dtype)

    def _post_payload(self, key: tuple[int, int, int], r: _Recv) -> None:
        """Check a come header against what its action expects; post the receive of exactly what it announces."""
        kind, from_stage, i = key
        what, a, src = ("activation", "gradient")[kind], r.action, self._owner(from_stage)
        self._wait(r.header_work, str(a), f"receive the {what} of {from_stage}{'FB'[kind]}{i} from", src)
        h = r.header.tolist()
        if h[0] != _MAGIC or h[1:4] != [kind, from_stage, i] or not 0 <= h[4] < len(_DTYPES) or h[5] > _MAX_DIMS:
            raise PipelineError(f"rank {self.rank}: {a}: the header from rank {src} is not the {what} of "
                                f"{from_stage}{'FB'[kind]}{i}, got {h}. Are both ranks running the same schedule?")
        shape, dtype = tuple(h[6:6 + h[5]]), _DTYPES[h[4]]
        expect = self._expect(a)
        assert not isinstance(expect, bool), f"{a}: the expected gradient is known once its F has run"
        self._check(a, what, from_stage, src, expect, shape, dtype)
        r.payload = torch.empty(shape, dtype=dtype, device=self.device)
        r.payload_work = dist.irecv(r.payload, src, group=self.group, tag=self._tag(kind, from_stage, i) + 1)

    def _recv(self, a: Action, kind: int, from_stage: int, expect: TensorSpec | None) -> torch.Tensor:
        what = ("activation", "gradient")[kind]
        src, i = self._owner(from_stage), a.microbatch
        key = (kind, from_stage, i)
        if src == self.rank:
            tensor = self._s.mailbox.pop(key)
            self._check(a, what, from_stage, src, expect, tensor.shape, tensor.dtype)
            return tensor
        r = self._s.recvs.pop(key)  # posted at the step's start
        awaited = f"receive the {what} of {from_stage}{'FB'[kind]}{i} from"
        t0 = time.perf_counter_ns()
        if r.payload_work is None:
            self._post_payload(key, r)  # waits for the header
        assert r.payload is not None
        self._wait(r.payload_work, str(a), awaited, src)
        t1 = time.perf_counter_ns()
        self._trace_wait(t0, t1, i, src, what)
        self._record("comm", "recv", t0, t1, recv_bytes=r.header.nbytes + r.payload.nbytes, microbatch=i, peer=src,
                     stage=a.stage, what=what)
        self._prefetch()
        return r.payload

    def _check(self, a: Action, what: str, from_stage: int, src: int, expect: TensorSpec | None,
               shape: Sequence[int], dtype: torch.dtype) -> None:
        if expect is not None and not expect.matches(shape, dtype):
            got = str(TensorSpec(tuple(shape), dtype))
            raise PipelineError(
                f"rank {self.rank}: {a}: stage {a.stage} expects the {what} of micro-batch {a.microbatch} from stage "
                f"{from_stage} (rank {src}) to be {expect}, got {got}. The ranks built different models, or a "
                "stage's output changed shape: build every rank's model from the same config and seed.")

    def _wait(self, work: Any, label: str, awaited: str, peer: int) -> None:
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            raise CommError(f"rank {self.rank}: {label}: {awaited} rank {peer} failed or did not complete within "
                            f"{self.timeout_s:g} s. The peer is dead, stuck, or running another schedule; its own "
                            f"error (if any) says which. [{str(e).splitlines()[0] if str(e) else type(e).__name__}]"
                            ) from e

    def _sync_tied(self) -> None:
        """Exchange tied copies' gradients with the ranks holding the other copies; sum in stage order."""
        remote: dict[tuple[int, int], torch.Tensor | None] = {}
        works: list[tuple[Any, int, str]] = []
        stages = self.schedule.stages
        base = 4 * stages * self.schedule.microbatches  # after every activation and gradient tag
        t0 = time.perf_counter_ns()
        nbytes = 0
        for st in self.stages:
            named = dict(st.named_parameters())
            for name, (tie, holders) in st.tied.items():
                p = named[name]
                grad = (p.grad if p.grad is not None else torch.zeros_like(p)).contiguous()
                for peer in sorted({self._owner(j) for j in holders} - {self.rank}):
                    works.append((dist.isend(grad, peer, group=self.group, tag=base + tie * stages + st.index),
                                  peer, f"send the gradient of tied weight {tie} (stage {st.index}) to"))
                    nbytes += grad.nbytes
                for j in holders:
                    if self._owner(j) != self.rank and (tie, j) not in remote:
                        remote[(tie, j)] = buf = torch.empty_like(p)
                        works.append((dist.irecv(buf, self._owner(j), group=self.group, tag=base + tie * stages + j),
                                      self._owner(j), f"receive the gradient of tied weight {tie} (stage {j}) from"))
        for work, peer, awaited in works:
            self._wait(work, "tied gradients", awaited, peer)
        if works:
            self._s.sent_bytes += nbytes
            self._s.messages += sum(1 for _, _, awaited in works if awaited.startswith("send"))
            self._record("comm", "tied_grads", t0, time.perf_counter_ns(), bytes=nbytes)
        sum_tied_grads(self.stages, remote)

    # -------------------------------------------------------------------------------------------- figures

    def _record(self, kind: Any, name: str, t0: int, t1: int, **kwargs: Any) -> None:
        origin = self.tracer.origin_ns
        self.tracer.record(kind, name, t0 - origin, t1 - origin, **kwargs)

    def _trace_compute(self, a: Action, t0: int) -> None:
        t1 = time.perf_counter_ns()
        self._s.compute_ns += t1 - t0
        self._record("compute", a.op, t0, t1, microbatch=a.microbatch, stage=a.stage)

    def _trace_wait(self, t0: int, t1: int, microbatch: int | None, peer: int | None, what: str) -> None:
        self._s.wait_ns += t1 - t0
        if t1 > t0:
            self._record("wait", "wait", t0, t1, microbatch=microbatch, peer=peer, what=what)

    def _result(self, start: int, end: int) -> StepResult:
        s = self._s
        step_ns = max(end - start, 1)
        mine = torch.tensor([s.loss.item() if s.loss is not None else 0.0, s.wait_ns / step_ns, s.peak_bytes,
                             s.peak_in_flight], dtype=torch.float64, device=self.device)
        everyone = [torch.empty_like(mine) for _ in self.ranks]
        work = dist.all_gather(everyone, mine, group=self.group, async_op=True)
        self._wait(work, "step end", "gather the step's loss and figures with", self.ranks[0])
        rows = [t.tolist() for t in everyone]
        last = self.schedule.owner(self.schedule.stages - 1)
        return StepResult(
            loss=rows[last][0], bubble=s.wait_ns / step_ns, busy=s.compute_ns / step_ns, step_s=step_ns / 1e9,
            wait_s=s.wait_ns / 1e9, compute_s=s.compute_ns / 1e9, peak_activation_bytes=s.peak_bytes,
            peak_in_flight=s.peak_in_flight, sent_bytes=s.sent_bytes, messages=s.messages,
            bubble_by_rank=tuple(r[1] for r in rows), peak_activation_bytes_by_rank=tuple(int(r[2]) for r in rows),
            peak_in_flight_by_rank=tuple(int(r[3]) for r in rows))


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _param_edges(root: Any, stops: set[Any]) -> Counter[int]:
    """Edges into each parameter's gradient accumulator reachable from ``root``, not walking past ``stops``."""
    edges: Counter[int] = Counter()
    todo, seen = [root], {root}
    while todo:
        node = todo.pop()
        for nxt, _ in node.next_functions if node is not None else ():
            if nxt is None:
                continue
            if hasattr(nxt, "variable"):
                edges[id(nxt.variable)] += 1
            elif nxt not in seen and nxt not in stops:
                seen.add(nxt)
                todo.append(nxt)
    return edges


def _weight_grads_are_local(out: torch.Tensor, calls: list[_Call], params: list[nn.Parameter]) -> bool:
    """Whether W may run per module call: every use of every parameter lies inside one call of its owner.

    Then a call's weight gradient needs only its output gradient (kept by B) and its own graph, and summing
    over calls is the whole gradient. Not so when a module runs twice, a parameter is shared, or one is used
    outside its module (a functional F.linear(x, other.weight)): those stages walk the stage again in W.
    """
    owners = [c.module for c in calls]
    if len({id(m) for m in owners}) != len(owners):
        return False
    owned = [p for m in owners for p in m.parameters(recurse=False) if p.requires_grad]
    if len({id(p) for p in owned}) != len(owned) or {id(p) for p in owned} != {id(p) for p in params}:
        return False
    uses = _param_edges(out.grad_fn, set())
    for call in calls:
        stops = {t.grad_fn for t in call.inputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        local = _param_edges(call.output.grad_fn, stops)
        if any(local[id(p)] != uses[id(p)] for p in call.module.parameters(recurse=False) if p.requires_grad):
            return False
    return True


def _describe(t: torch.Tensor) -> str:
    return str(TensorSpec(tuple(t.shape), t.dtype))


def build_pipeline(model: nn.Module | Sequence[nn.Module], schedule: Schedule,
                   group: dist.ProcessGroup | None = None, *, balance: Balance = "params",
                   boundaries: Sequence[int | str] | None = None, example: torch.Tensor | None = None,
                   **kwargs: Any) -> Pipeline:
    """Split ``model`` into ``schedule.stages`` stages and keep this rank's: every rank calls it alike.

    With ``balance="time"`` pp rank 0 measures and broadcasts its cut (timings differ between ranks, and
    every rank must cut the same). ``kwargs`` go to :class:`Pipeline` (``loss_fn``, ``tracer``, ``timeout_s``).
    """
    if boundaries is None and balance == "time":
        chosen: list[Any] = [None]
        if dist.get_rank(group) == 0:
            chosen[0] = plan(model, schedule.stages, balance="time", example=example)[1:]
        src = dist.get_process_group_ranks(group)[0] if group is not None else 0
        dist.broadcast_object_list(chosen, src=src, group=group)
        boundaries = chosen[0]
    stages = split_model(model, schedule.stages, balance=balance, boundaries=boundaries, example=example)
    return Pipeline(stages, schedule, group, **kwargs)
