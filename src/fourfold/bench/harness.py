"""What every ``fourfold bench`` shares: launching the ranks, a rank's start, sizes and times as text, the
least-squares fit, the gradient check's tolerance, and the report (``bench.json`` + ``bench.png``). One file
per benchmark builds on it: ``allreduce``, ``dp``, ``tp``, ``pp`` (each runs its variants through the same
engine users train with); the models and data the training-step ones run are :mod:`fourfold.bench.workloads`.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fourfold.files import atomic_path, write_text_atomic
from fourfold.units import format_bytes, parse_bytes

__all__ = ["GRAD_RTOL", "add_output_flags", "fit_alpha_beta", "fit_line", "fmt_time", "format_bytes", "launch_ranks",
           "machine", "name_list", "paired_ratio", "parse_size", "run_or_launch", "run_record", "save_png",
           "start_rank", "timed_rounds", "write_report"]

GRAD_RTOL = 1e-5  # float32: |ours - reference| <= 1e-5 * max|g_reference| per parameter (~80 ulps of the largest)


def parse_size(text: str) -> int:
    """``"64KB"`` -> 65536 (KB = 1024 B, as NCCL-tests counts); a multiple of 4 bytes (float32), >= 4."""
    n = parse_bytes(text)  # refuses anything but a size (ValueError: "size must be ...")
    if n < 4 or n % 4:
        raise ValueError(f"size must be a positive multiple of 4 bytes (float32 elements), got {text!r} = {n} B.")
    return n


def add_output_flags(parser: Any, bench: str, writes: str = "bench.json and bench.png") -> None:
    """The flags every benchmark ends with: ``--out`` (default ``runs/bench-NAME``), ``--timeout`` and the
    hidden ``--command`` (the user's command line, for bench.json)."""
    import argparse

    parser.add_argument("--out", default=f"runs/bench-{bench}", help=f"where {writes} go (overwritten; default: "
                        f"runs/bench-{bench})")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any call may wait (default: 120)")
    parser.add_argument("--command", default=None, help=argparse.SUPPRESS)


def add_round_flags(parser: Any, *, nproc: str, rounds: int, warmup: int, checks: str) -> None:
    """``--nproc`` (``nproc`` says what the ranks are), ``--rounds`` and ``--warmup`` (the first warm-up round
    ``checks`` something): the flags every multi-rank benchmark takes."""
    default = lab_nproc()
    parser.add_argument("--nproc", type=int, default=default, help=f"ranks to start on this machine: {nproc}, "
                        f">= 2 (default: {default})")
    parser.add_argument("--rounds", type=int, default=rounds, help=f"timed steps per variant (default: {rounds})")
    parser.add_argument("--warmup", type=int, default=warmup, help=f"untimed rounds first; the first checks {checks} "
                        f"(default: {warmup})")


def lab_nproc(default: int = 2) -> int:
    """``--nproc``'s default: 2, or in a lab its ``--gpus-per-node``."""
    from fourfold.torchrun import lab_default

    return lab_default("NPROC", default)


def lab_nodes() -> int:
    """Machines taking part: 1, or a lab's nodes (``fourfold lab run``; each runs ``--nproc`` ranks)."""
    from fourfold.torchrun import LaunchConfig

    return LaunchConfig().nnodes


def check_rounds(ns: Any, why_two: str, checks: str) -> None:
    """Refuse ``--nproc`` < 2 (``why_two``: why one rank shows nothing) and ``--rounds``/``--warmup`` < 1."""
    if ns.nproc * lab_nodes() < 2:
        raise ValueError(f"nproc must be >= 2 ({why_two}), got {ns.nproc}. Pass --nproc 2.")
    if ns.rounds < 1 or ns.warmup < 1:
        raise ValueError(f"rounds and warmup must be >= 1 (the first warm-up round checks {checks}), got "
                         f"rounds={ns.rounds}, warmup={ns.warmup}.")


def name_list(text: str, valid: Sequence[str], flag: str, example: str) -> list[str]:
    """``"a, b"`` -> ``["a", "b"]``: at least one name, each among ``valid``, none twice; else a ValueError
    naming ``flag``, the valid names and ``example``."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in valid for n in names) or len(set(names)) != len(names):
        raise ValueError(f"{flag} must be distinct names among {', '.join(valid)}, got {names}. E.g. --{flag} "
                         f"{example}.")
    return names


def fmt_time(s: float) -> str:
    return f"{s * 1e6:.0f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """``(a, b)`` minimising sum(((y - a - b*x) / y)^2): least squares on relative error."""
    pts = [(x, y, 1.0 / (y * y)) for x, y in zip(xs, ys, strict=True)]
    sw, sx, sy = sum(w for _, _, w in pts), sum(w * x for x, _, w in pts), sum(w * y for _, y, w in pts)
    sxx, sxy = sum(w * x * x for x, _, w in pts), sum(w * x * y for x, y, w in pts)
    b = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    return (sy - b * sx) / sw, b


def fit_alpha_beta(points: list[tuple[int, float]], small: int = 4 << 10,
                   large: int = 1 << 20) -> tuple[float, float]:
    """``(alpha, beta)`` of a one-way ping-pong ``[(bytes, seconds)]``: alpha the median time of messages of at
    most ``small`` bytes (the latency floor); beta the least-squares slope, through alpha, of messages of at least
    ``large`` bytes (the sustained bandwidth). A fit of all sizes at once lets the many small sizes decide beta,
    and a link that starts with a burst (a token bucket's, a NIC's) then looks several times faster than it is;
    without points on either side, :func:`fit_line` over all of them."""
    lat = sorted(t for n, t in points if n <= small)
    big = [(n, t) for n, t in points if n >= large]
    if not lat or not big:
        return fit_line([n for n, _ in points], [t for _, t in points])
    alpha = lat[len(lat) // 2]
    beta = sum(n * (t - alpha) for n, t in big) / sum(n * n for n, _ in big)
    return alpha, beta


def launch_ranks(bench: str, argv: list[str], nproc: int, command: str | None = None) -> int:
    """The parent side of ``fourfold bench NAME``: start ``nproc`` ranks through torchrun's launcher, each
    running ``python -m fourfold.bench.NAME`` with the same flags and the user's command (for bench.json)."""
    from fourfold.run.args import without_section_flags
    from fourfold.torchrun import LaunchConfig, launch_workers

    command = command or shlex.join(["fourfold", "bench", bench, *argv])
    print(f"fourfold bench {bench}: starting {nproc} ranks ...", flush=True)
    # the last --command wins in argparse, so ours overrides one the user passed
    return launch_workers(f"fourfold.bench.{bench}", [*without_section_flags(argv, "launch"), f"--command={command}"],
                          LaunchConfig(nproc=nproc))


def run_or_launch(name: str, argv: list[str] | None, parser: Any, check: Callable[[Any], Any],
                  run: Callable[[Any], None]) -> int:
    """Every benchmark's ``main``: parse and check the flags (a bad one exits 2 before any rank starts); in a
    rank started by the launcher run the benchmark, in the parent start ``--nproc`` ranks."""
    argv = sys.argv[1:] if argv is None else list(argv)
    ns = parser.parse_args(argv)
    try:
        check(ns)
    except ValueError as e:
        parser.error(str(e))  # exits
    from fourfold.torchrun import is_worker

    if is_worker():  # a rank started by the launcher
        run(ns)
        return 0
    return launch_ranks(name, argv, ns.nproc, ns.command)


def start_rank(tag: str, timeout_s: float) -> tuple[Any, Callable[..., None], float, tuple[float, float, float]]:
    """A benchmark rank's start: join the group; a ``say`` that prints on rank 0 only; the clock; the load
    average, with a warning when other work is running (figures taken then are noisy)."""
    from fourfold import launch

    ctx = launch.init("cpu", timeout_s=timeout_s)
    say = (lambda *a: print(tag, *a, flush=True)) if ctx.rank == 0 else (lambda *a: None)
    started, load_before = time.monotonic(), os.getloadavg()
    if load_before[0] > 0.5 * (os.cpu_count() or 1):
        say(f"warning: the machine is busy (load {load_before[0]:.1f} on {os.cpu_count()} cores): figures will "
            "be noisy; re-run when it is quiet")
    return ctx, say, started, load_before


def timed_rounds(steps: Sequence[Callable[[Any, Any, int], object]], batch: Callable[[int], tuple[Any, Any]],
                 warmup: int, rounds: int, after_round: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """Time every variant's training step side by side; a collective (every rank calls it alike).

    Round k draws ``batch(k)`` and runs ``step(x, y, k)`` of every variant once, the order rotating each round
    (no variant always runs first, on a cold cache, or last); ``warmup`` rounds first, not timed. A barrier
    precedes every step, so each starts with every rank ready; ``after_round(k)`` runs once each round is done.
    Returns per variant its ``times_s`` (one per timed round: the slowest rank's, as a step takes as long as its
    slowest rank) and their ``median_s``, ``min_s`` and ``max_s``.
    """
    import torch
    import torch.distributed as dist

    from fourfold.comm.wait import barrier

    elapsed = torch.zeros(len(steps), rounds, dtype=torch.float64)  # (variants, rounds): this rank's seconds
    for it in range(warmup + rounds):
        x, y = batch(it)  # the same batch for every variant this round
        for j in [(it + k) % len(steps) for k in range(len(steps))]:
            barrier("line up a timed round")
            t0 = time.perf_counter()
            steps[j](x, y, it)
            if it >= warmup:
                elapsed[j, it - warmup] = time.perf_counter() - t0
        if after_round is not None:
            after_round(it)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
    return [{"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "times_s": times}
            for times in elapsed.tolist()]


def paired_ratio(times_s: Sequence[float], reference_s: Sequence[float]) -> float:
    """The median over rounds of ``times_s[k] / reference_s[k]``: both steps ran in round k, back to back, so
    load that comes and goes over a run moves this less than the ratio of the two medians."""
    return statistics.median(a / b for a, b in zip(times_s, reference_s, strict=True))


def run_record(ns: Any, world_size: int, elapsed: float, load_before: tuple[float, float, float]) -> dict[str, Any]:
    """What every bench.json starts with (the command, when, how long, the machine, its load before and after);
    prints the load line under the targets."""
    import datetime

    load_after = os.getloadavg()
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} on {os.cpu_count()} cores")
    return {"command": ns.command, "argv": sys.argv,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "elapsed_s": elapsed, "machine": machine(world_size), "load_before": load_before,
            "load_after": load_after}


def write_report(out: Path, result: dict[str, Any], elapsed: float, chart: Callable[[Path], None],
                 name: str = "bench") -> None:
    """Rank 0's outputs: ``out/NAME.json`` (atomically) and ``chart(out/NAME.png)`` when matplotlib is there."""
    write_text_atomic(out / f"{name}.json", json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {out / f'{name}.json'} ({elapsed:.0f} s)", flush=True)
    try:
        chart(out / f"{name}.png")
    except ImportError:
        print("chart skipped: matplotlib is not installed (pip install 'fourfold[viz]')", flush=True)
    else:
        print(f"wrote {out / f'{name}.png'}", flush=True)


def save_png(fig: Any, path: Path) -> None:
    """A matplotlib ``Figure`` drawn to ``path`` as a PNG, atomically (every benchmark's chart ends here)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    with atomic_path(path) as tmp:
        FigureCanvasAgg(fig).print_png(str(tmp))


def machine(g: int) -> dict[str, Any]:
    """What the figures were measured on, for bench.json."""
    import torch

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "backend": "gloo", "world_size": g, "transport": "tcp over loopback"}
