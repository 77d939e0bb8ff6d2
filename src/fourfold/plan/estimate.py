"""Memory per rank, known before launch: what ``fourfold plan --memory`` prints and every run checks first.

    blocks = list(model.blocks)                                   # engine.pieces.model_blocks(model, split)
    probe = probe_activations(model, blocks, seq_len=64, shards=shard_plan(model))
    rows = estimate_memory(model, blocks, dp=2, tp=2, pp=2, batch_size=16, microbatches=4, schedule="1f1b",
                           zero=1, shards=shard_plan(model), probe=probe)
    print(format_estimate(rows, *per_rank_memory(world_size=8)))

Per rank (one row per pipeline rank: data-parallel replicas and tensor-parallel ranks hold the same amounts):

* **parameters, gradients, optimiser state**: the ZeRO formulas (:func:`~fourfold.observe.memory.estimate_held`)
  on Ψ, this rank's parameter elements. Ψ is counted from the model itself: each parameter's elements, divided
  by tp where the model family's plan shards it (column, row and vocabulary-parallel weights, column biases);
  the blocks cut into ``pp * virtual`` stages as the pipeline cuts them (by parameter count), stage s on
  pipeline rank s mod pp, a tied weight counted on each stage that holds a copy.
* **activations**: one forward of the whole model on one sample (zeros, ``seq_len`` long, on the CPU) records
  the bytes autograd saves inside each block (and, for checkpointed blocks, their input: all they keep). A
  micro-batch of b samples saves b times that (every saved tensor of a transformer grows with the batch); under
  tensor parallelism each rank holds 1/tp of it, but for the column layers' inputs and, without sequence
  parallelism, what a block saves outside its attention and MLP (norms, residuals), which stay whole. Without a pipeline a rank holds one
  forward of its B/dp samples (B/dp/k with k micro-batches of gradient accumulation: ``microbatches`` says k
  there); with one, the schedule's peak of micro-batches in flight on that rank
  (:func:`~fourfold.parallel.schedule.peak_in_flight`: until W for zero-bubble) times its stages' share.

The measured figures (``memory_bytes`` in metrics.jsonl) are within 5 % (held terms) and 15 % (activations) of
these for the layouts in ``tests/test_estimate.py``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fourfold.observe.memory import estimate_held
from fourfold.units import format_bytes

__all__ = ["Probe", "RankMemory", "cut_units", "estimate_memory", "format_estimate", "per_rank_memory",
           "probe_activations", "shard_elements", "suggest"]


@dataclass(frozen=True)
class RankMemory:
    """What one pipeline rank (each of its dp and tp ranks alike) holds at its peak, in bytes."""

    pp_rank: int
    parameters: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations

    def largest(self) -> tuple[str, int]:
        terms = {"parameters": self.parameters, "gradients": self.gradients, "optimiser state": self.optimizer,
                 "activations": self.activations}
        name = max(terms, key=lambda k: terms[k])
        return name, terms[name]


@dataclass(frozen=True)
class Probe:
    """One sample's forward, per unit (``[before the blocks, *blocks, after them]``): bytes saved for backward,
    of which ``whole`` were saved by column-parallel layers (their input, whole on every tp rank) and ``outside``
    by a block outside its tensor-parallel regions (the modules holding its column layers: attention, the MLP),
    which tp leaves whole and sequence parallelism splits (its norms, residuals); the unit's input bytes (what a
    checkpointed unit keeps), and its parametrized layers' output bytes (what zero-bubble keeps from B to W:
    those outputs' gradients), of which ``split_outputs`` are column layers' (split by tp) and
    ``outside_outputs`` replicated layers' in a block outside its regions (its norms: split by sequence
    parallelism); the rest (row layers' and the embedding's, whose gradient W reads whole) stays whole."""

    saved: tuple[int, ...]
    whole: tuple[int, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    outside: tuple[int, ...]
    split_outputs: tuple[int, ...]
    outside_outputs: tuple[int, ...]

    def kept_for_w(self, u: int, tp: int, sequence_parallel: bool) -> int:
        """Unit ``u``'s output gradients one tp rank keeps from B to W for one sample."""
        split, outside = self.split_outputs[u], self.outside_outputs[u]
        whole = self.outputs[u] - split - outside
        return whole + split // tp + (outside // tp if sequence_parallel else outside)

    def per_sample(self, u: int, tp: int, sequence_parallel: bool) -> int:
        """Unit ``u``'s bytes saved on one tp rank for one sample: column layers' inputs whole, and the block's
        work outside its regions whole unless ``sequence_parallel`` splits it; the rest split by tp."""
        whole = self.whole[u] + (0 if sequence_parallel else self.outside[u])
        return whole + (self.saved[u] - whole) // tp


