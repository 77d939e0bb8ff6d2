"""``fourfold demo``: a guided tour — one process, then data parallelism on two ranks — printed and drawn.

    fourfold demo                       # about 4 minutes on 2 CPU cores
    fourfold demo --steps 100 --out runs/quick

1. TinyGPT trains on one process on the built-in corpus (the Python standard library's source, read byte by
   byte); a sample of its text is printed.
2. The same run on 2 data-parallel ranks (started through torchrun's launcher), gradients all-reduced with
   the backend's own algorithm (``native``), then with fourfold's ``ring``, then on 2 tensor-parallel ranks
   (every big matmul split in two): the losses match the one-process run, and the table shows step time,
   throughput, bytes each rank sent, how much communication backward hid, and parameter memory per rank.
   A timeline picture shows one data-parallel step on both ranks.
3. The layers on 2 pipeline ranks: model parallel, GPipe and 1F1B, with the bubble against theory.
4. Whole documents padded vs packed (best-fit decreasing): real tokens/s, padding, and a picture of one batch.
5. Memory: the same model on 2 data-parallel ranks plain, with ZeRO-1, ZeRO-3, and ZeRO-3 with activation
   checkpointing: each rank's parameters, gradients, optimiser state and activations, estimated before launch
   and measured, as stacked bars (``memory.png``).

Everything lands under ``--out`` (default ``runs/demo``): one folder per run with ``metrics.jsonl``,
``trace.json`` (open in ui.perfetto.dev) and ``model.pt``, plus ``timeline-*.png`` pictures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from fourfold.config import Config, OutputConfig, TrainConfig
from fourfold.data import ByteTokenizer
from fourfold.files import drawn_row, median_row, steady, steady_rate
from fourfold.models.build import DTYPES
from fourfold.models.gpt import TinyGPT
from fourfold.observe.trace import load_jsonl
from fourfold.run.summary import TrainResult
from fourfold.train import train

__all__ = ["main"]


def _sample(cfg: Config, result: TrainResult, prompt: str, n: int, seed: int = 0) -> str:
    """Draw ``n`` bytes after ``prompt`` from the trained weights (temperature 0.8)."""
    model = TinyGPT(cfg.model, seed=cfg.train.seed, dtype=DTYPES[cfg.train.dtype])
    model.load_state_dict(result.state)
    model.eval()
    tok = ByteTokenizer()
    idx = tok.encode(prompt).reshape(1, -1)  # (1, T)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(n):
            logits = model(idx[:, -cfg.model.seq_len:])[:, -1, :]  # (1, V)
            probs = torch.softmax(logits.double() / 0.8, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=gen)], dim=1)
    return tok.decode(idx[0, len(prompt):])


NOTES = """
  KB sent/step: what rank 0 put on the wire per step, counted by fourfold's own algorithms (the backend's
    native all-reduce sends on its own: not counted; for tp=2, what a ring sends for its per-layer
    all-reduces).
  hidden: the share of the gradient all-reduce that overlapped backward.
  loss gap: float32 rounding only (the sums run in another order); in float64 every layout agrees with one
    process to 1e-10, which the tests check.
  One process runs on one thread (one core: one device); each of 2 ranks gets a core of its own, as 2 GPUs
  would, so a speed-up below 2x is what the layout costs: bytes sent, waiting, memory. On a machine busy
  with other work the figures move; the loss column does not.
"""


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _summary(name: str, rows: list[dict], reference: list[dict], counted: bool = True) -> str:
    """One row of the table; ``counted=False``: the bytes are the backend's own (native), not 0."""
    typical, timed = median_row(rows), steady(rows)  # as the run's own summary line reads them
    assert typical is not None
    ms, tps = 1e3 * typical["step_time_s"], typical["tokens_per_s"]
    kb = statistics.median(r["comm_bytes"] for r in timed) / 1024
    hidden = [float(r["comm_hidden_fraction"]) for r in timed if r.get("comm_hidden_fraction") is not None]
    hid = f"{100 * statistics.median(hidden):5.0f} %" if hidden else "      -"
    diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(rows, reference, strict=False))
    sent = f"{kb:12,.0f}" if counted else f"{'not counted':>12}"
    return f"  {name:<28} {ms:8.1f} {tps:10,.0f} {sent} {hid}   {diff:.1e}"


