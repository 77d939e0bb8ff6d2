"""Fit what one process cannot measure from 2-3 real steps of short runs, so that each run's own step comes out.

    runs = measure_runs(calibration_layouts(4), ...)              # fourfold.plan.runs
    profile, links, fitted = calibrate(profile, links, 16, runs)  # then fourfold.plan.predict.predict(...)

:mod:`fourfold.plan.predict` is the model; this module sets its figures (``Links``' β, ``tp_call_s``, ``contention``,
``action_s``, ``send_s``, ``p2p_alpha_s``, ``oversubscribed``, ``wake_s``) from real runs' step times and spans
(docs/simulator.md).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from fourfold.observe.trace import Span, _overlap
from fourfold.plan.predict import Candidate, Links, Measured, ModelProfile, predict

__all__ = ["action_overhead", "calibrate", "message_latency"]


def calibrate(profile: ModelProfile, links: Links, batch_size: int,
              runs: Mapping[Candidate, Measured]) -> tuple[ModelProfile, Links, dict[str, float]]:
    """Fit what one process cannot measure from 2-3 real steps of short runs (:mod:`fourfold.plan.runs`),
    each figure so that its run's own step comes out:

    * a data-parallel run's wait for its gradient sync (``grad_sync`` in its spans, when traced) is the node
      link's β in use; its step over its prediction is the slowdown of compute when ranks share the machine
      (``contention``: memory, caches, the launcher and gloo's threads);
    * a tensor-parallel run's step over its prediction, spread over its collectives, is ``tp_call_s``, what each
      call costs in use (the wait for the slower rank, its dispatch);
    * a pipeline run with a core per rank gives ``action_s`` and ``send_s``, an action's time outside its compute
      and its waits and what a send adds to it, and ``p2p_alpha_s``, a message's latency in use: from a send's
      end to the end of the receive waiting for it (:func:`message_latency`; all read off its spans; without a
      receive that waited, the latency that makes its step come out);
    * a data-parallel run with more ranks than cores gives ``oversubscribed``;
    * a pipeline run with more ranks than cores gives ``wake_s``, the time a stage's message waits for a core on
      the rank it wakes.

    Returns the profile and links with these applied, and the figures."""
    fitted: dict[str, float] = {}
    dp_run = next(((L, m) for L, m in runs.items() if L.dp > 1 and L.tp == L.pp == 1), None)
    if dp_run is not None and dp_run[1].spans:  # the sync is linear in beta: the beta that gives the run's own wait
        waits = [sum(s.duration_s for s in row if s.name == "grad_sync") for row in dp_run[1].spans.values()]
        link = links.node
        p = predict(profile, dp_run[0], links, batch_size)
        doubled = replace(links, node=replace(link, beta_s_per_byte=2 * link.beta_s_per_byte))
        slope = (predict(profile, dp_run[0], doubled, batch_size).dp_exposed_s - p.dp_exposed_s) / link.beta_s_per_byte
        if slope > 0:
            fitted["dp_beta_s_per_byte"] = max(1e-13, link.beta_s_per_byte + (statistics.median(waits)
                                                                              - p.dp_exposed_s) / slope)
            links = replace(links, node=replace(link, beta_s_per_byte=fitted["dp_beta_s_per_byte"],
                                                source=f"{link.source}; beta fitted on {dp_run[0]}"))
    if dp_run is not None:  # its ranks compute at once all step: the step is linear in contention
        p = predict(profile, dp_run[0], replace(links, contention=1.0), batch_size)
        work = p.step_s - p.dp_exposed_s
        # below 1 too: the in-process timing may have run in a slower moment than the run (this VM's speed drifts)
        fitted["contention"] = max(0.05, (dp_run[1].step_s - p.dp_exposed_s) / work)
        links = replace(links, contention=fitted["contention"])
    tp_run = next(((L, m) for L, m in runs.items() if L.tp > 1 and L.dp == L.pp == 1 and not L.sequence_parallel),
                  None)
    if tp_run is not None:
        L, m = tp_run
        p = predict(profile, L, replace(links, tp_call_s=0.0), batch_size)
        calls = sum(profile.forward_collectives) + sum(profile.backward_collectives) + \
            2 * sum(profile.norm_collectives)  # a norm's statistic is a call like any other
        # the step is linear in the cost of a call (one batch, no pipeline): the one that gives the run's own step.
        # Per call, not per ring step: sequence parallelism's halves each cost about what a whole all-reduce does
        fitted["tp_call_s"] = max(0.0, (m.step_s - p.step_s) / calls) if calls else 0.0
        links = replace(links, tp_call_s=fitted["tp_call_s"])
    alone = next(((L, m) for L, m in runs.items() if L.pp > 1 and L.dp == L.tp == 1
                  and (not links.cores or L.world_size <= links.cores)), None)  # a core per rank
    if alone is not None and alone[1].spans:
        fitted["action_s"], fitted["send_s"] = action_overhead(alone[1].spans)
        links = replace(links, action_s=fitted["action_s"], send_s=fitted["send_s"])
    seen = message_latency(alone[1].spans) if alone is not None else None
    if seen is not None:  # read off the run: its step's noise (a slow moment's compute) stays out of it
        fitted["p2p_alpha_s"] = max(0.0, seen[0] - links.node.beta_s_per_byte * seen[1])
    elif alone is not None:  # no message waited for: the latency that gives the run's own step
        fitted["p2p_alpha_s"] = _bisect(lambda a: predict(profile, alone[0], replace(links, p2p_alpha_s=a),
                                                          batch_size).step_s, alone[1].step_s)
    if "p2p_alpha_s" in fitted:
        links = replace(links, p2p_alpha_s=fitted["p2p_alpha_s"])
    crowded = next(((L, m) for L, m in runs.items() if links.cores and L.world_size > links.cores
                    and L.tp == L.pp == 1), None)
    if crowded is not None:  # the step grows with it (compute, optimizer and the sync's bytes all share the cores)
        fitted["oversubscribed"] = 1.0 + _bisect(lambda x: predict(profile, crowded[0], replace(
            links, oversubscribed=1.0 + x), batch_size).step_s, crowded[1].step_s, high=50.0)
        links = replace(links, oversubscribed=fitted["oversubscribed"])
    piped = next(((L, m) for L, m in runs.items() if links.cores and L.world_size > links.cores and L.pp > 1
                  and L.tp == 1), None)  # the step grows with wake_s: the one that gives the run's own step
    if piped is not None:
        fitted["wake_s"] = _bisect(lambda w: predict(profile, piped[0], replace(links, wake_s=w), batch_size).step_s,
                                   piped[1].step_s)
        links = replace(links, wake_s=fitted["wake_s"])
    return profile, links, fitted


def _bisect(step: Any, measured: float, high: float | None = None) -> float:
    """The x in [0, ``high``] (default ``measured``) for which ``step(x)`` (non-decreasing) comes out at
    ``measured``; 0 when even ``step(0)`` is over it."""
    low, high = 0.0, measured if high is None else high
    for _ in range(60):
        mid = (low + high) / 2
        if step(mid) < measured:
            low = mid
        else:
            high = mid
    return low


def action_overhead(spans: Mapping[int, list[Span]]) -> tuple[float, float]:
    """A pipeline action's time outside its compute and its waits, and what sending adds to it, from one step's
    spans: the gap after each F/B/W to the rank's next, less the waits in it; the median gap after the actions
    that send nothing, and the median after those that send (a ``send`` span in the gap) over it. Medians: one
    slow gap (a first message, the scheduler) does not set every action's cost. (0, 0) without actions."""
    quiet: list[float] = []
    sending: list[float] = []
    for row in spans.values():
        actions = sorted((s for s in row if s.kind == "compute" and s.name in ("F", "B", "W")),
                         key=lambda s: s.start_ns)
        waits = [(s.start_ns, s.end_ns) for s in row if s.kind == "wait"]
        sent = [s.start_ns for s in row if s.kind == "comm" and s.name == "send"]
        for a, after in zip(actions, actions[1:], strict=False):
            gap = max(0, after.start_ns - a.end_ns - _overlap((a.end_ns, after.start_ns), waits)) / 1e9
            (sending if any(a.end_ns <= t < after.start_ns for t in sent) else quiet).append(gap)
    base = statistics.median(quiet) if quiet else 0.0
    return base, max(0.0, statistics.median(sending) - base) if sending else 0.0


def message_latency(spans: Mapping[int, list[Span]]) -> tuple[float, int] | None:
    """A pipeline message's time in flight, from one step's spans on one clock: for each receive that waited
    and whose message's send ended meanwhile, from the send's end (the sender's ``isend`` has copied it out) to
    the receive's end. The median seconds and the median message's bytes; None when no receive waited so."""
    sends = {(s.args.get("what"), s.args.get("stage"), s.microbatch): s for row in spans.values() for s in row
             if s.kind == "comm" and s.name == "send"}
    seen: list[tuple[float, int]] = []
    for row in spans.values():
        for r in row:
            if r.kind != "comm" or r.name != "recv" or r.args.get("stage") is None:
                continue
            what, stage = r.args.get("what"), r.args["stage"]
            sent = sends.get((what, stage - 1 if what == "activation" else stage + 1, r.microbatch))
            if sent is not None and r.start_ns <= sent.end_ns <= r.end_ns:
                seen.append(((r.end_ns - sent.end_ns) / 1e9, sent.bytes))
    if not seen:
        return None
    seen.sort()
    return seen[len(seen) // 2]
