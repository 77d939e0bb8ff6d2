"""Short real runs of ``fourfold train`` for the simulator to fit on and be checked against.

    from fourfold.plan.runs import best_runs, calibration_layouts

    runs = {L: m for L, (m, _) in best_runs(calibration_layouts(microbatches=4), repeats=2, steps=8,
                                           train_flags=["--batch-size", "16"]).items()}
    profile, links, fitted = calibrate(profile, links, 16, runs)       # fourfold.plan.calibrate

Each run is ``fourfold train`` in a subprocess with the user's model and batch flags, then the layout's own
flags (which win), for a few steps without checkpoints: its median step after the first, that step's spans on
every rank (from the run's trace) and the share of CPU time the hypervisor took meanwhile (``/proc/stat``;
steal makes a run on a shared virtual machine slower than the model can know). ``fourfold bench predict`` and
``fourfold plan --calibrate`` use them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from fourfold.files import drawn_row
from fourfold.observe.trace import load_jsonl
from fourfold.plan.costs import UnitCosts, fastest
from fourfold.plan.predict import Candidate, Links, Measured

__all__ = ["LabShape", "best_runs", "best_runs_and_units", "calibration_layouts", "cpu_times", "measure_run", "stolen"]


def calibration_layouts(microbatches: int) -> tuple[Candidate, ...]:
    """The runs :func:`~fourfold.plan.calibrate.calibrate` fits on: data-, tensor- and pipeline-parallel at 2
    ranks, and with more ranks than a 2-core machine's cores, data-parallel and pipelined."""
    return (Candidate(dp=2), Candidate(tp=2), Candidate(pp=2, schedule="1f1b", microbatches=microbatches), Candidate(dp=4),
            Candidate(dp=2, pp=2, schedule="1f1b", microbatches=microbatches))


