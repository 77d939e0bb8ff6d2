"""``fourfold train --model ...``: GPT-2, Llama and a model of your own (examples/my_model.py) through the CLI,
equal to the same command on one process, with every output a TinyGPT run writes; and each bad model, split or
plan refused before training, naming the module or the number and the fix.

One torchrun launch (GPT-2 tp=2, as a user types it) and one two-rank spawn for the rest (each rank imports
transformers once). Float64, 3 steps, 1e-10.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fourfold import Split, SplitError
from fourfold import train as train_mod
from fourfold.checkpoint import load_checkpoint
from fourfold.parallel.pipeline.blocks import positions, resolve_split
from fourfold.testing import run_ranks
from helpers import losses

transformers = pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TOL = 1e-10
GPT2 = {"vocab_size": 256, "n_positions": 16, "n_embd": 16, "n_layer": 2, "n_head": 2, "resid_pdrop": 0.0,
        "embd_pdrop": 0.0, "attn_pdrop": 0.0}
LLAMA = {"vocab_size": 256, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16,
         "tie_word_embeddings": True}  # the tied head: one weight in stage 0's embedding and stage 1's head
MINE = {"width": 16, "layers": 2, "seq_len": 16}
COMMON = ["--steps", "3", "--dtype", "float64", "--seq-len", "16", "--batch-size", "4", "--device", "cpu",
          "--lr", "1e-2"]
# label -> (model flags, layout flags) for the two-rank spawn
RUNS = {"gpt2 pp2 1f1b": (["--model", "gpt2"], ["--pp", "2", "--schedule", "1f1b", "--microbatches", "2"]),
        "llama (tied) pp2 gpipe": (["--model", "llama"], ["--pp", "2", "--schedule", "gpipe", "--microbatches", "2"]),
        "mine tp2": (["--model", "my_model:build"], ["--tp", "2"]),
        "mine pp2 zb": (["--model", "my_model:build"], ["--pp", "2", "--schedule", "zb", "--microbatches", "2"])}


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, str]:
    where = tmp_path_factory.mktemp("configs")
    out = {}
    for name, values in (("gpt2", GPT2), ("llama", LLAMA), ("my_model:build", MINE)):
        path = where / f"{name.partition(':')[0]}.json"
        path.write_text(json.dumps(values))
        out[name] = str(path)
    return out


@pytest.fixture(autouse=True)
def _examples_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))  # as `cd examples` would; spawned ranks inherit sys.path


def _flags(model: list[str], configs: dict[str, str]) -> list[str]:
    return [*model, "--model-config", configs[model[1]], *COMMON]


@functools.cache
def _one_process(tmp: Path, model: tuple[str, ...], config: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    out = tmp / f"one-{model[1].partition(':')[0]}"
    assert train_mod.main([*model, "--model-config", config, *COMMON, "--out", str(out)]) == 0
    return losses(out), load_checkpoint(out / "model.pt")["model"]


def _equal(label: str, got: tuple[list[float], dict[str, torch.Tensor]],
           want: tuple[list[float], dict[str, torch.Tensor]]) -> None:
    (got_losses, got_state), (want_losses, want_state) = got, want
    assert max(abs(a - b) for a, b in zip(got_losses, want_losses, strict=True)) <= TOL, (label, got_losses,
                                                                                          want_losses)
    assert list(got_state) == list(want_state), f"{label}: names {list(got_state)} vs {list(want_state)}"
    worst = max((got_state[k] - want_state[k]).abs().max().item() for k in want_state)
    assert worst <= TOL, f"{label}: weights off one process by {worst:.3g}"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_gpt2_tp2_through_torchrun_writes_every_output_and_model_pt_loads_into_gpt2lmheadmodel(tmp_path, configs):
    one = _one_process(tmp_path, ("--model", "gpt2"), configs["gpt2"])
    out = tmp_path / "tp2"
    cmd = [sys.executable, "-m", "fourfold", "train", "--nproc", "2", "--tp", "2", "--verify", "2",
           *_flags(["--model", "gpt2"], configs), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert "trained GPT-2 (" in text and "(dp=1 tp=2 pp=1)" in text and "rank 0 sent per step: tp " in text, text
    assert "verify: OK, every difference within tolerance" in text, text
    for name in ("run.json", "metrics.jsonl", "trace.json", "trace-rank0.jsonl", "trace-rank1.jsonl",
                 "timeline.png", "model.pt"):
        assert (out / name).is_file(), f"{name} missing from {sorted(p.name for p in out.iterdir())}"
    assert json.loads((out / "run.json").read_text())["config"]["train"]["model"] == "gpt2"
    saved = load_checkpoint(out / "model.pt")["model"]
    _equal("gpt2 tp2 (torchrun)", (losses(out), saved), one)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)).double()
    assert not model.load_state_dict(saved, strict=True).missing_keys  # strict: the Hugging Face names as they are
    ids = torch.randint(256, (1, 16), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(model(ids).logits).all()


def _ranks(ctx, runs: dict, configs: dict[str, str], out: str) -> dict:
    """Every CLI layout in RUNS, then the engine's logits contract under tp=2: this rank's results."""
    from fourfold import parallelize
    from fourfold.loss import lm_loss
    from fourfold.mesh import Mesh
    from fourfold.models.hf import build_hf
    from fourfold.parallel.pipeline.blocks import output_tensor
    from fourfold.run.args import parse_args
    from fourfold.train import train

    results: dict = {}
    for label, (model, layout) in runs.items():
        result = train(parse_args([*_flags(model, configs), *layout, "--out", f"{out}/{label}"]), ctx)
        results[label] = (result.losses, result.state if ctx.rank == 0 else None)
    # The logits contract: fourfold's own loss reads them split inside step(); a loss_fn of yours, and a
    # direct call (Hugging Face's labels=), get them whole.
    ranks = Mesh.for_world(2, tp=2).build(30)
    ids = torch.randint(256, (2, 16), generator=torch.Generator().manual_seed(1))
    seen = []

    def mine(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(logits.shape))
        return lm_loss(logits, targets)

    engine = parallelize(build_hf("gpt2", overrides=GPT2, dtype=torch.float64), ranks, loss_fn=mine)
    results["loss_fn"] = (engine.step(ids[:, :-1], ids[:, 1:]).item(), seen)
    engine = parallelize(build_hf("gpt2", overrides=GPT2, dtype=torch.float64), ranks)
    step_loss = engine.step(ids[:, :-1], ids[:, 1:]).item()
    direct = engine.model(ids, labels=ids)
    results["labels"] = (step_loss, direct.loss.item(), tuple(output_tensor(direct).shape))
    return results


@functools.cache
def _spawned(configs_items: tuple, out: str) -> list[dict]:
    return run_ranks(_ranks, 2, RUNS, dict(configs_items), out, timeout_s=220)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("label", list(RUNS))
def test_cli_layouts_equal_one_process(tmp_path_factory, configs, label):
    per_rank = _spawned(tuple(sorted(configs.items())), str(tmp_path_factory.getbasetemp() / "spawned"))
    model = RUNS[label][0]
    want = _one_process(tmp_path_factory.getbasetemp(), tuple(model), configs[model[1]])
    for rank, results in enumerate(per_rank):
        got_losses, state = results[label]
        assert max(abs(a - b) for a, b in zip(got_losses, want[0], strict=True)) <= TOL, (label, rank)
    _equal(label, per_rank[0][label], want)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_split_logits_never_reach_your_loss_or_a_direct_call(tmp_path_factory, configs):
    from fourfold.loss import lm_loss
    from fourfold.models.hf import build_hf

    per_rank = _spawned(tuple(sorted(configs.items())), str(tmp_path_factory.getbasetemp() / "spawned"))
    ids = torch.randint(256, (2, 16), generator=torch.Generator().manual_seed(1))
    reference = build_hf("gpt2", overrides=GPT2, dtype=torch.float64)
    want_step = lm_loss(reference(ids[:, :-1]).logits, ids[:, 1:]).item()
    want_labels = reference(ids, labels=ids).loss.item()
    for results in per_rank:
        loss, seen = results["loss_fn"]
        assert seen == [(2, 15, 256)], f"your loss_fn was given logits of shape {seen}, not the whole vocabulary"
        assert abs(loss - want_step) <= TOL
        step_loss, labels_loss, shape = results["labels"]
        assert abs(step_loss - want_step) <= TOL  # fourfold's vocabulary-parallel loss on the split logits
        assert shape == (2, 16, 256) and abs(labels_loss - want_labels) <= TOL, (shape, labels_loss, want_labels)


# ----------------------------------------------------------------------------- refused before training


def _gpt2():
    from fourfold.models.hf import build_hf

    return build_hf("gpt2", overrides=GPT2, dtype=torch.float64)


def test_the_gpt2_chain_without_its_position_embedding_is_refused_naming_it():
    ids = torch.randint(256, (1, 8), generator=torch.Generator().manual_seed(0))
    chain = Split.sequential(["transformer.wte", "transformer.h", "transformer.ln_f", "lm_head"])
    with pytest.raises(SplitError, match=r"transformer\.wpe \(Embedding\) runs in the model's forward but in no "
                                         r"piece"):
        resolve_split(_gpt2(), chain, ids)
    no_norm = Split(blocks="transformer.h",
                    before=lambda m, x: m.transformer.drop(m.transformer.wte(x) + m.transformer.wpe(positions(x))),
                    after=lambda m, h: m.lm_head(h))
    with pytest.raises(SplitError, match=r"transformer\.ln_f"):
        resolve_split(_gpt2(), no_norm, ids)


def test_a_split_on_your_model_must_be_a_split():
    from my_model import build

    from fourfold.models import family_of

    model = build(**MINE)
    model.fourfold_split = ["layers"]
    with pytest.raises(TypeError, match="fourfold_split must be a fourfold.Split, got list"):
        family_of(model)


@pytest.mark.parametrize(("model", "flags", "message"), [
    ("llama", ["--nproc", "4", "--tp", "4"], "llama num_key_value_heads must be divisible by tp (each rank needs "
     "whole key/value heads for its query heads), got num_key_value_heads=2 and tp=4. Use tp in [1, 2]"),
    ("gpt2", ["--nproc", "4", "--tp", "4"], "n_head must be divisible by tp"),
    ("gpt2", ["--seq-len", "32"], "seq_len must be at most the model's positions, got seq_len=32 and 16 positions "
     "in GPT-2. Pass --seq-len 16"),
    ("gpt2", ["--nproc", "2", "--pp", "2", "--schedule", "interleaved", "--virtual", "3", "--microbatches", "2"],
     "stages must be at most the model's blocks (embedding, 2 layers, head), got pp*virtual=6 > 4"),
    ("gpt2", ["--nproc", "2", "--tp", "2", "--sequence-parallel", "--seq-len", "15"],
     "seq_len must be divisible by tp with sequence parallelism (each rank keeps T/tp tokens), got seq_len=15 and "
     "tp=2. Pass --seq-len 14"),
    ("my_model:build", ["--nproc", "2", "--tp", "2", "--sequence-parallel"],
     "sequence_parallel is TinyGPT's and the Hugging Face families'"),
    ("my_model:build", ["--vocab-size", "100"], "got vocab_size=100 in my_model:build. Build the model with a "
     "vocabulary of 256 (or more): its factory's keyword, in --model-config"),
    ("my_model:build", ["--seq-len", "32"], "model 'my_model:build': its forward on one sequence of --seq-len 32 "
     "tokens failed: IndexError"),  # its 16 positions: refused before launch, not a traceback on every rank
    ("my_model:build", ["--layerz", "2"], "building it with --model-config"),  # a keyword the factory lacks
    ("gpt2", ["--n-layer", "2", "--d-model", "32"], "--n-layer, --d-model shape TinyGPT only, got n_layer=2, "
     "d_model=32 with model='gpt2'"),  # ignored, they trained a 124 M GPT-2 where a tiny model was asked for
    ("gpt2", ["--vocab-size", "4096"], "--vocab-size shapes TinyGPT only, got vocab_size=4096 with model='gpt2', "
     "whose size and vocabulary come from --model-config"),  # GPT-2's vocabulary is its config's
    ("nowhere:build", [], "model 'nowhere:build': cannot import 'nowhere'"),
    ("my_model:nothing", [], "model 'my_model:nothing': 'my_model' has no 'nothing'"),
    ("tinygpt", ["--model-config", "x.json"], "model_config sizes a Hugging Face (gpt2, llama, mistral, qwen2, "
     "qwen3, gemma, gemma2, gemma3_text, granite, phi3, olmo2, olmo3, smollm3) or MODULE:FACTORY model"),
    ("gemma3", [], "got 'gemma3'. Did you mean --model gemma3_text?"),  # transformers' model_type
    ("Phi-3", [], "got 'Phi-3'. Did you mean --model phi3?"),
    ("mixtral", [], "got 'mixtral'. Pass --model gpt2"),  # no guess between architectures
    ("my model", [], "model must be tinygpt, gpt2, llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3_text, "
                  "granite, phi3, olmo2, olmo3, smollm3 or MODULE:FACTORY"),
])
def test_bad_models_are_refused_before_training(tmp_path, configs, capsys, model, flags, message):
    config = ["--model-config", configs[model]] if model in configs else []
    if model == "my_model:build" and flags[0] in ("--vocab-size", "--layerz"):  # factory keywords, from its JSON
        path = tmp_path / "small.json"
        path.write_text(json.dumps({**MINE, flags[0][2:].replace("-", "_"): int(flags[1])}))
        config, flags = ["--model-config", str(path)], ["--seq-len", "16", "--nproc", "2"]  # refused before launch
    argv = ["--model", model, *config, *flags, "--out", str(tmp_path / "run")]
    try:
        code = train_mod.main(argv)
    except SystemExit as e:  # a config value refused by the flag parser
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.count(message) == 1, err  # once, by the launcher: not once per rank
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing trained


@pytest.mark.timeout(120)
def test_a_family_given_no_config_is_refused_by_the_memory_estimate_before_anything_is_built(tmp_path):
    """--model llama alone is transformers' default LlamaConfig, 6.7 B parameters: the estimate builds it on the
    meta device and refuses it, where building it for real (it once did) had the kernel kill the process with no
    word. Under a 6 GB address-space limit, a real build could not even start."""
    import resource

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))

    proc = subprocess.run([sys.executable, "-m", "fourfold", "train", "--model", "llama", "--memory-limit", "16GB",
                           "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=100,
                          preexec_fn=limited)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "note: --model llama without --model-config builds transformers' default LlamaConfig" in proc.stderr
    assert "error: this layout needs 111 GB on pipeline rank 0's ranks, more than the 16 GB each rank has " \
           "(--memory-limit); the largest term is optimiser state, 50.2 GB" in proc.stderr, proc.stderr[-2000:]


def test_every_model_config_the_docs_pass_is_in_the_repository():
    import re

    root = EXAMPLES.parent
    texts = [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted(EXAMPLES.glob("*.py"))]
    named = {m for t in texts for m in re.findall(r"--model-config ([\w./-]+\.json)", t.read_text())}
    assert {"examples/gpt2-tiny.json", "examples/llama-tiny.json", "my_model.json"} <= named, named
    for name in named:  # from the repository's root, or (after `cd examples`) from examples/
        path = root / name if (root / name).exists() else EXAMPLES / name
        assert isinstance(json.loads(path.read_text()), dict), name


def test_a_model_config_run_resumes_from_another_directory_and_its_config_is_compared_by_contents(
        tmp_path, monkeypatch, capsys):
    started, elsewhere = tmp_path / "started", tmp_path / "elsewhere"
    started.mkdir(), elsewhere.mkdir()
    (started / "mine.json").write_text(json.dumps(MINE))
    (elsewhere / "copy.json").write_text(json.dumps(MINE))
    common = ["--seq-len", "16", "--batch-size", "4", "--no-trace", "--no-progress"]
    monkeypatch.chdir(started)  # the path as a user types it, relative to where the run started
    assert train_mod.main(["--model", "my_model:build", "--model-config", "mine.json", *common, "--steps", "1",
                           "--out", "run"]) == 0
    monkeypatch.chdir(elsewhere)
    resume = ["--resume", str(started / "run"), *common, "--steps", "2"]
    assert train_mod.main([*resume, "--out", "left-out"]) == 0  # the model and its config: the checkpoint's
    assert train_mod.main([*resume, "--model-config", "copy.json", "--out", "copied"]) == 0  # same keys
    (started / "mine.json").unlink()
    capsys.readouterr()
    with pytest.raises(SystemExit):
        train_mod.main([*resume, "--out", "gone"])
    assert 'which is gone; its keys are {"width": 16, "layers": 2, "seq_len": 16}' in capsys.readouterr().err


def test_a_value_error_in_your_forward_keeps_its_traceback(tmp_path, monkeypatch, capsys):
    # fourfold's own refusals print one line (exit 2); an error of the user's model is not one of them
    (tmp_path / "broken.py").write_text(
        "import torch\nfrom torch import nn\n\n\n"
        "class Broken(nn.Sequential):\n"
        "    def forward(self, ids):\n"
        "        if torch.is_grad_enabled():  # not in the check before launch (no_grad): in training\n"
        "            a, b, c = ids.chunk(2, dim=-1)\n"
        "        return super().forward(ids)\n\n\n"
        "def build():\n"
        "    return Broken(nn.Embedding(256, 8), nn.Linear(8, 256))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["--model", "broken:build", "--steps", "1", "--seq-len", "8", "--batch-size", "2", "--no-progress",
            "--out", str(tmp_path / "run")]
    with pytest.raises(ValueError, match="not enough values to unpack") as raised:
        train_mod.main(argv)
    assert raised.traceback[-1].path.name == "broken.py"
    assert "fourfold train: error:" not in capsys.readouterr().err
    # fourfold's own refusals stay one line, a library's error in a file fourfold reads included
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    assert train_mod.main(["--data", str(empty), "--out", str(tmp_path / "run2")]) == 2
    assert "fourfold train: error: data empty.bin must hold at least one token" in capsys.readouterr().err
    from fourfold.train import _raised_by_fourfold

    try:
        json.loads("{")  # a library's ValueError raised for this file: not fourfold's
    except ValueError as e:
        assert not _raised_by_fourfold(e)


def test_what_a_model_returns_stands_for_its_logits():
    from fourfold.parallel.pipeline.blocks import output_tensor

    logits = torch.zeros(2, 3)
    for out in (logits, (logits, None), [logits], {"logits": logits, "aux": 1.0},
                transformers.modeling_outputs.CausalLMOutput(logits=logits)):
        assert output_tensor(out) is logits
    with pytest.raises(TypeError, match=r"got dict with keys \['hidden', 'loss'\]\. Return the logits"):
        output_tensor({"hidden": logits, "loss": 0.0})
    # a mixture of experts' router loss beside the logits (Qwen3-MoE, Mixtral with output_router_logits): the logits
    # alone would train without it, silently; refused, as a Hugging Face output and as a dict
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast

    assert output_tensor(MoeCausalLMOutputWithPast(logits=logits)) is logits  # no aux_loss: output_router_logits off
    for out in (MoeCausalLMOutputWithPast(logits=logits, aux_loss=torch.tensor(0.3)),
                {"logits": logits, "aux_loss": torch.tensor(0.3)}):
        with pytest.raises(ValueError, match=r"the model returns an auxiliary loss beside its logits \(aux_loss.*"
                                             r"output_router_logits=False"):
            output_tensor(out)


YOURS = '''
from torch import nn


class Tiny(nn.Module):  # no plan, no split: a model fourfold knows nothing of
    def __init__(self):
        super().__init__()
        self.emb, self.mid, self.out = nn.Embedding(256, 8), nn.Linear(8, 8), nn.Linear(8, 256)

    def forward(self, ids):
        return self.out(self.mid(self.emb(ids)))


def plain():
    return Tiny()


def typo():
    m = Tiny()
    m.fourfold_tp_plan = {"mid": "column", "outt": "row"}
    return m


def listed():
    m = Tiny()
    m.fourfold_split = ["emb", "mid", "out"]
    return m
'''


@pytest.mark.parametrize(("factory", "flags", "message"), [
    ("typo", ["--tp", "2"], "plan names a module the model does not have, got 'outt'"),
    ("plain", ["--tp", "2"], "set model.fourfold_tp_plan"),
    ("plain", ["--pp", "2", "--microbatches", "2"], "a pipeline (--pp 2) cuts a model into blocks"),
    ("listed", ["--pp", "2", "--microbatches", "2"], "fourfold_split must be a fourfold.Split, got list"),
])
def test_a_plan_or_split_this_layout_cannot_use_is_refused_before_launch(tmp_path, monkeypatch, capsys, factory,
                                                                         flags, message):
    (tmp_path / "yours.py").write_text(YOURS)
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["--model", f"yours:{factory}", "--nproc", "2", *flags, "--steps", "1", "--seq-len", "8",
            "--batch-size", "4", "--out", str(tmp_path / "run")]
    assert train_mod.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count(message) == 1, err  # by the launcher, once: no rank started


RANKED = """
import os

