"""Held-out evaluation (``--eval-every N --eval-batches K``, ``Engine.evaluate``): the data that training never
reads, and its loss the same under a layout as on one process.

``Engine.evaluate`` itself equals ``model.eval()`` on one process in every layout of ``test_engine`` and
``test_zero``; here: the loaders hold data out, and ``fourfold train`` reports the held-out loss alike on a
pipeline (windows) and under dp with packed documents.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fourfold import train as train_mod
from fourfold.data import BatchLoader, DocumentLoader, Documents, load_corpus
from fourfold.data.loader import HeldOut

SMALL = ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--seq-len", "16", "--batch-size", "8",
         "--no-progress", "--device", "cpu", "--dtype", "float64", "--steps", "3"]


@given(st.integers(2, 400), st.data())
def test_the_held_out_items_and_the_trained_ones_are_every_item_once(n, data):
    count = data.draw(st.integers(0, n // 2))
    split = HeldOut(n, count)
    held = split.held(torch.arange(count)).tolist()
    trained = split.trained(torch.arange(n - count)).tolist()
    assert sorted(held + trained) == list(range(n))
    assert trained == sorted(trained) and held == sorted(held)  # each in the data's order
    if count:  # spread through the data: one in each of count equal stretches, not its end
        assert all(k * (n // count) <= h < (k + 1) * (n // count) for k, h in enumerate(held))


def test_held_out_windows_are_never_trained_on_and_shards_make_the_batch():
    corpus = load_corpus(max_bytes=4096)
    whole = BatchLoader(corpus, 4, 15, seed=0, eval_batches=2)
    n, held = whole.num_windows, whole.held_out
    assert held == 8 and whole.order.n == n - held
    out = set(whole.split.held(torch.arange(held)).tolist())
    trained = {int(i) for step in range(3 * n // 4) for i in whole.window_indices(step)}
    assert trained == set(range(n)) - out, "training visits every window but the held-out ones"
    assert max(out) >= n // 2 > min(out)  # from all through the corpus
    shards = [BatchLoader(corpus, 4, 15, seed=0, dp_rank=r, dp_size=2, eval_batches=2) for r in (0, 1)]
    for i in range(2):
        x = torch.cat([s.eval_batch(i).inputs for s in shards])
        assert torch.equal(x, whole.eval_batch(i).inputs)  # rank order: the global held-out batch
        first = int(whole.split.held(torch.tensor(4 * i)))
        assert torch.equal(whole.eval_batch(i).inputs[0], corpus.tokens[first * 16:][:15].long())
    with pytest.raises(ValueError, match=f"more than half of them. Pass --eval-batches {n // 2 // 4} at most"):
        BatchLoader(corpus, 4, 15, seed=0, eval_batches=n // 8 + 1)
    with pytest.raises(ValueError, match=r"i must be an integer in \[0, 2\)"):
        whole.eval_batch(2)
    with pytest.raises(ValueError, match="got none held out"):
        BatchLoader(corpus, 4, 15, seed=0).eval_batch(0)


def test_held_out_documents_are_spread_through_the_data_and_packed_as_a_step_is():
    docs = Documents.from_list([torch.arange(2, 2 + k) for k in range(3, 23)], "twenty")
    loader = DocumentLoader(docs, 8, seed=0, docs_per_step=3, eval_batches=2, eval_docs=3)
    assert loader.held_out == 6
    out = set(loader.split.held(torch.arange(6)).tolist())
    assert out == {1, 4, 7, 10, 13, 16}  # the middle of each stretch of 3 (20 // 6)
    taken = {d for step in range(10) for d in loader.doc_indices(step)}
    assert taken == set(range(20)) - out, taken
    budget = DocumentLoader(docs, 8, seed=0, tokens_per_step=30, eval_batches=2, eval_docs=3)
    assert not {d for step in range(10) for d in budget.doc_indices(step)} & out  # a token budget too
    with pytest.raises(ValueError, match=r"i must be an integer in \[0, 2\)"):
        loader.eval_batch(-1)
    with pytest.raises(ValueError, match="eval_docs must be >= 1"):
        DocumentLoader(docs, 8, seed=0, docs_per_step=3, eval_batches=2)
    batch = loader.eval_batch(1)  # documents 10, 13, 16: lengths 13, 16, 19
    assert set(batch.documents.unique().tolist()) - {-1} and batch.num_tokens == sum(k - 1 for k in (13, 16, 19))


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", [["--pp", "2", "--microbatches", "2"], ["--pack", "bfd", "--allreduce", "ring"]],
                         ids=["pp2 windows", "dp2 packed"])
def test_the_held_out_loss_under_a_layout_is_one_processs(tmp_path: Path, layout: list[str]):
    common = [*SMALL, "--eval-every", "2", "--eval-batches", "2", *layout]
    one = tmp_path / "one"
    assert train_mod.main([*common, "--out", str(one), "--pp", "1"] if "--pp" in layout else
                          [*common, "--out", str(one)]) == 0
    two = tmp_path / "two"
    cmd = [sys.executable, "-m", "fourfold", "train", "--nproc", "2", *common, "--out", str(two)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "held-out loss" in proc.stdout + proc.stderr
    rows = {}
    for name in ("one", "two"):
        rows[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert [("eval_loss" in r) for r in rows["two"]] == [False, True, True]  # every 2 steps, and the last
    for a, b in zip(rows["one"], rows["two"], strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-10, (a["loss"], b["loss"])
        assert abs(a.get("eval_loss", 0.0) - b.get("eval_loss", 0.0)) < 1e-10, (a, b)


def test_the_held_out_loss_counts_each_token_once_whatever_packed_batch_it_fell_in():
    from types import SimpleNamespace

    from fourfold.data.loader import Batch
    from fourfold.observe.trace import Tracer
    from fourfold.run.metrics import held_out_loss as _evaluate

    ids = torch.zeros(1, 4, dtype=torch.long)
    batches = [Batch(ids, ids, torch.zeros(1, 4, dtype=torch.long), num_tokens=10),
               Batch(ids, ids, torch.zeros(1, 4, dtype=torch.long), num_tokens=30)]
    losses = iter([1.0, 4.0])  # each batch's mean over its own real tokens
    engine = SimpleNamespace(evaluate=lambda *a, **k: torch.tensor(next(losses)))
    loader = SimpleNamespace(eval_batch=lambda i: batches[i])
    assert _evaluate(engine, loader, 2, torch.device("cpu"), Tracer(0, enabled=False)) == (10 * 1 + 30 * 4) / 40
    windows = [Batch(ids, ids), Batch(ids, ids)]  # equal targets in each: the plain mean
    losses = iter([1.0, 4.0])
    loader = SimpleNamespace(eval_batch=lambda i: windows[i])
    assert _evaluate(engine, loader, 2, torch.device("cpu"), Tracer(0, enabled=False)) == 2.5
