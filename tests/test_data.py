"""Corpus, tokenizer and BatchLoader: determinism, dp sharding, epoch coverage, resume, input errors.

Pure tests, no processes. If a sharding test fails, dp ranks no longer see exactly the global batch that one
process would train on, and every "N ranks equal one process" test downstream will fail with it.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fourfold.data import BatchLoader, ByteTokenizer, Corpus, load_corpus


def _corpus(n_bytes: int = 1000, seed: int = 0) -> Corpus:
    data = torch.randint(0, 256, (n_bytes,), generator=torch.Generator().manual_seed(seed))
    return Corpus.from_bytes(bytes(data.tolist()), "random")


@given(st.text(alphabet=st.characters(codec="utf-8")))
def test_tokenizer_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.dtype == torch.int64 and ids.dim() == 1 and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_tokenizer_replaces_invalid_utf8_and_refuses_non_bytes() -> None:
    tok = ByteTokenizer()
    assert tok.vocab_size == 256
    assert tok.decode(torch.tensor([104, 0xFF, 105])) == "h\ufffdi"
    with pytest.raises(ValueError, match=r"min=0, max=256"):
        tok.decode(torch.tensor([0, 256]))


def test_default_corpus_is_deterministic_and_nontrivial() -> None:
    a, b = load_corpus(max_bytes=300_000), load_corpus(max_bytes=300_000)
    assert a.sha256 == b.sha256 and len(a.sha256) == 64
    assert torch.equal(a.tokens, b.tokens)
    assert a.tokens.dtype == torch.uint8 and len(a) == 300_000
    text = bytes(a.tokens.tolist())
    assert b"def " in text and b"import " in text
    assert len(set(text)) > 60  # real source code, not one repeated byte
    assert load_corpus(max_bytes=1000).sha256 != a.sha256


def test_corpus_from_file(tmp_path) -> None:
    path = tmp_path / "tiny.txt"
    path.write_bytes(b"hello, corpus\n" * 10)
    corpus = load_corpus(path)
    assert bytes(corpus.tokens.tolist()) == b"hello, corpus\n" * 10 and corpus.name == "tiny.txt"
    assert len(load_corpus(path, max_bytes=5)) == 5
    with pytest.raises(ValueError, match=r"corpus path must be a readable file"):
        load_corpus(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"got 0 bytes"):
        load_corpus(tmp_path / "empty.txt")


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
@pytest.mark.parametrize("step", [0, 3, 9])  # step 9 spans the epoch boundary (111 windows, B=12)
def test_shards_partition_the_global_batch(dp: int, step: int) -> None:
    corpus, B = _corpus(), 12
    full = BatchLoader(corpus, batch_size=B, seq_len=8, seed=0)
    ranks = [BatchLoader(corpus, batch_size=B, seq_len=8, seed=0, dp_rank=r, dp_size=dp) for r in range(dp)]
    shards = [r.shard(step) for r in ranks]
    assert all(x.shape == (B // dp, 8) and y.shape == (B // dp, 8) for x, y in shards)
    X, Y = full.global_batch(step)
    assert X.dtype == Y.dtype == torch.int64 and X.shape == (B, 8)
    assert torch.equal(torch.cat([x for x, _ in shards]), X)
    assert torch.equal(torch.cat([y for _, y in shards]), Y)
    ids = [r.shard_indices(step) for r in ranks]
    assert torch.equal(torch.cat(ids), full.window_indices(step))
    # Disjoint as row positions always; as windows too when the batch stays inside one epoch.
    if step != 9:
        assert len(set(torch.cat(ids).tolist())) == B


def test_batch_is_a_function_of_seed_and_step() -> None:
    corpus = _corpus()
    a = BatchLoader(corpus, batch_size=4, seq_len=8, seed=3)
    b = BatchLoader(corpus, batch_size=4, seq_len=8, seed=3)
    c = BatchLoader(corpus, batch_size=4, seq_len=8, seed=4)
    b.global_batch(50)  # visiting other steps first must not matter
    assert torch.equal(a.global_batch(7)[0], b.global_batch(7)[0])
    assert not torch.equal(a.global_batch(7)[0], c.global_batch(7)[0])
    assert not torch.equal(a.global_batch(7)[0], a.global_batch(8)[0])


def test_each_epoch_visits_every_window_once() -> None:
    corpus = Corpus.from_bytes(bytes(range(256)) * 2, "ramp")  # 512 tokens -> 24 windows of 21
    loader = BatchLoader(corpus, batch_size=10, seq_len=20, seed=1)  # 10 does not divide 24
    n = loader.num_windows
    assert n == 24
    order = torch.cat([loader.window_indices(s) for s in range(5)])  # positions 0..49
    first, second = order[:n], order[n : 2 * n]
    assert torch.equal(first.sort().values, torch.arange(n))
    assert torch.equal(second.sort().values, torch.arange(n))
    assert not torch.equal(first, second)  # a fresh permutation each epoch


def test_y_is_x_shifted_by_one_in_the_corpus() -> None:
    corpus = _corpus()
    T = 8
    loader = BatchLoader(corpus, batch_size=6, seq_len=T, seed=0, dp_rank=1, dp_size=2)
    x, y = loader.shard(2)
    tokens = corpus.tokens.long()
    for row, k in enumerate(loader.shard_indices(2).tolist()):
        start = k * (T + 1)  # windows do not overlap: stride T+1
        assert torch.equal(x[row], tokens[start : start + T])
        assert torch.equal(y[row], tokens[start + 1 : start + T + 1])


def test_iteration_resumes_from_state_dict() -> None:
    corpus = _corpus()
    loader = BatchLoader(corpus, batch_size=4, seq_len=8, seed=0, dp_rank=1, dp_size=2)
    seen = [next(loader) for _ in range(5)]
    assert loader.state_dict() == {"step": 5}
    resumed = BatchLoader(corpus, batch_size=4, seq_len=8, seed=0, dp_rank=1, dp_size=2)
    resumed.load_state_dict({"step": 3})
    for i, (x, y) in zip(range(3, 5), resumed, strict=False):
        assert torch.equal(x, seen[i][0]) and torch.equal(y, seen[i][1])
    assert resumed.state_dict() == {"step": 5}
    with pytest.raises(ValueError, match=r"state\['step'\] must be an integer >= 0, got state\['step'\]=-1"):
        resumed.load_state_dict({"step": -1})


def test_indivisible_batch_is_refused() -> None:
    with pytest.raises(ValueError, match=r"batch_size=6, dp=4\. Pass --batch-size 8 \(a multiple of 4\)"):
        BatchLoader(_corpus(), batch_size=6, seq_len=8, seed=0, dp_rank=0, dp_size=4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seq_len": 0}, r"seq_len must be an integer >= 1, got seq_len=0"),
        ({"batch_size": 0}, r"batch_size must be an integer >= 1, got batch_size=0"),
        ({"dp_rank": 2, "dp_size": 2}, r"dp_rank must be an integer in \[0, 2\), got dp_rank=2"),
        ({"dp_rank": -1}, r"dp_rank must be an integer in \[0, 1\), got dp_rank=-1"),
        ({"seed": -1}, r"seed must be an integer in \[0, 4294967296\), got seed=-1"),
        ({"seq_len": 1000}, r"at least seq_len\+1=1001 tokens, got 1000"),
    ],
)
def test_bad_loader_arguments_are_refused(kwargs: dict[str, int], match: str) -> None:
    args = {"batch_size": 4, "seq_len": 8, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=match):
        BatchLoader(_corpus(), **args)
