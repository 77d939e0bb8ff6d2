"""Pipeline schedules as data: for every rank, the ordered list of actions ``(stage, op, microbatch)``.

::

    from fourfold.parallel.schedule import make_schedule
    from fourfold.parallel.timeline import peak_in_flight, simulate

    s = make_schedule("1f1b", pp=4, microbatches=8)    # validated on the way out
    print(s)                                            # the rank x time grid, cells like 0F3
    t = simulate(s, f=1.0, b=1.0, w=1.0)                # start/end of every action
    t.bubble, t.bubble_by_rank, peak_in_flight(s)       # 3/11 idle, (3/11,)*4, [4, 3, 2, 1]

Vocabulary. ``pp`` ranks hold ``pp * virtual`` model stages; stage ``s`` lives on rank ``s % pp`` (Megatron's
round robin: rank r holds stages r, r+pp, r+2pp, ...). ``F`` runs a stage forward on one micro-batch; ``B``
runs it backward: the input gradient, and also the weight gradient unless the schedule *splits* backward, in
which case ``W`` computes the weight gradient later (zero bubble). ``str(Action(1, "F", 3)) == "1F3"``.

A :class:`Schedule` holds only the *order* of each rank's work (compact lists, no idle slots). Time is a
consequence of that order and of costs, computed by :func:`~fourfold.parallel.timeline.simulate`: every rank runs its list in order, and an
action starts when the rank is free and its inputs exist (the activation of ``F`` on stage s-1, the gradient
of ``B`` on stage s+1; sends never block, i.e. the runtime uses ``isend``). The same rules, with every action
one time slot, give :func:`format_grid`'s columns and :func:`validate`'s deadlock check, so "valid" means "the
runtime, executing these lists with blocking receives, finishes".

Costs: ``f``, ``b``, ``w`` are the times of forward, input-gradient and weight-gradient work of one micro-batch
through one *rank's* share of the model; a fused ``B`` costs ``b + w`` and a virtual stage ``1/virtual`` of
each (so schedules compare at equal work). ``comm`` is added to every activation or gradient that crosses
ranks. The defaults f = b = w = 1 are the usual rule of thumb (backward = 2 x forward) and ZB-H1's assumption.
"""

from __future__ import annotations

from fourfold.parallel.schedule.named import (
    SCHEDULES,
    gpipe,
    interleaved,
    make_schedule,
    naive,
    one_f_one_b,
    pipeline_schedule,
    zero_bubble,
)
from fourfold.parallel.schedule.order import (
    Action,
    Cost,
    Op,
    Schedule,
    ScheduleError,
    format_grid,
    parse_actions,
    run_order,
    validate,
)

__all__ = [
    "SCHEDULES", "Action", "Cost", "Op", "Schedule", "ScheduleError", "format_grid", "gpipe", "interleaved",
    "make_schedule", "naive", "one_f_one_b", "parse_actions", "pipeline_schedule", "run_order", "validate",
    "zero_bubble",
]