def _units(model: nn.Module, blocks: list[nn.Module]) -> list[list[nn.Parameter]]:
    """The model's parameters by unit: those registered before the first block, each block's, those after."""
    in_block = {id(p) for b in blocks for p in b.parameters()}
    before: list[nn.Parameter] = []
    after: list[nn.Parameter] = []
    seen_block = False
    for _, p in model.named_parameters(remove_duplicate=False):
        if id(p) in in_block:
            seen_block = True
        elif seen_block:
            after.append(p)
        else:
            before.append(p)
    return [before, *(list(b.parameters()) for b in blocks), after]


def _kinds(model: nn.Module, shards: Mapping[str, str] | None) -> dict[int, str]:
    """id(module) -> its tensor-parallel kind (column, row, vocab, head) under ``shards``, the plan as
    :func:`~fourfold.parallel.tensor.plan.expand_plan` reads it (wildcards, Hugging Face's style names)."""
    from fourfold.parallel.tensor.plan import expand_plan

    styles = expand_plan(model, shards) if shards else {}
    return {id(model.get_submodule(name)): style.split(":")[0] for name, style in styles.items()
            if style and style != "partial"}  # partial: left whole


def _shard_divisors(model: nn.Module, shards: Mapping[str, str] | None, tp: int) -> dict[int, int]:
    """id(parameter) -> its tensor-parallel divisor (tp where the plan splits it, else 1): weights of every
    sharded layer, biases of column-parallel ones."""
    if tp == 1:
        return {}
    kinds = _kinds(model, shards)
    return {id(p): tp for module in model.modules() if id(module) in kinds
            for pname, p in module.named_parameters(recurse=False)
            if pname == "weight" or (pname == "bias" and kinds[id(module)] in ("column", "head"))}


