"""Messages between pipeline stages for one rank: activations forward, gradients back, tied weights' gradients.

Messages. Sends are ``isend`` (never blocking: the schedules' model); receives ``irecv`` waited for at most
``timeout_s``, or :class:`~fourfold.comm.CommError` names this rank, the action (``1F3``), the peer and what
was awaited. Each message has its own tag (kind, stage, micro-batch), so ranks need not post them in the same
order. Each is preceded by a 15-integer header (magic, kind, stage, micro-batch, dtype, moved, ndim, dims): the
receiver checks it against what its stage expects (the traced :class:`~fourfold.parallel.pipeline.split.TensorSpec`,
or the output's shape for a gradient) before it waits for the payload: a mismatch is a :class:`PipelineError`
naming stage, micro-batch, expected and got. The sender checks its output against the same spec first; on a
mismatch it still sends the header, so the receiver fails at once too.

Activation sends are known complete when the gradient for that micro-batch comes back (so they are waited for
then); gradient sends at the end of the step (gloo reports a send complete only when waited on, so their
buffers live until then).

Receives are posted before they are needed, because with gloo a send only announces a message: its data leaves
once the receiver has posted the matching receive, so a receive posted when its action starts costs a round
trip and two thread wake-ups (milliseconds on busy cores) on the critical path. Each step posts the header
``irecv`` of every message this rank will receive before its first action. A payload's ``irecv`` needs its
shape, and gloo reports a point-to-point receive complete only when it is waited on, so a header's arrival
cannot be seen between actions; after every send and receive the payload receives are posted at a shape known
ahead (:meth:`Links._guess`): a gradient's is its forward's output's, exact; an activation's is the last one's
from the same stage (the micro-batch before, or for a step's first the last step's last). The sender knows that
guess too: an activation whose shape differs from the last one's is *moved* (its header says so) one tag on, and
one byte fills the receive the guess may have posted. So
a posted receive is never smaller than what arrives: gloo aborts the process on a message longer than its
buffer. Where the backend does report an arrived header (NCCL), it is checked and its payload posted exactly.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fourfold.comm.ledger import Direction
from fourfold.comm.wait import bounded_wait
from fourfold.observe.trace import Tracer
from fourfold.parallel.pipeline.split import Stage, TensorSpec, sum_tied_grads
from fourfold.parallel.schedule import Action, Schedule

__all__ = ["ACTIVATION", "GRADIENT", "HEADER_INTS", "Links", "PipelineError", "describe"]

_MAGIC = 0x46_46_50  # "FFP"
_MAX_DIMS = 8
HEADER_INTS = 7 + _MAX_DIMS
ACTIVATION, GRADIENT = 0, 1
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16,
           torch.int32, torch.int64, torch.bool)


class PipelineError(RuntimeError):
    """A stage got (or would send) a tensor its neighbour does not expect, or failed on a micro-batch."""


@dataclass
class _Recv:
    """A receive posted before its action: the header's buffer and work, then the payload's once it is posted."""

    action: Action  # the action that will use it (named by its errors)
    header: torch.Tensor
    header_work: Any
    payload: torch.Tensor | None = None
    payload_work: Any = None
    checked: bool = False  # the header has come and was checked; the payload's receive is posted where it says
    spare: Any = None  # a receive posted at a guessed shape the sender moved past: it gets one byte


Expect = Callable[[Action], "TensorSpec | None | bool"]


class Links:
    """This rank's messages to and from the other stages of ``schedule`` over ``group``, one step at a time.

    :meth:`begin` posts the header receive of every message the step will bring; :meth:`send` / :meth:`recv`
    move one activation or gradient; :meth:`end` waits for the last sends. ``expect(action)`` says what a
    received tensor must look like (None: anything; False: not known yet). Per step: ``sent_bytes``,
    ``messages``, ``wait_ns`` (time blocked on receives and sends).
    """

    def __init__(self, schedule: Schedule, group: dist.ProcessGroup | None, *, ranks: Sequence[int],
                 device: torch.device, timeout_s: float, tracer: Tracer) -> None:
        self.schedule, self.group, self.ranks = schedule, group, list(ranks)
        self.rank, self.device, self.timeout_s, self.tracer = dist.get_rank(), device, timeout_s, tracer
        self._expect_fn: Expect = lambda a: None
        self.sent: dict[tuple[int, int, int], tuple[tuple[int, ...], torch.dtype]] = {}  # this step's, by message
        self.seen: dict[tuple[int, int, int], tuple[tuple[int, ...], torch.dtype]] = {}  # headers come this step
        self._reset()

    def _reset(self) -> None:
        self.sends: dict[tuple[int, int, int], tuple[list[Any], list[torch.Tensor], str, int]] = {}
        # the last step's shapes: a step's first activation from a stage is guessed, and moved, against them
        self.sent_before, self.seen_before = self.sent, self.seen
        self.sent, self.seen = {}, {}
        self.mailbox: dict[tuple[int, int, int], torch.Tensor] = {}  # messages from this rank to itself
        self.recvs: dict[tuple[int, int, int], _Recv] = {}  # posted, not yet used
        self.sent_bytes = self.messages = self.wait_ns = 0

    def begin(self, actions: Sequence[Action], expect: Expect) -> None:
        """Start a step: forget the last one's counters, post this step's header receives, and the payload
        receives whose shapes are known or guessed already."""
        self._reset()
        self._expect_fn = expect
        self._post_recvs(actions)
        self.prefetch()

    def end(self) -> None:
        """Wait for every send still in flight (gloo reports a send complete only when waited on)."""
        t0 = time.perf_counter_ns()
        for key in list(self.sends):
            self.complete_send(key, "step end")
        self._trace_wait(t0, time.perf_counter_ns(), None, None, "sends")
        assert not self.recvs, f"rank {self.rank}: receives posted but never used: {sorted(self.recvs)}"

    def _wait(self, work: Any, label: str, direction: Direction, awaited: str, peer: int, message: str) -> None:
        bounded_wait(work, self.timeout_s, rank=self.rank, op=label, awaited=awaited, peer=peer, direction=direction,
                     message=message,
                     hint="The peer is dead, stuck, or running another schedule; its own error (if any) says which.")

    def _record(self, kind: Any, name: str, t0: int, t1: int, **kwargs: Any) -> None:
        origin = self.tracer.origin_ns
        self.tracer.record(kind, name, t0 - origin, t1 - origin, **kwargs)

    def _trace_wait(self, t0: int, t1: int, microbatch: int | None, peer: int | None, what: str) -> None:
        self.wait_ns += t1 - t0
        if t1 > t0:
            self._record("wait", "wait", t0, t1, microbatch=microbatch, peer=peer, what=what)

    def owner(self, stage: int) -> int:
        return self.ranks[self.schedule.owner(stage)]

    def _tag(self, kind: int, stage: int, microbatch: int) -> int:
        """Three per message: its header, its payload, and its payload when moved (see :meth:`send`)."""
        return 3 * ((kind * self.schedule.stages + stage) * self.schedule.microbatches + microbatch)

    def send(self, a: Action, kind: int, tensor: torch.Tensor, to_stage: int, expect: TensorSpec | None) -> None:
        what = ("activation", "gradient")[kind]
        dst, i = self.owner(to_stage), a.microbatch
        tensor = tensor.detach().contiguous()
        if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
            raise PipelineError(f"rank {self.rank}: {a}: a stage boundary must carry a tensor of at most "
                                f"{_MAX_DIMS} dims and dtype in {[str(d) for d in _DTYPES]}, got {describe(tensor)}.")
        key = (kind, a.stage, i)
        if dst == self.rank:  # both stages on this rank (pp = 1): no message
            self.mailbox[key] = tensor
            return
        shape = (tuple(tensor.shape), tensor.dtype)
        self.sent[key] = shape
        if kind == ACTIVATION and i > 0 and (kind, a.stage, i - 1) not in self.sent:
            raise PipelineError(f"rank {self.rank}: {a}: activations must leave a stage in micro-batch order; "
                                f"{i - 1} has not been sent (the receiver guesses each one's shape from the last).")
        last = self._last(self.sent, self.sent_before, (kind, a.stage, i))
        moved = kind == ACTIVATION and last is not None and last != shape
        header = torch.tensor([_MAGIC, kind, a.stage, i, _DTYPES.index(tensor.dtype), int(moved), tensor.dim(),
                               *tensor.shape, *[0] * (_MAX_DIMS - tensor.dim())], dtype=torch.int64,
                              device=tensor.device)
        t0 = time.perf_counter_ns()
        tag = self._tag(kind, a.stage, i)
        works = [dist.isend(header, dst, group=self.group, tag=tag)]
        if expect is not None and not expect.matches(tensor.shape, tensor.dtype):
            self._wait(works[0], str(a), "send", f"send the {what} header to", dst,  # so the receiver fails at once too
                       _name(key))
            raise PipelineError(
                f"rank {self.rank}: {a}: stage {a.stage}'s {what} for micro-batch {i} is {describe(tensor)}, but "
                f"stage {to_stage} expects {expect}: the split traced the stages on its example, which fixes every "
                "dimension but the batch. Pass parallelize's example= with the training inputs' shape (one sequence "
                "of them: inputs[:1]).")
        held = [header, tensor]
        if moved:  # the receiver may have posted this payload at the last one's shape: one byte fills that receive
            held.append(torch.zeros(1, dtype=torch.uint8, device=tensor.device))
            works.append(dist.isend(held[-1], dst, group=self.group, tag=tag + 1))
        works.append(dist.isend(tensor, dst, group=self.group, tag=tag + 1 + int(moved)))
        nbytes = sum(t.nbytes for t in held)
        self.sends[key] = (works, held, what, dst)
        self.sent_bytes += nbytes
        self.messages += len(held)
        self._record("comm", "send", t0, time.perf_counter_ns(), bytes=nbytes, microbatch=i, peer=dst,
                     stage=a.stage, what=what)
        self.prefetch()

    def complete_send(self, key: tuple[int, int, int], label: str) -> None:
        entry = self.sends.pop(key, None)
        if entry is not None:
            works, _, what, dst = entry
            for work in works:
                self._wait(work, label, "send", f"send the {what} of {_name(key)} to", dst, _name(key))

    def _post_recvs(self, actions: Sequence[Action]) -> None:
        """Post the header receive of every message this rank receives in this step, in action order."""
        last = self.schedule.stages - 1
        for a in actions:
            if a.op == "F" and a.stage > 0:
                kind, from_stage = ACTIVATION, a.stage - 1
            elif a.op == "B" and a.stage < last:
                kind, from_stage = GRADIENT, a.stage + 1
            else:
                continue
            src = self.owner(from_stage)
            if src == self.rank:  # from the mailbox
                continue
            header = torch.empty(HEADER_INTS, dtype=torch.int64, device=self.device)
            work = dist.irecv(header, src, group=self.group, tag=self._tag(kind, from_stage, a.microbatch))
            self.recvs[(kind, from_stage, a.microbatch)] = _Recv(a, header, work)

    def prefetch(self) -> None:
        """Post the payload receive of every message whose header has come (and can be checked now), or whose
        shape is known or guessed before it (:meth:`_guess`); never blocks."""
        for key, r in self.recvs.items():
            if r.checked:
                continue
            expect = self._expect_fn(r.action)
            if isinstance(expect, bool):  # False: not known yet
                continue
            if r.header_work.is_completed():
                self._settle(key, r)
            elif r.payload_work is None and (guess := self._guess(key, expect)) is not None:
                self._post(key, r, *guess, moved=False)

    def _guess(self, key: tuple[int, int, int], expect: TensorSpec | None) -> tuple[tuple[int, ...], torch.dtype] | None:
        """The payload's shape before its header comes, or None. A gradient's is exact: its forward's output's (the
        sender checks its gradient against the very activation this rank sent it, and sends no payload if they
        differ). An activation's is the last one's from the same stage (:meth:`_last`); the sender knows that guess
        too, and moves a payload that differs from it (:meth:`send`). Either way a receive posted ahead is never
        too small: gloo aborts the process on a message longer than its buffer."""
        kind, from_stage, i = key
        if kind == GRADIENT:
            exact = [d for d in expect.shape if d is not None] if expect is not None else []
            return (tuple(exact), expect.dtype) if expect is not None and len(exact) == len(expect.shape) else None
        last = self._last(self.seen, self.seen_before, key)
        return last if last is not None and math.prod(last[0]) > 0 else None

    def _last(self, now: dict[tuple[int, int, int], Any], before: dict[tuple[int, int, int], Any],
              key: tuple[int, int, int]) -> Any:
        """The activation before ``key``'s from the same stage: this step's micro-batch i - 1, or for the first
        one the last step's last (None if none). Sender and receiver look it up alike, in what they sent and
        what they saw: a receiver saw only what was sent, so it never guesses where the sender would not move."""
        kind, stage, i = key
        return now.get((kind, stage, i - 1)) if i > 0 else before.get((kind, stage, self.schedule.microbatches - 1))

    def _post(self, key: tuple[int, int, int], r: _Recv, shape: tuple[int, ...], dtype: torch.dtype, *,
              moved: bool) -> None:
        kind, from_stage, i = key
        r.payload = torch.empty(shape, dtype=dtype, device=self.device)
        r.payload_work = dist.irecv(r.payload, self.owner(from_stage), group=self.group,
                                    tag=self._tag(kind, from_stage, i) + 1 + int(moved))

    def _settle(self, key: tuple[int, int, int], r: _Recv) -> None:
        """Wait for a message's header, check it against what its action expects, and make sure its payload's
        receive is posted where the header says: at the same tag as a receive posted ahead at the right shape,
        or, when the sender moved it, one tag on (the receive at the old tag, posted or not, takes one byte)."""
        kind, from_stage, i = key
        what, a, src = ("activation", "gradient")[kind], r.action, self.owner(from_stage)
        self._wait(r.header_work, str(a), "recv", f"receive the {what} of {_name(key)} from", src, _name(key))
        h = r.header.tolist()
        if (h[0] != _MAGIC or h[1:4] != [kind, from_stage, i] or not 0 <= h[4] < len(_DTYPES) or h[5] not in (0, 1)
                or h[6] > _MAX_DIMS):
            raise PipelineError(f"rank {self.rank}: {a}: the header from rank {src} is not the {what} of "
                                f"{_name(key)}, got {h}. Are both ranks running the same schedule?")
        shape, dtype, moved = tuple(h[7:7 + h[6]]), _DTYPES[h[4]], bool(h[5])
        expect = self._expect_fn(a)
        assert not isinstance(expect, bool), f"{a}: the expected gradient is known once its F has run"
        self._check(a, what, from_stage, src, expect, shape, dtype)
        self.seen[key] = (shape, dtype)
        if moved:
            if r.payload_work is None:
                r.payload = torch.empty(1, dtype=torch.uint8, device=self.device)
                r.payload_work = dist.irecv(r.payload, src, group=self.group, tag=self._tag(*key) + 1)
            r.spare = r.payload_work
            self._post(key, r, shape, dtype, moved=True)
        elif r.payload_work is None:
            self._post(key, r, shape, dtype, moved=False)
        elif r.payload is None or (tuple(r.payload.shape), r.payload.dtype) != (shape, dtype):
            raise PipelineError(f"rank {self.rank}: {a}: rank {src} sent the {what} of micro-batch {i} as "
                                f"{TensorSpec(shape, dtype)} at the tag of a receive posted at "
                                f"{describe(r.payload) if r.payload is not None else '?'}: the ranks run different "
                                "fourfold versions.")
        r.checked = True

    def recv(self, a: Action, kind: int, from_stage: int, expect: TensorSpec | None) -> torch.Tensor:
        what = ("activation", "gradient")[kind]
        src, i = self.owner(from_stage), a.microbatch
        key = (kind, from_stage, i)
        if src == self.rank:
            tensor = self.mailbox.pop(key)
            self._check(a, what, from_stage, src, expect, tensor.shape, tensor.dtype)
            return tensor
        r = self.recvs.pop(key)  # posted at the step's start
        awaited = f"receive the {what} of {_name(key)} from"
        t0 = time.perf_counter_ns()
        if not r.checked:
            self._settle(key, r)  # waits for the header: one that disagrees fails here, before a payload never sent
        assert r.payload is not None
        self._wait(r.payload_work, str(a), "recv", awaited, src, _name(key))
        self._wait(r.spare, str(a), "recv", awaited, src, _name(key))
        t1 = time.perf_counter_ns()
        self._trace_wait(t0, t1, i, src, what)
        self._record("comm", "recv", t0, t1, recv_bytes=r.header.nbytes + r.payload.nbytes, microbatch=i, peer=src,
                     stage=a.stage, what=what)
        self.prefetch()
        return r.payload

    def _check(self, a: Action, what: str, from_stage: int, src: int, expect: TensorSpec | None,
               shape: Sequence[int], dtype: torch.dtype) -> None:
        if expect is not None and not expect.matches(shape, dtype):
            got = str(TensorSpec(tuple(shape), dtype))
            raise PipelineError(
                f"rank {self.rank}: {a}: stage {a.stage} expects the {what} of micro-batch {a.microbatch} from stage "
                f"{from_stage} (rank {src}) to be {expect}, got {got}. The ranks built different models, or a "
                "stage's output changed shape: build every rank's model from the same config and seed.")

    def exchange_tied(self, stages: Sequence[Stage]) -> None:
        """Exchange tied copies' gradients with the ranks holding the other copies; sum in stage order."""
        remote: dict[tuple[int, int], torch.Tensor | None] = {}
        works: list[tuple[Any, int, Direction, str, str]] = []
        n = self.schedule.stages
        base = 6 * n * self.schedule.microbatches  # after every activation and gradient tag (3 each)
        t0 = time.perf_counter_ns()
        nbytes = 0
        sends: list[tuple[torch.Tensor, int, int, str, str]] = []
        for st in stages:  # receives posted before sends (see fourfold.comm.p2p on gloo)
            named = dict(st.named_parameters())
            for name, (tie, holders) in st.tied.items():
                p = named[name]
                grad = (p.grad if p.grad is not None else torch.zeros_like(p)).contiguous()
                for peer in sorted({self.owner(j) for j in holders} - {self.rank}):
                    sends.append((grad, peer, base + tie * n + st.index,
                                  f"send the gradient of tied weight {tie} (stage {st.index}) to",
                                  f"tied {tie} of stage {st.index}"))
                for j in holders:
                    if self.owner(j) != self.rank and (tie, j) not in remote:
                        remote[(tie, j)] = buf = torch.empty_like(p)
                        works.append((dist.irecv(buf, self.owner(j), group=self.group, tag=base + tie * n + j),
                                      self.owner(j), "recv", f"receive the gradient of tied weight {tie} (stage {j}) from",
                                      f"tied {tie} of stage {j}"))
        for grad, peer, tag, awaited, message in sends:
            works.append((dist.isend(grad, peer, group=self.group, tag=tag), peer, "send", awaited, message))
            nbytes += grad.nbytes
        waiting = time.perf_counter_ns()
        for work, peer, direction, awaited, message in works:
            self._wait(work, "tied gradients", direction, awaited, peer, message)
        if works:
            t1 = time.perf_counter_ns()
            self.sent_bytes += nbytes
            self.messages += sum(1 for _, _, direction, _, _ in works if direction == "send")
            # mostly the peer's backward still running (the last stage waits for the first's): drawn as a wait,
            # over the comm span, as a receive is
            self._trace_wait(waiting, t1, None, None, "tied gradients")
            self._record("comm", "tied_grads", t0, t1, bytes=nbytes)
        sum_tied_grads(stages, remote)


def _name(key: tuple[int, int, int]) -> str:
    """A message's name, the same at both ends: ``0F3``, the activation of stage 0's F of micro-batch 3."""
    kind, stage, microbatch = key
    return f"{stage}{'FB'[kind]}{microbatch}"


def describe(t: torch.Tensor) -> str:
    return str(TensorSpec(tuple(t.shape), t.dtype))
