"""fourfold: train PyTorch models on many devices with model, tensor, data and pipeline parallelism."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