from torch import nn

AT_IMPORT = os.environ.get("RANK")  # a module that reads its rank at import, as training scripts often do


def build():
    assert AT_IMPORT == os.environ.get("RANK"), f"imported as rank {AT_IMPORT}, built on rank {os.environ.get('RANK')}"
    return nn.Sequential(nn.Embedding(256, 8), nn.Linear(8, 256))
"""


@pytest.mark.timeout(120)
def test_a_model_of_yours_is_imported_by_each_rank_itself(tmp_path):
    """Ranks forked from a launcher that imported your module would share its import, made with no rank: the
    fork server imports torch and fourfold only, so each rank imports your module itself, knowing its rank."""
    (tmp_path / "ranked.py").write_text(RANKED)
    env = {k: v for k, v in os.environ.items() if k != "FOURFOLD_RANK_START"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "fourfold", "train", "--model", "ranked:build", "--nproc", "2",
                           "--steps", "1", "--seq-len", "8", "--batch-size", "4", "--no-trace", "--no-progress",
                           "--out", str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "on 2 rank(s)" in proc.stdout, proc.stdout


ROTARY = """
import torch
from torch import nn


class Rotary(nn.Module):  # a complex RoPE cache, as torchtitan's Llama keeps its freqs_cis
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(256, 8)
        self.head = nn.Linear(8, 256)
        angles = torch.arange(64.0)[:, None] * torch.tensor([1.0, 0.1, 0.01, 0.001])
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def forward(self, ids):
        h = self.embed(ids)
        z = torch.view_as_complex(h.float().reshape(*h.shape[:-1], 4, 2)) * self.freqs_cis[: ids.shape[1]]
        return self.head(torch.view_as_real(z).reshape(h.shape).type_as(h))


