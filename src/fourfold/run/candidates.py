"""Which candidate layouts ``fourfold train`` itself refuses: the planner's layouts (:mod:`fourfold.plan.layouts`)
passed through train's own checks before launch (:func:`fourfold.run.preflight.preflight`), so the plan never
suggests a layout train refuses."""

from __future__ import annotations

import os
from typing import Any

from fourfold.plan.layouts import layouts_and_why

__all__ = ["runnable", "train_checks", "train_refusals"]


def train_checks(cfg: Any, world_size: int, *, scan_data: bool = True) -> None:
    """Refuse (ValueError: train's own message and fix) what ``fourfold train`` refuses before it launches: the
    same :func:`fourfold.run.preflight.preflight` train calls. The plan writes nothing, so ``--out`` (writable, an
    earlier run's outputs in it) is left to train: here the checks see a fresh directory instead."""
    with _nowhere() as out:
        _preflight(cfg, world_size, out, scan_data=scan_data)


def _nowhere() -> Any:
    """A fresh directory the checks may take for ``--out``, removed after."""
    import tempfile

    return tempfile.TemporaryDirectory(prefix="fourfold-plan-")


def _preflight(cfg: Any, world_size: int, nowhere: str, *, scan_data: bool) -> None:
    from dataclasses import replace

    from fourfold.run.preflight import preflight

    preflight(replace(cfg, output=replace(cfg.output, out=os.path.join(nowhere, "out"))), world_size,
              scan_data=scan_data)


def train_refusals(cfg: Any, candidates: list[Any]) -> dict[Any, str]:
    """{layout: why ``fourfold train`` refuses it} for the ``candidates`` it refuses (a TinyGPT vocabulary tp does
    not divide, --compress int8 with ZeRO, ...): each checked as train checks it, the data not read through."""
    from dataclasses import replace

    refused: dict[Any, str] = {}
    checked: dict[Any, str | None] = {}
    with _nowhere() as out:  # one directory for every candidate's checks
        for layout in candidates:
            try:  # the config's own checks, ZeRO's among them
                parallel = replace(cfg.parallel, dp=layout.dp, tp=layout.tp, pp=layout.pp, schedule=layout.schedule,
                                   microbatches=layout.microbatches, virtual=layout.virtual, zero=layout.zero,
                                   cp=layout.cp, cp_algorithm=layout.cp_algorithm)
            except ValueError as e:
                refused[layout] = str(e)
                continue
            # preflight reads no ZeRO stage; it builds the schedule (most of its time): once per layout besides it
            key = replace(layout, zero=0)
            if key not in checked:
                try:
                    _preflight(replace(cfg, parallel=parallel), layout.world_size, out, scan_data=False)
                    checked[key] = None
                except ValueError as e:
                    checked[key] = str(e)
            why = checked[key]
            if why is not None:
                refused[layout] = why
    return refused


def runnable(cfg: Any, world: int, blocks: int, *, heads: int | None, tensor_plan: bool,
              per_node: int) -> tuple[list[Any], dict[str, str], dict[Any, str]]:
    """(the layouts of ``world`` ranks this model and batch can run, fourfold train's checks passed; {"dpX tpY
    ppZ": why it makes none}; {layout: train's refusal} for the layouts left out by those checks). Context
    parallelism is considered at the sizes dividing ``--cp`` (``fourfold plan --cp 4``: 1, 2 and 4)."""
    cp = cfg.parallel.cp
    candidates, why = layouts_and_why(world, blocks, cfg.train.batch_size, heads=heads, tensor_plan=tensor_plan,
                                       per_node=per_node, cp_sizes=tuple(d for d in range(1, cp + 1) if cp % d == 0))
    refused = train_refusals(cfg, candidates)
    for layout, message in refused.items():
        split = f"dp{layout.dp} tp{layout.tp} pp{layout.pp}" + (f" cp{layout.cp}" if layout.cp > 1 else "")
        if all(c in refused for c in candidates
               if (c.dp, c.tp, c.pp, c.cp) == (layout.dp, layout.tp, layout.pp, layout.cp)):
            why.setdefault(split, f"refused by fourfold train ({message.rstrip('.')})")
    return [c for c in candidates if c not in refused], why, refused
