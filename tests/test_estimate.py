"""Memory known before launch (:mod:`fourfold.plan.estimate`, ``fourfold plan --memory``, the check every
``fourfold train`` runs first) against what the ranks then measure: parameters, gradients and optimiser state
within 5 %, peak activations within 15 %, per pipeline rank, for each layout below (one 4-rank spawn).

Reading a failure: held terms off under tp point at the plan's description (``TINYGPT_SHARDS``); under pp at
the stage cut (the partition by parameter count); activations off under pp at the schedule's peak of
micro-batches in flight.
"""

from __future__ import annotations

import functools
import subprocess

import pytest
import torch

from fourfold import Layout, parallelize
from fourfold.engine.parallelize import model_blocks
from fourfold.models import GPTConfig, TinyGPT, shard_plan
from fourfold.observe.memory import held_bytes
from fourfold.plan.estimate import estimate_memory, probe_activations
from fourfold.testing import run_ranks
from fourfold.units import parse_bytes
from helpers import batches, optimizer, shard

CFG = GPTConfig(vocab_size=256, seq_len=32, n_layer=4, n_head=4, d_model=64)
BATCH = 16
LAYOUTS = [  # (label, dp, tp, pp, options)
    ("dp4", 4, 1, 1, {}),
    ("dp4 zero1", 4, 1, 1, {"zero": 1}),
    ("dp4 zero3", 4, 1, 1, {"zero": 3}),
    ("dp4 checkpointing", 4, 1, 1, {"activation_checkpointing": "full"}),
    ("dp2 tp2", 2, 2, 1, {}),  # the norms' and residuals' tensors whole on both tp ranks
    ("dp2 tp2 sp", 2, 2, 1, {"sequence_parallel": True}),
    ("dp2 tp2 sp zero2", 2, 2, 1, {"sequence_parallel": True, "zero": 2}),
    ("dp2 pp2 gpipe", 2, 1, 2, {"schedule": "gpipe"}),
    ("dp2 pp2 1f1b", 2, 1, 2, {"schedule": "1f1b"}),
    ("dp2 pp2 model", 2, 1, 2, {"strategy": "model"}),  # the whole shard at once, whatever microbatches says
    ("dp2 pp2 interleaved", 2, 1, 2, {"schedule": "interleaved"}),
    ("dp2 pp2 zb zero1", 2, 1, 2, {"schedule": "zb", "zero": 1}),
    ("tp2 pp2 1f1b", 1, 2, 2, {"schedule": "1f1b"}),
    ("tp2 pp2 1f1b sp", 1, 2, 2, {"schedule": "1f1b", "sequence_parallel": True}),
    ("tp2 pp2 zb", 1, 2, 2, {"schedule": "zb"}),  # row layers' output gradients kept whole for W
    ("tp2 pp2 zb sp", 1, 2, 2, {"schedule": "zb", "sequence_parallel": True}),
    ("dp2 cp2", 2, 1, 1, {"cp": 2}),  # each rank half of each sequence's activations
    ("cp4 ulysses", 1, 1, 1, {"cp": 4, "cp_algorithm": "ulysses"}),
    ("cp2 pp2 1f1b zero1", 1, 1, 2, {"cp": 2, "schedule": "1f1b", "zero": 1}),  # ZeRO over dp x cp
]
MICRO = 4


def _measure(ctx) -> list[dict]:
    out = []
    for label, dp, tp, pp, options in LAYOUTS:
        layout = Layout(dp=dp, tp=tp, pp=pp, microbatches=MICRO, **options)
        ranks = layout.mesh(4).build(30)
        engine = parallelize(TinyGPT(CFG, seed=0), ranks, layout)
        opt = optimizer(engine.parameters())
        x, y = batches(CFG, batch=BATCH, steps=1)[0]
        loss = engine.step(shard(x, ranks.coord.dp, dp), shard(y, ranks.coord.dp, dp))
        opt.step()
        held = held_bytes(engine.parameters(), opt)
        opt.zero_grad(set_to_none=True)
        loss.item()
        out.append({"label": label, "pp_rank": ranks.coord.pp, **held, "activations": loss.activation_bytes})
    return out


