"""Configuration: defaults < TOML file < flags; unknown keys and flags refused with the nearest valid name."""

from __future__ import annotations

import pytest

from fourfold.config import Config
from fourfold.run.args import load, parse_args


def test_defaults():
    cfg = parse_args([])
    assert cfg == Config()
    assert cfg.train.steps >= 1 and cfg.model.seq_len >= 1


def test_file_then_flags_override(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('[model]\nn_layer = 2\nd_model = 64\n[train]\nsteps = 7\nlr = 0.01\ndtype = "float64"\n'
                 "[launch]\nnproc = 2\n")
    cfg = parse_args(["--config", str(f), "--steps", "3", "--no-trace"])
    assert cfg.model.n_layer == 2 and cfg.model.d_model == 64
    assert cfg.train.steps == 3  # flag beats file
    assert cfg.optim.lr == 0.01 and cfg.train.dtype == "float64"  # lr under [train]: an older file, still read
    assert cfg.launch.nproc == 2
    assert cfg.output.trace is False


def test_unknown_key_in_file_names_the_nearest(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text("[train]\nstpes = 3\n")
    with pytest.raises(ValueError, match=r"unknown key 'stpes' in \[train\].*Did you mean 'steps'"):
        load(f)
    f.write_text("[trian]\nsteps = 3\n")
    with pytest.raises(ValueError, match=r"unknown section \[trian\].*Did you mean 'train'"):
        load(f)


def test_unknown_flag_names_the_nearest(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--stpes", "3"])
    assert e.value.code == 2
    assert "unknown flag '--stpes'. Did you mean '--steps'?" in capsys.readouterr().err


def test_abbreviated_flags_are_not_guessed(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--ste", "3"])
    assert "unknown flag '--ste'" in capsys.readouterr().err


def test_bad_values_refused_with_names(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--steps", "0"])
    assert "steps must be >= 1, got steps=0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--dtype", "float16"])
    assert "invalid choice" in capsys.readouterr().err
    f = tmp_path / "run.toml"
    f.write_text("[model]\nd_model = 130\nn_head = 4\n")
    with pytest.raises(SystemExit):
        parse_args(["--config", str(f)])
    assert "130" in capsys.readouterr().err


def test_multi_node_needs_an_endpoint(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--nnodes", "2"])
    assert "--rdzv-endpoint" in capsys.readouterr().err


def test_every_section_round_trips_through_a_dict():
    d = Config().to_dict()
    assert set(d) == {"model", "data", "parallel", "optim", "train", "checkpoint", "output", "launch"}
    assert d["train"]["steps"] == Config().train.steps


@pytest.mark.parametrize("toml,message", [
    ("[train]\nsteps = true", "steps must be an integer, got True (bool) in"),
    ("[train]\nsteps = 3.5", "steps must be an integer, got 3.5 (float) in"),
    ('[launch]\nnproc = "2"', "nproc must be an integer, got '2' (str) in"),
    ('[train]\ndtype = "float16"', "dtype must be one of float32, float64, got 'float16' in"),
    ("[train]\nout = 5", "out must be text, got 5 (int) in"),
    ("[train]\nlr = inf", "lr must be a finite number, got inf in"),
    ('[train]\nout = ""', "out must name a directory, got an empty string"),
    ("steps = 3\n[train]\nlr = 1e-3", "steps = 3 in {f} is outside any table; every key sits under [model], [data], "
     "[parallel], [optim], [train], [checkpoint], [output] or [launch]. Put it under [train]."),
    ("[train\nsteps = 3", "config {f} is not valid TOML: Expected ']' at the end of a table declaration"),
    ("[train]\nsteps = -1", "--config {f} (or a flag): steps must be >= 1, got steps=-1."),
])
def test_toml_values_are_checked_like_flags(tmp_path, capsys, toml, message):
    f = tmp_path / "run.toml"
    f.write_text(toml + "\n")
    with pytest.raises(SystemExit) as e:
        parse_args(["--config", str(f)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message.format(f=f) in err, err


@pytest.mark.parametrize("toml,flags,message", [
    ("[train]\nsteps = true", ["--steps", "1"], "steps must be an integer, got True (bool) in"),  # a flag replaces it
    ("[train]\nout = 5", ["--out", "runs/x"], "out must be text, got 5 (int) in"),
    ("[train]\nnproc = 2", [], "unknown key 'nproc' in [train] of {f}. It belongs under [launch]."),
])
def test_every_toml_value_is_checked_even_one_a_flag_replaces(tmp_path, capsys, toml, flags, message):
    f = tmp_path / "run.toml"
    f.write_text(toml + "\n")
    with pytest.raises(SystemExit):
        parse_args(["--config", str(f), *flags])
    assert message.format(f=f) in capsys.readouterr().err


def test_a_missing_config_file_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--config", str(tmp_path / "nope.toml")])
    assert f"config {tmp_path / 'nope.toml'} cannot be read: No such file or directory" in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [
    (["--lr", "inf"], "lr must be a finite number, got inf"),
    (["--timeout", "nan"], "timeout must be a finite number, got nan"),
    (["--timeout", "inf"], "timeout must be a finite number, got inf"),
    (["--out", ""], "out must name a directory, got an empty string"),
    (["--max-restarts", "-1"], "max_restarts must be >= 0"),
    (["--memory-limit", "80"], "memory_limit must have a unit, got '80', which would be 80 bytes. Pass 80GB"),
])
def test_non_finite_and_empty_flags_are_refused(capsys, flags, message):
    with pytest.raises(SystemExit):
        parse_args(flags)
    assert message in capsys.readouterr().err


def test_a_float_field_takes_a_toml_integer(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text("[optim]\nlr = 1\n")
    cfg = parse_args(["--config", str(f)])
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)


def test_torchrun_never_reads_the_commands_flags():
    """torch 2.13's torchrun has --virtual-local-rank: argparse took train's --virtual for a prefix of it and
    refused every interleaved run with --nproc > 1. The command's flags come after "--"."""
    from torch.distributed import run as torchrun

    from fourfold.torchrun import LaunchConfig, torchrun_args

    flags = ["--pp", "2", "--schedule", "interleaved", "--virtual", "2", "--nproc", "2"]
    args = torchrun.parse_args(torchrun_args("fourfold.train", flags, LaunchConfig(nproc=2)))
    assert args.module and args.training_script == "fourfold.train"
    assert args.training_script_args == flags and args.nproc_per_node == "2"


FLAGS = ["--nproc", "4", "--tp", "2", "--zero", "1", "--allreduce", "ring", "--boundaries", "1,blocks.2",
         "--lr", "1e-05", "--max-grad-norm", "0.5", "--steps", "7"]


def test_print_config_reads_back_to_the_same_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args([*FLAGS, "--print-config"])
    assert e.value.code == 0
    f = tmp_path / "run.toml"
    f.write_text(capsys.readouterr().out)
    assert parse_args(["--config", str(f)]) == parse_args(FLAGS)
    assert parse_args(["--config", str(f)]).record() == parse_args(FLAGS).record()  # run.json's config


def test_a_parallel_table_and_the_same_flags_give_the_same_run(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('[parallel]\ntp = 2\nzero = 1\nallreduce = "ring"\nboundaries = [1, "blocks.2"]\n'
                 "[launch]\nnproc = 4\n")
    flags = ["--nproc", "4", "--tp", "2", "--zero", "1", "--allreduce", "ring", "--boundaries", "1,blocks.2"]
    assert parse_args(["--config", str(f)]).record() == parse_args(flags).record()


def test_a_file_from_before_the_parallel_table_loads_with_one_note(tmp_path, capsys):
    f = tmp_path / "old.toml"
    f.write_text('[train]\nsteps = 3\ntp = 2\nzero = 1\nallreduce = "ring"\n[launch]\nnproc = 2\n')
    cfg = parse_args(["--config", str(f)])
    assert (cfg.parallel.tp, cfg.parallel.zero, cfg.parallel.allreduce, cfg.train.steps) == (2, 1, "ring", 3)
    err = capsys.readouterr().err
    assert err.count("note:") == 1 and "tp, zero, allreduce under [parallel]" in err and "[parallel]" in err, err
    f.write_text("[train]\ntp = 2\n[parallel]\ntp = 4\n")
    with pytest.raises(SystemExit):
        parse_args(["--config", str(f)])
    assert "tp is set twice" in capsys.readouterr().err


def test_the_readmes_toml_is_read_as_it_stands_in_its_sections(tmp_path, capsys):
    """README's example file: every table a section of its own, every key where it belongs (no note)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    (block,) = re.findall(r"```toml\n(.*?)```", readme, flags=re.S)
    f = tmp_path / "run.toml"
    f.write_text(block)
    cfg = parse_args(["--config", str(f)])
    assert "note:" not in capsys.readouterr().err
    assert re.findall(r"^\[(\w+)\]", block, flags=re.M) == list(cfg.to_dict())  # every section, in order
    assert (cfg.data.data, cfg.parallel.tp, cfg.optim.lr_decay, cfg.train.steps, cfg.checkpoint.checkpoint_every,
            cfg.output.out, cfg.launch.nproc) == ("corpus.txt", 2, "cosine", 200, 50, "runs/tp2", 4)


def test_a_file_from_before_the_sections_loads_each_key_into_its_table_with_one_note(tmp_path, capsys):
    """[train] once held the data, optimiser, checkpoint and output keys too: each goes to its table, one note
    names them by table, and the run is the one the sectioned file (or the flags) gives."""
    f = tmp_path / "old.toml"
    f.write_text('[train]\nsteps = 4\nlr = 0.01\ntokenizer = "bpe:300"\nkeep = 3\nout = "runs/old"\ntp = 2\n'
                 "[launch]\nnproc = 2\n")
    cfg = parse_args(["--config", str(f)])
    err = capsys.readouterr().err
    assert err.count("note:") == 1, err
    for words in ("lr under [optim]", "tokenizer under [data]", "keep under [checkpoint]", "out under [output]",
                  "tp under [parallel]"):
        assert words in err, (words, err)
    flags = ["--steps", "4", "--lr", "0.01", "--tokenizer", "bpe:300", "--keep", "3", "--out", "runs/old", "--tp",
             "2", "--nproc", "2"]
    assert cfg.record() == parse_args(flags).record()
    f.write_text('[train]\nlr = 0.01\n[optim]\nlr = 0.02\n')
    with pytest.raises(SystemExit):
        parse_args(["--config", str(f)])
    err = capsys.readouterr().err
    assert "lr is set twice in" in err and "under [train] and [optim]" in err, err