def cpu_times() -> list[int] | None:
    """This machine's CPU time counters (``/proc/stat``: user ... steal), or None off Linux."""
    try:
        return [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None


def stolen(before: list[int] | None, after: list[int] | None) -> float | None:
    """The share of CPU time the hypervisor took from this virtual machine between two :func:`cpu_times`."""
    if before is None or after is None or len(before) < 8 or len(after) < 8:
        return None
    spent = [b - a for a, b in zip(before, after, strict=True)]
    return spent[7] / sum(spent) if sum(spent) > 0 else None


@dataclass(frozen=True)
class LabShape:
    """Runs made in a lab (docs/lab.md): ``ranks_per_node`` ranks a node, the nodes joined by ``link``."""

    ranks_per_node: int
    link: str
    tcp: str = "auto"  # as `fourfold lab run --tcp`: resolved where the lab is made (Lab's)

    def links(self, here: Links, nodes: int | None = None) -> Links:
        """``here`` (this machine's links) as this lab joins them: a node's ranks over the machine's own link, the
        nodes over the lab's: its fitted model where ``lab run ... bench allreduce`` saved one (of ``nodes``
        nodes if given, else of any count: a link's alpha and beta do not depend on it), else the link's rate at
        the machine's own latency (a lab's latency is the real stack's)."""
        from fourfold.comm.auto import CostModel
        from fourfold.lab.net import Lab, cost_model_path

        lab = Lab(1, self.link, self.tcp)  # checks the link and tcp; "auto": the congestion control it would use
        rate, g, link, tcp = lab.rate, self.ranks_per_node, self.link, lab.tcp
        exact = cost_model_path(nodes or 0, g, link, tcp)
        fitted = [exact] if exact.exists() else sorted(exact.parent.glob(f"cost_model-*x{g}-{link}-{tcp}.json"))
        if fitted:  # with several ranks a node, the saved model's network pair is the link between nodes
            saved = CostModel.load(fitted[-1])
            alpha, beta = saved.network or (saved.alpha_s, saved.beta_s_per_byte)
            network = CostModel(alpha, beta, saved.gamma_s_per_byte, f"lab {link}, fitted ({fitted[-1]})")
        else:
            network = CostModel(here.node.alpha_s, 8 / rate, here.node.gamma_s_per_byte,
                                f"lab {link}, not fitted (fit it: fourfold lab run --nodes {nodes or 2} "
                                f"--gpus-per-node {g} --link {link} -- fourfold bench allreduce --nproc {g})")
        return replace(here, network=network, ranks_per_node=g)

    def command(self, layout: Candidate) -> list[str]:
        """``fourfold lab run ... -- fourfold train`` for ``layout`` (whose ranks must fill whole nodes)."""
        if layout.world_size % self.ranks_per_node:
            raise ValueError(f"a lab of {self.ranks_per_node} ranks per node cannot run {layout} "
                             f"({layout.world_size} ranks). Pick layouts of a multiple of {self.ranks_per_node} ranks.")
        return ["lab", "run", "--nodes", str(layout.world_size // self.ranks_per_node), "--gpus-per-node",
                str(self.ranks_per_node), "--link", self.link, "--tcp", self.tcp, "--", "fourfold", "train"]


def measure_run(layout: Candidate, steps: int, train_flags: Sequence[str], timeout: float,
                lab: LabShape | None = None) -> Measured:
    """Run ``fourfold train TRAIN_FLAGS`` with ``layout`` for ``steps`` steps (in ``lab`` when given): its
    typical step (:func:`~fourfold.files.drawn_row`: neither the first nor the last), that step's spans on every
    rank, and the CPU time stolen meanwhile."""
    cpu = cpu_times()
    with tempfile.TemporaryDirectory(prefix="fourfold-run-") as out:
        flags = layout.flags() if lab is None else layout.flags()[2:]  # in a lab --nproc counts a node's ranks
        argv = [sys.executable, "-m", "fourfold", *(["train"] if lab is None else lab.command(layout)),
                *train_flags, *flags,
                *([] if layout.zero else ["--zero", "0"]), "--steps", str(steps), "--out", out,
                "--no-memory-check", "--checkpoint-every", "0"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"fourfold train for {layout} failed (exit {done.returncode}):\n"
                               f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
        rows = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
        typical = drawn_row(rows)  # its time and its spans: one step's
        assert typical is not None
        middle = typical["step"]
        spans = {r: [s for s in load_jsonl(Path(out, f"trace-rank{r}.jsonl")) if s.step == middle]
                 for r in range(layout.world_size)}
    origin = min((s.start_ns for row in spans.values() for s in row), default=0)
    spans = {r: [replace(s, start_ns=s.start_ns - origin, end_ns=s.end_ns - origin) for s in row]
             for r, row in spans.items()}
    return Measured(typical["step_time_s"], spans, stolen(cpu, cpu_times()))


def best_runs_and_units(layouts: Sequence[Candidate], repeats: int, steps: int, train_flags: Sequence[str],
                        time_units: Callable[[], UnitCosts], samples: float, timeout: float = 120.0, *,
                        timed: Sequence[UnitCosts] = (), progress: Callable[[Candidate, Measured], None] | None = None,
                        lab: LabShape | None = None) -> tuple[dict[Candidate, tuple[Measured, float]], UnitCosts]:
    """:func:`best_runs`, with the units timed in this process (``time_units()``) before each round of runs, and
    the fastest timing at ``samples`` (:func:`~fourfold.plan.costs.fastest`): it sits beside the fastest runs.
    ``timed``: timings already taken, which stand for the first round's."""
    timings = list(timed)

    def before_round(k: int) -> None:
        if k or not timings:
            timings.append(time_units())

    best = best_runs(layouts, repeats, steps, train_flags, timeout, progress=progress, lab=lab,
                     before_round=before_round)
    return best, fastest(timings, samples)


def best_runs(layouts: Sequence[Candidate], repeats: int, steps: int, train_flags: Sequence[str],
              timeout: float = 120.0, *, progress: Callable[[Candidate, Measured], None] | None = None,
              lab: LabShape | None = None,
              before_round: Callable[[int], None] | None = None) -> dict[Candidate, tuple[Measured, float]]:
    """Each layout's fastest of ``repeats`` runs (a shared machine's noise only ever adds time), and its slowest
    over it. The runs rotate, every layout once and then again in reverse order, so a machine whose speed
    drifts over minutes (this VM's did by 20 %) weighs on the calibration runs and on the runs checked against
    them alike. ``progress(layout, run)`` is called after each run; ``before_round(k)`` before each round (the
    units are timed there: :func:`best_runs_and_units`); ``lab``: every run in such a lab."""
    runs: dict[Candidate, list[Measured]] = {L: [] for L in layouts}
    for k in range(repeats):
        if before_round is not None:
            before_round(k)
        for L in (list(runs) if k % 2 == 0 else list(runs)[::-1]):
            runs[L].append(measure_run(L, steps, train_flags, timeout, lab))
            if progress is not None:
                progress(L, runs[L][-1])
    return {L: (min(got, key=lambda m: m.step_s), max(m.step_s for m in got) / min(m.step_s for m in got))
            for L, got in runs.items()}
