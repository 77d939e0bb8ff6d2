"""Packed documents: the arrangement (pad, first-fit, bfd), the attention that keeps documents apart, and the
loss normalised by the global batch's real tokens, so every layout computes the gradient of the documents run
one at a time with no padding, summed and divided by their real token count (float64, 1e-10).

Reading a failure: ``reference`` runs each piece alone (B=1, its own length, plain causal attention). Off in
one process only: the mask or the positions (fourfold.models.attention, the HF hook). Off only under dp: the
count or the summed (not averaged) gradients; only under pp: micro-batch losses divided by m, or the layout not
current around a micro-batch's forward; only under tp: the vocabulary-parallel loss's ignored targets.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fourfold import Layout, Mesh, parallelize
from fourfold.data.documents import Documents, open_documents, skewed_documents
from fourfold.data.packing import DocumentLayout, DocumentLoader, document_layout, pack, pieces
from fourfold.data.tokenizers import ByteTokenizer
from fourfold.models import GPTConfig, TinyGPT
from fourfold.models.hf import FLOAT32_NORMS
from fourfold.parallel.pipeline.blocks import output_tensor
from fourfold.testing import run_ranks
from helpers import max_error

T = 16
TOL = 1e-10
DOCS = skewed_documents(60, 40, vocab_size=64, short_ratio=0.25, seed=1)  # a few longer than a row: split
GPT2 = dict(vocab_size=64, n_positions=T, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0)
LLAMA = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, max_position_embeddings=T)


def build(name: str) -> nn.Module:
    if name == "tiny":
        return TinyGPT(GPTConfig(vocab_size=64, seq_len=T, n_layer=2, n_head=2, d_model=16), seed=0,
                       dtype=torch.float64)
    pytest.importorskip("transformers")
    from fourfold.models.hf import build_hf

    windows = {"mistral": {"sliding_window": 5},  # every layer; documents up to T = 16 tokens
               "qwen2": {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},  # layer 1
               "gemma": {"head_dim": 4},  # not a window: Gemma's heads are 256 wide unless told
               "phi3": {"sliding_window": 5, "partial_rotary_factor": 0.5},  # fused q|k|v and gate|up; every layer
               "granite": {"embedding_multiplier": 12.0, "logits_scaling": 8.0, "residual_multiplier": 0.22},
               "gemma3_text": {"head_dim": 4, "sliding_window": 5, "query_pre_attn_scalar": 4,  # layer 0 windowed
                               "layer_types": ["sliding_attention", "full_attention"]},
               # eager attention (its scores soft-capped): fourfold's masks added to the scores
               "gemma2": {"head_dim": 4, "sliding_window": 5, "query_pre_attn_scalar": 4, "attn_logit_softcapping": 1.0,
                          "layer_types": ["sliding_attention", "full_attention"]},
               # OLMo 3: OLMo 2's q/k norms over all heads, and a window on layer 0
               "olmo3": {"sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"]},
               # SmolLM3: no rotary embedding on layer 1, and a window there
               "smollm3": {"no_rope_layers": [1, 0], "use_sliding_window": True, "sliding_window": 5,
                           "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}}
    return build_hf(name, overrides=GPT2 if name == "gpt2" else {**LLAMA, **windows.get(name, {})},
                    dtype=torch.float64)


def loader(packing: str = "bfd", dp: int = 1, rank: int = 0, micro: int = 1) -> DocumentLoader:
    return DocumentLoader(DOCS, T, seed=3, dp_rank=rank, dp_size=dp, docs_per_step=12, packing=packing,
                          row_multiple=micro)


@functools.cache
def reference(name: str, step: int = 0) -> tuple[float, dict[str, torch.Tensor]]:
    """Every piece of the step alone, no padding: sum of token losses / real tokens, and the gradients."""
    model = build(name)
    ld = loader()
    ids = ld.doc_indices(step)
    parts = pieces([len(DOCS[d]) for d in ids], T)
    total = sum(p.length for p in parts)
    loss = 0.0
    for p in parts:
        t = DOCS[ids[p.doc]][p.start:p.start + p.length + 1].long()[None]
        out = output_tensor(model(t[:, :-1]))
        piece = F.cross_entropy(out.reshape(-1, out.size(-1)), t[:, 1:].reshape(-1), reduction="sum") / total
        piece.backward()
        loss += piece.item()
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------- arrangement


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 32), min_size=1, max_size=40), st.sampled_from(["pad", "first-fit", "bfd"]))
def test_every_piece_is_placed_once_within_capacity(lengths, packing):
    rows = pack(lengths, 32, packing)
    placed = sorted(i for row in rows for i in row)
    assert placed == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 32 for row in rows)
    lower = -(-sum(lengths) // 32)
    assert len(rows) >= lower
    if packing != "pad":  # any-fit: a row is opened only for an item no row has room for, so at most one row is
        assert sum(sum(lengths[i] for i in row) <= 16 for row in rows) <= 1  # half full or less


def test_long_documents_are_split_at_row_boundaries_not_truncated():
    parts = pieces([35, 5], 16)  # 34 positions: 16 + 16 + 2
    assert parts == [(0, 0, 16), (0, 16, 16), (0, 32, 2), (1, 0, 4)]
    assert pieces([35, 5], 16, truncate=True) == [(0, 0, 16), (1, 0, 4)]
    batch = loader().global_batch(0)
    assert batch.stats["split"] >= 1 and batch.num_tokens == sum(
        len(DOCS[d]) - 1 for d in loader().doc_indices(0))  # every target of every document, once


def test_shards_make_the_global_batch_and_arrangements_hold_the_same_tokens():
    whole = loader("bfd", dp=2, micro=2).global_batch(0)
    assert whole.inputs.size(0) % 4 == 0
    shards = [loader("bfd", dp=2, rank=r, micro=2).shard(0) for r in range(2)]
    assert torch.equal(torch.cat([s.inputs for s in shards]), whole.inputs)
    assert {s.num_tokens for s in shards} == {whole.num_tokens}
    real = [int((s.targets != -100).sum()) for s in shards]  # each rank's share of the tokens, balanced
    fullest = max(int((row != -100).sum()) for row in whole.targets)
    assert sum(real) == whole.num_tokens and max(real) - min(real) <= fullest, real
    counts = {p: loader(p).global_batch(0) for p in ("pad", "first-fit", "bfd")}
    assert len({b.num_tokens for b in counts.values()}) == 1
    assert counts["bfd"].stats["rows"] <= counts["first-fit"].stats["rows"] < counts["pad"].stats["rows"]
    assert counts["bfd"].stats["padding_fraction"] < counts["pad"].stats["padding_fraction"]
    for b in counts.values():  # the same multiset of (input, target) pairs, wherever they sit
        pairs = sorted(zip(b.inputs[b.targets != -100].tolist(), b.targets[b.targets != -100].tolist(), strict=True))
        assert pairs == sorted(zip(counts["pad"].inputs[counts["pad"].targets != -100].tolist(),
                                   counts["pad"].targets[counts["pad"].targets != -100].tolist(), strict=True))


def test_tokens_per_step_budget_and_determinism():
    ld = DocumentLoader(DOCS, T, seed=3, tokens_per_step=60, packing="bfd")
    for step in range(4):
        ids = ld.doc_indices(step)
        cost = sum(len(DOCS[d]) - 1 for d in ids)
        assert cost <= 60 or len(ids) == 1
    again = DocumentLoader(DOCS, T, seed=3, tokens_per_step=60, packing="bfd")
    assert again.doc_indices(3) == ld.doc_indices(3)  # resuming at a step needs no state but the step


def test_positions_restart_and_the_mask_is_block_diagonal_causal():
    layout = DocumentLayout(torch.tensor([[0, 0, 0, 1, 1, -1]]))
    assert layout.positions.tolist() == [[0, 1, 2, 0, 1, 0]]
    m = layout.mask[0, 0]
    assert m[4].tolist() == [False, False, False, True, True, False]  # its own document, up to itself
    assert m[2].tolist() == [True, True, True, False, False, False]
    assert m[5, 5]  # padding attends to itself: no empty softmax row


def test_documents_come_from_json_lines_and_token_files_are_refused(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "hello world"}\n{"text": "x"}\n{"text": "packing"}\n')
    docs = open_documents(str(path), ByteTokenizer())
    assert len(docs) == 2 and docs.lengths.tolist() == [11, 7]  # "x" has no target: dropped
    with pytest.raises(ValueError, match="document boundaries"):
        open_documents(str(tmp_path / "ids.npy"), ByteTokenizer())


# ------------------------------------------------------------------------------- one process: exact


@pytest.mark.parametrize("name", ["tiny", "gpt2", "llama", "mistral", "qwen2", "gemma", "gemma2", "gemma3_text",
                                  "granite", "phi3", "olmo2", "olmo3", "smollm3"])
def test_packed_equals_documents_one_at_a_time(name):
    want_loss, want = reference(name)
    for packing in ("pad", "bfd"):
        engine = parallelize(build(name))
        b = loader(packing).global_batch(0)
        loss = engine.step(b.inputs, b.targets, documents=b.documents, num_tokens=b.num_tokens).item()
        got = {n: p.grad for n, p in engine.named_parameters()}
        # Gemma 2's eager attention takes its softmax in float32 whatever the model's dtype, over rows as long as
        # a document or as a packed row: float32's rounding of sums of different lengths (loss 5e-10 off, v_proj's
        # gradient 1.8e-8; with that softmax in float64, 2e-15 and 6e-10, its norms' float32 sums)
        assert abs(loss - want_loss) <= (1e-8 if name == "gemma2" else TOL), (name, packing, loss, want_loss)
        worst, err = max_error(got, want)
        tol = 1e-7 if name == "gemma2" else 1e-8 if name in FLOAT32_NORMS else TOL  # the Gemmas', OLMos' norms
        assert err <= tol, f"{name} {packing}: gradient of {worst} off by {err:.3g}"


@pytest.mark.parametrize("name", ["tiny", "gpt2", "llama", "mistral", "qwen2", "gemma", "gemma2", "gemma3_text",
                                  "granite", "phi3", "olmo2", "olmo3", "smollm3"])
def test_no_document_sees_its_neighbours(name):
    """Changing one document's tokens leaves every other document's logits in the row bitwise unchanged."""
    model = build(name).eval()
    b = loader("bfd").global_batch(0)
    row = int(torch.argmax(torch.tensor([len(set(r.tolist()) - {-1}) for r in b.documents])))  # most documents
    docs = b.documents[row:row + 1]
    first = int(docs[0, 0])
    changed = b.inputs[row:row + 1].clone()
    changed[docs == first] = (changed[docs == first] + 7) % 64
    with torch.no_grad(), document_layout(docs):
        before = output_tensor(model(b.inputs[row:row + 1]))
        after = output_tensor(model(changed))
    others = docs[0] != first
    assert others.sum() > 0 and not torch.equal(before[0, ~others], after[0, ~others])
    assert torch.equal(before[0, others], after[0, others])


def test_packed_attention_runs_document_by_document_with_no_row_by_row_tensor():
    """TinyGPT's packed attention costs what the documents cost: no tensor with two dimensions of row length is
    made in forward (the dense mask was (B, 1, T, T)), and it equals the dense mask's attention."""
    from torch.overrides import TorchFunctionMode

    from fourfold.models.attention import packed_attention

    width = 40  # no other dimension of this model is 40
    model = TinyGPT(GPTConfig(vocab_size=64, seq_len=width, n_layer=2, n_head=2, d_model=16), seed=0,
                    dtype=torch.float64)
    docs = skewed_documents(30, 30, vocab_size=64, short_ratio=0.25, seed=2)
    b = DocumentLoader(docs, width, seed=0, docs_per_step=12, packing="bfd").global_batch(0)
    assert b.inputs.size(1) == width and b.inputs.size(0) != width

    class Shapes(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.square: list[tuple[str, tuple[int, ...]]] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple) else (out,):
                if isinstance(t, torch.Tensor) and sum(d == width for d in t.shape) >= 2:
                    self.square.append((getattr(func, "__name__", str(func)), tuple(t.shape)))
            return out

    with document_layout(b.documents) as layout, packed_attention("runs"):  # rows this short: the mask, by default
        with Shapes() as seen:
            logits = output_tensor(model(b.inputs))
        logits.sum().backward()
        assert seen.square == [] and "mask" not in vars(layout), seen.square
        with packed_attention("dense"), torch.no_grad():
            dense = output_tensor(model(b.inputs))
    assert (logits - dense).abs().max() < 1e-12
    assert layout.score_elements == sum(n * (n + 1) // 2 * s.numel() for n, s in layout.runs) < b.inputs.numel() * width


def test_models_that_do_not_read_documents_are_refused():
    engine = parallelize(nn.Sequential(nn.Embedding(64, 8), nn.Linear(8, 64)).double())
    b = loader().global_batch(0)
    with pytest.raises(ValueError, match="keeps them apart"):
        engine.step(b.inputs, b.targets, documents=b.documents)
    engine = parallelize(build("tiny"), loss_fn=lambda z, y: F.cross_entropy(z.flatten(0, 1), y.flatten()))
    with pytest.raises(ValueError, match="a loss_fn of your own"):
        engine.step(b.inputs, b.targets, documents=b.documents)


# ----------------------------------------------------------------------------- every layout: exact

MICRO = 2
LAYOUTS_2 = {"dp2": (2, 1, 1, {}), "dp2 ring": (2, 1, 1, {"allreduce": "ring"}), "tp2": (1, 2, 1, {}),
             "pp2 1f1b": (1, 1, 2, {"schedule": "1f1b"}), "pp2 zb": (1, 1, 2, {"schedule": "zb"})}
LAYOUTS_4 = {"dp2 x pp2": (2, 1, 2, {"schedule": "1f1b"}), "dp2 x tp2": (2, 2, 1, {}),
             "tp2 x pp2 sp": (1, 2, 2, {"schedule": "1f1b", "sequence_parallel": True})}
MODELS = {2: ("tiny", "gpt2", "llama", "mistral", "qwen2"), 4: ("tiny",)}


def _one_step(ctx, name: str, label: str, dp: int, tp: int, pp: int, options: dict) -> dict:
    ranks = Mesh.for_world(ctx.world_size, dp=dp, tp=tp, pp=pp).build(30)
    engine = parallelize(build(name), ranks, Layout(dp=dp, tp=tp, pp=pp, microbatches=MICRO, **options))
    ld = DocumentLoader(DOCS, T, seed=3, dp_rank=ranks.coord.dp, dp_size=dp, docs_per_step=12, packing="bfd",
                        row_multiple=MICRO if pp > 1 else 1, width_multiple=tp if "sequence_parallel" in options else 1)
    b = ld.shard(0)
    before = engine.state_dict()
    loss = engine.step(b.inputs, b.targets, documents=b.documents)  # the count: all-reduced over dp here
    opt = torch.optim.SGD(engine.parameters(), lr=1.0)  # w - g: the gradient, read back by global name
    opt.step()
    after = engine.state_dict()
    grads = {k: before[k] - after[k] for k in before} if ctx.rank == 0 else None
    mine = int((b.targets != -100).sum())
    return {"label": f"{name} {label}", "loss": loss.item(), "grads": grads, "tokens": mine}


def _all(ctx, world: int) -> list[dict]:
    layouts = LAYOUTS_2 if world == 2 else LAYOUTS_4
    return [_one_step(ctx, name, label, *lay) for name in MODELS[world] for label, lay in layouts.items()]


@functools.cache
def _spawn(world: int) -> list[list[dict]]:
    return run_ranks(_all, world, world, timeout_s=280)


CASES = [(world, i, f"{m} {lab}") for world, layouts in ((2, LAYOUTS_2), (4, LAYOUTS_4))
         for i, (m, lab) in enumerate((m, lab) for m in MODELS[world] for lab in layouts)]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world", "index"), [c[:2] for c in CASES], ids=[c[2] for c in CASES])
def test_every_layout_equals_documents_one_at_a_time(world, index):
    pytest.importorskip("transformers")  # the 2-rank spawn trains GPT-2 and Llama too
    per_rank = _spawn(world)
    got = per_rank[0][index]
    want_loss, want = reference(got["label"].split()[0])
    for r, results in enumerate(per_rank):
        assert abs(results[index]["loss"] - want_loss) <= TOL, (got["label"], r, results[index]["loss"], want_loss)
    worst, err = max_error(got["grads"], {k: v for k, v in want.items() if k in got["grads"]})
    assert set(got["grads"]) >= set(want), f"{got['label']}: names {sorted(set(want) - set(got['grads']))} missing"
    assert err <= TOL, f"{got['label']}: gradient of {worst} off by {err:.3g}"
    if got["label"].split()[1].startswith("dp"):  # the ranks' shares of real tokens differ, and it is still exact
        assert len({results[index]["tokens"] for results in per_rank}) > 1, got["label"]


def test_documents_from_a_list():
    docs = Documents.from_list([torch.tensor([1, 2, 3]), torch.tensor([4])], "two")
    assert len(docs) == 1 and docs[0].tolist() == [1, 2, 3]


# ------------------------------------------------------------------------------------------- the CLI


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cli_packs_json_lines_under_dp_and_pp_and_verifies_against_one_process(tmp_path):
    import json
    import subprocess
    import sys

    gen = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in torch.randint(3, 90, (40,), generator=gen)]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": "ab" * (n // 2) + f"{k}"}) + "\n" for k, n in enumerate(lengths)))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "fourfold", "train", "--nproc", "4", "--dp", "2", "--pp", "2", "--microbatches", "2",
           "--pack", "first-fit", "--tokens-per-step", "300", "--data", str(data), "--seq-len", "32", "--n-layer",
           "2", "--d-model", "16", "--n-head", "2", "--steps", "2", "--verify", "2", "--dtype", "float64", "--no-trace",
           "--no-progress", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert "verify: OK, every difference within tolerance" in text and "real tokens/s of" in text, text
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["documents"] >= 2 and 0 < row["padding_fraction"] < 0.5 and row["split_documents"] >= 1, row
        assert row["real_tokens_per_s"] == pytest.approx(row["tokens_per_s"] * (1 - row["padding_fraction"]))
    run = json.loads((out / "run.json").read_text())
    assert run["corpus"]["packing"] == "first-fit" and run["corpus"]["documents"] == 40


def test_cli_refuses_packing_without_document_boundaries(tmp_path, capsys):
    from fourfold.run.args import parse_args
    from fourfold.run.preflight import preflight

    ids = tmp_path / "ids.npy"
    import numpy as np

    np.save(ids, np.arange(100, dtype=np.uint16))
    with pytest.raises(ValueError, match="document boundaries"):
        preflight(parse_args(["--pack", "bfd", "--data", str(ids), "--out", str(tmp_path / "o")]), 1)
    with pytest.raises(SystemExit):
        parse_args(["--tokens-per-step", "100"])
    assert "tokens_per_step and truncate_documents arrange documents" in capsys.readouterr().err


def test_fewer_documents_than_a_step_takes_are_named(tmp_path, capsys):
    import json

    from fourfold import train as train_mod

    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"text": "a single document, " * 4}) + "\n")
    argv = ["--data", str(data), "--pack", "bfd", "--batch-size", "4", "--steps", "1", "--seq-len", "16",
            "--n-layer", "1", "--d-model", "16", "--n-head", "2", "--no-progress", "--out", str(tmp_path / "run")]
    assert train_mod.main(argv) == 0
    assert "the data holds 1 document(s) to train on and each step takes 4 (--batch-size)" in capsys.readouterr().err
