"""Dropout's random streams under a layout: what one device would draw, as near as ranks can.

One process draws every dropout mask from one stream. Ranks that all seed alike draw the *same* stream, which is
right only where they hold the same activations:

* tensor-parallel ranks hold the same (replicated) activations between their regions: their masks there must
  agree, or the replicas drift apart;
* inside a region each holds other heads (other MLP columns; under sequence parallelism, other positions): the
  same stream there gives heads h and h + H/tp one mask, a correlation one device never has (Megatron-LM forks a
  per-rank stream there);
* pipeline stages hold other layers: the same stream would give stage 1's first block the masks of stage 0's
  embedding; data-parallel replicas hold other samples: sample i of every replica would share a mask.

So a run of several ranks draws from two streams of the rank's own, seeded from one base seed (the same on every
rank) and the rank's coordinates::

    shared   seed(base, dp, pp)       equal over tp: the replicated activations' masks agree
    sharded  seed(base, dp, pp, tp)   inside the regions (after a column layer until its row layer; under
                                      sequence parallelism the whole of every block), per tp rank

:meth:`Streams.stepping` puts the shared stream into the device's default generator for an engine step (the
caller's own draws, outside steps, are untouched), and :func:`fourfold.parallel.tensor.dropout.draw_per_rank` installs the hooks that switch to
the sharded stream and back. The generator's state is swapped, not replaced, so ``nn.Dropout``,
``F.dropout`` and a kernel's ``dropout_p`` (Hugging Face attention) all draw from the stream in force.
An activation-checkpointed block's recompute draws again what its forward drew: torch restores the generator's
state for it, :meth:`Streams.capture` the streams' bookkeeping.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

__all__ = ["SEQUENCE_SHARDED", "SHARDED", "SHARED", "Streams", "stream_seed"]

SHARED, SHARDED = "shared", "sharded"
SEQUENCE_SHARDED = "fourfold_sequence_sharded"
"""The attribute on a sequence-parallel model naming the modules that run on sequence shards (its blocks; TinyGPT's
embedding too): their dropout draws per tp rank."""


def stream_seed(base: int, *parts: object) -> int:
    """A 63-bit seed from ``base`` and ``parts`` (names, coordinates): unrelated seeds for unrelated streams."""
    digest = hashlib.sha256(repr((int(base), *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class Streams:
    """This rank's dropout streams: ``shared`` (equal over its tp group) and ``sharded`` (its own).

    ``coord``: the rank's (dp, pp, tp) coordinates (any object with those attributes). The streams are not
    bound to a generator until :meth:`bind` names the device the model computes on; before that every switch
    is a no-op (the checks :func:`fourfold.parallelize` runs on examples draw from the caller's stream).
    """

    def __init__(self, base: int, coord: Any) -> None:
        self.base, self.coord = int(base), coord
        self._generator: torch.Generator | None = None
        self._states: dict[str, torch.Tensor] = {}
        self._stack: list[str] = []  # streams put in, innermost last; beneath them the caller's (saved in _states)
        self._seeds(None)

    def _seeds(self, step: int | None) -> None:
        c = self.coord
        after = () if step is None else ("step", step)
        self._seed = {SHARED: stream_seed(self.base, SHARED, c.dp, c.pp, *after),
                      SHARDED: stream_seed(self.base, SHARDED, c.dp, c.pp, c.tp, *after)}
        self._states = {k: v for k, v in self._states.items() if k not in self._seed}  # fresh: drawn on bind

    def bind(self, device: torch.device) -> None:
        """Draw on ``device``'s default generator: the CPU's, or an accelerator's own (its module's
        ``default_generators``); a device without one (meta) switches nothing."""
        if device.type == "cpu":
            self._generator = torch.default_generator
            return
        module = torch.get_device_module(device) if device.type != "meta" else None
        generators = getattr(module, "default_generators", ())
        if not generators:
            self._generator = None
            return
        assert module is not None
        self._generator = generators[device.index if device.index is not None else module.current_device()]

    def _state(self, name: str) -> torch.Tensor:
        if name not in self._states:
            assert self._generator is not None
            gen = torch.Generator(device=self._generator.device)
            gen.manual_seed(self._seed[name])
            self._states[name] = gen.get_state()
        return self._states[name]

    def _swap(self, out: str, into: str) -> None:
        assert self._generator is not None
        self._states[out] = self._generator.get_state()
        self._generator.set_state(self._state(into))

    @property
    def depth(self) -> int:
        """How many streams are put in (0: the caller's own is in the generator)."""
        return len(self._stack)

    @property
    def current(self) -> str | None:
        """The stream the generator holds now: ``shared``, ``sharded`` or None (the caller's own)."""
        return self._stack[-1] if self._stack else None

    def push(self, name: str) -> int:
        """Put stream ``name`` into the generator; returns the depth to :meth:`unwind` to."""
        depth = len(self._stack)
        if self._generator is not None:
            self._swap(self.current or "caller", name)
            self._stack.append(name)
        return depth

    def unwind(self, depth: int) -> None:
        """Take streams out down to ``depth`` (0: the caller's own back in the generator)."""
        while len(self._stack) > depth:
            self._swap(self._stack.pop(), self.current or "caller")

    def into_shard(self) -> None:
        if self._generator is not None and self.current != SHARDED:
            self.push(SHARDED)

    def out_of_shard(self) -> None:
        if self.current == SHARDED:
            self.unwind(len(self._stack) - 1)

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """Around an engine step: the shared stream in the generator, everything put in taken out after (also
        when the step fails), the caller's stream back."""
        depth = self.push(SHARED)
        try:
            yield
        finally:
            self.unwind(depth)

    def capture(self) -> Callable[[], AbstractContextManager[None]]:
        """At an activation-checkpointed block's forward: what re-enters the streams as they were, for its
        recompute in backward (torch restores the generator's own state around it). Its first use, in the
        forward itself, does nothing."""
        snapshot = (list(self._stack), dict(self._states))
        uses = [0]

        @contextlib.contextmanager
        def again() -> Iterator[None]:
            uses[0] += 1
            if uses[0] == 1:
                yield
                return
            live = (self._stack, self._states)
            self._stack, self._states = list(snapshot[0]), dict(snapshot[1])
            try:
                yield
            finally:
                self._stack, self._states = live  # torch puts the generator's state back after the recompute

        return again

    def reseed(self, base: int) -> None:
        """Start every stream afresh from ``base`` (:meth:`fourfold.engine.step.Engine.manual_seed`)."""
        if self._stack:
            raise RuntimeError(f"the dropout streams are reseeded between steps, got {self._stack} in force")
        self.base = int(base)
        self._seeds(None)

    def state_dict(self) -> dict[str, Any]:
        """The streams' states between steps (a checkpoint's, to continue them on resume), and the kind of device
        they draw on (a CPU generator's state is no GPU's)."""
        if self._stack:
            raise RuntimeError(f"the dropout streams are saved between steps, got {self._stack} in force")
        if self._generator is None:
            return {"base": self.base, "device": None, "states": {}}
        return {"base": self.base, "device": self._generator.device.type,
                "states": {n: self._state(n).clone() for n in (SHARED, SHARDED)}}

    def resume(self, state: dict[str, Any] | None, step: int) -> None:
        """Continue the streams ``state`` saved (:meth:`state_dict`, the same rank under the same layout) where
        they draw on this kind of device; otherwise (None: another layout, whose ranks' streams do not map to this
        one's; a checkpoint from before the streams; another device) start afresh, seeded from ``step`` too, so
        the first steps' masks are not drawn again."""
        here = self._generator.device.type if self._generator is not None else None
        if state is not None and state.get("device") == here and here is not None:
            self.base = int(state["base"])
            self._seeds(None)
            self._states.update({n: t.clone() for n, t in state["states"].items()})
        else:
            self._seeds(step)