def shard_elements(params: list[nn.Parameter], divisor: Mapping[int, int]) -> int:
    """Trainable elements one tensor-parallel rank holds of ``params`` (a tied weight once), ``divisor`` from
    :func:`_shard_divisors`."""
    distinct = {id(p): p for p in params if p.requires_grad}
    return sum(p.numel() // divisor.get(i, 1) for i, p in distinct.items())


def probe_activations(model: nn.Module, blocks: list[nn.Module], seq_len: int,
                      shards: Mapping[str, str] | None = None, loss_fn: Any = None) -> Probe:
    """Run one sample (token 0, ``seq_len`` long) through ``model`` on its device and record, per unit, what
    :class:`Probe` holds (parameters left out; the loss's saved tensors go to the last unit). ``shards``: the
    tensor-parallel plan, to tell which layers are column-parallel."""
    from fourfold.loss import lm_loss
    from fourfold.models.hf import meta_kwargs
    from fourfold.parallel.pipeline.blocks import output_tensor

    device = next(model.parameters()).device
    meta = device.type == "meta"  # shapes only (a model too big to build): every storage is at address 0, but
    # a storage keeps one Python object, so its id tells storages apart while the graph holds them

    def key_of(t: torch.Tensor) -> int:
        return id(t.untyped_storage()) if meta else t.untyped_storage().data_ptr()

    params = {key_of(p) for p in model.parameters()}
    n = len(blocks) + 2
    saved, whole, inputs, outputs, outside, split_outputs, outside_outputs = ([0] * n for _ in range(7))
    unit = [0]
    stack: list[bool] = []  # per module entered: is it column-parallel (its saved input stays whole)?
    seen: set[int] = set()
    kinds = _kinds(model, shards)
    column = {i for i, kind in kinds.items() if kind in ("column", "head")}
    regions = _regions(blocks, column)
    depth = [0]  # regions entered

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = key_of(t)
        if key not in params and key not in seen:
            seen.add(key)
            nbytes = t.untyped_storage().nbytes()
            saved[unit[0]] += nbytes
            if stack and stack[-1]:
                whole[unit[0]] += nbytes
            elif regions and 0 < unit[0] < n - 1 and not depth[0]:
                outside[unit[0]] += nbytes
        return t

    def enter(module: nn.Module, args: Any) -> None:
        stack.append(id(module) in column)
        depth[0] += id(module) in regions

    def leave(module: nn.Module, args: Any, out: Any) -> None:
        stack.pop()
        depth[0] -= id(module) in regions
        if isinstance(out, torch.Tensor) and next(module.parameters(recurse=False), None) is not None:
            nbytes = out.numel() * out.element_size()
            outputs[unit[0]] += nbytes
            if id(module) in column:
                split_outputs[unit[0]] += nbytes
            elif id(module) not in kinds and regions and 0 < unit[0] < n - 1 and not depth[0]:
                outside_outputs[unit[0]] += nbytes

    handles = []
    for module in model.modules():
        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    for i, block in enumerate(blocks, start=1):
        def into(module: nn.Module, args: Any, i: int = i) -> None:
            unit[0] = i
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if first is not None:
                inputs[i] = first.numel() * first.element_size()

        def out_of(module: nn.Module, args: Any, out: Any) -> None:
            unit[0] = n - 1  # after a block, the rest belongs to what follows it (the last unit at the end)

        handles += [block.register_forward_pre_hook(into), block.register_forward_hook(out_of)]
    x = torch.zeros(1, seq_len, dtype=torch.long, device=device)
    was = model.training
    model.train()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                _fused_attention_on_meta() if meta else contextlib.nullcontext():
            out = output_tensor(model(x, **meta_kwargs(model, x)))
            (loss_fn or lm_loss)(out, torch.zeros(1, seq_len, dtype=torch.long, device=device))
    finally:
        model.train(was)
        for h in handles:
            h.remove()
    return Probe(tuple(saved), tuple(whole), tuple(inputs), tuple(outputs), tuple(outside), tuple(split_outputs),
                 tuple(outside_outputs))


def _regions(blocks: list[nn.Module], column: set[int]) -> set[int]:
    """id() of each block's tensor-parallel regions (:func:`~fourfold.parallel.tensor.regions.holders`); none when
    a column layer is a block's own (nothing then counts as outside them)."""
    from fourfold.parallel.tensor.regions import holders

    out: set[int] = set()
    for block in blocks:
        regions, direct = holders(block, lambda m: id(m) in column)
        if direct is not None:
            return set()
        out |= {id(r) for r in regions.values()}
    return out


class _FusedAttention(torch.autograd.Function):
    """On the meta device, what a fused attention kernel keeps for backward: q, k, v, the output and a float32
    log-sum-exp per query (the CPU's flash kernel; CUDA's flash and memory-efficient ones). On meta, torch runs
    SDPA in its decomposed form, which keeps the (T, T) probabilities of every head: 15-30 % more than the real
    kernel on tiny models, and growing with T^2 (3.6x at T = 2048). With it, a meta probe of the tiny models of
    the tests is within -4..+10 % of the real one (a Hugging Face model on meta is given a mask, so it expands
    grouped-query keys and values itself, which the real one leaves to the kernel: the +10 %)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        raise RuntimeError("the meta device's attention stand-in only counts what a forward keeps")


@contextlib.contextmanager
def _fused_attention_on_meta() -> Iterator[None]:
    """``F.scaled_dot_product_attention`` on meta tensors keeps what the fused kernel keeps (:class:`_FusedAttention`;
    grouped-query attention's keys and values as given, as the kernel keeps them); elsewhere it is torch's own."""
    original = F.scaled_dot_product_attention

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not q.is_meta:
            return original(q, k, v, *args, **kwargs)
        out: torch.Tensor = _FusedAttention.apply(q, k, v)
        return out

    F.scaled_dot_product_attention = attention  # type: ignore[assignment]
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original  # type: ignore[assignment]


def _peak(actions: Any, act: dict[int, int], extra: dict[int, int], split: bool) -> int:
    """Bytes held at the peak of one rank's action list: F adds the stage's activations, B frees them (or, split,
    adds the output gradients kept for W), W frees both."""
    held = peak = 0
    for a in actions:
        if a.op == "F":
            held += act[a.stage]
        elif a.op == "B":
            held += extra[a.stage] if split else -act[a.stage]
        else:
            held -= act[a.stage] + extra[a.stage]
        peak = max(peak, held)
    return peak


def cut_units(elements: list[int], stages: int) -> list[list[int]]:
    """The units ``[before, *blocks, after]`` (their parameter elements) each pipeline stage holds, cut as the
    pipeline cuts them: by parameter count, empty end units joining their neighbours."""
    from fourfold.parallel.pipeline.split import partition

    n = len(elements)
    pieces = [u for u in range(n) if elements[u] or 0 < u < n - 1]
    starts = partition([elements[u] for u in pieces], stages)
    ends = (*starts[1:], len(pieces))
    out = [pieces[a:b] for a, b in zip(starts, ends, strict=True)]
    if pieces[0] != 0:
        out[0] = [0, *out[0]]
    if pieces[-1] != n - 1:
        out[-1] = [*out[-1], n - 1]
    return out


def estimate_memory(model: nn.Module, blocks: list[nn.Module], *, dp: int = 1, tp: int = 1, pp: int = 1,
                    batch_size: int, microbatches: int = 1, schedule: str = "1f1b", virtual: int = 2,
                    strategy: str = "pipeline", zero: int = 0, checkpoint_every: int = 0,
                    sequence_parallel: bool = False, shards: Mapping[str, str] | None = None,
                    probe: Probe | None = None,
                    optimizer_slots: int = 2, cp: int = 1) -> list[RankMemory]:
    """One :class:`RankMemory` per pipeline rank for this layout (see the module docstring). ``cp``: each
    sequence cut over cp ranks, so a sample's activations are 1/cp of the probe's per rank, and the weights are
    replicated (ZeRO: sharded) over dp x cp."""
    from fourfold.parallel.schedule import pipeline_schedule

    units = _units(model, blocks)
    divisor = _shard_divisors(model, shards, tp)
    first = next(model.parameters())
    itemsize = first.element_size()

    def numel(params: list[nn.Parameter]) -> int:
        return shard_elements(params, divisor)

    n = len(units)
    checkpointed = {1 + i for i in range(len(blocks)) if checkpoint_every and i % checkpoint_every == 0}
    per_sample = [0] * n
    kept_for_w = [0] * n
    if probe is not None:  # under tp: column layers' inputs, and without sequence parallelism norms, whole
        per_sample = [(probe.inputs[u] // (tp if sequence_parallel else 1) if u in checkpointed else
                       probe.per_sample(u, tp, sequence_parallel)) // cp for u in range(n)]
        kept_for_w = [probe.kept_for_w(u, tp, sequence_parallel) // cp for u in range(n)]
    rows = []
    if pp == 1:
        held = estimate_held(numel([p for u in units for p in u]), itemsize, dp=dp * cp, zero=zero,
                             optimizer_slots=optimizer_slots)
        rows.append(RankMemory(0, held["parameters"], held["gradients"], held["optimizer"],  # one micro-batch of
                               sum(per_sample) * (batch_size // dp // microbatches)))  # gradient accumulation
        return rows
    sched = pipeline_schedule(strategy, schedule, pp, microbatches, virtual)
    stage_units = cut_units([numel(u) for u in units], sched.stages)
    micro = batch_size // dp // sched.microbatches  # model parallelism: one, whatever microbatches says
    act = {s: sum(per_sample[u] for u in stage_units[s]) * micro for s in range(sched.stages)}
    extra = {s: sum(kept_for_w[u] for u in stage_units[s]) * micro for s in range(sched.stages)}
    for r in range(pp):
        mine = sched.held(r)
        elements = sum(numel([p for u in stage_units[s] for p in units[u]]) for s in mine)
        held = estimate_held(elements, itemsize, dp=dp * cp, zero=zero, optimizer_slots=optimizer_slots)
        activations = _peak(sched.ranks[r], act, extra, sched.split_backward)
        rows.append(RankMemory(r, held["parameters"], held["gradients"], held["optimizer"], activations))
    return rows


def per_rank_memory(world_size: int, device: str = "cpu") -> tuple[int, str]:
    """(bytes each rank may use, where that figure came from): a GPU's total memory, or the machine's available
    memory (``MemAvailable``) shared by its ranks."""
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, "the GPU's memory"
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return available // world_size, f"the machine's available memory / {world_size} rank(s)"


def format_estimate(rows: list[RankMemory], available: int | None = None, where: str = "") -> str:
    """The table ``fourfold plan --memory`` prints: one row per pipeline rank."""
    lines = [f"  {'pp rank':>7}  {'parameters':>11}  {'gradients':>10}  {'optimiser':>10}  {'activations':>11}  "
             f"{'total':>10}"]
    for r in rows:
        lines.append(f"  {r.pp_rank:>7}  {format_bytes(r.parameters):>11}  {format_bytes(r.gradients):>10}  "
                     f"{format_bytes(r.optimizer):>10}  {format_bytes(r.activations):>11}  {format_bytes(r.total):>10}")
    if available is not None:
        worst = max(rows, key=lambda r: r.total)
        verdict = "fits" if worst.total <= available else "does NOT fit"
        lines.append(f"  largest rank: {format_bytes(worst.total)} of {format_bytes(available)} ({where}): {verdict}")
    return "\n".join(lines)


def suggest(estimate: Any, available: int, options: dict[str, Any], *, sequence_parallel: bool = False) -> str:
    """The cheapest change to ``options`` (estimate_memory's keyword arguments) that fits ``available``, in
    order of what it costs: a higher ZeRO stage (communication only), sequence parallelism under tp where the
    model runs it (``sequence_parallel``: the bytes tp moves anyway, in twice the collectives), activation
    checkpointing (one more forward), more micro-batches (a smaller micro-batch: the pipeline's, or gradient
    accumulation's), a smaller batch; else more tensor/pipeline ranks."""
    tries: list[tuple[str, dict[str, Any]]] = []
    if options.get("dp", 1) > 1:
        tries += [(f"--zero {z}", {"zero": z}) for z in range(options.get("zero", 0) + 1, 4)]
    if sequence_parallel and options.get("tp", 1) > 1 and not options.get("sequence_parallel"):
        tries.append(("--sequence-parallel", {"sequence_parallel": True}))
    if not options.get("checkpoint_every"):
        tries.append(("--activation-checkpointing full", {"checkpoint_every": 1}))
    m = options.get("microbatches", 1)  # without a pipeline: gradient accumulation's
    per = options["batch_size"] // options.get("dp", 1)
    flag = "--microbatches" if options.get("pp", 1) > 1 else "--grad-accum"
    if not (options.get("pp", 1) > 1 and options.get("strategy") == "model"):  # model parallelism runs one
        tries += [(f"{flag} {k}", {"microbatches": k}) for k in (2 * m, 4 * m) if per % k == 0]
    b = options["batch_size"]
    tries += [(f"--batch-size {b // k}", {"batch_size": b // k}) for k in (2, 4)
              if b // k >= options.get("dp", 1) and (b // k) % options.get("dp", 1) == 0]

    def fits(change: dict[str, Any]) -> int | None:
        worst = max(r.total for r in estimate({**options, **change}))
        return worst if worst <= available else None

    for label, change in tries:  # one change alone, cheapest first
        worst = fits(change)
        if worst is not None:
            return f"{label} (largest rank then {format_bytes(worst)})"
    labels: list[str] = []
    together: dict[str, Any] = {}
    for label, change in tries:  # then together, each kind at its strongest, in the same order
        key = next(iter(change))
        if key in together:
            labels = [lab for lab in labels if not lab.startswith(label.split()[0])]
        labels.append(label)
        together.update(change)
        worst = fits(together)
        if worst is not None:
            return f"{' '.join(labels)} (largest rank then {format_bytes(worst)})"
    return "more devices: a larger --tp or --pp (each rank then holds a smaller share of the model)"