@functools.cache
def _measured() -> list[list[dict]]:
    return run_ranks(_measure, 4, timeout_s=240)


@functools.cache
def _estimates() -> list[list]:
    model = TinyGPT(CFG, seed=0)
    blocks = model_blocks(model, None)
    probe = probe_activations(model, blocks, CFG.seq_len, shard_plan(model))
    out = []
    for _, dp, tp, pp, options in LAYOUTS:
        every = 1 if options.get("activation_checkpointing") == "full" else 0
        out.append(estimate_memory(model, blocks, dp=dp, tp=tp, pp=pp, batch_size=BATCH,
                                   microbatches=MICRO if pp > 1 else 1, schedule=options.get("schedule", "1f1b"),
                                   strategy=options.get("strategy", "pipeline"),
                                   zero=options.get("zero", 0), checkpoint_every=every, shards=shard_plan(model),
                                   sequence_parallel=options.get("sequence_parallel", False), probe=probe,
                                   cp=options.get("cp", 1)))
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(len(LAYOUTS)))
def test_estimate_agrees_with_what_the_ranks_measure(index):
    label = LAYOUTS[index][0]
    rows = _estimates()[index]
    for r, runs in enumerate(_measured()):
        got = runs[index]
        want = rows[got["pp_rank"]]
        # activations measured 0.1-7.2 % over the estimate (interleaved); under cp 5.5-9.5 %: the probe is one
        # process's attention, and cp's keeps its own output and log-sum-exp per chunk beside the layer's
        for term, limit in (("parameters", 0.05), ("gradients", 0.05), ("optimizer", 0.05),
                            ("activations", 0.10 if "cp" in label else 0.08)):
            estimate = getattr(want, term)
            assert abs(got[term] - estimate) <= limit * estimate, \
                f"{label} rank {r} (pp {got['pp_rank']}): {term} measured {got[term]}, estimated {estimate}"


def test_a_meta_probe_keeps_near_what_a_real_one_keeps():
    """A model too big to build here is probed on the meta device, where torch runs attention decomposed and would
    count every head's (T, T) probabilities, which no fused kernel keeps: the stand-in keeps what the kernel keeps,
    so the two probes agree within 12 % (measured: TinyGPT +6 %, a grouped-query Llama at T = 512 +11 %, where the
    decomposed form counted +23 % and 3.6x at T = 2048)."""
    def probe(model: torch.nn.Module, seq_len: int) -> int:
        return sum(probe_activations(model, model_blocks(model, None), seq_len, None).saved)

    config = GPTConfig(seq_len=128)
    real = probe(TinyGPT(config, seed=0), 128)
    with torch.device("meta"):
        meta = probe(TinyGPT(config, seed=0, device="meta"), 128)
    assert 0.95 <= meta / real <= 1.12, (meta, real)
    pytest.importorskip("transformers")
    from fourfold.models.hf import build_hf, family_split

    llama = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512)

    def hf_probe(model: torch.nn.Module) -> int:
        return sum(probe_activations(model, model_blocks(model, family_split(model)), 512, None).saved)

    real = hf_probe(build_hf("llama", overrides=llama))
    with torch.device("meta"):
        meta = hf_probe(build_hf("llama", overrides=llama))
    assert 0.95 <= meta / real <= 1.12, (meta, real)


