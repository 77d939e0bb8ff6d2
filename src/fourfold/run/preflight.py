"""What ``fourfold train`` checks and says before any process starts: bad input fails here, in one paragraph,
never as a traceback on every rank.

    mesh = preflight(cfg, world_size)        # every check that needs no process group (the ranks run it too)
    before_launch_notes(cfg, mesh, world_size)   # the memory estimate (refuses what would not fit), notes

:func:`preflight` runs in the launcher and again in every rank (``scan_data=False``), so every rank fails alike.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from torch import nn

from fourfold.config import Config, recorded_settings
from fourfold.data import is_token_file, read_texts, token_range, vocab_of
from fourfold.files import check_writable, earlier_outputs, set_aside, written_by_a_run
from fourfold.launch import resolve_device
from fourfold.mesh import Mesh
from fourfold.models import dropout_sites, family_of, split_of, tensor_plan
from fourfold.models.build import ModelInfo, build_model, built_info, check_model, check_vocab, meta_model
from fourfold.models.gpt_plan import check_tinygpt_tp
from fourfold.models.hf import FAMILIES
from fourfold.parallel.pipeline.blocks import block_paths
from fourfold.parallel.pipeline.split import named_blocks
from fourfold.parallel.schedule import pipeline_schedule
from fourfold.parallel.tensor.plan import expand_plan
from fourfold.run.resume import (
    changed_settings,
    check_resume,
    continues_run,
    restart_count,
    resume_from,
)

__all__ = ["DATA_FLAGS", "PIPELINE_FLAGS", "before_launch_notes", "check_data_vocab", "preflight", "unused_flags"]


def preflight(cfg: Config, world_size: int, *, scan_data: bool = True) -> Mesh:
    """Every check that needs no process group, so bad input fails before any process starts. ``scan_data``:
    read a token file once through for its largest id (the launcher does; its ranks need not)."""
    t = cfg.train
    p = cfg.parallel
    resolve_device(t.device)  # --device cuda on a machine without CUDA: refused first, not by every rank
    mesh = cfg.parallel.mesh(world_size)  # the layout's own rules were checked as it was made
    stages = _check_pipeline(cfg, mesh) if mesh.pp > 1 else 1
    if t.model == "tinygpt":
        check_tinygpt_tp(cfg.model, mesh.tp, sequence_parallel=p.sequence_parallel, within=mesh.dp * mesh.tp)
    elif p.sequence_parallel and cfg.model.seq_len % mesh.tp:
        fit = cfg.model.seq_len - cfg.model.seq_len % mesh.tp
        raise ValueError(f"seq_len must be divisible by tp with sequence parallelism (each rank keeps T/tp tokens), "
                         f"got seq_len={cfg.model.seq_len} and tp={mesh.tp}. Pass --seq-len {fit or mesh.tp}, or "
                         "drop --sequence-parallel.")
    info = check_model(cfg, mesh.tp, stages)  # heads, blocks, positions: before any process starts
    meta = functools.cache(functools.partial(meta_model, cfg))  # built once, for the checks that read shapes
    resume = resume_from(cfg)  # the checkpoint this run starts from, if any (its manifest read once)
    if t.init_from is not None and resume is None:  # a resume's weights are its checkpoint's
        _check_init_from(cfg, meta)
    if t.verify and world_size > 1:  # one process's re-run of one process draws the same masks
        _check_no_dropout(cfg, meta)
    if mesh.cp > 1:
        _check_context(cfg, mesh, meta)
    if cfg.data.pack != "none" and cfg.data.data is not None and is_token_file(cfg.data.data):
        raise ValueError(f"--pack needs document boundaries, got the token file {cfg.data.data!r}, which has none. Pass "
                         "JSON Lines (one document per record), a folder (one per file), or --pack none.")
    if cfg.data.pack == "none" and t.batch_size % mesh.dp:
        raise ValueError(f"batch_size must be divisible by dp, got batch_size={t.batch_size}, dp={mesh.dp}. "
                         f"Pass --batch-size {-(-t.batch_size // mesh.dp) * mesh.dp} (a multiple of {mesh.dp}).")
    if cfg.data.pack == "none" and (t.batch_size // mesh.dp) % p.grad_accum:  # packed rows are padded to a multiple
        each, k = mesh.dp * p.grad_accum, p.grad_accum
        raise ValueError(f"each data-parallel shard must divide into --grad-accum micro-batches, got {t.batch_size // mesh.dp} "
                         f"sequences per shard (batch_size={t.batch_size}, dp={mesh.dp}) and grad_accum={k}. Pass "
                         f"--batch-size {-(-t.batch_size // each) * each} or --grad-accum "
                         f"{_divisor_near(t.batch_size // mesh.dp, k)}.")
    if cfg.data.data is not None and not (Path(cfg.data.data).is_file() or Path(cfg.data.data).is_dir()):
        raise ValueError(f"data must be a readable file or folder, got {cfg.data.data!r}. Leave --data out to use the "
                         "built-in corpus.")
    out = Path(cfg.output.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out must be a directory, got the file {out}. Pass another --out.")
    check_writable(out)
    if info.vocab_size is None and scan_data:  # a model of your own: its vocabulary is known once it is built
        info = _check_yours(cfg, info, mesh, stages, meta)
    check_data_vocab(cfg, info, scan=scan_data)
    if scan_data:
        check_text_data(cfg)
    if resume is not None:
        check_resume(cfg, resume)
    existing = [p.name for p in earlier_outputs(out)]
    continuing = restart_count() > 0 or (resume is not None and continues_run(cfg, resume))  # its own files
    if existing and not cfg.output.overwrite and not continuing:
        raise ValueError(f"out already holds an earlier run's {', '.join(existing)} in {out}. Pass --overwrite to "
                         "replace them, --resume to continue it, or another --out.")
    if resume is not None and cfg.output.overwrite and not continuing:  # what --overwrite moves aside, then deletes
        source = Path(resume["dir"]).resolve()
        moved = [p for p in [*earlier_outputs(out), *set_aside(out)] if source.is_relative_to(p.resolve())]
        if moved:
            raise ValueError(f"resume: the checkpoint {resume['dir']} lies in {moved[0]}, which this --overwrite run "
                             f"in {out} moves aside (before it loads the checkpoint) and deletes when it ends. Move "
                             f"the checkpoint out of {out} first, or pass another --out.")
    if existing and cfg.output.overwrite and not continuing and not written_by_a_run(out):
        raise ValueError(f"out holds {', '.join(existing)} in {out} but no run.json a fourfold run wrote, so they may "
                         "be files of yours: --overwrite replaces only an earlier run's outputs. Pass another --out, "
                         "or move them away.")
    return mesh


LARGEST_VOCAB = 1 << 24
"""Token ids at or above this (16.8 M) mean a token file read as the wrong dtype, not a vocabulary."""


def check_data_vocab(cfg: Config, info: ModelInfo, *, scan: bool) -> None:
    """The model's vocabulary must cover the data's ids: the tokenizer's, or (``scan``) the largest in a token
    file, found in one pass over it. The loader checks every batch's ids again as it reads them."""
    if cfg.data.data is None or not is_token_file(cfg.data.data):
        check_vocab(info, vocab_of(cfg.data.tokenizer))
    elif scan:
        low, high = token_range(cfg.data.data, cfg.data.data_dtype)
        if low < 0:
            raise ValueError(f"token ids must be >= 0, got {low} in {cfg.data.data}. Pass the --data-dtype the file was "
                             "written with")
        if high >= LARGEST_VOCAB:  # no vocabulary is that large: the bytes are read as the wrong type
            raise ValueError(f"token ids must be below {LARGEST_VOCAB:,} (no tokenizer's vocabulary is larger), "
                             f"got {high:,} in {cfg.data.data} read as --data-dtype {cfg.data.data_dtype}. Pass the --data-dtype "
                             "the file was written with (nanoGPT's .bin files: uint16).")
        check_vocab(info, high + 1, f"{Path(cfg.data.data).name} holds")


