"""``--init-from``: a run starts from stored weights under any layout, and the one-process re-run of ``--verify``
from the same ones. The check is exact: a run of one step at ``--lr 1e-30`` ends where it started (Adam moves a
weight by about lr), so its ``model.pt`` must equal what it loaded to 1e-20 after the layout cut the model and
gathered it again. Names and shapes that do not fit the model are refused before launch, one line each."""

from __future__ import annotations

import json
import os

import pytest
import torch

from fourfold import train as train_mod
from fourfold.checkpoint import load_checkpoint

SMALL = ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--seq-len", "16", "--batch-size", "8",
         "--dtype", "float64", "--no-progress", "--no-trace"]
STILL = ["--steps", "1", "--lr", "1e-30"]  # one step that moves no weight by more than ~1e-30
GPT2 = {"vocab_size": 256, "n_positions": 16, "n_embd": 16, "n_layer": 2, "n_head": 2, "resid_pdrop": 0.0,
        "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for name, value in want.items():
        assert name in got, name
        assert torch.allclose(got[name].double(), value.double(), rtol=0, atol=1e-20), name


@pytest.mark.timeout(240)
def test_a_runs_weights_start_another_run_under_a_3d_layout_and_its_verify(tmp_path, capfd):
    first = tmp_path / "first"
    assert train_mod.main([*SMALL, "--steps", "2", "--out", str(first)]) == 0
    second = tmp_path / "second"
    assert train_mod.main([*SMALL, *STILL, "--init-from", str(first / "model.pt"), "--nproc", "4", "--tp", "2",
                           "--pp", "2", "--microbatches", "2", "--verify", "1", "--out", str(second)]) == 0
    assert "verify: OK" in capfd.readouterr().out
    _same(load_checkpoint(second / "model.pt")["model"], load_checkpoint(first / "model.pt")["model"])
    assert json.loads((second / "run.json").read_text())["config"]["train"]["init_from"] == str(first / "model.pt")


@pytest.mark.timeout(240)
def test_a_hugging_face_directory_sizes_the_model_and_its_tied_head_stored_once_is_filled(tmp_path, capfd):
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from fourfold.models.hf import build_hf

    folder = tmp_path / "gpt2"
    build_hf("gpt2", overrides=GPT2, seed=3).save_pretrained(folder)
    stored = load_file(str(folder / "model.safetensors"))
    assert "lm_head.weight" not in stored  # tied to the token embedding: save_pretrained keeps one
    out = tmp_path / "run"
    assert train_mod.main(["--model", "gpt2", "--init-from", str(folder), *STILL, "--seq-len", "16",
                           "--batch-size", "8", "--dtype", "float64", "--no-progress", "--no-trace", "--nproc", "2",
                           "--pp", "2", "--microbatches", "2", "--verify", "1", "--out", str(out)]) == 0
    assert "verify: OK" in capfd.readouterr().out
    got = load_checkpoint(out / "model.pt")["model"]
    _same(got, stored)
    assert torch.equal(got["lm_head.weight"], got["transformer.wte.weight"])
    # the same weights in shards (model.safetensors.index.json), read in one process
    sharded = tmp_path / "sharded"
    build_hf("gpt2", overrides=GPT2, seed=3).save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists() and not (sharded / "model.safetensors").exists()
    assert train_mod.main(["--model", "gpt2", "--init-from", str(sharded), *STILL, "--seq-len", "16",
                           "--batch-size", "8", "--dtype", "float64", "--no-progress", "--no-trace",
                           "--out", str(tmp_path / "one")]) == 0
    _same(load_checkpoint(tmp_path / "one" / "model.pt")["model"], stored)


def test_weights_that_do_not_fit_the_model_are_refused_before_launch_naming_them(tmp_path, capsys):
    pytest.importorskip("transformers")
    from fourfold.models.hf import build_hf

    run = tmp_path / "small"
    assert train_mod.main([*SMALL, "--steps", "1", "--out", str(run)]) == 0
    state = load_checkpoint(run / "model.pt")["model"]
    torch.save({k: v for k, v in state.items() if not k.startswith("blocks.1.")}, tmp_path / "part.pt")
    torch.save([1, 2, 3], tmp_path / "list.pt")
    folder = tmp_path / "gpt2"
    build_hf("gpt2", overrides=GPT2).save_pretrained(folder)
    (tmp_path / "config.json").write_text("{}")
    wider = [*SMALL[:2], "--d-model", "64", *SMALL[4:]]
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 100)  # a truncated download, say
    shards = tmp_path / "shards"
    build_hf("gpt2", overrides=GPT2).save_pretrained(shards, max_shard_size="20KB")
    next(shards.glob("model-*.safetensors")).unlink()
    cases = [
        ([*wider, "--init-from", str(run / "model.pt")], "init_from '"),
        ([*wider, "--init-from", str(run / "model.pt")], "of another shape: embed.wte.weight [256, 32] (the "
                                                          "model's: [256, 64])"),
        ([*SMALL, "--init-from", str(tmp_path / "part.pt")], "missing: blocks.1."),
        ([*SMALL, "--init-from", str(tmp_path / "list.pt")], "must hold a state dict ({name: tensor}), got a list"),
        ([*SMALL, "--init-from", str(tmp_path / "bad.safetensors")], "must be a safetensors file, got "
                                                                      "SafetensorError"),
        (["--init-from", str(shards), "--seq-len", "16"], "model.safetensors.index.json lists shards that are not "
                                                           "there"),
        ([*SMALL, "--init-from", str(tmp_path / "nowhere.pt")], "init_from must be a Hugging Face model directory or "
                                                                 "a weights file"),
        (["--model", "llama", "--init-from", str(folder)], "init_from holds a gpt2 model (its config.json's "
                                                            "model_type), got model='llama'. Pass --model gpt2"),
        ([*SMALL, "--init-from", str(folder)], "shape TinyGPT only, got n_layer=2, n_head=2, d_model=32 with "
                                                f"model='gpt2', sized by --init-from {folder}'s config.json"),
        (["--model", "gpt2", "--model-config", str(tmp_path / "config.json"), "--init-from", str(folder)],
         "init_from's config.json sizes the model"),
        ([*SMALL, "--init-from", str(tmp_path)], "init_from's config.json must be of a family fourfold has a plan "
                                                  "for (gpt2, llama, mistral, qwen2, qwen3, gemma, gemma2, "
                                                  "gemma3_text, granite, phi3, olmo2, olmo3, smollm3), got "
                                                  "model_type=None"),
        ([*SMALL, "--nproc", "2", "--init-from", str(run / "checkpoints")], "without a readable config.json"),
    ]
    for argv, message in cases:
        try:
            code = train_mod.main([*argv, "--out", str(tmp_path / "refused")])
        except SystemExit as e:  # refused by the flag parser
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and message in err, (argv, err)
        assert not (tmp_path / "refused").exists()


