"""Model parallelism: the model's layers on different devices, one batch going through them in turn.

Two forms of the same idea:

* :func:`model_parallel` (``--strategy model``): each rank of ``group`` holds a contiguous run of layers,
  and the whole batch is one micro-batch under the ``naive`` schedule. It is the pipeline runtime with nothing
  overlapped: while one rank computes, the p-1 others wait, a bubble of (p-1)/p. That idle time is the point
  of showing it: the pipeline schedules exist to fill it::

      pipe = model_parallel(TinyGPT(cfg, seed=0), group)     # every rank calls it alike
      result = pipe.step(x, y); opt.step()                   # result.bubble_by_rank ~ (p-1)/p each

* :class:`MultiDeviceModel`: one process placing the stages on several local devices (``["cuda:0",
  "cuda:1"]`` for a user with two GPUs; ``["cpu", "cpu"]`` runs it anywhere), moving the activation to the next
  device in forward. Autograd carries gradients back across the copies::

      model = MultiDeviceModel(TinyGPT(cfg, seed=0), ["cuda:0", "cuda:1"])
      logits, loss = model(idx, targets)   # idx on any device; logits and loss on the last one
      loss.backward()
      model.finish()                       # a weight tied across devices: add the copies' gradients
      opt.step()

On GPUs the devices run one after the other as well (each waits for the activation from the one before), so
the idle time is the same (p-1)/p; the gain is memory: each device holds 1/p of the parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fourfold.loss import lm_loss
from fourfold.parallel.pipeline.runtime import Pipeline, build_pipeline
from fourfold.parallel.pipeline.split import Balance, Stage, split_model, sum_tied_grads
from fourfold.parallel.schedule import make_schedule

__all__ = ["MultiDeviceModel", "model_parallel"]


def model_parallel(model: nn.Module | Sequence[nn.Module], group: dist.ProcessGroup | None = None, *,
                   balance: Balance = "params", boundaries: Sequence[int | str] | None = None,
                   example: torch.Tensor | None = None, **kwargs: Any) -> Pipeline:
    """This rank's layers of ``model``, one stage per rank of ``group``, run with one micro-batch (naive).

    ``kwargs`` go to :class:`~fourfold.parallel.pipeline.Pipeline` (``loss_fn``, ``tracer``, ``timeout_s``).
    """
    schedule = make_schedule("naive", dist.get_world_size(group), 1)
    return build_pipeline(model, schedule, group, balance=balance, boundaries=boundaries, example=example,
                          **kwargs)


class MultiDeviceModel(nn.Module):
    """``model``'s blocks cut into ``len(devices)`` stages, stage k on ``devices[k]``; one process.

    ``forward(x, targets=None)`` returns the output, or ``(output, loss_fn(output, targets))`` like TinyGPT.
    A weight shared by blocks on two stages is a copy per stage (one tensor cannot live on two devices):
    call :meth:`finish` after backward so each copy gets their summed gradient, as the single weight would.
    """

    def __init__(self, model: nn.Module | Sequence[nn.Module], devices: Sequence[torch.device | str], *,
                 balance: Balance = "params", boundaries: Sequence[int | str] | None = None,
                 example: torch.Tensor | None = None,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss) -> None:
        super().__init__()
        if not devices:
            raise ValueError("devices must name at least one device, got none. Pass e.g. ['cuda:0', 'cuda:1'].")
        self.devices = [torch.device(d) for d in devices]
        stages = split_model(model, len(self.devices), balance=balance, boundaries=boundaries, example=example)
        self.stages = nn.ModuleList(st.to(d) for st, d in zip(stages, self.devices, strict=True))
        self._stages: list[Stage] = stages  # the same modules, typed
        self.loss_fn = loss_fn

    def forward(self, x: torch.Tensor,
                targets: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        for stage, device in zip(self.stages, self.devices, strict=True):
            x = stage(x.to(device))  # the copy between devices is differentiable: gradients come back
        if targets is None:
            return x
        return x, self.loss_fn(x, targets.to(x.device))

    def finish(self) -> None:
        """After backward: give every copy of a tied weight the sum of the copies' gradients (stage order)."""
        sum_tied_grads(self._stages)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The state dict under the original model's names, as one process's model would have it."""
        return {k: v for st in self._stages for k, v in st.model_state_dict().items()}