TEXT_CHECKED_BYTES = 64 * 2**20
"""Text data up to this size is read once in the launcher, so that an empty file, a .jsonl line without the text
key or bytes that are not UTF-8 are refused before any rank starts (larger data: by each rank as it reads)."""


def check_text_data(cfg: Config) -> None:
    """Read ``--data`` (text, a folder of it, JSON Lines) as the ranks will, when it is small enough, and refuse
    what they would refuse: in one line, before launch, rather than once per rank after it."""
    if cfg.data.data is None or is_token_file(cfg.data.data):
        return
    root = Path(cfg.data.data)
    files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()] if root.is_dir() else []
    if sum(p.stat().st_size for p in files) > TEXT_CHECKED_BYTES:
        return
    read_texts(cfg.data.data, cfg.data.text_key)  # refuses what the ranks' read would: no text, a keyless line, not UTF-8


def _check_no_dropout(cfg: Config, meta: Callable[[], nn.Module | None]) -> None:
    """``--verify`` compares with one process, which draws other dropout masks than the layout's ranks: with any
    dropout the differences are the masks', and a correct layout would be called a mismatch. Refused, naming
    where the probability is set."""
    t = cfg.train
    model = meta()
    if model is None:  # a model of your own that cannot be built on meta: each rank builds it
        return
    config = getattr(model, "config", None)
    found = dropout_sites(model)
    if found:
        from fourfold.models.build import model_config_path

        path = model_config_path(t)
        fix = ("Pass --dropout 0" if t.model == "tinygpt" else
               f"Set them to 0 in {'--model-config' if path == t.model_config else path}" if config is not None
               else "Build the model with dropout 0")
        raise ValueError(f"verify compares the layout with one process, which draws other dropout masks, so any "
                         f"dropout makes them differ however right the layout is, got {', '.join(found[:4])}"
                         f"{f' and {len(found) - 4} more' if len(found) > 4 else ''}. {fix} for --verify, or "
                         "drop --verify.")


