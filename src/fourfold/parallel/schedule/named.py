"""The named schedules, each written once as the per-rank lists it produces: naive (model parallelism), GPipe,
1F1B, interleaved 1F1B and zero bubble (ZB-H1); :func:`make_schedule` picks one by name and validates it."""

from __future__ import annotations

import difflib
from collections.abc import Callable

from fourfold.parallel.schedule.order import _FB, Action, Op, Schedule, _check_sizes, _inputs, validate

__all__ = ["SCHEDULES", "gpipe", "interleaved", "make_schedule", "naive", "one_f_one_b", "pipeline_schedule",
           "zero_bubble"]


def _one_stage_per_rank(name: str, pp: int, microbatches: int, virtual: int) -> None:
    _check_sizes(name, pp, microbatches, virtual)
    if virtual != 1:
        raise ValueError(f"{name} runs one stage per rank, got virtual={virtual} with pp={pp}: "
                         "use virtual=1, or the interleaved schedule for virtual stages.")


def naive(pp: int, microbatches: int, virtual: int = 1) -> Schedule:
    """Model parallelism: each micro-batch goes all the way forward and back before the next one starts."""
    _one_stage_per_rank("naive", pp, microbatches, virtual)
    ranks = tuple(tuple(Action(r, op, i) for i in range(microbatches) for op in _FB) for r in range(pp))
    return Schedule("naive", pp, microbatches, 1, ranks)


def gpipe(pp: int, microbatches: int, virtual: int = 1) -> Schedule:
    """GPipe (Huang et al. 2019): every micro-batch forward, then every micro-batch backward."""
    _one_stage_per_rank("gpipe", pp, microbatches, virtual)
    ranks = tuple(tuple(Action(r, op, i) for op in _FB for i in range(microbatches)) for r in range(pp))
    return Schedule("gpipe", pp, microbatches, 1, ranks)


