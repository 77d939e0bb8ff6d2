"""Pipeline parallelism: ``split`` (cut a model into stages, checked against its own forward), ``runtime``
(one executor for any :mod:`~fourfold.parallel.schedule`), ``p2p`` (messages between stages), ``backward``
(the B/W split of zero-bubble schedules), ``figures`` (a step's loss, bubble and memory, gathered over pp),
``state`` (the stages' state dicts merged).
"""

from __future__ import annotations

from fourfold.parallel.pipeline.p2p import PipelineError
from fourfold.parallel.pipeline.runtime import Pipeline, StepResult, build_pipeline
from fourfold.parallel.pipeline.split import Stage, TensorSpec, split_model

__all__ = ["Pipeline", "PipelineError", "Stage", "StepResult", "TensorSpec", "build_pipeline", "split_model"]
