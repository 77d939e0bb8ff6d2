"""Training checkpoints of an :class:`~fourfold.engine.step.Engine`, saved under one layout and loaded under any.

Each rank writes its own pieces: a tensor-parallel shard (or the whole tensor when it is replicated) of a model
tensor or of its optimiser state, keyed by the **unsharded model's own name** (``model/NAME#i``,
``optim/NAME/KEY#i``) and described by its global shape and how it was cut (dim, fused parts, index, count):
never by stage or rank. Data-parallel replicas write nothing (dp rank 0 of each replica group writes);
replicated tensors are written by tp rank 0 only. Loading rebuilds each tensor this rank holds from the pieces
it needs, one tensor at a time, from memory-mapped files, and cuts it for this layout. Each rank's own state,
its RNG and its gradient compressor's (int8's and PowerSGD's errors fed back, PowerSGD's factors), is restored
when the layout is the same; under another it starts afresh.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fourfold.checkpoint.store import (
    FORMAT,
    MANIFEST,
    CheckedFiles,
    CheckpointError,
    prune,
    read_manifest,
    sha256_file,
)
from fourfold.comm.wait import default_timeout_s, gather_objects, group_timeout
from fourfold.files import atomic_path, fsync, write_text_atomic
from fourfold.launch import on_close

__all__ = ["load", "save"]


def _world() -> tuple[int, int]:
    """(rank, world size); one process without a process group is rank 0 of 1."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


IO_TIMEOUT_S = 30 * 60.0
"""How long a save or a load waits for the slowest rank's files: the timeout of a group of their own. Ranks of
replicas other than dp 0 write nothing and wait for dp 0's whole write and checksum, which on a large model and
a slow filesystem takes minutes, far past ``--timeout`` (a dead rank still fails it at once)."""

_IO_GROUPS: dict[Any, Any] = {}  # the world group -> its copy with IO_TIMEOUT_S, made at the first save or load
on_close(_IO_GROUPS.clear)  # gone with the process group


def io_group() -> dist.ProcessGroup:
    """Every rank, with :data:`IO_TIMEOUT_S` (or the run's timeout, if longer). Made on first use, a collective:
    ``fourfold train`` makes it at the start, where every rank arrives within ``--timeout``; from Python, the
    first save or load does."""
    world = dist.group.WORLD
    if world not in _IO_GROUPS:
        _IO_GROUPS.clear()  # a group of an earlier process group is gone with it
        _IO_GROUPS[world] = dist.new_group(list(range(dist.get_world_size())),
                                           timeout=group_timeout(max(IO_TIMEOUT_S, default_timeout_s())))
    return _IO_GROUPS[world]


def _gather(obj: Any, op: str) -> list[Any]:
    """Every rank's ``obj``, waited for as long as the slowest rank's file I/O may take (:data:`IO_TIMEOUT_S`)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    return gather_objects(obj, io_group(), op=op)


def io_barrier(op: str) -> None:
    """Every rank waits for the others as long as a rank's file I/O may take (:data:`IO_TIMEOUT_S`): the end of
    a save or a load, and of ``model.pt``, which rank 0 alone writes."""
    _gather(None, op)


def _global_shape(shape: torch.Size, layout: Any, count: int) -> list[int]:
    """The whole tensor's shape from one of ``count`` pieces cut by ``layout`` (a replicated one is whole)."""
    out = list(shape)
    if layout.dim is not None:
        out[layout.dim] *= count
    return out


def _pieces(engine: Any, states: dict[str, dict[str, Any]]) -> Iterator[tuple[str, torch.Tensor, Any]]:
    """``(key, this rank's tensor, layout)`` of everything a checkpoint holds: the model's state under its own
    names (``model/NAME``) and each parameter's optimiser state (``optim/NAME/KEY``, shaped like the parameter
    or replicated; ``states``: :meth:`Engine.optimizer_state`)."""
    from fourfold.parallel.tensor.layers import REPLICATED

    for name, t in engine.local_state_dict().items():
        yield f"model/{name}", t, engine.layouts.get(name, REPLICATED)
    for name, p in engine.named_parameters():
        for key, value in states.get(name, {}).items():
            if isinstance(value, torch.Tensor):
                same = value.shape == p.shape
                yield f"optim/{name}/{key}", value, engine.layouts.get(name, REPLICATED) if same else REPLICATED