def test_plan_memory_prints_the_table_and_refuses_what_does_not_fit(tmp_path, capsys):
    # in this process: a plan and a refusal start no rank (a launch would not get past the refusal either)
    from fourfold.cli import main

    def run(*argv: str) -> subprocess.CompletedProcess:
        code = main(list(argv))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(argv, code, out, err)

    def plan(*flags: str) -> subprocess.CompletedProcess:
        return run("plan", "--memory", "--steps", "1", *flags)

    ok = plan("--nproc", "4", "--pp", "2", "--zero", "1")
    assert ok.returncode == 0, ok.stderr
    assert "pp rank" in ok.stdout and ": fits" in ok.stdout and ok.stdout.count("\n") >= 4
    tight = plan("--nproc", "2", "--memory-limit", "10MB")
    assert tight.returncode == 1
    assert "largest term: activations" in tight.stdout and "--zero 3" in tight.stdout
    refused = run("train", "--nproc", "2", "--steps", "1", "--out", str(tmp_path / "run"), "--memory-limit", "10MB")
    assert refused.returncode == 2 and "largest term is activations" in refused.stderr, refused.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before any rank started


def test_verify_is_refused_before_launch_where_its_whole_model_copies_would_not_fit():
    """--verify K keeps K whole-model copies on rank 0 during the run, then trains the whole model in one process:
    either overflowing is refused before launch (a rank 0 killed mid-run loses the run), naming the sizes."""
    from fourfold.cli.plan import check_memory
    from fourfold.run.args import parse_args

    def check(limit: str) -> str:
        cfg = parse_args(["--nproc", "8", "--tp", "2", "--pp", "2", "--verify", "3", "--memory-limit", limit])
        try:
            return check_memory(cfg, 8)
        except ValueError as e:
            return str(e)

    assert check("14MB").startswith("--verify 3 keeps the whole model after each of the first 3 steps on rank 0, "
                                    "9.55 MB beside the 5.93 MB it trains with: 15.5 MB, more than the 14 MB each "
                                    "rank has (--memory-limit). Pass a smaller --verify")
    # the layout's 3 copies and the re-run's own 4 (its start and each step's), beside its training
    assert check("30MB").startswith("--verify 3 trains the whole model on the whole global batch in one process "
                                    "after the run, 46.9 MB (estimated), and compares 7 whole copies of it (22.3 MB): "
                                    "69.2 MB, more than the 30 MB available (--memory-limit)")
    assert check("90MB").startswith("memory per rank (estimated")
    from fourfold.cli.plan import main  # plan --memory says what train would refuse, not "fits"

    assert main(["--memory", "--nproc", "8", "--tp", "2", "--pp", "2", "--verify", "3", "--memory-limit", "30MB"]) == 1


