"""The rank grid: a world of ``dp * cp * tp * pp`` ranks, and the process groups along each axis.

Ranks are laid out with tp innermost, then cp, then dp, then pp::

    rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index

so the ranks of one tensor-parallel group are consecutive (on one machine, where its per-layer all-reduces
are cheapest), context-parallel peers (whose attention talks every layer) next, data-parallel peers
``cp * tp`` apart, and pipeline stages ``dp * cp * tp`` apart. The weights are replicated over dp x cp: their
gradients are reduced over that flattened group (:attr:`RankMesh.replica_group`). With dp=2, tp=2, pp=2 on 8
ranks::

    pp stage 0:  dp 0 -> ranks [0, 1]   dp 1 -> ranks [2, 3]     (each pair is one tp group)
    pp stage 1:  dp 0 -> ranks [4, 5]   dp 1 -> ranks [6, 7]

:class:`Mesh` is pure arithmetic (testable with no processes); :meth:`Mesh.build` creates the process groups
once the default group exists and returns this rank's :class:`RankMesh`.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch.distributed as dist

from fourfold.comm.wait import default_timeout_s, group_timeout
from fourfold.observe.trace import Tracer

__all__ = ["AXES", "Axis", "Coord", "Mesh", "RankMesh"]

Axis = Literal["pp", "dp", "cp", "tp"]
AXES: tuple[Axis, ...] = ("pp", "dp", "cp", "tp")  # outermost to innermost


class Coord(NamedTuple):
    """A rank's position on the grid."""

    pp: int
    dp: int
    tp: int
    cp: int = 0


@dataclass(frozen=True)
class Mesh:
    """A validated factorisation of the world: ``dp * cp * tp * pp`` ranks."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"{axis} must be a positive integer, got {axis}={size!r}. "
                                 f"Pass --{axis} 1 or more.")

    @classmethod
    def for_world(cls, world_size: int, *, dp: int | None = None, tp: int = 1, pp: int = 1, cp: int = 1) -> Mesh:
        """The mesh for ``world_size`` ranks; ``dp=None`` takes whatever tp, pp and cp leave."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}.")
        if dp is None:
            if tp < 1 or pp < 1 or cp < 1 or world_size % (tp * pp * cp):
                names, sizes = ("tp*pp*cp", f"{tp}*{pp}*{cp}") if cp != 1 else ("tp*pp", f"{tp}*{pp}")
                n = tp * pp * cp
                raise ValueError(
                    f"world size must be divisible by {names}, got world_size={world_size}, {names}={sizes}"
                    f"={n}. Launch a multiple of {n} processes (fourfold train --nproc {n}) or "
                    f"change {names.replace('*', '/')} (--{names.replace('*', '/--')}).")
            dp = world_size // (tp * pp * cp)
        mesh = cls(dp=dp, tp=tp, pp=pp, cp=cp)
        mesh.check_world(world_size)
        return mesh

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def record(self) -> dict[str, int]:
        """The sizes as run.json and checkpoint manifests record them (cp only when used: earlier records read
        the same)."""
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, **({"cp": self.cp} if self.cp > 1 else {})}

    def describe(self) -> str:
        """``dp=2 tp=1 pp=1`` (and ``cp=2`` when used): how summaries name the mesh."""
        return " ".join(f"{k}={v}" for k, v in self.record().items())

    @property
    def replicas(self) -> int:
        """Ranks holding the same weights (one pipeline stage's, one tp shard's): dp x cp."""
        return self.dp * self.cp

    def check_world(self, world_size: int) -> None:
        """Refuse a mesh whose product is not the number of ranks launched."""
        if self.world_size != world_size:
            fixes = []
            others = self.tp * self.pp * self.cp
            rest = world_size // others if world_size % others == 0 else None
            if rest:
                fixes.append(f"pass --dp {rest}")
            fixes.append(f"launch {self.world_size} processes (--nproc {self.world_size})")
            names, sizes = ("dp*cp*tp*pp", f"{self.dp}*{self.cp}*{self.tp}*{self.pp}") if self.cp != 1 else \
                ("dp*tp*pp", f"{self.dp}*{self.tp}*{self.pp}")
            raise ValueError(
                f"{names} must equal the world size, got {sizes}={self.world_size} "
                f"vs world size {world_size}. {' or '.join(fixes).capitalize()}.")

    def coord(self, rank: int) -> Coord:
        """``rank`` -> (pp, dp, tp, cp) coordinates."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}.")
        pp, rest = divmod(rank, self.dp * self.cp * self.tp)
        dp, rest = divmod(rest, self.cp * self.tp)
        cp, tp = divmod(rest, self.tp)
        return Coord(pp, dp, tp, cp)

    def rank(self, pp: int = 0, dp: int = 0, tp: int = 0, cp: int = 0) -> int:
        """(pp, dp, tp, cp) coordinates -> rank."""
        for axis, index in (("pp", pp), ("dp", dp), ("tp", tp), ("cp", cp)):
            if not 0 <= index < getattr(self, axis):
                raise ValueError(f"{axis} index must be in [0, {getattr(self, axis)}), got {index}.")
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def groups(self, axis: Axis) -> list[list[int]]:
        """Every group along ``axis``: the ranks that differ only in that coordinate, in coordinate order."""
        if axis not in AXES:
            raise ValueError(f"axis must be one of {AXES}, got {axis!r}.")
        return self.groups_over((axis,))

    def groups_over(self, axes: tuple[Axis, ...]) -> list[list[int]]:
        """Every group of ranks that differ only along ``axes`` (flattened, the first axis outermost)."""
        others = [a for a in AXES if a not in axes]
        result = []
        for fixed in itertools.product(*(range(getattr(self, a)) for a in others)):
            at = dict(zip(others, fixed, strict=True))
            result.append([self.rank(**at, **dict(zip(axes, idx, strict=True)))  # type: ignore[arg-type]
                           for idx in itertools.product(*(range(getattr(self, a)) for a in axes))])
        return sorted(result)

    def peers(self, rank: int, axis: Axis) -> list[int]:
        """The ranks of ``rank``'s group along ``axis`` (``rank`` included)."""
        return next(g for g in self.groups(axis) if rank in g)

    def build(self, timeout_s: float | None = None, tracer: Tracer | None = None) -> RankMesh:
        """Create the dp, tp and pp process groups (collective: every rank must call it, in the same order).

        An axis of size 1 gets no group (None): nothing communicates along it, and creating one would cost a
        store round trip per rank for nothing. The engine applies no strategy along such an axis.

        ``timeout_s``: the groups' own timeout; None is the run's (``launch.init(timeout_s=...)``, ``--timeout``),
        not torch's 30 minutes, for which a collective bounded only by its group (an object gather) would wait
        on a stuck peer. Every collective and send/recv of an engine on this mesh is bounded by it too.
        ``tracer``: what records this rank's spans (:mod:`fourfold.observe.trace`); None records nothing.
        """
        if not dist.is_initialized():
            raise RuntimeError("Mesh.build() needs the default process group: call fourfold.launch.init() first.")
        world = dist.get_world_size()
        self.check_world(world)
        rank = dist.get_rank()
        timeout = group_timeout(timeout_s)
        mine: dict[str, dist.ProcessGroup | None] = dict.fromkeys((*AXES, "replicas"))
        flat: tuple[Axis, ...] = ("dp", "cp")
        for axis, axes, size in [(a, (a,), getattr(self, a)) for a in AXES] + [("replicas", flat, self.replicas)]:
            if size == 1 or (axis == "replicas" and 1 in (self.dp, self.cp)):
                continue  # (dp x cp with one of them 1 is the other's group)
            for ranks in self.groups_over(axes):
                # new_group is collective over the whole world, so every rank creates every group.
                group = dist.new_group(ranks, timeout=timeout) if len(ranks) < world else dist.group.WORLD
                if rank in ranks:
                    mine[axis] = group
        replicas = mine["replicas"] or mine["dp"] or mine["cp"]
        return RankMesh(self, rank, self.coord(rank), mine["dp"], mine["tp"], mine["pp"], timeout_s, tracer,
                        cp_group=mine["cp"], replica_group=replicas)