def build():
    return Rotary()
"""


def test_a_complex_buffer_of_yours_stays_complex_under_float64(tmp_path, monkeypatch, recwarn):
    """``--dtype float64`` casts floating-point weights as ``model.double()`` does: a complex buffer keeps its
    imaginary part (``model.to(float64)`` dropped it with torch's warning only, and --verify's reference alike)."""
    from fourfold.models.build import build_model
    from fourfold.run.args import parse_args

    (tmp_path / "rotary.py").write_text(ROTARY)
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["--model", "rotary:build", "--dtype", "float64", "--seq-len", "16", "--batch-size", "4", "--steps", "1",
            "--no-trace", "--no-progress", "--out", str(tmp_path / "run")]
    model = build_model(parse_args(argv))
    import rotary

    assert model.freqs_cis.dtype == torch.complex64 and torch.equal(model.freqs_cis, rotary.build().freqs_cis)
    assert model.embed.weight.dtype == model.head.weight.dtype == torch.float64
    assert train_mod.main(argv) == 0
    assert not [w for w in recwarn if "imaginary part" in str(w.message)], [str(w.message) for w in recwarn]


ENCODER = """
from torch import nn


class Encoder(nn.Module):  # every position sees the whole sequence, as BERT's attention does
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(256, 8), nn.Linear(8, 256)

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(h + h.mean(1, keepdim=True))