def save(root: str | Path, step: int, engine: Any, optimizer: torch.optim.Optimizer | None, *,
         config: dict[str, Any], keep: int = 2) -> Path:
    """Write the checkpoint of ``step`` under ``root`` (``root/step-NNNNNN``) and keep the newest ``keep``.

    A collective: every rank of the engine's mesh calls it. Returns the checkpoint's directory.
    """
    mesh, coord = engine.mesh, engine.ranks.coord
    rank, world = _world()
    where = Path(root) / f"step-{step:06d}"
    where.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, dict[str, Any]] = {}
    states = engine.optimizer_state(optimizer) if optimizer is not None else {}  # ZeRO: gathered over dp
    with engine.gathered():  # ZeRO: the whole parameters, on every dp rank (a collective)
        tied = _aliases(engine)
        if coord.dp == 0 and coord.cp == 0:  # one replica writes; the others (over dp x cp) hold the same numbers
            _collect(engine, states, coord, mesh, tensors, meta)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    if engine.streams is not None:  # several ranks: dropout's own streams (fourfold.parallel.rng)
        rng["streams"] = engine.streams.state_dict()
    compressor = getattr(engine.dp, "compress", None)  # int8 / PowerSGD: this rank's errors fed back, its factors
    compress = {k: t.detach().to("cpu", copy=True) for k, t in compressor.state_dict().items()} if compressor else {}
    name = f"rank-{rank:05d}.pt"
    with atomic_path(where / name, durable=True) as tmp:  # on the disk before any older checkpoint is pruned
        torch.save({"tensors": tensors, "rng": rng, "compress": compress}, tmp)
    mine = {"file": name, "bytes": (where / name).stat().st_size, "sha256": sha256_file(where / name),
            "meta": meta, "aliases": tied}
    everyone = _gather(mine, "checkpoint save: gather the piece tables")
    if rank == 0:
        elsewhere = [r for r, got in enumerate(everyone) if not (where / got["file"]).is_file()]
        if elsewhere:  # another machine wrote them into an --out of its own
            _warn_elsewhere(where, elsewhere, world)
        located: dict[str, dict[str, Any]] = {}
        for got in everyone:
            for piece, m in got["meta"].items():
                located.setdefault(piece, {**m, "file": got["file"]})  # a tied copy on two stages: the first
        aliases = {k: v for got in everyone for k, v in got["aliases"].items()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] if optimizer else []
        manifest = {"format": FORMAT, "step": step, "config": config, "world_size": world,
                    "mesh": mesh.record(),
                    "optimizer": {"class": type(optimizer).__name__ if optimizer else None, "param_groups": groups},
                    "files": {g["file"]: {"bytes": g["bytes"], "sha256": g["sha256"]} for g in everyone},
                    "aliases": aliases, "pieces": located}
        write_text_atomic(where / MANIFEST, json.dumps(manifest, indent=1, default=_jsonable) + "\n", durable=True)
        fsync(where.parent)  # the step's folder itself, before the older ones go
        prune(Path(root), keep)
    io_barrier("checkpoint save: wait for every rank's files")  # on return the checkpoint exists, on every rank
    return where


_WARNED: set[str] = set()  # the checkpoint folders warned of: once per run


def _warn_elsewhere(where: Path, ranks: list[int], world: int) -> None:
    """Rank 0 does not see other ranks' files beside its own: each machine wrote to a folder of its own, and the
    checkpoint resumes only once its files are brought together. Say so once, at the first checkpoint."""
    if str(where.parent) in _WARNED:
        return
    _WARNED.add(str(where.parent))
    some = ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
    print(f"fourfold: warning: checkpoint {where.name} is not complete in {where.parent}: {len(ranks)} of "
          f"{world} ranks' files (ranks {some}) are not there; their machines wrote them to --out folders of their "
          "own. A run over several machines resumes (--resume, --max-restarts) only from an --out that every "
          "machine shares (NFS or a cluster filesystem): to resume from one of these checkpoints, copy every "
          "machine's files of it into this folder first (its manifest lists them). Training goes on; model.pt at "
          "the end is still written whole (rank 0 gathers it).",
          file=sys.stderr, flush=True)