def _check_context(cfg: Config, mesh: Mesh, meta: Callable[[], nn.Module | None]) -> None:
    """What context parallelism asks of the run, before any process starts: sequences the cut divides, no
    dropout (not built under cp), a Hugging Face config without a window or soft-capped scores, and heads that
    Ulysses can split."""
    from fourfold.parallel.context import check_length

    p, cp, T = cfg.parallel, mesh.cp, cfg.model.seq_len
    check_length(T, cp, p.cp_balance == "head-tail")
    model = meta()
    if model is not None and cfg.train.model in FAMILIES:  # a window, soft-capped scores: refused, named
        from fourfold.models.hf_context import check_context

        check_context(model.config, cp, T)
    found = dropout_sites(model) if model is not None else []
    if found:
        raise ValueError(f"dropout under context parallelism is not built (each rank would draw masks for its own "
                         f"chunk), got {', '.join(found[:4])}. Pass --dropout 0 (or build the model without), or "
                         "--cp 1")
    heads = cfg.model.n_head
    if p.cp_algorithm == "ulysses" and cfg.train.model == "tinygpt" and heads % (mesh.tp * cp):
        raise ValueError(f"Ulysses gives each cp rank heads / (tp x cp) heads, got n_head={heads} with tp={mesh.tp} "
                         f"and cp={cp}. Pass --cp-algorithm ring (any head count), or --n-head a multiple of "
                         f"{mesh.tp * cp}")


def _check_init_from(cfg: Config, meta: Callable[[], nn.Module | None]) -> None:
    """``--init-from``'s names and shapes against the model's, the weights' data left unread (built on the meta
    device where it can be, else without its weights)."""
    from fourfold.models.weights import check_weights, stored_shapes

    model = meta()
    if model is None:  # a model of your own that cannot be built on meta
        model = build_model(cfg, weights=False)
    check_weights(model, stored_shapes(cfg.train.init_from or ""), repr(cfg.train.init_from))


def _check_yours(cfg: Config, info: ModelInfo, mesh: Mesh, stages: int,
                 meta: Callable[[], nn.Module | None]) -> ModelInfo:
    """A model of your own, built on the meta device (shapes, no memory, no weights): ``info`` with its
    vocabulary, so one smaller than the data's is refused once, before launch; and what this layout needs of it,
    refused here rather than on every rank: under tp a plan whose every path names one of its modules, under
    pp a split (or a blocks list) of at least the pipeline's stages."""
    model = meta()
    if model is None:  # a model that cannot be built on meta: each rank checks it as it builds it
        return info
    try:
        family = family_of(model)
    except TypeError as e:  # a fourfold_split that is not a Split
        raise ValueError(f"model {cfg.train.model!r}: {e}") from None
    # a factory may return one of fourfold's families, which run sequence parallelism
    if cfg.parallel.sequence_parallel and not (family is not None and family.splits_sequence):
        raise ValueError(f"sequence_parallel is TinyGPT's and the Hugging Face families' (their plans run norms "
                         f"and residuals on sequence shards and know where attention mixes them), got model "
                         f"{cfg.train.model!r}, a {type(model).__name__}. Drop --sequence-parallel.")
    if mesh.tp > 1:
        plan = tensor_plan(model)  # a model with none is refused, naming fourfold_tp_plan
        if isinstance(plan, Mapping):
            expand_plan(model, plan)  # a path naming no module, or a style fourfold lacks
    if mesh.pp > 1:
        try:
            split = split_of(model, family)
            pieces = (len(block_paths(model, split.blocks)) + (split.before is not None) + (split.after is not None)
                      if split is not None else len(named_blocks(model)))
        except TypeError as e:  # neither a split nor a list of blocks
            raise ValueError(f"model {cfg.train.model!r}: a pipeline (--pp {mesh.pp}) cuts a model into blocks: "
                             f"{e}") from None
        if stages > pieces:
            raise ValueError(f"model {cfg.train.model!r}: stages must be at most the pieces of its split, got "
                             f"pp*virtual={stages} > {pieces}. Use fewer --pp, or split the model finer")
    return built_info(info, model)