def build():
    return Encoder()
"""


def test_a_model_of_yours_that_sees_later_tokens_is_refused_before_training(tmp_path, monkeypatch, capsys):
    """Next-token training through a bidirectional model lets each position see the token it predicts: refused
    before any rank starts, naming the position whose logits moved when only the last token changed."""
    (tmp_path / "encoder.py").write_text(ENCODER)
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["--model", "encoder:build", "--seq-len", "8", "--batch-size", "4", "--steps", "1", "--nproc", "2",
            "--no-progress", "--out", str(tmp_path / "run")]
    assert train_mod.main(argv) == 2
    said = capsys.readouterr().err
    assert "model 'encoder:build' is not causal: its logits at position 0 changed by" in said, said
    assert "when only the last of --seq-len 8 tokens did" in said and "is_causal=True" in said, said
    assert not (tmp_path / "run").exists()


MOE = """
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM


def build(router_loss=True):
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=256, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
        output_router_logits=router_loss, max_position_embeddings=32))
"""


def test_a_mixture_of_experts_whose_router_loss_would_be_dropped_is_refused_before_launch(tmp_path, monkeypatch,
                                                                                          capsys):
    """Qwen3-MoE with output_router_logits (as training configs set it) returns its load-balancing loss beside the
    logits; fourfold's loss reads the logits only, and trained without it, silently. Refused before any rank
    starts; without the router loss it trains."""
    (tmp_path / "moe.py").write_text(MOE)
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["--model", "moe:build", "--seq-len", "8", "--batch-size", "4", "--steps", "1", "--no-progress",
            "--no-trace"]
    assert train_mod.main([*argv, "--nproc", "2", "--out", str(tmp_path / "run")]) == 2
    said = capsys.readouterr().err
    assert said.count("the model returns an auxiliary loss beside its logits (aux_loss") == 1, said
    assert "output_router_logits=False" in said and not (tmp_path / "run").exists(), said
    (tmp_path / "off.json").write_text('{"router_loss": false}')
    assert train_mod.main([*argv, "--model-config", str(tmp_path / "off.json"), "--out", str(tmp_path / "off")]) == 0
