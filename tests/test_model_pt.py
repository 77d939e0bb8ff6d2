"""model.pt proves itself: a run's final weights carry a sha256 that loading checks, so a damaged file is refused
in one line naming it, what is wrong and what to do, and never loads other weights without a word.

Reading a failure: "loaded other weights" means a byte flipped inside the file went unnoticed (the digest does not
cover what changed); a message without the file's name breaks the promise of docs/reliability.md.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from fourfold.checkpoint import load_checkpoint, save_checkpoint
from fourfold.models.model_pt import WeightsFileError, weights_sha256

CONFIG = {"model": {"n_layer": 1}, "train": {"steps": 3, "lr": 0.01}, "note": "tiny"}


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed.weight": torch.randn(16, 8, generator=g), "head.bias": torch.randn(16, generator=g).bfloat16(),
            "rope": torch.randn(4, 2, generator=g, dtype=torch.complex64), "mask": torch.ones(4, dtype=torch.bool),
            "count": torch.tensor(7), "ids": torch.arange(5)}


def _same(got: dict, want: dict) -> bool:
    return (got["config"] == want["config"] and got["step"] == want["step"] and got["model"].keys() == want["model"].keys()
            and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in
                    ((got["model"][k], want["model"][k]) for k in want["model"])))


@pytest.fixture
def saved(tmp_path):
    path = save_checkpoint(tmp_path / "model.pt", _state(), config=CONFIG, step=3)
    return path, load_checkpoint(path)


def test_a_saved_model_loads_as_written_with_its_digest(saved):
    path, loaded = saved
    assert _same(loaded, {"model": _state(), "config": CONFIG, "step": 3})
    assert loaded["format"] == 2 and loaded["sha256"] == weights_sha256(_state(), CONFIG, 3)
    plain = torch.load(path, weights_only=True)  # still a plain torch file for any other tool
    assert torch.equal(plain["model"]["embed.weight"], _state()["embed.weight"])


def test_no_flipped_byte_loads_other_weights_silently(saved):
    path, want = saved
    data = path.read_bytes()
    positions = sorted(random.Random(0).sample(range(len(data)), 300)) + list(range(0, len(data), 97))
    refused = 0
    for pos in positions:
        damaged = bytearray(data)
        damaged[pos] ^= 0x10
        path.write_bytes(bytes(damaged))
        try:
            got = load_checkpoint(path)
        except WeightsFileError as e:
            refused += 1
            assert str(path) in str(e) and "\n" not in str(e), str(e)
            continue
        assert _same(got, want), f"a byte flipped at {pos} of {len(data)} loaded other weights without a word"
    assert refused > len(positions) // 2  # most flips land in data the digest covers


@pytest.mark.parametrize("kind", ["empty", "truncated", "random", "text", "state dict", "digest removed"])
def test_a_damaged_or_foreign_file_is_refused_in_one_line_naming_it_and_the_fix(saved, kind):
    path, _ = saved
    data = path.read_bytes()
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "random":
        path.write_bytes(os.urandom(len(data)))
    elif kind == "text":
        path.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 1234\n")
    elif kind == "state dict":
        torch.save(_state(), path)
    else:
        payload = torch.load(path, weights_only=True)
        del payload["sha256"]
        torch.save(payload, path)
    with pytest.raises(WeightsFileError) as raised:
        load_checkpoint(path)
    said = str(raised.value)
    assert said.startswith(str(path)) and "\n" not in said, said
    what = {"empty": "is empty", "truncated": "truncated or damaged", "random": "not a torch file",
            "text": "holds text", "state dict": "not fourfold's model.pt", "digest removed": "is damaged"}[kind]
    assert what in said, said
    assert "take it again" in said or "--init-from" in said, said


def test_a_model_pt_written_before_the_digest_still_loads(tmp_path):
    path = tmp_path / "model.pt"
    torch.save({"model": _state(), "config": CONFIG, "step": 3}, path)
    assert _same(load_checkpoint(path), {"model": _state(), "config": CONFIG, "step": 3})


def test_init_from_and_export_refuse_a_damaged_model_pt(saved, tmp_path):
    from fourfold.cli.export import export
    from fourfold.models.weights import stored_shapes

    path, _ = saved
    assert stored_shapes(path)["embed.weight"] == (16, 8)  # what --init-from reads first
    payload = torch.load(path, weights_only=True)
    payload["model"]["embed.weight"][3, 4] += 1.0  # as a flipped bit inside the tensor would
    torch.save(payload, path)
    with pytest.raises(WeightsFileError, match="is damaged"):
        stored_shapes(path)
    with pytest.raises(WeightsFileError, match="is damaged"):
        export(path, tmp_path / "exported")
    assert not (tmp_path / "exported").exists()
