"""Step time, bubble, exposed communication and memory of a layout, predicted before it runs.

    costs = measure_units(model, blocks, seq_len=64)      # fourfold.plan.costs: each unit's time
    profile = ModelProfile.of(model, blocks, seq_len=64, shards=shard_plan(model), costs=costs)
    links = Links(node=CostModel.load(), network=CostModel.load(), ranks_per_node=8, cores=2)
    p = predict(profile, Candidate(dp=2, tp=2, pp=2, schedule="1f1b", microbatches=4), links, batch_size=16)
    print(p.step_s, p.bubble, p.dp_exposed_s, max(r.total for r in p.memory))

The model (docs/simulator.md):

* **compute**: each unit of ``[before the blocks, *blocks, after them]`` costs ``fixed + per_sample * b / tp``
  seconds forward and backward for a micro-batch of b samples, timed or counted in FLOPs
  (:mod:`fourfold.plan.costs`). The pipeline cuts the
  units into stages as the runtime does (by parameter count); a split backward gives W the share timed for it.
* **tensor parallelism**: one all-reduce of a block's activation (b x seq x d) per row-parallel or vocabulary
  layer forward and per column-parallel layer (per module holding them, where one f serves them all: a Hugging
  Face family's attention and MLP) or head backward, ring-costed on the node's link; under sequence
  parallelism a reduce-scatter and an all-gather in its place (half the steps and bytes each). Every call costs
  ``Links.tp_call_s`` more; its α steps and that wait without a core, its bytes are copied and added by one.
* **pipeline**: :func:`~fourfold.parallel.schedule.simulate` runs the schedule with every action's own cost
  and one point-to-point message (α + bytes·β) between ranks: the makespan and the bubble.
* **data parallelism**: the rank's gradients in buckets, each a ring all-reduce on the dp group's link
  (ZeRO-1/2 the same bytes as reduce-scatter + all-gather, ZeRO-3 1.5x: the parameters gathered again for
  backward; across nodes the two-level model of :mod:`fourfold.comm.network`, the node's tp groups sharing
  its link); hidden behind the last micro-batch's backward where a core or a device is free to do it,
  exposed otherwise.
* **gradient accumulation** (``Candidate.grad_accum``, no pipeline): the micro-batches' forward and backward one
  after another; dp and ZeRO-1 sync once, ZeRO-2/3 reduce-scatter (ZeRO-3 also gather) every micro-batch, each
  waited before the next.
* **shared cores**: ranks on ``cores`` CPU cores (this machine: 8 ranks on 2) cannot all compute at once: while
  k processes compute, each goes at ``cores / k`` of its speed (over ``oversubscribed``, fitted), event by event
  in the pipeline's simulation, so a bubble on one stage speeds up the others; with more ranks than cores a
  pipeline message waits ``wake_s`` (fitted) for the rank it wakes to get a core. Two or more computing at once
  also go ``contention`` (fitted) times slower than one alone.
* **optimiser**: the rank's elements (/dp under ZeRO) times the measured seconds per element.
* **memory**: :func:`~fourfold.plan.estimate.estimate_memory`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from fourfold.comm.auto import CostModel, cost
from fourfold.comm.auto import predict as allreduce_time
from fourfold.observe.trace import Span
from fourfold.parallel.schedule import Action, pipeline_schedule
from fourfold.parallel.timeline import Timeline, simulate
from fourfold.plan.costs import UnitCosts
from fourfold.plan.estimate import (
    Probe,
    RankMemory,
    _kinds,
    _shard_divisors,
    _units,
    cut_units,
    estimate_memory,
    probe_activations,
    shard_elements,
)

__all__ = ["Candidate", "Links", "Measured", "ModelProfile", "Prediction", "predict"]

@dataclass(frozen=True)
class Links:
    """How ranks talk: ``node`` within a machine, ``network`` between machines (α-β-γ each; one point-to-point
    message costs α + bytes·β); ``cores``: CPU cores the ranks of one machine share (None: a device each)."""

    node: CostModel
    network: CostModel
    ranks_per_node: int
    cores: int | None = None
    oversubscribed: float = 1.0
    """With more ranks computing than ``cores``: how much slower than the cores' fair share each goes (switches,
    and ranks waiting for a peer the scheduler has set aside; fitted by :mod:`~fourfold.plan.calibrate`)."""

    wake_s: float = 0.0
    """With more ranks than ``cores``: the time a pipeline message adds, beyond the link's, before the rank it
    wakes runs (the scheduler has given its core to another rank; fitted by :mod:`~fourfold.plan.calibrate`
    on a crowded pipeline run; see :meth:`wake`)."""

    contention: float = 1.0
    """With several ranks computing at once on one machine: how much slower each goes than one alone (memory
    bandwidth, caches, the launcher and gloo's threads; fitted by :mod:`~fourfold.plan.calibrate` on a
    data-parallel run). One computing alone (a pipeline stage while the other waits in the bubble) goes at its own
    speed."""

    action_s: float = 0.0
    """A pipeline action's own time beyond its compute: the runtime's bookkeeping between actions. It uses a core.
    Measured on a pipeline run's spans by :mod:`~fourfold.plan.calibrate` (its ``action_overhead``)."""

    send_s: float = 0.0
    """What an action that sends to another rank spends on it beyond ``action_s``: gloo's ``isend`` copies the
    message out in the calling thread (~0.2 ms for 128 KB on this VM). It uses a core. A zero-bubble W sends
    nothing; an interleaved schedule sends after every F and B. Measured with ``action_s``."""

    tp_call_s: float = 0.0
    """What each tensor-parallel collective costs beyond its ring steps' α, once per call: the wait for the group's
    slowest rank and the call's own dispatch (no core used). Fitted by :mod:`~fourfold.plan.calibrate` on a
    tensor-parallel run (1.5-2.5 ms a call on this VM, whatever the size: sequence parallelism's reduce-scatter
    and all-gather halves each cost about what one all-reduce does); 0 on paper."""

    p2p_alpha_s: float | None = None
    """A pipeline message's fixed latency within a node, fitted on a pipeline run so that its step comes out. None:
    the node link's α (which :mod:`~fourfold.plan.calibrate` fits to tensor-parallel collectives, waits for
    the slower rank included)."""

    def wake(self, ranks: int) -> float:
        """What a pipeline message adds when ``ranks`` processes share the cores: ``wake_s`` once more ranks than
        cores run (0 while every rank has a core). Not scaled with the crowd: a woken process is run ahead of the
        busy ones, and scaled by ranks/cores - 1 it put 8-rank pipelines at +100..+190 % (docs/simulator.md)."""
        return 0.0 if self.cores is None or ranks <= self.cores else self.wake_s

    def speed(self, computing: int) -> float:
        """The fraction of its own speed each of ``computing`` processes gets on this machine's cores."""
        return 1.0 if computing <= 1 else self.crowding(computing) / self.contention

    def crowding(self, busy: int) -> float:
        """The share of a core each of ``busy`` processes gets: 1 while every one has a core."""
        if self.cores is None or busy <= self.cores:
            return 1.0
        return self.cores / busy / self.oversubscribed


