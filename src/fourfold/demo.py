"""``fourfold demo``: a short single-process TinyGPT run that prints and draws what happened.

    fourfold demo                       # about a minute on 2 CPU cores
    fourfold demo --steps 20 --out runs/quick

It trains TinyGPT on the built-in corpus (the Python standard library's source, read byte by byte), then
prints a summary, where each step's time went, and a sample of text from the trained model, and writes under
``--out``: ``metrics.jsonl``, ``trace.json`` (open in ui.perfetto.dev), ``timeline.png`` and ``model.pt``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

from fourfold.config import Config, TrainConfig
from fourfold.data import ByteTokenizer
from fourfold.models.gpt import TinyGPT
from fourfold.train import DTYPES, TrainResult, train

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


def _time_breakdown(result: TrainResult, tracer_spans: list) -> str:
    per_name: dict[str, list[float]] = defaultdict(list)
    for s in tracer_spans:
        per_name[s.name].append(s.duration_s * 1e3)
    steps = max(1, len(result.losses))
    return "  ".join(f"{name} {sum(v) / steps:.1f} ms" for name, v in per_name.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fourfold demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--out", default="runs/demo", help="where to write the outputs (default: runs/demo)")
    parser.add_argument("--steps", type=int, default=500, help="optimiser steps (default: 500)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    cfg = Config(train=replace(TrainConfig(), steps=args.steps, out=str(out), overwrite=True, device="cpu"))
    print(f"fourfold demo: training TinyGPT for {args.steps} steps on one process "
          f"(global batch {cfg.train.batch_size} x {cfg.model.seq_len} tokens)\n", flush=True)
    result = train(cfg)
    print("\n" + result.summary())
    tps = [r["tokens_per_s"] for r in result.metrics]
    print(f"\nthroughput: median {statistics.median(tps):,.0f} tokens/s over {len(tps)} steps")
    spans = _load_spans(out / "trace-rank0.jsonl")
    print(f"time per step: {_time_breakdown(result, spans)}")
    _draw(spans, out)
    prompt = "def "
    print(f"\nthe trained model continues {prompt!r}:\n---\n{prompt}{_sample(cfg, result, prompt, 120)}\n---")
    return 0


def _load_spans(path: Path) -> list:
    from fourfold.trace import load_jsonl

    return load_jsonl(path) if path.exists() else []


def _draw(spans: list, out: Path) -> None:
    try:
        from fourfold.visualize import timeline
    except ImportError:
        return
    last = [s for s in spans if s.step is not None and s.step > max(s.step or 0 for s in spans) - 3]
    path = out / "timeline.png"
    try:
        timeline({0: last}, path, title="the last 3 steps of rank 0", color_by="name")
    except ImportError as e:  # matplotlib missing: the picture is optional
        print(f"(no timeline picture: {e})")
        return
    print(f"timeline of the last 3 steps: {path}")


if __name__ == "__main__":
    sys.exit(main())