def test_an_estimate_that_cannot_run_the_model_is_one_line_in_plan_and_skipped_by_train(capsys, monkeypatch):
    """A model the probe cannot run (transformers calling .item() on a meta tensor, for one): plan --memory says
    so in one line, exit 2, and train's check says it skipped, rather than a traceback or a refusal."""
    from fourfold.cli import plan
    from fourfold.plan import estimate
    from fourfold.run.args import parse_args

    def fails(*args, **kwargs):
        raise RuntimeError("cannot read a meta tensor's value")

    monkeypatch.setattr(estimate, "probe_activations", fails)
    assert plan.main(["--memory", "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: the memory estimate could not run this model: RuntimeError: cannot " \
        "read a meta tensor's value. fourfold train skips its check" in err, err
    assert plan.check_memory(parse_args([]), 1) == "memory estimate skipped: RuntimeError: cannot read a meta " \
        "tensor's value"


def test_plan_memory_refuses_what_train_refuses(capsys, tmp_path):
    """plan --memory runs train's own checks before launch (preflight) first: it never says "fits" for a layout
    train refuses, and says it as train does, in one line."""
    from fourfold.cli.plan import main

    def error() -> str:
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("fourfold plan: error: "), err
        return err

    assert main(["--memory", "--nproc", "3"]) == 2
    assert "batch_size must be divisible by dp, got batch_size=16, dp=3. Pass --batch-size 18" in error()
    assert main(["--memory", "--nproc", "4", "--pp", "2", "--microbatches", "3"]) == 2  # not a rounded micro-batch
    assert "each data-parallel shard must divide into micro-batches, got 8 sequences per shard and " \
           "microbatches=3. Pass --microbatches 4" in error()
    assert capsys.readouterr().out == ""  # no table
    (tmp_path / "metrics.jsonl").write_text("{}\n")  # an earlier run's outputs: train's business, not the plan's
    assert main(["--memory", "--nproc", "2", "--n-layer", "2", "--out", str(tmp_path)]) == 0
    assert ": fits" in capsys.readouterr().out


def test_parse_bytes():
    assert parse_bytes("80GB") == 80 * 2**30 and parse_bytes("1.5 gb") == 3 * 2**29 and parse_bytes("512") == 512
    with pytest.raises(ValueError, match="like 80GB"):
        parse_bytes("lots")
    # where a plain number is a slip (--gpu-mem 80 meant 80GB), a unit can be required; 80B says bytes
    with pytest.raises(ValueError, match=r"--gpu-mem must have a unit, got '80', which would be 80 bytes\. Pass 80GB"):
        parse_bytes("80", what="--gpu-mem", unit=True)
    assert parse_bytes("80B", unit=True) == 80 and parse_bytes("1 KiB", unit=True) == 1024


def test_format_bytes_never_writes_e_notation():
    from fourfold.units import format_bytes

    assert [format_bytes(n) for n in (512, 874 * 1024, 3.18 * 2**20, 1010 * 1024, 1023.9 * 2**20, 2**30)] == \
        ["512 B", "874 KB", "3.18 MB", "1010 KB", "1024 MB", "1 GB"]


def test_tinygpt_shards_describe_the_real_plan():
    """The estimate's description of TinyGPT's plan divides exactly the parameters the real plan shards."""
    from fourfold.plan.estimate import _shard_divisors

    model = TinyGPT(CFG, seed=0)
    divided = {n for n, p in model.named_parameters() if id(p) in _shard_divisors(model, shard_plan(model), 2)}
    want = {"embed.wte.weight"} | {f"blocks.{i}.{m}" for i in range(CFG.n_layer) for m in (
        "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "mlp.fc.weight", "mlp.fc.bias", "mlp.proj.weight")}
    assert divided == want
    assert torch.equal(model.head.lm_head.weight, model.embed.wte.weight)  # tied: the head is the embedding


def test_draw_memory_draws_stacked_bars(tmp_path):
    pytest.importorskip("matplotlib")
    from fourfold.observe.visualize import draw_memory

    terms = {"parameters": 2**20, "gradients": 2**20, "optimizer": 2**21, "activations": 3 * 2**20}
    assert draw_memory({"dp=2": {"estimated": terms, "measured": terms}, "ZeRO-3": {"measured": terms}},
                       tmp_path / "memory.png")
    assert (tmp_path / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_machine_shares_its_own_memory_among_its_own_ranks():
    from fourfold.run.args import parse_args
    from fourfold.run.fits import per_rank_budget as _available

    one = parse_args(["--nproc", "4"])
    assert _available(one, 4)[1] == "the machine's available memory / 4 rank(s)"
    two = parse_args(["--nproc", "2", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "10.0.0.1:29400"])
    assert _available(two, 4)[1] == "the machine's available memory / 2 rank(s)"  # not the world's 4


@pytest.mark.parametrize("flags, want", [
    ({"pp": 2, "schedule": "gpipe", "microbatches": 8}, {"schedule": "gpipe", "microbatches": 8}),
    ({"pp": 2, "schedule": "interleaved", "virtual": 3, "microbatches": 4},
     {"schedule": "interleaved", "virtual": 3, "microbatches": 4}),
    ({"grad_accum": 4}, {"microbatches": 4, "pp": 1}),  # without a pipeline: accumulation's micro-batches
    ({"pp": 2, "strategy": "model", "microbatches": 8}, {"strategy": "model", "microbatches": 1}),  # not 8
])
def test_the_check_before_launch_estimates_the_run_as_given(flags, want):
    """``layout_memory`` (what ``plan --memory`` prints and ``train`` checks first) builds the estimate's options
    from the flags: a lost schedule once estimated every pipeline as 1F1B."""
    from fourfold.cli.plan import layout_memory
    from fourfold.config import Config, TrainConfig

    cfg = Config(model=GPTConfig(n_layer=4, d_model=32, n_head=2, seq_len=16),
                 train=TrainConfig(batch_size=16), parallel=Layout(**flags))
    rows, options, estimate, _ = layout_memory(cfg, 2 if flags.get("pp") else 1)
    assert {k: options[k] for k in want} == want
    assert rows == estimate(options)
    if flags.get("schedule") == "gpipe":  # GPipe holds every micro-batch's activations: more than 1F1B's peak
        assert rows[0].activations > estimate({**options, "schedule": "1f1b"})[0].activations


def test_model_parallelism_is_never_told_to_take_more_micro_batches():
    """--strategy model runs one micro-batch whatever --microbatches says: a suggestion naming it would not fit
    any better (and the run would call the flag unused)."""
    from fourfold.plan.estimate import suggest

    tried = []

    def estimate(options):
        tried.append(options)
        return [type("Row", (), {"total": 10 if options.get("batch_size") == 4 else 100})()]

    options = {"dp": 1, "tp": 1, "pp": 2, "batch_size": 16, "microbatches": 1, "strategy": "model",
               "checkpoint_every": 1}
    assert suggest(estimate, 50, options).startswith("--batch-size 4")
    assert all(t["microbatches"] == 1 for t in tried), tried
    tried.clear()
    suggest(estimate, 50, {**options, "strategy": "pipeline"})  # a pipeline's micro-batches are tried
    assert any(t["microbatches"] > 1 for t in tried), tried


def test_sequence_parallelism_is_the_cheapest_change_under_tp_where_it_fits():
    """Under tp, sequence parallelism splits what a block saves outside attention and the MLP (its norms and
    residuals), which tp alone keeps whole: where that is the difference, it is the change suggested, before
    activation checkpointing's extra forward; a model of your own, which cannot run it, is never told to."""
    from fourfold.run.args import parse_args
    from fourfold.run.fits import layout_memory, overflow

    def largest(*flags: str) -> int:
        rows = layout_memory(parse_args(["--nproc", "2", "--tp", "2", *flags]), 2).rows
        return max(r.total for r in rows)

    plain, split = largest(), largest("--sequence-parallel")
    assert split < plain
    rows, options, estimate, splits = layout_memory(parse_args(["--nproc", "2", "--tp", "2"]), 2)
    assert splits
    between = (plain + split) // 2
    _, _, fix = overflow(rows, between, options, estimate, sequence_parallel=True)
    assert fix.startswith("--sequence-parallel (largest rank then"), fix
    _, _, fix = overflow(rows, between, options, estimate)
    assert fix.startswith("--activation-checkpointing full"), fix


def tiny_llama():
    """A ``--model MODULE:FACTORY`` returning a Hugging Face family's model (test_estimate:tiny_llama)."""
    from fourfold.models.hf import build_hf

    return build_hf("llama", overrides=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=2,
                                            max_position_embeddings=64))


@pytest.mark.parametrize("model, splits", [("test_estimate:tiny_llama", True), ("examples.my_model:build", False)])
def test_sequence_parallelism_is_suggested_by_the_model_built_not_by_its_name(model, splits):
    """A factory returning a family's model runs sequence parallelism (it was never suggested for one: the check
    went by the --model name); a model of your own does not."""
    pytest.importorskip("transformers")
    from fourfold.run.args import parse_args
    from fourfold.run.fits import layout_memory

    extra = ["--model-config", "examples/my_model.json"] if "my_model" in model else []
    cfg = parse_args(["--nproc", "2", "--tp", "2", "--model", model, *extra, "--seq-len", "32"])
    assert layout_memory(cfg, 2).can_split_sequence is splits