@dataclass(frozen=True)
class Candidate:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual: int = 1
    zero: int = 0
    grad_accum: int = 1
    """Without a pipeline: micro-batches run one after another per step (``--grad-accum``)."""
    sequence_parallel: bool = False
    """Under tp: the norms and residuals on T/tp tokens (``--sequence-parallel``)."""
    cp: int = 1
    """Context parallelism: each sequence over cp ranks (``--cp``), attention by ``cp_algorithm``."""
    cp_algorithm: str = "ring"

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def __str__(self) -> str:
        out = f"dp{self.dp} tp{self.tp} pp{self.pp}" + (f" cp{self.cp} {self.cp_algorithm}" if self.cp > 1 else "")
        if self.pp > 1:
            out += f" {self.schedule} m{self.microbatches}" + (f" v{self.virtual}" if self.virtual > 1 else "")
        out += f" zero{self.zero}" if self.zero else ""
        out += " sp" if self.sequence_parallel else ""
        return out + (f" accum{self.grad_accum}" if self.grad_accum > 1 else "")

    def flags(self) -> list[str]:
        """``fourfold train``'s flags for this layout."""
        out = ["--nproc", str(self.world_size), "--dp", str(self.dp), "--tp", str(self.tp), "--pp", str(self.pp)]
        if self.pp > 1:
            out += ["--schedule", self.schedule, "--microbatches", str(self.microbatches)]
            if self.schedule == "interleaved":
                out += ["--virtual", str(self.virtual)]
        out += ["--zero", str(self.zero)] if self.zero else []
        out += ["--sequence-parallel"] if self.sequence_parallel else []
        out += ["--cp", str(self.cp), "--cp-algorithm", self.cp_algorithm] if self.cp > 1 else []
        return out + (["--grad-accum", str(self.grad_accum)] if self.grad_accum > 1 else [])


