"""The ``fourfold`` command: one entry point, one sub-command per job.

    fourfold train --steps 50 --nproc 2     train TinyGPT (data parallel over 2 ranks)
    fourfold demo                           a short guided run that prints what it did
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

from fourfold import __version__

__all__ = ["main"]

COMMANDS = {
    "train": ("fourfold.train", "train a model (TinyGPT, GPT-2, Llama or your own: --model) on one process or --nproc N"),
    "demo": ("fourfold.cli.demo", "a short run that trains, then prints and draws what happened"),
    "explain": ("fourfold.cli.explain", "draw an all-reduce step by step from a real run: fourfold explain ring"),
    "bench": ("fourfold.bench", "benchmarks beside PyTorch's own (allreduce, dp, tp, pp, packing, zero, predict): "
              "fourfold bench dp --nproc 2"),
    "schedule": ("fourfold.cli.schedule", "print and draw a pipeline schedule, its bubble and memory: "
                 "fourfold schedule --schedule 1f1b"),
    "lab": ("fourfold.cli.lab", "an emulated cluster (namespaces, shaped links; root): fourfold lab run --nodes 2 "
            "-- fourfold train"),
    "export": ("fourfold.cli.export", "a run's final weights as a Hugging Face directory (model.safetensors, "
               "config.json, tokenizer.json): fourfold export runs/x --out runs/x-hf"),
    "plan": ("fourfold.cli.plan", "which layout: every one that fits, fastest first (fourfold plan --gpus 64 "
             "--gpu-mem 80GB --link 400gbit), or one's memory (plan --memory --nproc 4 --zero 2)"),
}

USAGE = f"""usage: fourfold [-h] [--version] COMMAND [ARGS]

fourfold {__version__}: train PyTorch models on many devices with model, tensor, data and pipeline
parallelism, and see what each one costs.

commands:
{chr(10).join(f"  {name:<8} {text}" for name, (_, text) in COMMANDS.items())}

Run `fourfold COMMAND --help` for a command's flags. Examples:
  fourfold train --steps 20 --dtype float64 --out runs/first
  fourfold train --nproc 2 --steps 20 --out runs/dp2     # 2 data-parallel ranks through torchrun
  fourfold demo
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0
    if argv[0] == "--version":
        print(f"fourfold {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        near = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        print(f"fourfold: unknown command {name!r}.{hint} Commands: {', '.join(COMMANDS)}.", file=sys.stderr)
        return 2
    import importlib

    with _quiet_cpp_warnings():
        module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


@contextlib.contextmanager
def _quiet_cpp_warnings() -> Iterator[None]:
    """This process logs only C++ errors (a launcher; with --nproc 1 the one rank too): torchrun's store client
    otherwise prints a warning and ~20 C++ stack frames each time it retries a machine that has not joined,
    before fourfold's one line saying so. c10 reads ``TORCH_CPP_LOG_LEVEL`` once, as torch loads (while the
    command imports), so the variable is removed again after: the ranks, started later, log as the user's
    environment says. A level the user set is kept."""
    if "TORCH_CPP_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    try:
        yield
    finally:
        os.environ.pop("TORCH_CPP_LOG_LEVEL", None)


if __name__ == "__main__":
    sys.exit(main())
