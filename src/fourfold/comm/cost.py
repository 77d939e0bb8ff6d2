"""The all-reduce cost model: each algorithm's critical path (steps, bytes on the wire, bytes reduced) and the
α-β-γ model that turns it into seconds, measured by ``fourfold bench allreduce`` (or :data:`DEFAULT`).
:mod:`fourfold.comm.auto` chooses with it; :mod:`fourfold.comm.network` extends it to two levels (nodes).

    cost("ring", 1 << 20, 4, 4)        # Cost(steps=6, wire_bytes=..., reduced_bytes=...)
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

from fourfold.comm import hierarchical, master, naive, rabenseifner, ring, tree
from fourfold.files import write_text_atomic

__all__ = ["DEFAULT", "Cost", "CostModel", "cost", "default_path", "sent_by_rank"]


_FORMAT = "fourfold-cost-model"
_VERSION = 1


@dataclass(frozen=True)
class CostModel:
    """α (s per step), β (s per byte on a link), γ (s per byte reduced); ``source`` and ``info`` say whence."""

    alpha_s: float
    beta_s_per_byte: float
    gamma_s_per_byte: float = 0.0
    source: str = ""
    info: Mapping[str, Any] = field(default_factory=dict, compare=False)
    network: tuple[float, float] | None = None  # (α, β) of the links between nodes; None: one class of link

    def __post_init__(self) -> None:
        if self.network is not None:
            if not isinstance(self.network, (tuple, list)) or len(self.network) != 2 or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                    for v in self.network) or not any(self.network):
                raise ValueError(f"network must be (alpha_s, beta_s_per_byte) of the links between nodes, finite, "
                                 f">= 0 and not both 0, got {self.network!r}.")
            object.__setattr__(self, "network", (float(self.network[0]), float(self.network[1])))
        for name in ("alpha_s", "beta_s_per_byte", "gamma_s_per_byte"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}.")
        if self.alpha_s == 0 and self.beta_s_per_byte == 0:
            raise ValueError("alpha_s and beta_s_per_byte must not both be 0: the model would predict every "
                             "algorithm takes no time.")

    def to_dict(self) -> dict[str, Any]:
        return {"format": _FORMAT, "version": _VERSION, **asdict(self), "info": dict(self.info)}

    def save(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Write the model as JSON (atomically) to ``path`` or :func:`default_path`; return the path."""
        target = Path(path) if path is not None else default_path()
        write_text_atomic(target, json.dumps(self.to_dict(), indent=2) + "\n")
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None) -> CostModel:
        """The model in ``path``; with no path, the one at :func:`default_path`, or :data:`DEFAULT` if none.

        A file that exists but is not a cost model is refused (``ValueError``), never silently replaced.
        """
        if path is None:
            path = default_path()
            if not path.exists():
                return DEFAULT
        fix = "Re-run `fourfold bench allreduce --nproc 2` to write a fresh one, or delete the file to use " \
              "the built-in defaults."
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"cost model {path} must be JSON, got a parse error: {e}. {fix}") from None
        if not isinstance(data, dict) or data.get("format") != _FORMAT or data.get("version") != _VERSION:
            got = {k: data.get(k) for k in ("format", "version")} if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"cost model {path} must have format={_FORMAT!r} and version={_VERSION}, got "
                             f"{got}. {fix}")
        missing = [k for k in ("alpha_s", "beta_s_per_byte") if k not in data]
        if missing:
            raise ValueError(f"cost model {path} must have {' and '.join(missing)}, got keys {sorted(data)}. {fix}")
        try:
            network = data.get("network")
            return cls(data["alpha_s"], data["beta_s_per_byte"], data.get("gamma_s_per_byte", 0.0),
                       str(data.get("source", "")), dict(data.get("info") or {}),
                       tuple(network) if isinstance(network, list) else network)
        except (ValueError, TypeError) as e:
            raise ValueError(f"cost model {path}: {e} {fix}") from None


