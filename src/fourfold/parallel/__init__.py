"""Parallel strategies, one module each: ``data`` (DataParallel, sync_gradients), ``tensor`` (column/row-
parallel layers, TinyGPT's plan in ``tensor_gpt``), ``schedule`` (pipeline schedules as pure data).

Import the module you need (``from fourfold.parallel.data import DataParallel``); this package imports
nothing itself, so the pure ones (``schedule``) load without torch.distributed.
"""
