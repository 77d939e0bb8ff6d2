"""``fourfold plan`` without ``--memory``: every layout of the model that fourfold train would run, ranked by
its predicted step time, on paper (``--gpus``) or on this machine (``--nproc``, ``--lab``); the first printed
as a command that runs as it stands. :mod:`fourfold.cli.plan` is the command; its docstring the user's guide.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fourfold.config import Config
    from fourfold.plan.predict import Links
    from fourfold.plan.runs import LabShape

from fourfold.plan.layouts import (
    cannot_run,
    model_heads,
    none_runs,
    rank_layouts,
    uneven_machines,
)
from fourfold.run.candidates import runnable
from fourfold.run.fits import (
    WHOLE_MODEL_TIMES,
    per_rank_budget,
    too_big_here,
)

__all__ = ["PAPER_FLAGS", "RANKING_FLAGS", "rank"]


def _fits_whole_here(cfg: Any) -> None:
    """Refuse to time a model's units on this machine (the whole model trained a few steps in one process:
    parameters, gradients, AdamW's two moments, activations) where that would not fit the memory available:
    built for real, it would be killed by the kernel, with no word."""
    from fourfold.units import format_bytes

    too_big = too_big_here(cfg, WHOLE_MODEL_TIMES.train)
    if too_big is not None:
        _, held, available = too_big
        raise ValueError(f"timing the model's units here trains it whole in this process, got {format_bytes(held)} "
                         f"of parameters (with gradients and AdamW's two moments, about "
                         f"{format_bytes(WHOLE_MODEL_TIMES.train * held)}) against the {format_bytes(available)} this "
                         "machine has available. Plan it on paper, its units' times from their FLOPs: --gpus N "
                         "(with --gpu-mem, --link), or size the model down with --model-config.")


def rank(argv: list[str]) -> int:
    """``fourfold plan [--gpus N] ...``: print the ranking; the exit status (2: bad flags, 1: none fits)."""
    import argparse

    from fourfold.engine.parallelize import model_blocks
    from fourfold.models import family_of, shard_plan, split_of
    from fourfold.plan.costs import flop_units, measure_units
    from fourfold.plan.predict import ModelProfile
    from fourfold.train import parse_args

    parser = argparse.ArgumentParser(prog="fourfold plan", add_help=False)
    for flag, options in RANKING_FLAGS.items():
        parser.add_argument(flag, **options)
    ns, rest = parser.parse_known_args(_negative_values_joined(argv))
    paper = ns.gpus is not None
    given = {a.split("=", 1)[0] for a in argv}
    try:
        _refuse_unread(ns, given, paper)
        cfg = parse_args(rest)
        world = ns.gpus if paper else cfg.launch.world_size
        t = cfg.train
        p = cfg.parallel
        if p.grad_accum > 1:
            raise ValueError(f"the ranking chooses gradient accumulation itself (the fewest micro-batches that fit, "
                             f"for a layout without a pipeline that does not fit without it), got --grad-accum "
                             f"{p.grad_accum}. Drop it; fourfold plan --memory --grad-accum {p.grad_accum} ... shows "
                             "what it saves on one layout.")
        model, links, available, where, lab = _devices(ns, cfg, paper, world)
        family = family_of(model)
        blocks = model_blocks(model, split_of(model, family))
        shards = shard_plan(model)
        heads, tensor_plan = model_heads(model), bool(shards)

        def runs_some(g: int, c: Any) -> bool:
            """Whether ``c`` can run some layout of ``g`` devices (on whole machines, or a lab's whole nodes)."""
            if paper and g > ns.gpus_per_node and g % ns.gpus_per_node or ns.lab is not None and g % ns.lab:
                return False
            per_node = ns.gpus_per_node if paper else g // ns.lab if ns.lab is not None else g
            return bool(runnable(c, g, len(blocks), heads=heads, tensor_plan=tensor_plan, per_node=per_node)[0])

        candidates, why, refused = runnable(cfg, world, len(blocks), heads=heads, tensor_plan=tensor_plan,
                                             per_node=links.ranks_per_node)
        if not candidates:
            raise ValueError(none_runs(cfg, world, "--gpus" if paper else "--nproc", "GPUs" if paper else "ranks",
                                        why, runs_some))
        # sequence parallelism: where asked for, on every layout with tp; else tried where one does not fit
        splits_sequence = family is not None and family.splits_sequence
        if p.sequence_parallel:
            candidates = [replace(c, sequence_parallel=c.tp > 1 and cfg.model.seq_len % c.tp == 0)
                          for c in candidates]
        seq = cfg.model.seq_len
        samples = (1, max(2, t.batch_size // max(1, world)))
        costs = (flop_units(model, blocks, seq, ns.gpu_flops * ns.mfu) if paper else
                 measure_units(model, blocks, seq, samples=samples))
        profile = ModelProfile.of(model, blocks, seq, shards, costs)
    except ValueError as e:
        print(f"fourfold plan: error: {e}", file=sys.stderr)
        return 2
    if ns.calibrate:
        try:
            profile, links = _calibrated(profile, links, rest, t.batch_size, len(blocks), tensor_plan, heads, samples)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"fourfold plan: error: a calibration run failed: {e}", file=sys.stderr)
            return 1
    ranked = rank_layouts(profile, candidates, links, t.batch_size, available, sequence_parallel=splits_sequence)
    return _report(ranked, candidates, refused, profile, links, model, cfg, ns, rest, world, available, where, lab)


def _refuse_unread(ns: Any, given: set[str], paper: bool) -> None:
    """Refuse plan flags that contradict each other or that nothing would read, before anything is built."""
    if paper and ns.lab is not None:
        raise ValueError("--lab plans for a lab on this machine and --gpus on paper; drop one of them.")
    if paper and ns.calibrate:
        raise ValueError("--calibrate fits the model to short runs on this machine; with --gpus (on paper) there "
                         "is nothing to run. Drop one of them.")
    unread = [] if paper else [f for f in PAPER_ONLY if f in given]
    if unread:
        raise ValueError(f"{', '.join(unread)} describe{'s' if len(unread) == 1 else ''} the devices of a plan on "
                         f"paper, got {'it' if len(unread) == 1 else 'them'} without --gpus: nothing would read "
                         f"{'it' if len(unread) == 1 else 'them'}. Pass --gpus N, or drop {', '.join(unread)}.")
    if not paper and ns.lab is None and "--link" in given:
        raise ValueError("--link is the link between machines on paper (--gpus N) or between a lab's nodes (--lab "
                         "N), got it with neither: nothing would read it (this machine's links come from its "
                         "fitted cost model). Pass --gpus N or --lab N, or drop --link.")
    if paper and (ns.gpus < 1 or ns.gpus_per_node < 1 or not 0 < ns.mfu <= 1 or ns.top < 1):
        raise ValueError(f"--gpus and --gpus-per-node must be >= 1, --mfu in (0, 1], --top >= 1, got --gpus "
                         f"{ns.gpus}, --gpus-per-node {ns.gpus_per_node}, --mfu {ns.mfu}, --top {ns.top}.")
    if paper and ns.gpus > ns.gpus_per_node and ns.gpus % ns.gpus_per_node:
        raise ValueError(uneven_machines(ns.gpus, ns.gpus_per_node))


def _devices(ns: Any, cfg: Config, paper: bool, world: int) -> tuple[Any, Links, int, str, LabShape | None]:
    """The model to rank (on meta on paper), the links between ranks, each rank's memory budget and where it
    comes from, and the lab's shape under --lab."""
    import torch

    from fourfold.comm.auto import CostModel
    from fourfold.lab.net import parse_rate, rate_words
    from fourfold.models.build import build_model
    from fourfold.plan.predict import Links
    from fourfold.plan.runs import LabShape
    from fourfold.units import parse_bytes

    t = cfg.train
    lab: LabShape | None = None
    if paper:
        def link(text: str) -> CostModel:
            bits = parse_rate(text, most=1e13)
            return CostModel(ns.latency, 8 / bits, 0.0, f"{rate_words(text, bits)}, {ns.latency * 1e6:g} us")
        ns.link = ns.link or "400gbit"
        links = Links(node=link(ns.node_link or ns.link), network=link(ns.link), ranks_per_node=ns.gpus_per_node)
        if ns.gpu_mem:
            available, where = parse_bytes(ns.gpu_mem, what="--gpu-mem", unit=True), "--gpu-mem"
            if available <= 0:
                raise ValueError(f"--gpu-mem must be more than 0 bytes, got {ns.gpu_mem!r}. Pass a device's "
                                 "memory, like 80GB.")
        else:
            available = parse_bytes(t.memory_limit or "80GB")
            where = "--memory-limit" if t.memory_limit else "80GB (default)"
        if t.model == "tinygpt":  # builds shapes only on meta (its initialisation reads no data)
            model = build_model(cfg, device="meta")
        else:
            with torch.device("meta"):  # any size: nothing is allocated
                model = build_model(cfg, device="meta")
    else:
        _fits_whole_here(cfg)  # its units are timed here, on the whole model in this one process
        model = build_model(cfg, weights=False)
        cost_model = CostModel.load()
        links = Links(cost_model, cost_model, ranks_per_node=world, cores=os.cpu_count() or 1)
        if ns.lab is not None:  # below, too: the first layout's command is the lab's own
            if ns.lab < 1 or world % ns.lab:
                raise ValueError(f"--lab must be a number of nodes that divides --nproc, got --lab {ns.lab} for "
                                 f"--nproc {world}.")
            lab = LabShape(world // ns.lab, ns.link or "1gbit", ns.tcp)
            links = lab.links(links, nodes=ns.lab)
        available, where = per_rank_budget(cfg, world)
    return model, links, available, where, lab


def _report(ranked: list[Any], candidates: list[Any], refused: dict[Any, str], profile: Any, links: Links,
            model: Any, cfg: Config, ns: Any, rest: list[str], world: int, available: int, where: str,
            lab: LabShape | None) -> int:
    """Print the ranking, fastest first, and the command that runs the first; 1 when no layout fits."""
    from fourfold.lab.net import parse_rate, rate_words
    from fourfold.units import format_bytes

    t, seq, paper = cfg.train, cfg.model.seq_len, ns.gpus is not None
    fits = [p for p, ok in ranked if ok]
    params = sum(p.numel() for p in model.parameters())
    millions = f"{params / 1e6:,.{1 if params >= 1e7 else 2}f}"  # 0.03 M, not 0.0 M
    link_text = links.network.source or "fitted cost model"
    if paper and ns.node_link:
        link_text = f"{links.network.source} between machines, {links.node.source} within one"
    if lab is not None and (words := rate_words(lab.link, parse_rate(lab.link))) != lab.link:  # a bps link in bits
        link_text += f"; {words}"
    print(f"fourfold plan: {t.model} ({millions} M parameters), batch {t.batch_size} x {seq}, on {world} "
          f"{'GPUs' if paper else 'ranks'}; {format_bytes(available)} per rank ({where}); "
          f"compute: {profile.costs.source}; links: {link_text}"
          f"{', with the figures fitted above' if ns.calibrate else ''}")
    print(f"{len(candidates)} layout{'s' if len(candidates) != 1 else ''} considered, {len(fits)} fit. Fastest "
          "first:")
    print(f"  {'#':>3} {'layout':<36} {'step':>10} {'tokens/s':>12} {'bubble':>7} {'dp exposed':>11} "
          f"{'memory/rank':>12}")
    for i, p in enumerate(fits[:ns.top], start=1):
        print(f"  {i:>3} {str(p.layout):<36} {_time(p.step_s):>10} {t.batch_size * seq / p.step_s:>12,.0f} "
              f"{p.bubble:>7.1%} {_time(p.dp_exposed_s):>11} {format_bytes(p.peak_bytes):>12}")
    if refused:
        layout, message = next(iter(refused.items()))
        print(f"  left out: {len(refused)} layout{'s' if len(refused) != 1 else ''} fourfold train refuses, e.g. "
              f"{layout}: {message}")
    if not fits:
        smallest = min((p for p, _ in ranked), key=lambda p: p.peak_bytes, default=None)
        if smallest is not None:
            print(f"  none fits: the smallest, {smallest.layout}, needs {format_bytes(smallest.peak_bytes)} per rank. "
                  "Try more devices, a smaller batch, or --activation-checkpointing full.")
        return 1
    first = fits[0].layout
    flags, user = first.flags(), _user_flags(rest, first)  # the user's model and batch flags go with it
    if lab is not None:  # in a lab, --nproc counts a node's ranks: the lab's --gpus-per-node says it
        print(f"  run the first in the lab: fourfold {shlex.join(lab.command(first) + flags[2:] + user)}")
    elif paper and world > ns.gpus_per_node:  # --nproc counts one machine's processes
        nodes = world // ns.gpus_per_node
        print(f"  run the first on {nodes} machines of {ns.gpus_per_node} GPUs, on machine K of 0..{nodes - 1}: "
              f"fourfold train --nnodes {nodes} --node-rank K --rdzv-endpoint HOST:PORT --nproc {ns.gpus_per_node} "
              f"{shlex.join(flags[2:] + user)}")
    else:
        print(f"  run the first here: fourfold {shlex.join(['train', *flags, *user])}")
    cores = links.cores
    if not paper and not ns.calibrate and lab is None and cores and world > cores:
        print(f"  note: {world} ranks share this machine's {cores} CPU cores. Uncalibrated, the figures share the "
              "cores fairly at no cost for switching ranks or waking one, so they are optimistic and may be ordered "
              "otherwise than runs measure; --calibrate fits them to short runs here first (a minute or two).")
    return 0



LAYOUT_FLAGS = frozenset({"--nproc", "--nnodes", "--node-rank", "--rdzv-endpoint", "--dp", "--tp", "--pp",
                          "--schedule", "--microbatches", "--virtual", "--zero", "--grad-accum", "--cp",
                          "--cp-algorithm"})
"""Train's flags the suggested command sets itself (the layout's, a machine's launch), each taking a value."""
SWITCHES = frozenset({"--sequence-parallel", "--no-sequence-parallel"})
"""Train's switches the suggested command sets itself (the layout's)."""


def _user_flags(rest: list[str], layout: Any) -> list[str]:
    """The train flags given to the plan (model, batch, data, ...), for the suggested command: without those
    :data:`LAYOUT_FLAGS` names, which the command gives itself."""
    from fourfold.run.args import without_flags

    kept = [a for a in without_flags(rest, LAYOUT_FLAGS) if a not in SWITCHES]
    config = any(a.split("=", 1)[0] == "--config" for a in rest)
    if not layout.zero and layout.dp > 1 and config:
        kept += ["--zero", "0"]  # a --config file's zero would stand otherwise (flags win over the file)
    if not layout.sequence_parallel and config:
        kept += ["--no-sequence-parallel"]  # the file's, likewise
    if layout.cp == 1 and config:
        kept += ["--cp", "1"]  # the file's, likewise
    return kept


def _negative_values_joined(argv: list[str]) -> list[str]:
    """``--gpu-mem -5GB`` as ``--gpu-mem=-5GB``, so that the value's own check refuses it: argparse takes a value
    that starts with '-' for a flag and says only 'expected one argument'."""
    out: list[str] = []
    for arg in argv:
        takes_value = bool(out) and out[-1] in RANKING_FLAGS and "action" not in RANKING_FLAGS[out[-1]]
        if takes_value and arg[:1] == "-" and arg[1:2].isdigit():
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


CALIBRATION_REPEATS = 2
"""Runs per calibration layout; the fastest counts (one slow run moved every pp2 prediction of ``bench predict``
by 15-26 %, docs/simulator.md)."""


def _calibrated(profile: Any, links: Any, train_flags: list[str], batch_size: int, blocks: int,
                tensor_plan: bool, heads: int | None, samples: tuple[int, int]) -> tuple[Any, Any]:
    """``profile`` and ``links`` fitted to short runs of ``fourfold train`` here (:mod:`fourfold.plan.runs`),
    with the user's model and batch flags; the runs this model or batch cannot make are skipped, and said so.
    The units are timed again between rounds of runs (at ``samples``), and the fastest timing kept."""
    from dataclasses import replace

    from fourfold.plan.calibrate import calibrate
    from fourfold.plan.costs import measure_units
    from fourfold.plan.predict import Candidate, Measured
    from fourfold.plan.runs import best_runs_and_units, calibration_layouts

    microbatches = next((m for m in (4, 2, 1) if batch_size % (2 * m) == 0), 1)
    runnable = []
    for layout in calibration_layouts(microbatches):
        why = cannot_run(layout, batch_size, blocks, tensor_plan, heads)
        if why:
            print(f"  calibration layout {layout}: skipped ({why})", flush=True)
        else:
            runnable.append(layout)
    made = iter(range(1, CALIBRATION_REPEATS * len(runnable) + 1))

    def progress(layout: Candidate, measured: Measured) -> None:
        stolen = "" if measured.stolen is None else f", {measured.stolen:.0%} of the CPU stolen"
        print(f"  calibration run {next(made)}/{CALIBRATION_REPEATS * len(runnable)}, {layout}: "
              f"{_time(measured.step_s)} per step{stolen}", flush=True)

    best, costs = best_runs_and_units(
        runnable, CALIBRATION_REPEATS, 8, train_flags,
        lambda: measure_units(profile.model, profile.blocks, profile.seq_len, samples=samples), samples[-1],
        timed=[profile.costs], progress=progress)  # the timing made for the ranking stands for the first round's
    profile = replace(profile, costs=costs)
    print(f"  units: {profile.costs.source}", flush=True)
    runs = {layout: measured for layout, (measured, _) in best.items()}
    profile, links, fitted = calibrate(profile, links, batch_size, runs)
    print("  fitted: " + (", ".join(f"{k} {v:.3g}" for k, v in fitted.items()) or "nothing (no run could be made)")
          + " (what each means: docs/simulator.md, 'What is predicted, and how')")
    return profile, links


PAPER_FLAGS = """with --gpus (on paper):
  --gpus N            devices to plan for (the model is built on the meta device: any size)
  --gpu-mem SIZE      memory per device, with its unit: 80GB (default: --memory-limit, else 80GB)
  --gpus-per-node N   devices per machine; tensor parallelism stays inside one, and more --gpus than
                      this must be a multiple of it (default: 8)
  --link RATE         bandwidth between machines in tc's units: 400gbit is bits/s, 50gbps bytes/s
                      (default: 400gbit)
  --node-link RATE    bandwidth inside a machine (default: --link)
  --latency S         seconds per message on either link (default: 1e-05)
  --gpu-flops X       peak FLOP/s of one device (default: 9.89e14, an H100 SXM's dense bf16)
  --mfu X             the fraction of the peak a step reaches (default: 0.4)
  --top N             layouts to print (default: 10)

on this machine (without --gpus):
  --lab N             plan for `fourfold lab run --nodes N`: --nproc / N ranks per node, nodes joined by --link
                      (default: 1gbit), the lab's fitted model where one was saved (docs/lab.md)
  --tcp NAME          the lab's TCP congestion control, as lab run's --tcp (default: auto, cubic where a
                      namespace may choose it)
  --calibrate         first fit the simulator to short runs of fourfold train here, the fastest of 2 of each
                      of dp=2, tp=2, pp=2, dp=4, dp=2 pp=2 (about two minutes for a small model): how ranks
                      sharing the cores slow each other, the links' real alpha and beta, a pipeline action's
                      overhead (docs/simulator.md).
                      Without it, 4- and 8-rank figures on a CPU with fewer cores are optimistic."""


def _time(s: float) -> str:
    """Seconds as a plan's columns show them: a tiny model's step on paper is microseconds, not "0.0 ms"."""
    if 0 < s < 1e-3:
        return f"{s * 1e6:.1f} us"
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.1f} s"


RANKING_FLAGS: dict[str, dict[str, Any]] = {
    "--gpus": {"type": int}, "--gpu-mem": {"default": None}, "--gpus-per-node": {"type": int, "default": 8},
    "--link": {"default": None}, "--lab": {"type": int, "default": None}, "--tcp": {"default": "auto"},
    "--node-link": {"default": None}, "--latency": {"type": float, "default": 10e-6},
    "--gpu-flops": {"type": float, "default": 989e12}, "--mfu": {"type": float, "default": 0.4},
    "--top": {"type": int, "default": 10}, "--calibrate": {"action": "store_true"},
}
"""The flags of the ranking (``fourfold plan`` without ``--memory``), beside train's model and batch flags."""
PAPER_ONLY = ("--gpu-mem", "--gpus-per-node", "--node-link", "--latency", "--gpu-flops", "--mfu")
"""The ranking's flags that describe devices on paper: without ``--gpus`` nothing reads them."""
