"""Data beyond the built-in corpus: a text file, a folder of them, JSON Lines, token ids memory-mapped from
.npy / .bin, a tokenizer.json or a BPE trained at start-up; each refused with the fix when it cannot be read or
does not fit the model's vocabulary, before any process starts; and a trained tokenizer shared by two
data-parallel ranks gives the same numbers as one process (float64, 3 steps, 1e-10).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fourfold import train as train_mod
from fourfold.data import BatchLoader, ByteTokenizer, open_data, run_corpus, token_range
from fourfold.testing import run_ranks
from helpers import losses

TINY = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "16", "--batch-size", "4",
        "--steps", "3", "--dtype", "float64", "--no-progress"]


def _docs(tmp_path: Path) -> list[str]:
    return [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (3 + i) for i in range(12)]


def test_a_folder_of_text_files_is_its_files_in_path_order_joined_by_newlines(tmp_path):
    folder = tmp_path / "books"
    (folder / "b").mkdir(parents=True)
    (folder / "a.txt").write_text("first")
    (folder / "b" / "c.txt").write_text("second")
    (folder / ".hidden").write_text("never read")
    corpus = open_data(folder, ByteTokenizer())
    assert bytes(corpus.tokens.tolist()) == b"first\nsecond" and corpus.name == "books/"
    (folder / "bad.bin.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match=r"data must be UTF-8 text, got .*bad.bin.txt with a bad byte at offset 0"):
        open_data(folder, ByteTokenizer())


def test_a_byte_order_mark_is_left_out_and_a_json_file_is_not_read_as_text(tmp_path):
    path = tmp_path / "w.jsonl"  # as Windows tools write it
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "one"}).encode() + b"\r\n")
    assert bytes(open_data(path, ByteTokenizer()).tokens.tolist()) == b"one"
    text = tmp_path / "w.txt"
    text.write_bytes(b"\xef\xbb\xbfplain")
    assert bytes(open_data(text, ByteTokenizer()).tokens.tolist()) == b"plain"
    text.write_bytes(b"\xff")  # one file: nothing about folders
    with pytest.raises(ValueError, match=r"bad byte at offset 0\. Convert it to UTF-8$"):
        open_data(text, ByteTokenizer())
    array = tmp_path / "docs.json"
    array.write_text(json.dumps([{"text": "one"}]))
    with pytest.raises(ValueError, match=r"docs.json is a .json file, which fourfold would read as plain text.*"
                                         r"\.jsonl file \(JSON Lines\), or rename it .txt"):
        open_data(array, ByteTokenizer())


def test_json_lines_are_documents_and_a_bad_line_is_named(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(["one", "two"])) + "\n\n")
    corpus = open_data(path, ByteTokenizer())
    assert bytes(corpus.tokens.tolist()) == b"one\ntwo"
    path.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r'c.jsonl line 2 must be an object with a "text" string'):
        open_data(path, ByteTokenizer())
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"c.jsonl line 1 must be one JSON object"):
        open_data(path, ByteTokenizer())


def test_json_lines_keep_their_text_under_the_key_text_key_names(tmp_path, capsys):
    from fourfold.data import open_documents

    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps({"content": t, "id": i}) for i, t in enumerate(["one", "two"])) + "\n")
    with pytest.raises(ValueError, match=r'line 1 must be an object with a "text" string, got .* \(its keys: '
                                         r"content, id\)\. .*pass --text-key KEY"):
        open_data(path, ByteTokenizer())
    assert bytes(open_data(path, ByteTokenizer(), text_key="content").tokens.tolist()) == b"one\ntwo"
    documents = open_documents(str(path), ByteTokenizer(), text_key="content")
    assert [bytes(documents[k].tolist()) for k in range(len(documents))] == [b"one", b"two"]
    # through train, packed, with a note where the key reads nothing
    path.write_text("\n".join(json.dumps({"content": d}) for d in _docs(tmp_path)) + "\n")
    out = tmp_path / "run"
    assert train_mod.main([*TINY, "--data", str(path), "--text-key", "content", "--pack", "bfd", "--no-trace",
                           "--out", str(out)]) == 0
    assert json.loads((out / "run.json").read_text())["config"]["data"]["text_key"] == "content"
    assert train_mod.main([*TINY, "--text-key", "content", "--no-trace", "--out", str(tmp_path / "builtin")]) == 0
    assert "--text-key content (only a --data FILE.jsonl reads it)" in capsys.readouterr().err


@pytest.mark.parametrize(("suffix", "dtype"), [(".npy", "int32"), (".bin", "uint16"), (".bin", "uint32")])
def test_token_ids_are_memory_mapped_as_stored_and_batched_exactly(tmp_path, suffix, dtype):
    ids = (np.arange(5000) * 7919 % 1000).astype(dtype)
    path = tmp_path / f"ids{suffix}"
    np.save(path, ids) if suffix == ".npy" else ids.tofile(path)
    corpus = open_data(path, ByteTokenizer(), data_dtype=dtype)
    assert corpus.tokens.dtype == getattr(torch, dtype) and len(corpus) == 5000  # as stored: no int64 copy
    assert token_range(path, dtype) == (0, 999)
    whole = BatchLoader(corpus, 8, 16, seed=3, vocab_size=1000)
    x, y = whole.global_batch(2)
    windows = whole.window_indices(2)
    want = torch.from_numpy(ids.astype(np.int64)).view(-1)[: whole.num_windows * 17].view(-1, 17)[windows]
    assert torch.equal(x, want[:, :-1]) and torch.equal(y, want[:, 1:])
    shards = [BatchLoader(corpus, 8, 16, seed=3, dp_rank=r, dp_size=2).shard(2)[0] for r in range(2)]
    assert torch.equal(torch.cat(shards), x)  # the dp shards are the global batch, as for text
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, vocab_size=500\), got 9\d\d in 'ids"):
        BatchLoader(corpus, 8, 16, seed=3, vocab_size=500).global_batch(0)


def test_a_tokenizer_json_encodes_text_and_a_bad_one_is_refused(tmp_path):
    pytest.importorskip("tokenizers")
    from fourfold.data import load_tokenizer, train_bpe

    texts = _docs(tmp_path)
    trained = train_bpe(texts, 300, tmp_path / "tokenizer.json")
    assert 256 < trained.vocab_size <= 300
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert tok.decode(tok.encode(texts[0])) == texts[0]  # byte-level: every text round-trips
    (tmp_path / "c.txt").write_text("\n".join(texts))
    corpus = open_data(tmp_path / "c.txt", tok)
    assert corpus.tokens.max() < tok.vocab_size and len(corpus) < len("\n".join(texts))  # merges shorten it
    (tmp_path / "broken.json").write_text("{}")
    with pytest.raises(ValueError, match=r"tokenizer must be a readable tokenizer.json, got .*broken.json"):
        load_tokenizer(str(tmp_path / "broken.json"))


@pytest.mark.parametrize(("flags", "message"), [
    (["--data", "{ids}", "--vocab-size", "512"], "vocab_size must cover the data's tokens: ids.npy holds ids "
     "0..999, got vocab_size=512 in TinyGPT. Pass --vocab-size 1000 (or more)"),
    (["--data", "{ids}", "--tokenizer", "bpe:300"], "tokenizer reads text, got tokenizer='bpe:300' with token ids"),
    (["--tokenizer", "bpe:100"], "tokenizer must be bytes, bpe:N (N >= 256"),
    (["--tokenizer", "bpe:1024"], "the tokenizer makes ids 0..1023, got vocab_size=256 in TinyGPT. Pass "
     "--vocab-size 1024"),
    (["--data", "{missing}"], "data must be a readable file or folder"),
    (["--data", "{odd}", "--data-dtype", "uint32"], "must hold whole uint32 token ids, got 6 bytes"),
    (["--data", "{u16}", "--data-dtype", "int64"], "token ids must be below 16,777,216 (no tokenizer's "
     "vocabulary is larger), got 288,234,769,970,234,365 in {u16} read as --data-dtype int64. Pass the --data-dtype "
     "the file was written with"),  # uint16 ids read 4 at a time: not a vocabulary
    # text read in the launcher too (small enough): refused once, before any rank starts
    (["--data", "{empty}"], "corpus must hold at least one byte, got 0 bytes from 'empty.txt'"),
    (["--data", "{keyless}"], 'data keyless.jsonl line 2 must be an object with a "text" string'),
])
def test_data_that_does_not_fit_is_refused_before_start(tmp_path, capsys, flags, message):
    np.save(tmp_path / "ids.npy", np.arange(1000, dtype=np.int32))
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 6)
    np.arange(1, 1025, dtype=np.uint16).tofile(tmp_path / "u16.bin")  # as nanoGPT writes its ids
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "keyless.jsonl").write_text('{"text": "a"}\n{"content": "b"}\n')
    names = {"ids": tmp_path / "ids.npy", "missing": tmp_path / "nope.txt", "odd": tmp_path / "odd.bin",
             "u16": tmp_path / "u16.bin", "empty": tmp_path / "empty.txt", "keyless": tmp_path / "keyless.jsonl"}
    message = message.format(**names)
    argv = [f.format(**names) for f in flags] + [*TINY, "--out", str(tmp_path / "run"), "--nproc", "2"]
    try:
        code = train_mod.main(argv)
    except SystemExit as e:  # refused by the flag parser
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert not (tmp_path / "run" / "run.json").exists()


def _dp2(ctx, argv: list[str]) -> list[float]:
    from fourfold.run.args import parse_args
    from fourfold.train import train

    return train(parse_args(argv), ctx).losses


@pytest.mark.timeout(180)
def test_a_bpe_trained_at_start_up_is_shared_by_every_rank_and_equals_one_process(tmp_path):
    pytest.importorskip("tokenizers")
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in _docs(tmp_path)))
    common = [*TINY, "--data", str(path), "--tokenizer", "bpe:300", "--vocab-size", "300"]
    assert train_mod.main([*common, "--out", str(tmp_path / "one")]) == 0
    got = run_ranks(_dp2, 2, [*common, "--dp", "2", "--allreduce", "ring", "--out", str(tmp_path / "two")],
                    timeout_s=150)
    want = losses(tmp_path / "one")
    for rank_losses in got:
        assert max(abs(a - b) for a, b in zip(rank_losses, want, strict=True)) < 1e-10, (rank_losses, want)
    one, two = (tmp_path / "one" / "tokenizer.json").read_text(), (tmp_path / "two" / "tokenizer.json").read_text()
    assert one == two  # the same corpus trains the same tokenizer; both runs keep theirs
    run = json.loads((tmp_path / "two" / "run.json").read_text())
    assert run["corpus"]["tokenizer"].startswith("bpe:300 (") and run["corpus"]["tokens"] == len(
        run_corpus(str(path), "bpe:300", tmp_path / "two").tokens)


def test_a_bpe_that_learns_fewer_ids_than_asked_says_so(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    path = tmp_path / "c.txt"
    path.write_text("\n".join(_docs(tmp_path)))
    corpus = run_corpus(str(path), "bpe:4096", tmp_path)
    got = json.loads((tmp_path / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(got) < 4096 and int(corpus.tokens.max()) < len(got)
    assert (f"bpe:4096 learned only {len(got)} ids from this corpus" in (err := capsys.readouterr().err)
            and f"Pass --tokenizer bpe:{len(got)} --vocab-size {len(got)}" in err), err