def _collect(engine: Any, states: dict[str, dict[str, Any]], coord: Any, mesh: Any,
             tensors: dict[str, torch.Tensor], meta: dict[str, dict[str, Any]]) -> None:
    """This rank's pieces into ``tensors`` (CPU copies) and their descriptions into ``meta``."""
    for key, t, layout in _pieces(engine, states):
        if layout.dim is None and coord.tp != 0:
            continue
        index, count = (coord.tp, mesh.tp) if layout.dim is not None else (0, 1)
        piece = f"{key}#{index}"
        if piece in tensors:
            continue  # a tied tensor listed twice on this rank
        tensors[piece] = t.detach().to("cpu", copy=True)
        meta[piece] = {"shape": _global_shape(t.shape, layout, count), "dim": layout.dim, "parts": layout.parts,
                       "index": index, "count": count, "dtype": str(t.dtype).removeprefix("torch.")}


def _aliases(engine: Any) -> dict[str, str]:
    """Tied tensors this rank holds under several names (a head sharing the embedding's weight): every other
    name -> the first. The optimiser's state is saved under the first only; a layout that holds the tie as
    two copies (a pipeline's first and last stage) finds it through this map."""
    first: dict[tuple[int, tuple[int, ...]], str] = {}
    out = {}
    for name, t in engine.local_state_dict().items():
        key = (t.data_ptr(), tuple(t.shape))
        if key in first and t.numel() > 0:
            out[name] = first[key]
        first.setdefault(key, name)
    return out