@dataclass(frozen=True)
class RankMesh:
    """One rank's view of the mesh: its coordinates and the process groups it belongs to (None along an axis
    of size 1)."""

    mesh: Mesh
    rank: int
    coord: Coord
    dp_group: dist.ProcessGroup | None
    tp_group: dist.ProcessGroup | None
    pp_group: dist.ProcessGroup | None
    timeout_s: float | None = None  # the groups' (Mesh.build's); None: the run's, launch.init's --timeout
    tracer: Tracer | None = None  # records this rank's spans; None: nothing recorded
    cp_group: dist.ProcessGroup | None = None
    replica_group: dist.ProcessGroup | None = None  # dp x cp: the ranks holding the same weights (None: alone)

    @classmethod
    def single(cls, tracer: Tracer | None = None) -> RankMesh:
        """One process, no groups: what the engine runs on for the single-process reference."""
        return cls(Mesh(), 0, Coord(0, 0, 0), None, None, None, tracer=tracer)

    def using(self, *, tracer: Tracer | None = None, timeout_s: float | None = None) -> RankMesh:
        """This mesh (the same groups) with another tracer or timeout: a bench's variant traced on its own."""
        return dataclasses.replace(self, tracer=tracer if tracer is not None else self.tracer,
                                   timeout_s=timeout_s if timeout_s is not None else self.timeout_s)

    @property
    def timeout(self) -> float:
        """Seconds any collective or send/recv on this mesh may wait: :meth:`Mesh.build`'s, or the run's."""
        return default_timeout_s() if self.timeout_s is None else self.timeout_s

    @property
    def recorder(self) -> Tracer:
        """This rank's tracer, or one that records nothing."""
        return self.tracer if self.tracer is not None else Tracer(self.rank, enabled=False)

    def group(self, axis: Axis) -> dist.ProcessGroup | None:
        return {"dp": self.dp_group, "tp": self.tp_group, "pp": self.pp_group, "cp": self.cp_group}[axis]

    def duplicate(self, axis: Axis, timeout_s: float | None = None) -> dist.ProcessGroup | None:
        """A second process group of this rank's ``axis`` peers (None along an axis of size 1), for collectives
        issued from another thread than the main one's on the same ranks: each group keeps its own order, so two
        threads' collectives cannot meet in different orders on different ranks. Collective: every rank calls
        it, in the same order (each creates every group along ``axis``). ``timeout_s`` as :meth:`Mesh.build`'s."""
        if getattr(self.mesh, axis) == 1:
            return None
        timeout = group_timeout(timeout_s)
        mine = None
        for ranks in self.mesh.groups(axis):
            group = dist.new_group(ranks, timeout=timeout)
            if self.rank in ranks:
                mine = group
        return mine

    def peers(self, axis: Axis) -> list[int]:
        return self.mesh.peers(self.rank, axis)