def _check_pipeline(cfg: Config, mesh: Mesh) -> int:
    """The schedule's stages (the model's blocks are checked against them by check_model)."""
    t = cfg.train
    p = cfg.parallel
    # refuses combinations it cannot run, naming both numbers
    schedule = pipeline_schedule(p.strategy, p.schedule, mesh.pp, p.microbatches, p.virtual)
    m = schedule.microbatches
    shard = t.batch_size // mesh.dp
    if shard % m and cfg.data.pack == "none":  # packed rows are padded to a multiple of the micro-batches
        raise ValueError(f"each data-parallel shard must divide into micro-batches, got {shard} sequences per "
                         f"shard and microbatches={m}. Pass --microbatches {_divisor_near(shard, m)} or change "
                         "--batch-size.")
    return schedule.stages


def _divisor_near(n: int, m: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - m), -d))  # ties: more


def before_launch_notes(cfg: Config, mesh: Mesh, world_size: int) -> None:
    """The launcher's lines after :func:`preflight`: the memory estimate (a layout that would not fit is refused,
    ValueError), then what a resumed or ignored setting means for this run."""
    _default_size_note(cfg)
    _set_aside_note(Path(cfg.output.out), cfg.output.overwrite)
    _memory_line(cfg, world_size)
    _resume_note(cfg, mesh, world_size)
    _unused_note(cfg, mesh)
    t = cfg.train
    if t.init_from is not None and cfg.data.tokenizer == str(Path(t.init_from) / "tokenizer.json"):
        print(f"fourfold train: text becomes ids by {cfg.data.tokenizer}, the tokenizer of --init-from's model",
              file=sys.stderr, flush=True)
    if world_size > 1 and t.hang_threshold >= t.timeout:
        print(f"fourfold train: note: --hang-threshold {t.hang_threshold:g} s is not below --timeout {t.timeout:g} "
              "s, so a stuck run ends at the timeout, whose error names the operation, before the hang doctor can "
              "name the rank that never arrived. Pass a --hang-threshold below --timeout.",
              file=sys.stderr, flush=True)


def _set_aside_note(out: Path, overwrite: bool) -> None:
    """OUT holds runs a failed ``--overwrite`` set aside: say so before anything runs, what becomes of them, and
    how to restore one."""
    for aside in set_aside(out):
        held = ", ".join(sorted(p.name for p in aside.iterdir())) or "nothing"
        fate = ("this --overwrite run replaces it: it is removed when this run finishes" if overwrite else
                f"it is kept (a run with --overwrite would replace it). To restore it: mv {out / aside.name}/* {out}/")
        print(f"fourfold train: note: {out / aside.name}/ holds an earlier run that an --overwrite run set aside "
              f"and did not finish ({held}); {fate}.", file=sys.stderr, flush=True)


def _default_size_note(cfg: Config) -> None:
    """A Hugging Face family given no config (no --model-config, no --init-from, no checkpoint's) is the full-size
    model transformers' config class describes by default (LlamaConfig's 6.7 B parameters): say so first, and how
    to size it, before the memory estimate says whether it fits."""
    from fourfold.models.build import model_config_path
    from fourfold.models.hf import causal_lm_class

    t = cfg.train
    if t.model in FAMILIES and model_config_path(t) is None:
        name = causal_lm_class(t.model).config_class.__name__
        print(f"fourfold train: note: --model {t.model} without --model-config builds transformers' default {name}, "
              f"a full-size model. Pass --model-config FILE.json to size it (examples/*-tiny.json are small ones).",
              file=sys.stderr, flush=True)


def _memory_line(cfg: Config, world_size: int) -> None:
    """Before launch: each rank's memory, estimated; a layout that would not fit is refused (ValueError)."""
    if cfg.train.memory_check:
        from fourfold.run.fits import check_memory

        print(f"fourfold train: {check_memory(cfg, world_size)}", flush=True)


