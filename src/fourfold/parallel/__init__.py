"""Parallel strategies: data, tensor, pipeline and model parallelism."""

from __future__ import annotations

from fourfold.parallel.data import sync_gradients

__all__ = ["sync_gradients"]