def _warmup_steady_cooldown(pp: int, microbatches: int, virtual: int, rank: int,
                            warmup: int) -> tuple[Action, ...]:
    """``warmup`` forwards, then forward/backward pairs, then the backwards left: 1F1B and its interleaving.

    The k-th forward on a rank takes micro-batches in groups of pp through chunk 0, then the same group through
    chunk 1, ...; the k-th backward walks the chunks the other way (Narayanan et al. 2021). With virtual=1
    both are simply micro-batch k.
    """
    total = microbatches * virtual

    def at(k: int, op: Op) -> Action:
        chunk = (k // pp) % virtual
        if op == "B":
            chunk = virtual - 1 - chunk
        return Action(chunk * pp + rank, op, k // (pp * virtual) * pp + k % pp)

    order = [at(k, "F") for k in range(warmup)]
    for k in range(total - warmup):  # steady state: one forward, one backward
        order += [at(warmup + k, "F"), at(k, "B")]
    return tuple(order + [at(k, "B") for k in range(total - warmup, total)])


def one_f_one_b(pp: int, microbatches: int, virtual: int = 1) -> Schedule:
    """PipeDream-Flush 1F1B (Narayanan et al. 2021): pp-1-r warm-up forwards, then alternate F and B.

    A rank never holds more than pp-r micro-batches' activations, where GPipe holds all of them; the bubble
    is GPipe's. Allowed with fewer micro-batches than ranks, where it degenerates: the first pp-m ranks run
    out of forwards while warming up (GPipe's order) and the bubble (p-1)/(m+p-1) is most of the step.
    """
    _one_stage_per_rank("1f1b", pp, microbatches, virtual)
    ranks = tuple(_warmup_steady_cooldown(pp, microbatches, 1, r, min(pp - 1 - r, microbatches))
                  for r in range(pp))
    return Schedule("1f1b", pp, microbatches, 1, ranks)


def interleaved(pp: int, microbatches: int, virtual: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021): each rank holds ``virtual`` non-adjacent stages.

    A micro-batch crosses every rank ``virtual`` times in stages 1/virtual as long, so the fill and drain
    shrink by that factor, for ``virtual`` times more messages. Rank r warms up with 2(pp-1-r) + (v-1)pp
    forwards: (v-1)pp so its first backward's stage exists, and twice 1F1B's pp-1-r so that a message's
    round trip (comm > 0) does not stall the steady state. Megatron warms up fully when microbatches == pp;
    simulating both shows no gain, so this keeps the lower memory.
    """
    _check_sizes("interleaved", pp, microbatches, virtual)
    if virtual < 2:
        raise ValueError(f"interleaved needs virtual >= 2 stages per rank, got virtual={virtual} with pp={pp}: "
                         "pass virtual=2 or more, or use 1f1b (which is the one-stage case).")
    if microbatches % pp:
        low, high = microbatches // pp * pp, (microbatches // pp + 1) * pp
        fix = f"{low} or {high}" if low else f"{high}"
        raise ValueError(f"interleaved needs microbatches divisible by pp, got microbatches={microbatches} and "
                         f"pp={pp}: use {fix} micro-batches.")
    total = microbatches * virtual
    ranks = tuple(_warmup_steady_cooldown(pp, microbatches, virtual, r,
                                          min(total, 2 * (pp - 1 - r) + (virtual - 1) * pp)) for r in range(pp))
    return Schedule("interleaved", pp, microbatches, virtual, ranks)


def zero_bubble(pp: int, microbatches: int, virtual: int = 1) -> Schedule:
    """ZB-H1 (Qi et al. 2023): 1F1B's order of F and B, with B the input gradient only and W placed later.

    Gradients travel back after B alone, so the drain is shorter; each W (weight gradient, needed by no other
    rank) waits until its rank would otherwise idle. F and B keep 1F1B's order, so at most pp-r micro-batches
    are between F and B on rank r, as in 1F1B; and a rank starts no F while pp micro-batches are between F and
    W, so counted until W (what W still needs: layer inputs and output gradients) the peak is 1F1B's pp too.
    W is placed by running the schedule with F = B = W = one slot, the paper's assumption; each rank then
    idles (p-1)(f+b-w) for any costs with w <= min(f, b) and m >= p.
    """
    _one_stage_per_rank("zb", pp, microbatches, virtual)
    order = one_f_one_b(pp, microbatches).ranks
    done: dict[tuple[int, str, int], int] = {}  # (stage, op, microbatch) -> slot it ended in
    out: list[list[Action]] = [[] for _ in range(pp)]
    pos, held = [0] * pp, [0] * pp  # next F/B in 1F1B's order; micro-batches between F and W
    waiting: list[list[int]] = [[] for _ in range(pp)]  # micro-batches whose B ran and W did not
    t = 0
    while any(pos[r] < len(order[r]) or waiting[r] for r in range(pp)):
        for r in range(pp):
            nxt = order[r][pos[r]] if pos[r] < len(order[r]) else None
            if nxt is not None and (nxt.op == "B" or held[r] < pp) and _ready(nxt, pp, done, t):
                action, pos[r] = nxt, pos[r] + 1
                if nxt.op == "B":
                    waiting[r].append(nxt.microbatch)
            elif waiting[r]:  # nothing else can start now: fill the slot with the oldest weight gradient
                action = Action(r, "W", waiting[r].pop(0))
            else:
                continue
            out[r].append(action)
            held[r] += {"F": 1, "W": -1}.get(action.op, 0)
            done[(action.stage, action.op, action.microbatch)] = t + 1
        t += 1
    return Schedule("zb", pp, microbatches, 1, tuple(map(tuple, out)), split_backward=True)


def _ready(a: Action, stages: int, done: dict[tuple[int, str, int], int], t: int) -> bool:
    return all(done.get(key, t + 1) <= t for key, _ in _inputs(a, stages))


SCHEDULES: dict[str, Callable[[int, int, int], Schedule]] = {
    "naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zb": zero_bubble,
}


def pipeline_schedule(strategy: str, schedule: str, pp: int, microbatches: int, virtual: int = 2) -> Schedule:
    """The schedule a layout runs: ``strategy="model"`` is model parallelism (``naive``, one micro-batch);
    otherwise ``schedule`` over ``microbatches``, with ``virtual`` stages per rank for ``interleaved`` only."""
    if strategy == "model":
        return make_schedule("naive", pp, 1)
    return make_schedule(schedule, pp, microbatches, virtual if schedule == "interleaved" else 1)


def make_schedule(name: str, pp: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The named schedule, validated; refuses unknown names with the nearest one."""
    if name not in SCHEDULES:
        near = difflib.get_close_matches(name, SCHEDULES, n=1)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {name!r}.{hint}")
    schedule = SCHEDULES[name](pp, microbatches, virtual)
    validate(schedule)
    return schedule