def _jsonable(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.item() if x.numel() == 1 else x.tolist()
    if isinstance(x, tuple):
        return list(x)
    raise TypeError(f"cannot write {type(x).__name__} into a checkpoint manifest")


def load(path: str | Path, engine: Any, optimizer: torch.optim.Optimizer | None = None, *,
         restore_rng: bool = True) -> dict[str, Any]:
    """Load the checkpoint ``path`` names into this rank's part of ``engine`` (and ``optimizer``), under any
    layout. A collective. Returns the manifest (``"step"``: the step it was saved after).

    Refused with :class:`CheckpointError`, on every rank alike, when the model's tensors (names, global shapes,
    dtypes) differ from the checkpoint's, naming them. RNG states and gradient compressors' state are restored
    when the layout is the same; under another, ``restore_rng`` reseeds from the seed and the step (each rank's
    dropout streams, or one process's ``torch`` generator), so the first steps' masks are not drawn again.
    """
    from fourfold.parallel.rng import stream_seed
    from fourfold.parallel.tensor import LazyState
    from fourfold.parallel.tensor.layers import ShardLayout, fused, shard, unshard

    manifest = read_manifest(path)
    where, pieces = Path(manifest["dir"]), manifest["pieces"]
    _check_model(engine, pieces, where)
    files = CheckedFiles(where, manifest["files"])
    coord, mesh = engine.ranks.coord, engine.mesh

    def whole(key: str) -> torch.Tensor:
        first = pieces[f"{key}#0"]
        parts = [files.get(pieces[f"{key}#{i}"]["file"])["tensors"][f"{key}#{i}"] for i in range(first["count"])]
        # parts: a count, or (JSON's list of) proportions
        return unshard(parts, ShardLayout(first["dim"], fused(first["parts"])))

    def mine(key: str, layout: Any) -> torch.Tensor:
        full = whole(key)
        return shard(full, layout, coord.tp, mesh.tp) if layout.dim is not None else full

    names = [key[len("model/"):-len("#0")] for key in pieces if key.startswith("model/") and key.endswith("#0")]
    engine.load_state_dict(LazyState(names, lambda name: whole(f"model/{name}")))  # each read when asked for
    if optimizer is not None:
        with torch.no_grad():
            _load_optimizer(engine, optimizer, manifest, pieces, mine, where)
    rank, world = _world()
    if manifest["world_size"] == world and manifest["mesh"] == mesh.record():
        own = files.get(f"rank-{rank:05d}.pt")  # this rank's own state: meaningful under the same layout only
        compressor = getattr(engine.dp, "compress", None)
        if compressor is not None:
            compressor.load_state_dict(own.get("compress", {}))
        if restore_rng:
            torch.set_rng_state(own["rng"]["cpu"])
            if "cuda" in own["rng"] and torch.cuda.is_available():
                torch.cuda.set_rng_state(own["rng"]["cuda"])
            if engine.streams is not None:
                engine.streams.resume(own["rng"].get("streams"), manifest["step"])
    elif restore_rng:  # another layout: draw afresh from the seed and the step, not the first steps' masks again
        if engine.streams is not None:
            engine.streams.resume(None, manifest["step"])
        else:  # one process draws from torch's own generator, as plain PyTorch does
            torch.manual_seed(stream_seed(torch.initial_seed(), "step", manifest["step"]))
    io_barrier("checkpoint load: wait for every rank's reads")  # the next step's collectives start together
    return manifest


def _load_optimizer(engine: Any, optimizer: torch.optim.Optimizer, manifest: dict[str, Any],
                    pieces: dict[str, Any], mine: Any, where: Path) -> None:
    from fourfold.parallel.tensor.layers import REPLICATED

    saved = manifest["optimizer"]
    if saved["class"] != type(optimizer).__name__:
        raise CheckpointError(f"{where}: optimizer must be {saved['class']} to resume this checkpoint, got "
                              f"{type(optimizer).__name__}.")
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(f"{where}: the optimizer must have the checkpoint's {len(saved['param_groups'])} "
                              f"param group(s) to resume it, got {len(optimizer.param_groups)}. Build it with the "
                              "same groups (weight decay on and off, say) as the run that saved it.")
    for group, values in zip(optimizer.param_groups, saved["param_groups"], strict=True):  # torch's rule: saved wins
        for k, v in values.items():
            if k in group and not isinstance(group[k], torch.Tensor):
                group[k] = tuple(v) if isinstance(group[k], tuple) else v
    states: dict[str, set[str]] = {}  # parameter name -> its saved state keys ("exp_avg", "step", ...)
    for piece in pieces:
        if piece.startswith("optim/") and piece.endswith("#0"):
            name, key = piece[len("optim/"):-len("#0")].rsplit("/", 1)
            states.setdefault(name, set()).add(key)
    aliases = manifest.get("aliases", {})
    loaded: dict[str, dict[str, Any]] = {}
    for name, p in engine.named_parameters():
        tie = aliases.get(name, name)  # the checkpoint held the tie as one tensor: its state is under that name
        saved_as = next((n for n in (name, tie, *(a for a, b in aliases.items() if b == tie)) if n in states), None)
        if saved_as is None:
            continue
        param_shape = pieces[f"model/{name}#0"]["shape"]
        state = {}
        for key in sorted(states[saved_as]):  # shaped like the parameter: cut like it here; the rest is whole
            shaped = pieces[f"optim/{saved_as}/{key}#0"]["shape"] == param_shape
            layout = engine.layouts.get(name, REPLICATED) if shaped else REPLICATED
            state[key] = mine(f"optim/{saved_as}/{key}", layout).to(p.device)  # a new tensor already
        loaded[name] = state
    engine.load_optimizer_state(optimizer, loaded)


def _check_model(engine: Any, pieces: dict[str, Any], where: Path) -> None:
    """The model's tensors (union over every rank: names, global shapes, dtypes) against the checkpoint's."""
    from fourfold.parallel.tensor.layers import REPLICATED

    mesh = engine.mesh
    mine = {}
    for name, t in engine.local_state_dict().items():
        layout = engine.layouts.get(name, REPLICATED)
        mine[name] = (_global_shape(t.shape, layout, mesh.tp), str(t.dtype).removeprefix("torch."))
    model: dict[str, Any] = {}
    for got in _gather(mine, "checkpoint load: gather the model table"):
        model.update(got)
    saved = {k[len("model/"):-2]: (v["shape"], v["dtype"]) for k, v in pieces.items()
             if k.startswith("model/") and k.endswith("#0")}
    missing = sorted(set(model) - set(saved))
    extra = sorted(set(saved) - set(model))
    differ = sorted(n for n in set(model) & set(saved) if list(model[n][0]) != list(saved[n][0])
                    or model[n][1] != saved[n][1])
    if missing or extra or differ:
        def show(names: list[str]) -> str:
            return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")

        said = [f"missing from the checkpoint: {show(missing)}" if missing else "",
                f"not in the model: {show(extra)}" if extra else "",
                "different: " + ", ".join(f"{n} {saved[n][1]}{saved[n][0]} in the checkpoint, {model[n][1]}"
                                          f"{model[n][0]} in the model" for n in differ[:6])
                + (f" and {len(differ) - 6} more" if len(differ) > 6 else "") if differ else ""]
        raise CheckpointError(f"{where} does not match the model: " + "; ".join(s for s in said if s) +
                              ". Build the model from the checkpoint's config (manifest.json).")