@dataclass(frozen=True)
class Prediction:
    """One step of ``layout``, seconds: the whole step, its busiest rank's compute (forward + backward, tensor
    parallelism's all-reduces inside), the pipeline bubble, the gradient sync and the part of it not hidden,
    the optimiser; the memory per pipeline rank; the pipeline's simulated timeline (None without one)."""

    layout: Candidate
    step_s: float
    compute_s: float
    bubble: float
    tp_comm_s: float
    dp_comm_s: float
    dp_exposed_s: float
    optimizer_s: float
    memory: list[RankMemory]
    timeline: Timeline | None = field(default=None, repr=False)
    tails: tuple[tuple[float, float, float], ...] = ()
    """Per pipeline rank: when its last backward ends, its exposed gradient sync, its optimiser step."""
    forward_s: float = 0.0
    """Without a pipeline: the forward's part of the compute."""

    @property
    def peak_bytes(self) -> int:
        return max(r.total for r in self.memory)

    def spans(self, step: int | None = None) -> dict[int, list[Span]]:
        """The predicted step as trace spans from t=0, one row per pipeline rank (its dp x tp copies do the same),
        named as :mod:`fourfold.train`'s trace names them (forward/backward, or the pipeline's F/B/W per
        micro-batch; the gradient sync's exposed part as a ``grad_sync`` wait; ``optimizer``)."""
        def ns(seconds: float) -> int:
            return round(seconds * 1e9)

        out: dict[int, list[Span]] = {}
        for r, (end, exposed, optimizer) in enumerate(self.tails):
            if self.timeline is not None:
                row = [Span(r, "compute", t.action.op, ns(t.start), ns(t.end), microbatch=t.action.microbatch,
                            step=step, args={"stage": t.action.stage}) for t in self.timeline.ranks[r]]
            else:
                row = [Span(r, "compute", "forward", 0, ns(self.forward_s), step=step),
                       Span(r, "compute", "backward", ns(self.forward_s), ns(end), step=step)]
            if exposed:
                row.append(Span(r, "wait", "grad_sync", ns(end), ns(end + exposed), step=step))
            row.append(Span(r, "compute", "optimizer", ns(end + exposed), ns(end + exposed + optimizer), step=step))
            out[r] = row
        return out


@dataclass
class ModelProfile:
    """What :func:`predict` reads from a model: its units' parameters and tensor-parallel layers, one sample's
    activations (:class:`~fourfold.plan.estimate.Probe`) and the units' costs."""

    model: nn.Module
    blocks: list[nn.Module]
    seq_len: int
    shards: Mapping[str, str] | None
    costs: UnitCosts
    probe: Probe
    forward_collectives: tuple[int, ...]
    backward_collectives: tuple[int, ...]
    hidden_bytes: int
    norm_collectives: tuple[int, ...]  # per unit: norms over split features (style "norm"), one all-reduce of a
    # float32 per token each, forward and again backward: latency more than bytes

    @classmethod
    def of(cls, model: nn.Module, blocks: list[nn.Module], seq_len: int, shards: Mapping[str, str] | None,
           costs: UnitCosts, loss_fn: Any = None) -> ModelProfile:
        kinds = _kinds(model, shards)
        in_block = [{id(m) for m in b.modules()} for b in blocks]
        fwd, bwd, norms = [0] * (len(blocks) + 2), [0] * (len(blocks) + 2), [0] * (len(blocks) + 2)
        seen_block = False
        once = _regions_entered_once(model)
        entered: set[str] = set()  # the f before column layers: one per module holding them, where it is shared
        for name, m in model.named_modules():
            u = next((i + 1 for i, ids in enumerate(in_block) if id(m) in ids), None)
            seen_block = seen_block or u is not None
            unit = u if u is not None else (len(blocks) + 1 if seen_block else 0)
            kind = kinds.get(id(m))
            fwd[unit] += kind in ("row", "vocab")
            if kind in ("column", "head"):
                region = name.rpartition(".")[0] if once and u is not None else name
                bwd[unit] += region not in entered
                entered.add(region)
            norms[unit] += kind == "norm"
        probe = probe_activations(model, blocks, seq_len, shards, loss_fn)
        return cls(model, blocks, seq_len, shards, costs, probe, tuple(fwd), tuple(bwd), max(probe.inputs),
                   tuple(norms))