def _draw(out: Path, ranks: int, name: str, title: str, color_by: str = "name", steps: int | None = None) -> None:
    """The run's typical step (:func:`~fourfold.files.drawn_row`, the one its table row reads; ``steps``: among
    its first ones, as the row compares), drawn and named."""
    from fourfold.observe.visualize import draw_step

    row = drawn_row(_rows(out)[:steps])
    assert row is not None
    step = row["step"]
    title = f"{title}: step {step} (the median, {1e3 * row['step_time_s']:.0f} ms)"
    spans = {r: load_jsonl(out / f"trace-rank{r}.jsonl") for r in range(ranks)}
    if draw_step(spans, step, out.parent / name, title, color_by=color_by):
        print(f"  {title}: {out.parent / name}")
    else:
        print("(no picture: matplotlib is not installed: pip install 'fourfold[viz]')")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fourfold demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--out", default="runs/demo", help="where to write the outputs (default: runs/demo)")
    parser.add_argument("--steps", type=int, default=400, help="one-process training steps (default: 400)")
    parser.add_argument("--dp-steps", type=int, default=30, help="steps of each 2-rank run (default: 30)")
    parser.add_argument("--pack-steps", type=int, default=8, help="steps of each packing run (default: 8)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    for flag in ("steps", "dp_steps", "pack_steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}.")
    root = Path(args.out)
    cfg = Config(train=TrainConfig(steps=args.steps, device="cpu"),
                 output=OutputConfig(out=str(root / "single"), overwrite=True))
    print(f"fourfold demo 1/5: TinyGPT trains for {args.steps} steps on one process and one thread "
          f"(global batch {cfg.train.batch_size} x {cfg.model.seq_len} bytes of Python source)\n", flush=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one device, as each of the later runs' ranks gets one thread: a fair comparison
    try:
        result = train(cfg)
    finally:
        torch.set_num_threads(threads)
    print("\n" + result.summary())
    prompt = "def "
    print(f"\nthe trained model continues {prompt!r}:\n---\n{prompt}{_sample(cfg, result, prompt, 160)}\n---\n")

    print(f"fourfold demo 2/5: the same batches on 2 ranks, {args.dp_steps} steps each: data parallel (every rank "
          "sees half of each batch, gradients averaged during backward), then tensor parallel (every rank holds "
          "half of each big matmul)\n", flush=True)
    from fourfold.train import main as train_main

    # 1 MB buckets: the model's ~3.3 MB of gradients go out in 4 pieces, the first while backward still runs
    flags = ["--nproc", "2", "--steps", str(args.dp_steps), "--overwrite", "--no-progress", "--device", "cpu"]
    runs = {f"dp2-{a}": ["--allreduce", a, "--bucket-mb", "1"] for a in ("native", "ring")}
    runs["tp2"] = ["--tp", "2"]  # tensor parallelism: every big matmul split over the 2 ranks
    for name, extra in runs.items():
        out = root / name
        print(f"$ fourfold train {' '.join(flags)} {' '.join(extra)} --out {out}", flush=True)
        if train_main([*flags, *extra, "--out", str(out)]) != 0:
            print(f"fourfold demo: the {name} run failed; its error is above.", file=sys.stderr)
            return 1

    single = _rows(root / "single")
    print(f"\n  {'run':<28} {'ms/step':>8} {'tokens/s':>10} {'KB sent/step':>12} {'hidden':>7}   "
          "max |loss - one process|")
    print(_summary(f"1 process, steps 1-{min(args.dp_steps, len(single))}", single[: args.dp_steps], single))
    for algorithm in ("native", "ring"):
        print(_summary(f"dp=2, {algorithm} all-reduce", _rows(root / f"dp2-{algorithm}"), single,
                       counted=algorithm != "native"))
    print(_summary("tp=2 (matmuls split)", _rows(root / "tp2"), single))
    print("\n  parameter memory per rank (run.json):")
    for name in ("single", "dp2-ring", "tp2"):
        pb = json.loads((root / name / "run.json").read_text())["parameter_bytes_rank0"]
        print(f"    {name:<10} {pb['total'] / 2**20:6.2f} MB  (sharded "
              f"{pb['sharded'] / 2**20:.2f} MB, replicated {pb['replicated'] / 2**20:.2f} MB)")
    print(NOTES)
    _draw(root / "single", 1, "timeline-single.png", "one training step, one process", steps=args.dp_steps)
    _draw(root / "dp2-ring", 2, "timeline-dp.png", "one data-parallel step, 2 ranks, ring")
    if _pipelines(root, flags) != 0 or _packing(root, flags, args.pack_steps) != 0 or _memory(root) != 0:
        return 1
    print("\n  open any trace.json in https://ui.perfetto.dev to explore every span")
    return 0


PIPELINES = {  # name: (flags, what it is)
    "model": (["--strategy", "model"], "model parallel: layers split over 2 ranks, one micro-batch"),
    "gpipe": (["--schedule", "gpipe", "--microbatches", "8"], "GPipe: 8 micro-batches, all F then all B"),
    "1f1b": (["--schedule", "1f1b", "--microbatches", "8"], "1F1B: 8 micro-batches, one F one B"),
}


def _pipelines(root: Path, flags: list[str]) -> int:
    """Part 3: the same layers on 2 pipeline ranks, three ways; bubble and activation memory per rank."""
    from fourfold.parallel.timeline import theory_bubble
    from fourfold.train import main as train_main

    print("\nfourfold demo 3/5: the model's layers split over 2 ranks (pipeline parallelism): model parallel "
          "(one rank busy at a time), then GPipe and 1F1B with 8 micro-batches\n", flush=True)
    # 64 sequences a step, so each of the 8 micro-batches (8 sequences) computes long enough to outweigh a
    # message between the ranks (milliseconds with gloo on 2 busy cores)
    flags = [*flags, "--pp", "2", "--batch-size", "64"]
    for name, (extra, _) in PIPELINES.items():
        out = root / f"pp2-{name}"
        print(f"$ fourfold train {' '.join(flags)} {' '.join(extra)} --out {out}", flush=True)
        if train_main([*flags, *extra, "--out", str(out)]) != 0:
            print(f"fourfold demo: the pp2-{name} run failed; its error is above.", file=sys.stderr)
            return 1
    print(f"\n  {'run':<58} {'ms/step':>8} {'bubble':>7} {'theory':>7} {'activations per rank':>22}")
    for name, (_, text) in PIPELINES.items():
        rows = _rows(root / f"pp2-{name}")
        typical = drawn_row(rows)  # the step its picture shows
        assert typical is not None
        ms, bubble = 1e3 * typical["step_time_s"], statistics.mean(typical["bubble_by_rank"])
        m = 1 if name == "model" else 8
        theory = theory_bubble("naive" if name == "model" else name, 2, m)
        mem = " / ".join(f"{b / 2**20:.1f}" for b in rows[-1]["peak_activation_bytes_by_rank"])
        print(f"  {text:<58} {ms:8.1f} {100 * bubble:6.0f}% {100 * theory:6.0f}% {mem:>17} MB")
    print("\n  bubble: the share of the step each rank is not computing (waiting for the other, its idle tail too),")
    print("  beside the schedule's theory with equal costs, (p-1)/(m+p-1) for GPipe and 1F1B. On 2 shared cores")
    print("  the measured figure also holds each message's latency and time waiting for a core (the theory")
    print("  counts neither: `fourfold schedule --comm X` adds it). activations: the most bytes saved for")
    print("  backward held at once; 1F1B keeps about p micro-batches alive where GPipe keeps all m.")
    for name in PIPELINES:
        _draw(root / f"pp2-{name}", 2, f"timeline-pp-{name}.png", f"one pipeline step, {PIPELINES[name][1]}",
              color_by="microbatch")
    return 0


def _packing(root: Path, flags: list[str], steps: int) -> int:
    """Part 4: whole documents (the standard library's functions), padded to the longest vs packed bfd."""
    from fourfold.observe.visualize import draw_packing
    from fourfold.run.args import parse_args
    from fourfold.run.data import make_loader
    from fourfold.train import main as train_main

    print(f"\nfourfold demo 4/5: whole documents, the standard library's functions (most a few hundred bytes, a "
          f"few thousands), 16 a step in rows of 1024: padded to the longest, then packed best-fit decreasing; "
          f"{steps} steps each on one process\n", flush=True)
    flags = ["--steps", str(steps), "--seq-len", "1024", "--batch-size", "16", "--overwrite", "--no-progress",
             "--device", "cpu"]
    for pack in ("pad", "bfd"):
        out = root / f"pack-{pack}"
        print(f"$ fourfold train {' '.join(flags)} --pack {pack} --out {out}", flush=True)
        if train_main([*flags, "--pack", pack, "--out", str(out)]) != 0:
            print(f"fourfold demo: the pack-{pack} run failed; its error is above.", file=sys.stderr)
            return 1
    rows = {pack: _rows(root / f"pack-{pack}") for pack in ("pad", "bfd")}
    typical = {pack: median_row(r) or {} for pack, r in rows.items()}
    print(f"\n  {'run':<34} {'ms/step':>8} {'real tokens/s':>14} {'padding, mean of steps':>23}   "
          "max |loss - padded|")
    for pack, text in (("pad", "padded to the step's longest"), ("bfd", "packed, best-fit decreasing")):
        ms, real = 1e3 * typical[pack]["step_time_s"], steady_rate(rows[pack], "real_tokens_per_s")
        pad = statistics.mean(r["padding_fraction"] for r in steady(rows[pack]))
        diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(rows[pack], rows["pad"], strict=True))
        print(f"  {text:<34} {ms:8.1f} {real:14,.0f} {pad:23.1%}   {diff:.1e}")
    # the runs' real tokens over their steady steps' time, not one step's figure
    speedup = steady_rate(rows["bfd"], "real_tokens_per_s") / steady_rate(rows["pad"], "real_tokens_per_s")
    bound = 1 / (1 - statistics.mean(r["padding_fraction"] for r in steady(rows["pad"])))
    above = (" (above it here: the padded step's bigger attention matrices also cost memory traffic)"
             if speedup > bound else "")
    print(f"\n  packing learns from {speedup:.1f}x the tokens per second; the bound, counting positions only, is "
          f"1 / (1 - padding) = {bound:.1f}x{above}.\n  Same documents, same loss: attention stays inside each "
          "document and the loss divides by the real tokens of the whole batch.")
    batches = {}
    for pack in ("pad", "bfd"):
        loader, _ = make_loader(parse_args([*flags, "--pack", pack, "--out", str(root / f"pack-{pack}")]), root)
        batches[pack] = loader.batch(0)
    if draw_packing(batches, root / "packing.png", "step 1's documents, padded (left) and packed (right); "
                    "white = padding"):
        print(f"  one step's documents, padded and packed: {root / 'packing.png'}")
    return 0


