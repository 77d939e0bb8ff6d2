"""Run configuration: typed dataclasses, one per section, each validated as it is made. They are filled from
defaults, then a TOML file, then command-line flags (and a resumed run's model settings, left out, from its
checkpoint) by :mod:`fourfold.run.args`.

A TOML file has one table per section, model / data / parallel / optim / train / checkpoint / output / launch::

    [model]
    n_layer = 4
    d_model = 128

    [data]
    data = "corpus.txt"

    [parallel]          # the Layout (fourfold.engine.layout): every parallel setting and its rules
    tp = 2
    zero = 1
    allreduce = "ring"

    [optim]
    lr = 3e-3

    [train]
    steps = 50
    batch_size = 16

    [checkpoint]
    checkpoint_every = 10

    [output]
    out = "runs/tp2"

    [launch]
    nproc = 4

A file written before the sections, with their keys under ``[train]``, still loads (one note names each key's
table). Each section checks its own fields as it is made; :class:`Config` the rules across sections.

``fourfold train --print-config`` prints a run's whole configuration in this form. Every field is also a flag spelled with dashes (``--n-layer``, ``--batch-size``, ``--nproc``); the same name
is used in the file, the flag, the docs and ``metrics.jsonl``. An unknown key or flag is refused with the
nearest valid name.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from fourfold.engine.layout import Layout
from fourfold.launch import DEFAULT_HANG_S, DEFAULT_TIMEOUT_S
from fourfold.models.gpt import GPTConfig
from fourfold.models.hf import read_model_config
from fourfold.torchrun import LaunchConfig

__all__ = ["MODEL_HELP", "SECTIONS", "CheckpointConfig", "Config", "DataConfig", "LaunchConfig", "OptimConfig",
           "OutputConfig", "TrainConfig", "recorded_settings", "to_toml"]


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class TrainConfig:
    """How to train: the model, steps, global batch, seed, dtype, device, evaluation and verification, memory and
    time limits."""

    model: str = field(default="tinygpt", metadata=_help(
        "what to train: tinygpt (sized by the [model] flags), gpt2, llama, mistral, qwen2, qwen3, gemma, "
        "gemma2, gemma3_text, granite, phi3, olmo2, olmo3 or smollm3 (Hugging Face, needs fourfold[hf]; sized by "
        "--model-config), or MODULE:FACTORY, your own: FACTORY(**model_config) returns an nn.Module"))
    model_config: str | None = field(default=None, metadata=_help(
        "with --model gpt2|llama|mistral|qwen2|qwen3|gemma|gemma2|gemma3_text|granite|phi3|olmo2|olmo3|smollm3: a JSON "
        "file of the Hugging Face config's keys (vocab_size, n_layer, ...); with MODULE:FACTORY: a JSON file of the "
        "factory's keyword arguments"))
    init_from: str | None = field(default=None, metadata=_help(
        "start from these weights: a Hugging Face model directory (config.json and model.safetensors, as "
        "save_pretrained writes; it sizes the model and names its family, --model optional), a .safetensors "
        "file, or a torch state dict (.pt, a run's model.pt); checked against the model before launch, nothing "
        "downloaded"))
    steps: int = field(default=20, metadata=_help("optimiser steps to run"))
    batch_size: int = field(default=16, metadata=_help(
        "global batch: sequences per optimiser step, summed over data-parallel ranks"))
    seed: int = field(default=0, metadata=_help("seed for the initial weights and the batch order"))
    dtype: Literal["float32", "float64"] = field(default="float32", metadata=_help(
        "parameter and activation dtype (float64 for exact comparisons)"))
    memory_check: bool = field(default=True, metadata=_help(
        "before launch, estimate each rank's memory (parameters, gradients, optimiser state, activations) and "
        "refuse a layout that would not fit, naming the largest term and the cheapest change that fits"))
    memory_limit: str | None = field(default=None, metadata=_help(
        "memory per rank to plan against, e.g. 80GB (default: the GPU's, or the machine's available memory "
        "shared by its ranks)"))
    device: Literal["auto", "cpu", "cuda"] = field(default="auto", metadata=_help(
        "where to train: cuda:<local rank> with NCCL when available (auto), else cpu with gloo"))
    timeout: float = field(default=DEFAULT_TIMEOUT_S, metadata=_help(
        "seconds any collective or send/recv may wait before the run fails with a named error"))
    hang_threshold: float = field(default=DEFAULT_HANG_S, metadata=_help(
        "seconds a rank may wait in one operation before the hang doctor looks for the rank that never "
        "arrived; a stopped or deadlocked one ends the run, named (0: off)"))
    eval_every: int = field(default=0, metadata=_help(
        "every N steps and at the last, the loss on held-out data (--eval-batches x --batch-size windows or "
        "documents spread evenly through the data, which training then never reads), forward only in eval mode: "
        "metrics.jsonl eval_loss (0: off)"))
    eval_batches: int = field(default=2, metadata=_help("with --eval-every: held-out batches per evaluation"))
    verify: int = field(default=0, metadata=_help(
        "after the run, re-run its first N steps in one process (rank 0) and print the loss and parameter "
        "differences per step, judged by float64's 1e-10, or float32's 1e-5 of the loss and 1e-3 of the update "
        "(docs: README); a mismatch exits with status 1 (0: off)"))

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {name}={getattr(self, name)}.")
        if self.eval_every < 0 or self.eval_batches < 1:
            raise ValueError(f"eval_every must be >= 0 (0: off) and eval_batches >= 1, got eval_every="
                             f"{self.eval_every}, eval_batches={self.eval_batches}.")
        if self.verify < 0 or self.verify > self.steps:
            raise ValueError(f"verify must be between 0 and steps, got verify={self.verify}, steps={self.steps}. "
                             f"Pass --verify {min(max(self.verify, 0), self.steps)}.")
        if self.memory_limit is not None:
            from fourfold.units import parse_bytes

            parse_bytes(self.memory_limit, what="memory_limit", unit=True)  # a size, with its unit (80 is not 80GB)
        if self.timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got timeout={self.timeout}.")
        if self.hang_threshold < 0:
            raise ValueError(f"hang_threshold must be >= 0 seconds (0 = off), got hang_threshold="
                             f"{self.hang_threshold}.")
        module, colon, factory = self.model.partition(":")
        from fourfold.models.hf import FAMILIES, named_like

        if self.model not in ("tinygpt", *FAMILIES) and not (
                colon and all(p.isidentifier() for p in module.split(".")) and factory.isidentifier()):
            near = named_like(self.model, ("tinygpt", *FAMILIES))
            fix = f"Did you mean --model {near}? " if near else ""
            raise ValueError(f"model must be tinygpt, {', '.join(FAMILIES)} or MODULE:FACTORY (an importable module "
                             f"and a function in it), got {self.model!r}. {fix}Pass --model gpt2, or --model "
                             "mypkg.models:build")
        if self.init_from is not None:
            self._check_init_from(FAMILIES)
        if self.model_config is not None and self.model == "tinygpt":
            raise ValueError(f"model_config sizes a Hugging Face ({', '.join(FAMILIES)}) or MODULE:FACTORY model, "
                             f"got model_config="
                             f"{self.model_config!r} with model='tinygpt'. Size TinyGPT with --n-layer, --d-model, "
                             "..., or pass --model gpt2")

    def _check_init_from(self, families: tuple[str, ...]) -> None:
        """A Hugging Face directory sizes the model itself: its ``model_type`` must be ``model``, with no
        ``model_config`` beside it; a file must exist (its names and shapes are checked before launch)."""
        from fourfold.models.weights import check_file, hf_directory

        check_file(self.init_from or "")
        config = hf_directory(self.init_from or "")
        if config is None:
            return
        kind = config.get("model_type")
        if kind not in families:
            raise ValueError(f"init_from's config.json must be of a family fourfold has a plan for ({', '.join(families)}), "
                             f"got model_type={kind!r} in {self.init_from!r}. Pass a model of your own as "
                             "--model MODULE:FACTORY with --init-from its .safetensors file.")
        if self.model != kind:  # (fourfold train's flags left out, the directory's family is taken: run.args)
            raise ValueError(f"init_from holds a {kind} model (its config.json's model_type), got model="
                             f"{self.model!r}. Pass --model {kind}, or leave --model out.")
        if self.model_config is not None:
            raise ValueError(f"init_from's config.json sizes the model, got model_config={self.model_config!r} "
                             "beside it. Drop --model-config (or edit the directory's config.json).")


@dataclass(frozen=True)
class DataConfig:
    """What to train on and how text becomes token ids and rows."""

    data: str | None = field(default=None, metadata=_help(
        "what to train on: a text file, a folder of them, a .jsonl of {\"text\": ...} lines, or token ids in a "
        ".npy / .bin (memory-mapped; larger than memory is fine). Default: the built-in corpus, the Python "
        "standard library's source"))
    text_key: str = field(default="text", metadata=_help(
        "with --data FILE.jsonl: the key of each record's text (\"content\", say)"))
    tokenizer: str = field(default="bytes", metadata=_help(
        "how text becomes ids: bytes (UTF-8 bytes, 256 ids), a tokenizer.json (Hugging Face tokenizers), or "
        "bpe:N (a byte-level BPE of N ids trained on the data at start-up, saved as OUT/tokenizer.json). Left "
        "out with --init-from a directory holding a tokenizer.json: that one"))
    data_dtype: Literal["uint8", "uint16", "int32", "uint32", "int64"] = field(default="uint16", metadata=_help(
        "the integer type of a .bin file's token ids (a .npy says its own)"))
    pack: Literal["none", "pad", "first-fit", "bfd"] = field(default="none", metadata=_help(
        "train on whole documents (JSON Lines records, files of a folder, or the built-in standard-library "
        "functions) instead of windows of one stream: pad (each padded to the step's longest), first-fit or bfd "
        "(packed into rows of --seq-len, attention kept inside each document); --batch-size then counts "
        "documents"))
    tokens_per_step: int | None = field(default=None, metadata=_help(
        "with --pack: each step takes documents until their tokens would pass this budget (instead of "
        "--batch-size documents)"))
    truncate_documents: bool = field(default=False, metadata=_help(
        "with --pack: keep only a document's first --seq-len tokens (default: split it into rows, none lost)"))

    def __post_init__(self) -> None:
        if self.pack == "none" and (self.tokens_per_step is not None or self.truncate_documents):
            raise ValueError("tokens_per_step and truncate_documents arrange documents, got pack='none'. Pass "
                             "--pack bfd (or pad, first-fit), or drop them.")
        if self.tokens_per_step is not None and self.tokens_per_step < 1:
            raise ValueError(f"tokens_per_step must be >= 1, got {self.tokens_per_step}.")
        from fourfold.data import is_token_file
        from fourfold.data.tokenizers import check_tokenizer_spec

        check_tokenizer_spec(self.tokenizer)
        if not self.text_key:
            raise ValueError("text_key must name the key of each JSON Lines record's text, got an empty string. Pass "
                             "--text-key text (the default), or the key your records use.")
        if self.tokenizer != "bytes" and self.data is not None and is_token_file(self.data):
            raise ValueError(f"tokenizer reads text, got tokenizer={self.tokenizer!r} with token ids in "
                             f"data={self.data!r}. Drop --tokenizer (the ids are used as they are)")


@dataclass(frozen=True)
class OptimConfig:
    """The optimiser (AdamW), its learning-rate schedule and gradient clipping."""

    lr: float = field(default=3e-3, metadata=_help("AdamW learning rate"))
    weight_decay: float = field(default=0.0, metadata=_help("AdamW weight decay"))
    warmup_steps: int = field(default=0, metadata=_help(
        "raise the learning rate linearly over the first N steps, to --lr at step N"))
    lr_decay: Literal["none", "linear", "cosine"] = field(default="none", metadata=_help(
        "after the warm-up, lower the learning rate from --lr to --min-lr at the last step (--steps)"))
    min_lr: float = field(default=0.0, metadata=_help("with --lr-decay linear|cosine: the last step's learning rate"))
    max_grad_norm: float = field(default=0.0, metadata=_help(
        "clip the gradients before each step so their global norm (the whole model's, as one process computes "
        "it, under any layout) is at most this; metrics.jsonl records grad_norm, and a non-finite norm stops "
        "the run before the step (0: off)"))

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got lr={self.lr}.")
        if not 0 <= self.min_lr < self.lr:
            raise ValueError(f"min_lr must be >= 0 and below lr, got min_lr={self.min_lr}, lr={self.lr}. Pass "
                             f"--min-lr {self.lr / 10:g} (a tenth of --lr), say.")
        if not 0 <= self.max_grad_norm < math.inf:  # NaN too; and run.json stays JSON
            raise ValueError(f"max_grad_norm must be finite and >= 0 (0: off), got max_grad_norm={self.max_grad_norm}. "
                             "Pass --max-grad-norm 1.0, say (a value it never reaches records the norm only).")


@dataclass(frozen=True)
class CheckpointConfig:
    """Training checkpoints: how often, how many kept, and where a resumed run starts."""

    checkpoint_every: int = field(default=0, metadata=_help(
        "save a training checkpoint (model, optimiser, RNG, step) to OUT/checkpoints every N steps and at the "
        "end (0: only at the end)"))
    keep: int = field(default=2, metadata=_help("training checkpoints to keep, the newest"))
    resume: str | None = field(default=None, metadata=_help(
        "continue from the newest complete checkpoint of this run directory (or this checkpoint) up to "
        "--steps, under any layout; into the same --out the run's files are continued. The model's flags left out "
        "are the checkpoint's"))

    def __post_init__(self) -> None:
        if self.checkpoint_every < 0 or self.keep < 1:
            raise ValueError(f"checkpoint_every must be >= 0 and keep >= 1, got checkpoint_every="
                             f"{self.checkpoint_every}, keep={self.keep}.")


@dataclass(frozen=True)
class OutputConfig:
    """What a run writes: its directory, and which of its files."""

    out: str = field(default="runs/train", metadata=_help(
        "output directory: metrics.jsonl, trace.json, trace-rank*.jsonl, model.pt"))
    overwrite: bool = field(default=False, metadata=_help(
        "replace the outputs of an earlier run in OUT (refused otherwise, so no run is lost)"))
    trace: bool = field(default=True, metadata=_help("record per-rank spans and write trace.json"))
    save: bool = field(default=True, metadata=_help("save the final weights to OUT/model.pt"))
    progress: bool = field(default=True, metadata=_help("show a progress bar on rank 0"))

    def __post_init__(self) -> None:
        if not self.out.strip():
            raise ValueError("out must name a directory, got an empty string. Pass --out runs/NAME.")


MODEL_HELP = {
    "vocab_size": "vocabulary size (256 for the byte-level tokenizer)",
    "seq_len": "tokens per sequence (the model's context length)",
    "n_layer": "transformer blocks",
    "n_head": "attention heads per block",
    "d_model": "width of the residual stream",
    "dropout": "dropout probability (0 keeps runs exactly reproducible)",
    "tie_weights": "share the token embedding with the output head",
    "bias": "use biases in linear layers and layer norms",
}


@dataclass(frozen=True)
class Config:
    """Everything one run needs; sections match the TOML tables."""

    model: GPTConfig = field(default_factory=GPTConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: Layout = field(default_factory=Layout)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    def __post_init__(self) -> None:
        t, p, o, c = self.train, self.parallel, self.optim, self.checkpoint  # across sections; each checked its own
        if o.warmup_steps < 0 or o.warmup_steps > t.steps:
            raise ValueError(f"warmup_steps must be between 0 and steps, got warmup_steps={o.warmup_steps}, "
                             f"steps={t.steps}. Pass --warmup-steps {min(max(o.warmup_steps, 0), t.steps)}.")
        if c.resume is not None and t.verify:
            raise ValueError(f"verify re-runs a run's first steps from its initial weights; a resumed run starts "
                             f"from a checkpoint, got verify={t.verify} with resume={c.resume!r}. Drop "
                             "--verify, or verify the run that wrote the checkpoint.")
        if p.precision == "bf16" and t.dtype != "float32":
            raise ValueError(f"precision bf16 keeps float32 master weights, got dtype={t.dtype}. Pass --dtype "
                             "float32 with --precision bf16.")
        if p.reduce_dtype == "float32" and t.dtype == "float64":
            raise ValueError("reduce_dtype float32 would round float64 gradients, got dtype=float64. Leave "
                             "--reduce-dtype auto (or pass bfloat16 deliberately).")
        if self.train.model == "tinygpt":
            return
        default = GPTConfig()
        sized = [f for f in TINYGPT_ONLY if getattr(self.model, f) != getattr(default, f)]
        if sized:  # they would be ignored: a 124 M-parameter GPT-2 trained where the flags asked for a tiny model
            given = ", ".join(f"{f}={getattr(self.model, f)!r}" for f in sized)
            flags = ", ".join("--" + f.replace("_", "-") for f in sized)
            one = len(sized) == 1
            sized_by_directory = self.train.model_config is None and self.train.init_from is not None and \
                os.path.isdir(self.train.init_from)
            source, fix = ((f"sized by --init-from {self.train.init_from}'s config.json", "") if sized_by_directory
                           else ("whose size and vocabulary come from --model-config (a JSON object of its config's "
                                 "keys, e.g. examples/gpt2-tiny.json, or of your factory's keyword arguments)",
                                 ", or put the values in --model-config"))
            raise ValueError(f"{flags} {'shapes' if one else 'shape'} TinyGPT only, got {given} with "
                             f"model={self.train.model!r}, {source}. Drop {'it' if one else 'them'}{fix}.")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {s.name: dataclasses.asdict(getattr(self, s.name)) for s in dataclasses.fields(self)}

    @functools.cached_property
    def model_config_values(self) -> dict[str, Any] | None:
        """``--model-config``'s JSON object (or ``--init-from``'s directory's ``config.json``), read once (the first
        :meth:`record`, as the run starts): a file edited or removed mid-run changes nothing the run writes down,
        and costs no checkpoint."""
        from fourfold.models.build import model_config_path

        path = model_config_path(self.train)
        return read_model_config(path) if path is not None else None

    def record(self) -> dict[str, Any]:
        """What a run writes down (run.json, checkpoints, model.pt): :meth:`to_dict` (for a model other than TinyGPT
        without TinyGPT's sizes and dropout, its defaults, which would read as this model's), and
        ``--model-config``'s JSON object itself under ``model_config_values``, so a resume compares contents, not
        paths."""
        record: dict[str, Any] = self.to_dict()
        if self.train.model != "tinygpt":  # TinyGPT's sizes and dropout are not this model's: never written down
            record["model"] = {k: v for k, v in record["model"].items() if k not in TINYGPT_ONLY}
        if self.model_config_values is not None:
            record["model_config_values"] = self.model_config_values
        if self.train.eval_every:
            from fourfold.data.loader import HELD_OUT

            record["held_out"] = HELD_OUT  # which data evaluation holds out, as a resume compares it
        return record


TINYGPT_ONLY = ("vocab_size", "n_layer", "n_head", "d_model", "dropout", "tie_weights", "bias")
"""The [model] fields only TinyGPT reads (seq_len is every model's: the data's). Another model's vocabulary is
its config's, checked against the data's before launch."""


def to_toml(cfg: Config) -> str:
    """``cfg`` as a TOML file that ``--config`` reads back to the same configuration: one table per section, every
    field (a value left None is left out: its default)."""
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items() if value is not None]
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)}  # type: ignore[misc]


def recorded_settings(record: dict[str, Any]) -> dict[str, Any]:
    """A recorded configuration's (run.json's, a checkpoint's) settings of every section in one table: a run
    written before the sections kept its data, parallel, optim, checkpoint and output settings under [train]."""
    return {key: value for section in SECTIONS if section != "model" and isinstance(record.get(section), dict)
            for key, value in record[section].items()}
