"""fourfold: train PyTorch models on many devices with model, tensor, data and pipeline parallelism.

    from fourfold import Layout, launch, parallelize

    ctx = launch.init()                                           # torchrun's environment, or one process
    layout = Layout(tp=2, pp=2, schedule="1f1b")                  # every parallel setting, checked here
    engine = parallelize(model, layout.mesh(ctx.world_size).build(), layout)
    loss = engine.step(x, y)                                      # then optimizer.step(), loss.item()

The names load on first use, so ``fourfold --help`` and the pure modules (schedules) start without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["Engine", "Layout", "Mesh", "Split", "SplitError", "__version__", "launch", "parallelize"]

_LAZY = {"Engine": "fourfold.engine.step", "Layout": "fourfold.engine.layout", "parallelize": "fourfold.engine.parallelize", "Mesh": "fourfold.mesh",
         "launch": "fourfold.launch", "Split": "fourfold.parallel.pipeline.blocks",
         "SplitError": "fourfold.parallel.pipeline.blocks"}

if TYPE_CHECKING:
    from fourfold import launch
    from fourfold.engine.layout import Layout
    from fourfold.engine.parallelize import parallelize
    from fourfold.engine.step import Engine
    from fourfold.mesh import Mesh
    from fourfold.parallel.pipeline.blocks import Split, SplitError


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'fourfold' has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name])
    return module if name == "launch" else getattr(module, name)