MEMORY = {  # name: flags (2 data-parallel ranks each)
    "dp=2": [],
    "ZeRO-1": ["--zero", "1"],
    "ZeRO-3": ["--zero", "3"],
    "ZeRO-3 + ckpt": ["--zero", "3", "--activation-checkpointing", "full"],
}


def _memory(root: Path, steps: int = 3) -> int:
    """Part 5: one model, four layouts: what a rank holds, estimated before launch and measured."""
    from fourfold.observe.visualize import MEMORY_TERMS, draw_memory
    from fourfold.run.args import parse_args
    from fourfold.run.fits import layout_memory
    from fourfold.train import main as train_main

    print("\nfourfold demo 5/5: memory. The same model on 2 data-parallel ranks: plain (every rank holds everything),"
          " ZeRO-1 (optimiser state split), ZeRO-3 (parameters and gradients too), and ZeRO-3 with activation "
          f"checkpointing; {steps} steps each\n", flush=True)
    flags = ["--nproc", "2", "--steps", str(steps), "--overwrite", "--no-progress", "--device", "cpu"]
    layouts: dict[str, dict[str, dict[str, int]]] = {}
    for name, extra in MEMORY.items():
        out = root / f"memory-{name.lower().replace(' + ', '-').replace('=', '')}"
        print(f"$ fourfold train {' '.join(flags)} {' '.join(extra)} --out {out}", flush=True)
        if train_main([*flags, *extra, "--out", str(out)]) != 0:
            print(f"fourfold demo: the {name} run failed; its error is above.", file=sys.stderr)
            return 1
        estimated = layout_memory(parse_args([*flags, *extra, "--out", str(out)]), 2)[0][0]
        measured = _rows(out)[-1]["memory_bytes"]
        layouts[name] = {"estimated": {t: getattr(estimated, t) for t in MEMORY_TERMS},
                         "measured": {t: measured[t] for t in MEMORY_TERMS}}
    print(f"\n  {'MB per rank':<16} " + " ".join(f"{t:>12}" for t in (*MEMORY_TERMS, "total")) + "   (estimated)")
    for name, kinds in layouts.items():
        m, e = kinds["measured"], kinds["estimated"]
        print(f"  {name:<16} " + " ".join(f"{m[t] / 2**20:12.2f}" for t in MEMORY_TERMS) +
              f" {sum(m.values()) / 2**20:12.2f}   ({sum(e.values()) / 2**20:.2f})")
    print("\n  ZeRO-1 splits the optimiser's state over the ranks, ZeRO-3 the parameters and gradients too (each")
    print("  gathered just before use); checkpointing keeps only each block's input for backward and recomputes")
    print("  the rest. The estimate is what `fourfold plan --memory` prints (and every run checks) before launch.")
    if draw_memory(layouts, root / "memory.png", "memory per rank, TinyGPT on 2 ranks: estimated before launch "
                   "(hatched) and measured"):
        print(f"  memory per rank, as stacked bars: {root / 'memory.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
