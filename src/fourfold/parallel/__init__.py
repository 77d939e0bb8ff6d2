"""The strategies, generic (never importing ``fourfold.models``): ``data`` (DataParallel, sync_gradients),
``tensor/`` (collectives, column/row-parallel layers, the vocabulary-parallel loss, sharding by a plan),
``pipeline/`` (splitting into stages, the runtime, messages between stages, the B/W split), ``schedule``
(pipeline schedules as pure data), ``model`` (model parallelism: a pipeline with one micro-batch).

Import the module you need (``from fourfold.parallel.data import DataParallel``); this package imports
nothing itself, so the pure ones (``schedule``) load without torch.distributed. ``fourfold.parallelize``
composes them.
"""
