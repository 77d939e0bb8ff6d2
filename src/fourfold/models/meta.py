"""Building on the meta device (shapes only), without the cost of drawing nothing.

``with on_meta():`` is ``with torch.device("meta"):`` in which a random initialisation of a meta tensor
(``nn.init.normal_``, ``Tensor.uniform_``, ...) returns the tensor as it is: there are no values to draw. Torch's
meta kernels for these ops are Python functions behind a lazy import of its compiler, ~1.3 s of CPU the first time
in a process; a launcher that builds the model on meta only for its checks before launch (and every TinyGPT,
built on meta first so that no layer's own init draws from the global generator) never pays it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["on_meta"]

_RANDOM_FILLS: frozenset[Callable[..., Any]] = frozenset({
    nn.init.normal_, nn.init.uniform_, nn.init.trunc_normal_, nn.init.kaiming_normal_, nn.init.kaiming_uniform_,
    nn.init.xavier_normal_, nn.init.xavier_uniform_, nn.init.orthogonal_, nn.init.sparse_,
    torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.bernoulli_, torch.Tensor.exponential_,
    torch.Tensor.geometric_, torch.Tensor.log_normal_, torch.Tensor.cauchy_, torch.Tensor.random_,
})


class _NothingToDraw(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _RANDOM_FILLS:
            target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@contextmanager
def on_meta() -> Iterator[None]:
    """Make modules on the meta device, their random initialisations skipped (they would write nothing)."""
    with torch.device("meta"), _NothingToDraw():
        yield