def _regions_entered_once(model: nn.Module) -> bool:
    """Whether tensor parallelism enters each module holding a block's column layers once (one f for q, k and v:
    :func:`~fourfold.parallel.tensor.regions.shard_regions`, the Hugging Face families'), not once per layer."""
    from fourfold.models import family_of

    family = family_of(model)
    return family is not None and family.regions is not None


def _ring(link: CostModel, nbytes: float, itemsize: int, ranks: int, node_size: int | None = None) -> float:
    """One ring all-reduce of ``nbytes`` over ``ranks`` on ``link`` (across nodes of ``node_size`` of them when
    ``link`` knows its ``network``)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return allreduce_time(link, "ring", max(1, int(nbytes) // itemsize), itemsize, ranks, node_size)


def _exposed(sync: float, last: float, backward: float, idle_core: bool) -> float:
    """What a micro-batch's backward cannot hide of its gradient sync: all of it without a core (or device) free
    to run it, else whatever outlasts the backward, and at least the last bucket (full only when backward ends)."""
    return sync if not idle_core else max(last, sync - backward) if sync else 0.0


def _cp_attention(profile: ModelProfile, L: Candidate, links: Links, micro: int, itemsize: int) -> float:
    """Seconds one block's attention waits on the cp group's link per direction (forward or backward): half of
    :func:`fourfold.parallel.context.auto.predict`'s exposed wire time for a call, its q this rank's share of an
    activation over tp and cp (key/value heads taken as many as the query heads). 0 without cp."""
    if L.cp == 1:
        return 0.0
    from fourfold.parallel.context.auto import predict as cp_wire

    link = links.node if L.cp * L.tp <= links.ranks_per_node else links.network
    q = profile.hidden_bytes * micro // L.tp // L.cp
    wire = cp_wire(L.cp_algorithm, L.cp, link, q_bytes=q, kv_bytes=2 * q, grad_kv_bytes=2 * q * max(1, 4 // itemsize),
                   heads=L.cp, kv_heads=L.cp)  # heads stand in: the layouts let Ulysses only where they divide
    return (wire or 0.0) / 2


def _dp_links(links: Links, layout: Candidate) -> tuple[CostModel, int | None]:
    """The link model a data-parallel ring runs on, and the group's ranks per node. Within a node: the node's
    link. Across nodes (ranks are tp innermost, then dp): k = per_node / tp consecutive dp ranks share a node, and
    the node's tp groups all sync at once, so each group's ring gets 1/tp of the node's link (the two-level
    model of :mod:`fourfold.comm.network`: the ring's node-crossing hops decide its steps)."""
    per_node = links.ranks_per_node
    replicas, inner = layout.dp * layout.cp, layout.tp  # dp x cp reduce the gradients; tp innermost
    if replicas * inner <= per_node:
        return links.node, None
    k = max(1, per_node // inner)
    k = k if replicas % k == 0 else 1
    net = links.network
    node = links.node if k > 1 else net
    return CostModel(node.alpha_s, node.beta_s_per_byte, node.gamma_s_per_byte,
                     network=(net.alpha_s, net.beta_s_per_byte * (per_node // k))), k


def predict(profile: ModelProfile, layout: Candidate, links: Links, batch_size: int, *,
            bucket_bytes: int = 25 * 2**20, checkpoint_every: int = 0,
            sequence_parallel: bool = False) -> Prediction:
    """One step of ``layout`` on a global batch of ``batch_size`` samples (see the module docstring).
    ``sequence_parallel``: as ``layout.sequence_parallel`` (either turns it on)."""
    L, n = layout, len(profile.blocks) + 2
    sequence_parallel = sequence_parallel or L.sequence_parallel
    if L.grad_accum < 1 or L.grad_accum > 1 and L.pp > 1:
        raise ValueError(f"grad_accum must be >= 1, and 1 with a pipeline (its micro-batches do that job), got "
                         f"grad_accum={L.grad_accum} for {L}.")
    micro_count = L.microbatches if L.pp > 1 else L.grad_accum
    if batch_size % (L.dp * micro_count):
        raise ValueError(f"batch_size must divide into dp x microbatches, got batch_size={batch_size} for "
                         f"{L} ({L.dp} x {micro_count}). Pass a batch size that is a multiple of {L.dp * micro_count}.")
    micro = batch_size // L.dp // micro_count
    model, units = profile.model, _units(profile.model, profile.blocks)
    divisor = _shard_divisors(model, profile.shards, L.tp)
    itemsize = next(model.parameters()).element_size()

    def elements(params: list[nn.Parameter]) -> int:
        return shard_elements(params, divisor)

    per_unit = [elements(u) for u in units]
    per_node = links.ranks_per_node
    tp_link = links.node if L.tp <= per_node else links.network

    def tp_collective(nbytes: int, size: int, share: float = 1.0) -> tuple[float, float]:
        """(its time, its latency) on the tp group's link, for an all-reduce (``share`` 1) or one of sequence
        parallelism's halves (0.5: a reduce-scatter or an all-gather, half its steps and bytes). The latency (α
        per step, and ``tp_call_s`` per call: the slowest rank's arrival) uses no core; copying and adding the
        bytes does."""
        if L.tp == 1:
            return 0.0, 0.0
        time = _ring(tp_link, nbytes, size, L.tp) * share
        steps = cost("ring", max(1, nbytes // size), size, L.tp).steps * share
        return time + links.tp_call_s, min(time, steps * tp_link.alpha_s) + links.tp_call_s

    # Each row-parallel (vocabulary) layer's forward all-reduce and each column-parallel region's backward one;
    # under sequence parallelism each becomes a reduce-scatter in its direction and an all-gather in the other
    fwd, bwd = profile.forward_collectives, profile.backward_collectives
    by_halves = sequence_parallel and L.tp > 1
    calls = {"F": tuple(f + b for f, b in zip(fwd, bwd, strict=True)) if by_halves else fwd}
    calls["B"] = calls["F"] if by_halves else bwd
    one, latency = tp_collective(profile.hidden_bytes * micro, itemsize, 0.5 if by_halves else 1.0)  # an activation
    statistic, statistic_latency = tp_collective(4 * profile.seq_len * micro, 4)  # a norm's mean square per token
    norms = profile.norm_collectives
    costs = profile.costs

    attention = _cp_attention(profile, L, links, micro, itemsize)  # per block and direction, exposed

    def unit_time(op: str, u: int) -> tuple[float, float]:
        """(computing, waiting) seconds: the unit's own work and its tensor-parallel collectives' bytes moved and
        added, then the collectives' latency (waits on the link and the group's slowest rank: no core used, so
        cores shared do not slow it). Norms over split features all-reduce a statistic forward and backward.
        Under cp a rank computes 1/cp of each sample's tokens (the head-tail cut balances attention too), and a
        block waits for its attention's exposed wire time."""
        collectives, stats = calls[op][u], norms[u]
        block = 0 < u < n - 1
        return (costs.time(op, u, micro, L.tp) / L.cp + collectives * (one - latency)
                + stats * (statistic - statistic_latency),
                collectives * latency + stats * statistic_latency + (attention if block else 0.0))

    def total(op: str, us: Iterable[int]) -> tuple[float, float]:
        parts = [unit_time(op, u) for u in us]
        return sum(c for c, _ in parts), sum(w for _, w in parts)

    tp_comm = micro_count * (one * (sum(calls["F"]) + sum(calls["B"])) + statistic * 2 * sum(norms))
    timeline, copies = None, L.dp * L.tp * L.cp  # processes doing what each pipeline rank does, at the same time
    if L.pp == 1:
        share = links.speed(copies)
        (fc, fw), (bc, bw) = total("F", range(n)), total("B", range(n))
        forward = (fc / share + fw) * micro_count  # accumulation: the micro-batches one after another
        span = forward + (bc / share + bw) * micro_count
        busy, bubble, ends = [span], 0.0, [span]
        held = [elements([p for u in units for p in u])]
        last_backward = [bc + bw]
    else:
        sched = pipeline_schedule("pipeline", L.schedule, L.pp, L.microbatches, L.virtual)
        stages = cut_units(per_unit, sched.stages)
        f = [total("F", us) for us in stages]
        b = [total("B", us) for us in stages]
        b_share, w_share = costs.split_at(micro, L.tp) if sched.split_backward else (1.0, 0.0)

        def action_time(a: Action) -> tuple[float, float]:
            if a.op == "F":
                computing, waiting = f[a.stage]
            else:
                computing, waiting = b[a.stage]  # a split backward's collectives are in B (the input gradient)
                computing, waiting = (computing * b_share, waiting) if a.op == "B" else (computing * w_share, 0.0)
            return computing + links.action_s + (links.send_s if sched.sends(a) else 0.0), waiting

        link = links.node if L.world_size <= per_node else links.network
        alpha = links.p2p_alpha_s if link is links.node and links.p2p_alpha_s is not None else link.alpha_s
        message_bytes = profile.hidden_bytes * micro // (L.tp if sequence_parallel else 1) // L.cp
        message = alpha + link.beta_s_per_byte * message_bytes + links.wake(L.world_size)
        timeline = simulate(sched, comm=message, cost=action_time, speed=lambda k: links.speed(k * copies))
        span, busy, bubble = timeline.makespan, list(timeline.busy), timeline.bubble
        forward, ends = 0.0, [max(t.end for t in row) for row in timeline.ranks]
        mine = [sched.held(r) for r in range(L.pp)]
        held = [elements([p for s in ss for u in stages[s] for p in units[u]]) for ss in mine]
        last_backward = [sum(sum(b[s]) for s in ss) for ss in mine]
    dp_link, dp_node = _dp_links(links, L)
    idle_core = links.cores is None or L.world_size < links.cores
    tails, dp_times = [], []
    # Within a machine a bucket's ring is CPU work (bytes copied and added) beside its latency; every rank syncs at
    # about the same time, so with more ranks than cores each gets its share of them (contention, fitted on a run
    # with a core per rank, is in the link's fitted beta). Between machines the wire decides.
    share = links.crowding(L.world_size) if dp_node is None else 1.0

    replicas = L.dp * L.cp  # the weights' copies, whose gradients the sync reduces

    def ring(size: int) -> float:
        whole = _ring(dp_link, size, itemsize, replicas, dp_node)
        wait = min(whole, cost("ring", max(1, size // itemsize), itemsize, replicas).steps * dp_link.alpha_s)
        return wait + (whole - wait) / share

    # In halves of an all-reduce's bytes: ZeRO's reduce-scatter and all-gather are one each, ZeRO-3 gathers twice
    # (forward, backward). With accumulation ZeRO-2/3 reduce-scatter every micro-batch (ZeRO-3 gathers for each
    # too), each waited before the next begins; plain dp and ZeRO-1 sync once, in the last backward.
    k = L.grad_accum
    halves = {0: (2, 0), 1: (2, 0), 2: (1, 1), 3: (3, 0)}[L.zero]  # (per micro-batch, once per step)
    syncs = k if L.zero in (2, 3) else 1
    for r, elems in enumerate(held):
        nbytes = elems * itemsize
        buckets = [bucket_bytes] * (nbytes // bucket_bytes) + ([nbytes % bucket_bytes] if nbytes % bucket_bytes else [])
        allreduce_s = sum(ring(size) for size in buckets)
        each, own = allreduce_s * halves[0] / 2, allreduce_s * halves[1] / 2  # per sync, once per step
        sync = each * syncs + own
        last = ring(buckets[-1]) if buckets else 0.0
        # at least the last bucket's own sync is exposed: ZeRO-2's reduce-scatter between micro-batches is half
        # of the all-reduce `last` is (the step's last sync adds its all-gather)
        last_each = last / 2 if L.zero == 2 else last
        exposed = ((syncs - 1) * _exposed(each, last_each, last_backward[r], idle_core)
                   + _exposed(each + own, last, last_backward[r], idle_core))
        optimizer = elems / (replicas if L.zero else 1) * costs.optimizer_s_per_element / links.speed(L.world_size)
        dp_times.append((sync, exposed))
        tails.append((ends[r], exposed, optimizer))
    worst = max(range(len(held)), key=lambda r: sum(tails[r]))  # a stage's dp group syncs when its backward ends
    memory = estimate_memory(model, profile.blocks, dp=L.dp, tp=L.tp, pp=L.pp, batch_size=batch_size,
                             microbatches=micro_count, schedule=L.schedule, virtual=L.virtual, zero=L.zero,
                             checkpoint_every=checkpoint_every, sequence_parallel=sequence_parallel,
                             shards=profile.shards, probe=profile.probe, cp=L.cp)
    return Prediction(L, sum(tails[worst]), max(busy), bubble, tp_comm, dp_times[worst][0], dp_times[worst][1],
                      tails[worst][2], memory, timeline, tuple(tails), forward)


@dataclass(frozen=True)
class Measured:
    """What a real run says of one step: its time (the median after the first)."""

    step_s: float
    spans: Mapping[int, list[Span]] = field(default_factory=dict, compare=False, repr=False)
    """The median step's spans per rank, from t=0 (when the run was traced)."""
    stolen: float | None = None
    """The share of the machine's CPU time its hypervisor took during the run (``/proc/stat``), when known."""