def _resume_note(cfg: Config, mesh: Mesh, world_size: int) -> None:
    """Say so when a resumed run will not continue the checkpoint's run exactly: a training setting given
    another value, or what each rank keeps of its own, restored only under the checkpoint's layout: int8's and
    PowerSGD's state (errors fed back, factors), the dropout streams."""
    p = cfg.parallel
    resume = resume_from(cfg)
    changed = changed_settings(cfg, resume) if resume is not None else []
    if resume is not None and changed:
        print(f"fourfold train: note: resuming step {resume['step']} with {', '.join(changed)}; the run goes on "
              "with these, so it is not the checkpoint's run continued exactly.", file=sys.stderr, flush=True)
    if resume is None or (resume["world_size"] == world_size
                          and resume["mesh"] == mesh.record()):
        return  # below: what each rank keeps of its own, continued only under the checkpoint's layout
    if mesh.dp > 1 and p.compress in ("int8", "powersgd"):
        print(f"fourfold train: note: --compress {p.compress} keeps state on each rank (its errors fed back), "
              f"restored only under the checkpoint's layout ({resume['world_size']} ranks, {resume['mesh']}): "
              "this run starts it afresh, so its losses follow an uninterrupted run's closely, not exactly.",
              file=sys.stderr, flush=True)
    model = meta_model(cfg)
    sites = dropout_sites(model) if model is not None else []
    if sites:
        what = "each rank's own streams" if world_size > 1 else "its ranks' own streams (one process: torch's)"
        print(f"fourfold train: note: the model's dropout ({', '.join(sites[:2])}) draws from {what}, continued "
              f"only under the checkpoint's layout ({resume['world_size']} ranks, {resume['mesh']}): this run "
              f"draws afresh from the seed and step {resume['step']}, so its losses follow an uninterrupted run's "
              "statistically, not exactly.", file=sys.stderr, flush=True)


PIPELINE_FLAGS = ("schedule", "microbatches", "virtual")
"""What a schedule reads: nothing to do without a pipeline (pp=1) or under strategy model (one micro-batch)."""
DATA_FLAGS = ("allreduce", "bucket_mb", "reduce_dtype", "compress", "powersgd_rank", "powersgd_warmup", "zero",
              "sync_batchnorm", "find_unused_parameters")
"""What the gradient sync reads: nothing to do without data parallelism (dp=1)."""


def unused_flags(cfg: Config, mesh: Mesh) -> list[str]:
    """The flags set away from their defaults that this layout does not read, each with why: ``"--virtual 3
    (only --schedule interleaved reads it)"``. No pipeline (pp=1) or strategy model: the schedule's flags; no
    data parallelism (dp=1): the gradient sync's; a schedule other than interleaved: --virtual; a compression
    other than PowerSGD: its rank and warm-up."""
    t, p = cfg.train, cfg.parallel
    why: dict[str, str] = {}
    if mesh.pp == 1:
        why.update(dict.fromkeys(PIPELINE_FLAGS, "pp=1: no pipeline"))
        why["microbatches"] = "pp=1: no pipeline; --grad-accum N cuts each step into N micro-batches without one"
    elif p.strategy == "model":  # strategy model at pp=1 is refused by the Layout
        why.update(dict.fromkeys(PIPELINE_FLAGS, "--strategy model runs one micro-batch"))
    elif p.schedule != "interleaved":
        why["virtual"] = f"only --schedule interleaved reads it, got --schedule {p.schedule}"
    if cfg.optim.lr_decay == "none":
        why["min_lr"] = "only --lr-decay linear or cosine reads it"
    if not t.eval_every:
        why["eval_batches"] = "only --eval-every reads it"
    if cfg.data.data is None or not str(cfg.data.data).endswith(".jsonl"):
        why["text_key"] = "only a --data FILE.jsonl reads it"
    if mesh.dp == 1:
        why.update(dict.fromkeys(DATA_FLAGS, "dp=1: no gradient sync"))
    elif p.compress != "powersgd":
        why.update(dict.fromkeys(("powersgd_rank", "powersgd_warmup"),
                                 f"only --compress powersgd reads it, got --compress {p.compress}"))
    given = recorded_settings(cfg.to_dict())
    defaults = recorded_settings(Config().to_dict())
    return [f"--{n.replace('_', '-')} {given[n]} ({reason})" for n, reason in why.items() if given[n] != defaults[n]]


def _unused_note(cfg: Config, mesh: Mesh) -> None:
    """Say, before launch, which flags this layout ignores and why (so a sweep's shared flags still run)."""
    unused = unused_flags(cfg, mesh)
    if unused:
        one = len(unused) == 1
        print(f"fourfold train: note: {'; '.join(unused)}: {'it has' if one else 'they have'} no effect in this "
              f"run; run.json records {'it' if one else 'them'} as given.", file=sys.stderr, flush=True)