def test_a_directory_names_the_model_and_its_tokenizer_for_the_flags_left_out(tmp_path):
    from fourfold.train import parse_args

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "model.safetensors").write_bytes(b"")

    def cfg(*flags: str):
        return parse_args(["--init-from", str(tmp_path), *flags])

    assert (cfg().train.model, cfg().data.tokenizer) == ("llama", "bytes")  # no tokenizer.json there
    (tmp_path / "tokenizer.json").write_text("{}")
    assert cfg().data.tokenizer == str(tmp_path / "tokenizer.json")
    assert cfg("--tokenizer", "bpe:300").data.tokenizer == "bpe:300"
    assert cfg("--tokenizer", "bytes").data.tokenizer == "bytes"  # given: kept, even the default's value
    ids = tmp_path / "ids.npy"
    ids.write_bytes(b"")  # token ids are used as they are: no tokenizer
    assert cfg("--data", str(ids)).data.tokenizer == "bytes"
    with pytest.raises(SystemExit):  # given, the family must be the directory's
        cfg("--model", "gpt2")


def test_an_init_from_run_exports_to_a_directory_from_pretrained_loads_and_resumes_without_the_flag(tmp_path, capsys):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM

    from fourfold.cli.export import main as export
    from fourfold.models.hf import build_hf

    folder = tmp_path / "gpt2"
    build_hf("gpt2", overrides=GPT2, seed=3).save_pretrained(folder)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(["some text"], trainers.BpeTrainer(
        vocab_size=256, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer.save(str(folder / "tokenizer.json"))
    run = tmp_path / "run"
    flags = ["--seq-len", "16", "--batch-size", "4", "--dtype", "float64", "--no-progress", "--no-trace"]
    assert train_mod.main(["--model", "gpt2", "--init-from", str(folder), "--steps", "2", "--checkpoint-every", "1",
                           *flags, "--out", str(run)]) == 0
    assert "text becomes ids by " + str(folder / "tokenizer.json") in capsys.readouterr().err
    out = tmp_path / "hf"
    assert export([str(run), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).state_dict()
    _same(loaded, load_checkpoint(run / "model.pt")["model"])
    assert export([str(run), "--out", str(out)]) == 2  # never over files of yours
    assert "out must be a new or empty directory" in capsys.readouterr().err
    # a resume builds the model from the directory's config.json again, with no --init-from given; the weights
    # are the checkpoint's, so the directory's are not read
    (folder / "model.safetensors").unlink()
    assert train_mod.main(["--resume", str(run), "--steps", "3", *flags, "--out", str(run)]) == 0
    folder.rename(tmp_path / "moved")
    with pytest.raises(SystemExit) as refused:  # by the flags' parser, as the checkpoint's settings are taken
        train_mod.main(["--resume", str(run), "--steps", "4", *flags, "--out", str(run)])
    assert refused.value.code == 2
    assert f"sized by --init-from {folder}'s config.json, which is gone" in capsys.readouterr().err


def test_a_base_models_checkpoint_without_the_causal_lms_prefix_loads_as_from_pretrained_reads_it(tmp_path):
    pytest.importorskip("transformers")
    from safetensors.torch import save_file

    from fourfold.models.hf import build_hf
    from fourfold.models.weights import load_weights

    trained = build_hf("gpt2", overrides=GPT2, seed=3)
    # GPT-2's Hub checkpoint: the base model's names (h.0..., wte...), no head (tied), old causal-mask buffers
    hub = {k.removeprefix("transformer."): v for k, v in trained.state_dict().items() if k != "lm_head.weight"}
    hub["h.0.attn.bias"] = torch.ones(1, 1, 16, 16)
    save_file(hub, str(tmp_path / "hub.safetensors"))
    fresh = load_weights(build_hf("gpt2", overrides=GPT2, seed=4), tmp_path / "hub.safetensors")
    _same(fresh.state_dict(), trained.state_dict())
    both = {**hub, "transformer.wte.weight": hub["wte.weight"].clone()}  # which of the two would load?
    save_file(both, str(tmp_path / "both.safetensors"))
    with pytest.raises(ValueError, match="stored under two names"):
        load_weights(build_hf("gpt2", overrides=GPT2), tmp_path / "both.safetensors")


def test_a_tinygpt_run_exports_its_weights_alone_which_init_from_takes(tmp_path, capsys):
    from fourfold.cli.export import main as export

    first = tmp_path / "first"
    assert train_mod.main([*SMALL, "--steps", "2", "--out", str(first)]) == 0
    out = tmp_path / "weights"
    assert export([str(first / "model.pt"), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert [p.name for p in out.iterdir()] == ["model.safetensors"], said
    umask = os.umask(0)
    os.umask(umask)  # others read an export as they read what a plain mkdir and open make
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask and (out / "model.safetensors").stat().st_mode & 0o777 == \
        0o666 & ~umask
    assert f"--init-from {out / 'model.safetensors'} takes it" in said and "read UTF-8 bytes" in said
    second = tmp_path / "second"
    assert train_mod.main([*SMALL, *STILL, "--init-from", str(out / "model.safetensors"), "--out", str(second)]) == 0
    _same(load_checkpoint(second / "model.pt")["model"], load_checkpoint(first / "model.pt")["model"])
    assert export([str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2
    assert "export reads a run's model.pt" in capsys.readouterr().err and not (tmp_path / "x").exists()
    # the export carries its weights' sha256 in its metadata: a byte flipped in a tensor is refused by name
    data = bytearray((out / "model.safetensors").read_bytes())
    data[-5] ^= 0x10  # the last tensor's bytes
    (out / "model.safetensors").write_bytes(bytes(data))
    argv = [*SMALL, *STILL, "--init-from", str(out / "model.safetensors"), "--out", str(tmp_path / "third")]
    assert train_mod.main(argv) == 2
    said = capsys.readouterr().err
    assert f"{out / 'model.safetensors'} is damaged" in said and "take it again" in said, said


def _resident() -> int:
    """This process's resident memory, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc/self/statm (Linux)")
def test_unfilled_parameters_use_memory_only_where_written_and_keep_ties_and_built_buffers():
    from torch import nn

    from fourfold.models.weights import empty_parameters, zero_pages

    mb = 2**20
    with empty_parameters():
        model = nn.Sequential(*(nn.Linear(2048, 2048) for _ in range(8)))  # 8 x 16 MB of float32
        model.register_buffer("made", torch.arange(4.0))  # computed when built: kept
    assert all(p.is_meta for p in model.parameters()) and torch.equal(model.made, torch.arange(4.0))
    model[1].weight = model[0].weight
    with empty_parameters():  # one parameter registered on two modules as they are built stays one
        shared = nn.Parameter(torch.ones(3))
        first, second = nn.Module(), nn.Module()
        first.w, second.w = shared, shared
    assert first.w is second.w and first.w.is_meta
    before = _resident()
    zero_pages(model)
    assert all(float(p.detach().sum()) == 0.0 for p in model.parameters())  # read: the zero page, no memory used
    assert _resident() - before < 16 * mb
    with torch.no_grad():
        model[0].weight.fill_(1.0)  # written: this parameter's pages, and its tie's (the same tensor)
    assert model[1].weight is model[0].weight and float(model[1].weight.detach().sum()) == 2048 * 2048
    assert 15 * mb < _resident() - before < 32 * mb


def test_a_hugging_face_model_unfilled_keeps_its_rotary_frequencies_and_fills_from_stored_weights(tmp_path):
    pytest.importorskip("transformers")
    from fourfold.models.build import build_unfilled
    from fourfold.models.hf import build_hf
    from fourfold.models.weights import StoredWeights
    from fourfold.run.args import parse_args

    llama = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 16}
    saved = build_hf("llama", overrides=llama, seed=5)
    saved.save_pretrained(tmp_path / "llama")
    cfg = parse_args(["--model", "llama", "--init-from", str(tmp_path / "llama"), "--seq-len", "16"])
    model = build_unfilled(cfg)
    assert all(float(p.detach().abs().sum()) == 0.0 for p in model.parameters())
    assert torch.equal(model.model.rotary_emb.inv_freq, saved.model.rotary_emb.inv_freq)
    with StoredWeights(tmp_path / "llama", model) as stored:
        assert set(stored) == set(model.state_dict())
        with torch.no_grad():
            for name, t in model.state_dict().items():
                t.copy_(stored[name])
    _same(model.state_dict(), saved.state_dict())


LLAMA = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 16}
PHI3 = {**LLAMA, "num_attention_heads": 4}  # q|k|v fused, blocks 2:1:1: each rank fills its slice of each


def _unfilled(ctx, folders: list[str]) -> list[dict]:
    """README's recipe: a Hugging Face model never whole on any rank, each rank filling its tp x pp part."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fourfold import Layout, Mesh, parallelize
    from fourfold.models.weights import StoredWeights, empty_parameters, zero_pages

    out = []
    for folder in folders:
        with empty_parameters():
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), torch_dtype=torch.float64)
        zero_pages(model)
        ranks = Mesh.for_world(ctx.world_size, tp=2, pp=2).build(30)
        with StoredWeights(folder, model) as stored:
            engine = parallelize(model, ranks, Layout(tp=2, pp=2, microbatches=2),
                                 example=torch.zeros(1, 8, dtype=torch.long))
            engine.load_state_dict(stored)
        held = sum(t.numel() for t in engine.local_state_dict().values())
        state = engine.state_dict()
        to_3 = engine.state_dict(to=3)  # gathered onto rank 3 alone (pp 1, tp 1): the others never hold it whole
        out.append({"state": state, "held": held, "total": sum(t.numel() for t in state.values()),
                    "to_3": to_3 if ctx.rank == 3 else len(to_3)})
    return out


@pytest.mark.timeout(240)
def test_a_model_built_unfilled_is_cut_then_each_rank_fills_its_part_from_stored_weights(tmp_path):
    pytest.importorskip("transformers")
    from fourfold.models.hf import build_hf
    from fourfold.testing import run_ranks

    saved = {name: build_hf(name, overrides=config, seed=7, dtype=torch.float64)
             for name, config in (("llama", LLAMA), ("phi3", PHI3))}
    for name, model in saved.items():
        model.save_pretrained(tmp_path / name)
    per_rank = run_ranks(_unfilled, 4, [str(tmp_path / name) for name in saved], timeout_s=200)
    for i, model in enumerate(saved.values()):
        got = [r[i] for r in per_rank]
        _same(got[0]["state"], model.state_dict())
        assert all(r["held"] < got[0]["total"] / 2 for r in got)  # a tp x pp rank holds under half of the model
        assert list(got[3]["to_3"]) == list(got[3]["state"]) and [got[r]["to_3"] for r in range(3)] == [0, 0, 0]
        _same(got[3]["to_3"], got[3]["state"])


@pytest.mark.timeout(240)
def test_one_process_with_dropout_verifies_from_stored_weights(tmp_path, capfd):
    """The run builds the model unfilled (its initialisation draws nothing) and --verify's re-run builds it
    whole: both leave the generator at the seed, so one process draws the same dropout masks twice."""
    pytest.importorskip("transformers")
    from fourfold.models.hf import build_hf

    folder = tmp_path / "gpt2"
    build_hf("gpt2", overrides={**GPT2, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1},
             seed=3).save_pretrained(folder)
    assert train_mod.main(["--init-from", str(folder), "--steps", "2", "--seq-len", "16", "--batch-size", "4",
                           "--dtype", "float64", "--no-progress", "--no-trace", "--verify", "2",
                           "--out", str(tmp_path / "run")]) == 0
    assert "verify: OK" in capfd.readouterr().out