DEFAULT = CostModel(
    alpha_s=114e-6, beta_s_per_byte=0.22e-9, gamma_s_per_byte=0.029e-9,
    source="built-in default: `fourfold bench allreduce --nproc 2` on a 2-core x86-64 VM, gloo over loopback, "
           "torch 2.13 CPU, 2026-11-21 (machine clock); rounded (docs/allreduce.md)",
)
"""Used when no cost-model file exists: α 114 us, β 0.22 ns/B (4.6 GB/s), γ 0.029 ns/B, measured on the machine
this project is developed on (the run in docs/allreduce.md). Loopback figures: a real network has larger α and
β, so run the benchmark on yours; the crossover moves, the shape does not."""


def default_path() -> Path:
    """``$FOURFOLD_COST_MODEL`` if set, else ``~/.cache/fourfold/cost_model.json``."""
    env = os.environ.get("FOURFOLD_COST_MODEL")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fourfold" / "cost_model.json"


class Cost(NamedTuple):
    """One algorithm's critical path: steps, bytes on the wire, bytes reduced."""

    steps: int
    wire_bytes: int
    reduced_bytes: int


def sent_by_rank(algorithm: str, numel: int, world_size: int, itemsize: int, node_size: int | None = None
                 ) -> list[int]:
    """Each rank's bytes sent in ``algorithm`` (any of fourfold's point-to-point ones), from its own
    ``theory()``: what the counted bytes must equal."""
    if algorithm == "hierarchical":
        return [hierarchical.theory(numel, world_size, r, itemsize, node_size)[0] for r in range(world_size)]
    fn = {"ring": ring.theory, "tree": tree.theory, "rabenseifner": rabenseifner.theory, "naive": naive.theory,
          "master": master.theory}[algorithm]
    return [fn(numel, world_size, r, itemsize)[0] for r in range(world_size)]


@lru_cache(maxsize=4096)
def _max_sent(algorithm: str, numel: int, world_size: int, itemsize: int, node_size: int) -> int:
    """The busiest rank's bytes sent (:func:`sent_by_rank`)."""
    return max(sent_by_rank(algorithm, numel, world_size, itemsize, node_size))


def cost(algorithm: str, numel: int, itemsize: int, world_size: int, node_size: int | None = None) -> Cost:
    """The critical path of ``algorithm`` (any of fourfold's point-to-point ones) summing ``numel`` elements over G
    ranks. naive and master are not ``auto``'s candidates; they are here so that every algorithm has a prediction."""
    g_, n = world_size, numel
    if g_ == 1 or n == 0:
        return Cost(0, 0, 0)
    if algorithm == "ring":
        steps, reduced = 2 * (g_ - 1), (g_ - 1) * -(-n // g_)
    elif algorithm == "tree":
        d, extra = g_.bit_length() - 1, g_ - (1 << (g_.bit_length() - 1))
        steps, reduced = d + (2 if extra else 0), (d + (1 if extra else 0)) * n
    elif algorithm == "rabenseifner":
        d, extra = g_.bit_length() - 1, g_ - (1 << (g_.bit_length() - 1))
        steps = 2 * d + (2 if extra else 0)
        reduced = ((1 << d) - 1) * -(-n // (1 << d)) + (n if extra else 0)
    elif algorithm == "hierarchical":
        g = node_size or g_
        nodes = g_ // g
        steps = 2 * (g - 1) + 2 * (nodes - 1)
        reduced = (g - 1) * -(-n // g) + (nodes - 1) * -(-n // g_)
    elif algorithm in ("naive", "master"):
        steps, reduced = (1 if algorithm == "naive" else 2), (g_ - 1) * n  # master: gather, then broadcast
    else:
        raise ValueError(f"algorithm must be ring, tree, rabenseifner, hierarchical, naive or master for the cost "
                         f"model, got {algorithm!r}.")
    wire = _max_sent(algorithm, n, g_, itemsize, node_size or g_)
    if algorithm in ("tree", "rabenseifner") and g_ & (g_ - 1):
        wire += n * itemsize  # the fold: received by ranks j < E before they send anything
    if algorithm == "master":
        wire *= 2  # the root receives (G-1)N before it sends as much
    return Cost(steps, wire, reduced * itemsize)
