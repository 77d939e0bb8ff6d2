"""Context parallelism (``Layout(cp=N)``, :mod:`fourfold.parallel.context`): each algorithm's attention equals
full attention, output and every gradient, sends what its theory says, and a TinyGPT trained under cp equals one
process.

Layer level, one spawn per world size (2, 3, 4 ranks): float64, causal, balanced (head-tail) and contiguous cuts,
grouped-query attention (key/value heads that divide cp, and at cp = 3 ones that do not, which Ulysses repeats),
against ``scaled_dot_product_attention`` on the whole sequence, to 1e-12.

Reading a failure: a wrong dK/dV under ring with right outputs points at the accumulators' hops (they must arrive
home after the last one); wrong outputs only with the balanced cut at the positions (the mask compares global
positions, so a rank's chunks may be anywhere).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from fourfold import Layout, parallelize
from fourfold.comm.p2p import Communicator
from fourfold.data.documents import skewed_documents
from fourfold.data.packing import DocumentLoader, document_layout
from fourfold.engine.sent import bytes_by_axis
from fourfold.models import GPTConfig, TinyGPT
from fourfold.observe.trace import Tracer
from fourfold.parallel.context import ALGORITHMS, ContextShard, attend, causal_work, pieces, positions, theory
from fourfold.testing import run_ranks
from helpers import TOL64, batches, max_error, optimizer, reference_eval, reference_run, shard

TOL = 1e-12
HEADS = {2: [(4, 2), (4, 4)], 3: [(6, 3), (6, 2)], 4: [(8, 4)]}  # (query heads, key/value heads) per cp


def _layer(ctx) -> list[dict]:
    N = ctx.world_size
    comm = Communicator(None, 30)
    out = []
    for H, hk in HEADS[N]:
        g = torch.Generator().manual_seed(7)
        B, T, D = 2, 6 * N, 4
        q = torch.randn(B, H, T, D, dtype=torch.float64, generator=g, requires_grad=True)
        k = torch.randn(B, hk, T, D, dtype=torch.float64, generator=g, requires_grad=True)
        v = torch.randn(B, hk, T, D, dtype=torch.float64, generator=g, requires_grad=True)
        dout = torch.randn(B, H, T, D, dtype=torch.float64, generator=g)
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != hk).backward(dout)
        for algorithm in ALGORITHMS:
            for balanced in (True, False):
                shard = ContextShard(comm, algorithm, T, balanced)
                mine = shard.mine
                ql, kl, vl = (t.detach()[:, :, mine].clone().requires_grad_() for t in (q, k, v))
                want = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), is_causal=True,
                                                      enable_gqa=H != hk)[:, :, mine]
                before = comm.stats.sent_bytes
                y = attend(shard, ql, kl, vl)
                forward = comm.stats.sent_bytes - before
                y.backward(dout[:, :, mine])
                errors = {"out": (y - want).abs().max().item(),
                          **{f"d{n}": (t.grad - w.grad[:, :, mine]).abs().max().item()
                             for n, t, w in (("q", ql, q), ("k", kl, k), ("v", vl, v))}}
                out.append({"case": (algorithm, balanced, H, hk), "errors": errors, "forward": forward,
                            "backward": comm.stats.sent_bytes - before - forward,
                            "theory": theory(algorithm, N, q_bytes=ql.numel() * 8, kv_bytes=2 * kl.numel() * 8,
                                             kv_heads_divide=hk % N == 0, heads_per_kv=H // hk)})
    return out


@functools.cache
def _spawn(n: int) -> list[list[dict]]:
    return run_ranks(_layer, n, timeout_s=120)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_each_algorithm_equals_full_attention_and_its_theory(n):
    for rank, cases in enumerate(_spawn(n)):
        assert len(cases) == len(HEADS[n]) * len(ALGORITHMS) * 2
        for case in cases:
            worst = max(case["errors"].values())
            assert worst <= TOL, f"cp={n} rank {rank} {case['case']}: {case['errors']}"
            sent = {"forward": case["forward"], "backward": case["backward"]}
            assert sent == case["theory"], f"cp={n} rank {rank} {case['case']}: sent {sent}, theory {case['theory']}"


def test_the_head_tail_cut_balances_the_causal_work():
    T = 64
    for cp in (2, 3, 4):
        assert sum(causal_work(T * cp, cp, True)) == T * cp * (T * cp + 1) // 2
        balanced = causal_work(T * cp, cp, True)
        assert len(set(balanced)) == 1, balanced
        plain = causal_work(T * cp, cp, False)
        assert plain == sorted(plain) and plain[-1] > 2 * plain[0]  # the last chunk sees every key
    assert pieces(16, 2, 0, True) == [(0, 4), (12, 16)] and pieces(16, 2, 1, True) == [(4, 8), (8, 12)]
    assert torch.equal(torch.sort(torch.cat([positions(24, 3, r, True) for r in range(3)])).values, torch.arange(24))


def test_a_length_the_cut_cannot_divide_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"multiple of 8 tokens.*--seq-len 8"):
        positions(12, 4, 0, True)
    assert positions(12, 4, 3, False).tolist() == [9, 10, 11]


# ------------------------------------------------------------------------------------------ end to end

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=16)
TWO = {"ring": {"cp": 2}, "allgather": {"cp": 2, "cp_algorithm": "allgather"},
       "ulysses": {"cp": 2, "cp_algorithm": "ulysses"}, "ring unbalanced": {"cp": 2, "cp_balance": "none"},
       "zero3": {"cp": 2, "zero": 3}, "auto": {"cp": 2, "cp_algorithm": "auto"}}
FOUR = {"cp4 ring": {"cp": 4}, "cp4 ulysses": {"cp": 4, "cp_algorithm": "ulysses"},
        "dp2 cp2": {"dp": 2, "cp": 2}, "cp2 tp2 sp": {"cp": 2, "tp": 2, "sequence_parallel": True},
        "cp2 pp2 1f1b": {"cp": 2, "pp": 2, "schedule": "1f1b", "microbatches": 2},
        "cp2 dp2 zero1 ac": {"cp": 2, "dp": 2, "zero": 1, "activation_checkpointing": "full"}}


def _refusals(ctx) -> dict[str, str]:
    """What apply_cp refuses, on a cp = 2 mesh: each message."""
    ranks = Layout(cp=2).mesh(ctx.world_size).build(30)
    seq = torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 64))
    cases = {"loss_fn": (TinyGPT(CFG, seed=0), {"loss_fn": lambda logits, y: logits.sum()}),
             "dropout": (TinyGPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=8, dropout=0.1)), {}),
             "foreign": (seq, {})}
    out = {}
    for name, (model, kw) in cases.items():
        try:
            parallelize(model, ranks, Layout(cp=2), **kw)
            out[name] = "accepted"
        except ValueError as e:
            out[name] = str(e)
    return out


def _train(ctx, layouts: dict[str, dict]) -> dict[str, dict]:
    out = {"_refused": _refusals(ctx)} if ctx.world_size == 2 else {}
    for label, options in layouts.items():
        tracer = Tracer(ctx.rank)
        layout = Layout(**options)
        ranks = layout.mesh(ctx.world_size).build(30, tracer)
        engine = parallelize(TinyGPT(CFG, seed=0, dtype=torch.float64), ranks, layout)
        opt = optimizer(engine.parameters())
        losses, sent = [], 0
        for x, y in batches(CFG):
            first = len(tracer.spans)
            dp, i = ranks.mesh.dp, ranks.coord.dp
            losses.append(engine.step(shard(x, i, dp), shard(y, i, dp)).item())
            opt.step()
            opt.zero_grad(set_to_none=True)
            sent = bytes_by_axis(tracer.spans[first:])["cp"]
        waits = sum(s.name == "cp.wait" and s.kind == "wait" for s in tracer.spans)
        x, y = batches(CFG, steps=1, seed=99)[0]  # a held-out batch: forward only, cut as a step cuts it
        held = engine.evaluate(shard(x, ranks.coord.dp, ranks.mesh.dp), shard(y, ranks.coord.dp, ranks.mesh.dp))
        out[label] = {"losses": losses, "state": engine.state_dict(), "cp_bytes": sent, "waits": waits,
                      "evaluated": held.item()}
    return out


@functools.cache
def _trained(n: int) -> list[dict[str, dict]]:
    return run_ranks(_train, n, TWO if n == 2 else FOUR, timeout_s=240)


@functools.cache
def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    return reference_run(CFG, batches(CFG))


@pytest.mark.parametrize("n,label", [(2, k) for k in TWO] + [(4, k) for k in FOUR])
def test_tinygpt_under_cp_equals_one_process(n, label):
    want_losses, want_state = _reference()
    for rank, runs in enumerate(_trained(n)):
        run = runs[label]
        assert run["losses"] == pytest.approx(want_losses, abs=TOL64), (label, rank)
        name, err = max_error(run["state"], want_state)
        assert err <= TOL64, f"{label} rank {rank}: {name} off by {err:.3g}"
        assert run["evaluated"] == pytest.approx(reference_eval(CFG, want_state, batches(CFG, steps=1, seed=99)[0]),
                                                 abs=TOL64), (label, rank)
        assert run["cp_bytes"] > 0, (label, rank)  # the attention's messages, counted on the cp axis
        ring = (Layout(**(TWO | FOUR)[label]).cp_algorithm == "ring")
        if label != "auto":
            assert (run["waits"] > 0) == ring, (label, rank)  # the ring's waits for each hop, in the timeline
    if label in ("ring", "allgather", "ulysses"):  # the spans' bytes (bytes_by_axis) are the theory's, every layer
        rows, t, d = 8, CFG.seq_len // 2, CFG.d_model // CFG.n_head
        q = rows * CFG.n_head * t * d * 8  # float64
        th = theory(label, 2, q_bytes=q, kv_bytes=2 * q)  # type: ignore[arg-type]
        assert all(r[label]["cp_bytes"] == CFG.n_layer * (th["forward"] + th["backward"]) for r in _trained(n))


# --------------------------------------------------------------------------------------- packed documents

PACKED = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=16)
DOCS = skewed_documents(60, 40, vocab_size=64, short_ratio=0.25, seed=1)  # some longer than a row: split


def _loader() -> DocumentLoader:
    return DocumentLoader(DOCS, PACKED.seq_len, seed=3, docs_per_step=12, packing="bfd", row_multiple=2)


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out[0] if isinstance(out, tuple) else out


def _packed(ctx) -> dict:
    out: dict = {}
    for algorithm in ALGORITHMS:
        layout = Layout(cp=2, cp_algorithm=algorithm, pp=1)
        ranks = layout.mesh(ctx.world_size).build(30)
        engine = parallelize(TinyGPT(PACKED, seed=0, dtype=torch.float64), ranks, layout)
        opt = optimizer(engine.parameters())
        losses = []
        for step in range(2):
            b = _loader().shard(step)
            losses.append(engine.step(b.inputs, b.targets, documents=b.documents, num_tokens=b.num_tokens).item())
            opt.step()
            opt.zero_grad(set_to_none=True)
        # one document changed: every other document's logits, on every rank's chunk, bitwise the same
        b = _loader().shard(0)
        docs = b.documents
        across = (docs[:, 3] == docs[:, 4]) & (docs[:, 4] >= 0)  # head-tail: rank 0 holds 0-3, rank 1 4-7
        changed = int(docs[int(torch.nonzero(across)[0]), 4])  # a document on both ranks
        other = b.inputs.clone()
        other[docs == changed] = (other[docs == changed] + 1) % PACKED.vocab_size
        cut = engine.sequence
        model = TinyGPT(PACKED, seed=0, dtype=torch.float64)
        found = []
        for ids in (b.inputs, other):
            x, _, codes, shard = cut.cut(ids, b.targets, docs)
            with cut.running(shard), document_layout(codes), torch.no_grad():
                found.append(_logits(model, x))
        mine = shard.mine
        keep = docs[:, mine] != changed
        out[algorithm] = {"losses": losses, "state": engine.state_dict(),
                          "same": bool(torch.equal(found[0][keep], found[1][keep])),
                          "moved": bool(not torch.equal(found[0][~keep], found[1][~keep]))}
    return out


@functools.cache
def _packed_runs() -> list[dict]:
    return run_ranks(_packed, 2, timeout_s=180)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_packed_documents_under_cp_equal_one_process_and_stay_apart(algorithm):
    engine = parallelize(TinyGPT(PACKED, seed=0, dtype=torch.float64))
    opt = optimizer(engine.parameters())
    want = []
    for step in range(2):
        b = _loader().shard(step)
        want.append(engine.step(b.inputs, b.targets, documents=b.documents, num_tokens=b.num_tokens).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = engine.state_dict()
    for rank, runs in enumerate(_packed_runs()):
        run = runs[algorithm]
        assert run["losses"] == pytest.approx(want, abs=TOL64), (algorithm, rank)
        name, err = max_error(run["state"], state)
        assert err <= TOL64, f"{algorithm} rank {rank}: {name} off by {err:.3g}"
        assert run["same"], f"{algorithm} rank {rank}: another document's logits moved"
        assert run["moved"], f"{algorithm} rank {rank}: the changed document's own logits did not move"


def test_what_cp_cannot_compute_exactly_is_refused_naming_the_fix():
    refused = _trained(2)[0]["_refused"]
    assert "a loss_fn of yours is a mean over its chunk. Drop loss_fn" in refused["loss_fn"]
    assert "dropout under context parallelism is not built" in refused["dropout"] and "p=0.1" in refused["dropout"]
    assert "needs a model whose attention and positions are fourfold's" in refused["foreign"]
    assert "got Sequential" in refused["foreign"]


def test_cli_trains_packed_documents_under_cp_and_pp_and_verifies(tmp_path):
    import json
    import subprocess
    import sys

    gen = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in torch.randint(3, 90, (40,), generator=gen)]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": "ab" * (n // 2) + f"{k}"}) + "\n" for k, n in enumerate(lengths)))
    cmd = [sys.executable, "-m", "fourfold", "train", "--nproc", "4", "--cp", "2", "--pp", "2", "--microbatches", "2",
           "--pack", "first-fit", "--tokens-per-step", "300", "--cp-algorithm", "auto", "--data", str(data), "--seq-len", "32", "--n-layer", "2",
           "--d-model", "16", "--n-head", "2", "--steps", "2", "--verify", "2", "--dtype", "float64", "--no-progress",
           "--out", str(tmp_path / "run")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert "verify: OK, every difference within tolerance" in text, text
    assert "(dp=1 tp=1 pp=2 cp=2)" in text and "cp " in text.split("sent per step:")[1].splitlines()[0], text
    assert "cp auto chose " in text and "predicted wire time for q " in text, text
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["bytes_by_axis"]["cp"] > 0 for r in rows if "bytes_by_axis" in r), rows


@pytest.mark.parametrize("flags,message", [
    (["--cp", "2", "--dropout", "0.1"], r"dropout under context parallelism is not built"),
    (["--cp", "4", "--seq-len", "12"], r"multiple of 8 tokens \(e\.g\. --seq-len 8\)"),
    (["--cp", "2", "--cp-algorithm", "ulysses", "--n-head", "3", "--d-model", "24"], r"Ulysses gives each cp rank"),
])
def test_cli_refuses_before_any_process_starts(flags, message, tmp_path):
    from fourfold.config import Config
    from fourfold.run.args import parse_args
    from fourfold.run.preflight import preflight

    cfg: Config = parse_args(["--nproc", flags[1], "--out", str(tmp_path / "x"), *flags])
    with pytest.raises(ValueError, match=message):
        preflight(cfg, int(flags[1]), scan_data=False)


# ------------------------------------------------------------------------------ Hugging Face families

HF = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=16)  # grouped-query attention: 2 query heads per key head


def _hf_model(name: str) -> torch.nn.Module:
    from fourfold.models.hf import build_hf

    return build_hf(name, overrides=HF, dtype=torch.float64)


def _hf_train(ctx, names: tuple[str, ...], options: dict) -> dict[str, dict]:
    out = {}
    for name in names:
        layout = Layout(**options)
        ranks = layout.mesh(ctx.world_size).build(30) if ctx.world_size > 1 else None
        engine = parallelize(_hf_model(name), ranks, layout)
        opt = optimizer(engine.parameters())
        losses = []
        for x, y in batches(CFG, steps=2):
            dp, i = (ranks.mesh.dp, ranks.coord.dp) if ranks is not None else (1, 0)
            losses.append(engine.step(shard(x, i, dp), shard(y, i, dp)).item())
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[name] = {"losses": losses, "state": engine.state_dict()}
    return out


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_hugging_face_families_under_ring_cp_equal_one_process(name):
    pytest.importorskip("transformers")

    class One:
        world_size, rank = 1, 0

    want = _hf_train(One(), (name,), {})[name]
    for rank, runs in enumerate(_hf_runs()):
        run = runs[name]
        assert run["losses"] == pytest.approx(want["losses"], abs=TOL64), (name, rank)
        worst, err = max_error(run["state"], want["state"])
        assert err <= TOL64, f"{name} rank {rank}: {worst} off by {err:.3g}"


@functools.cache
def _hf_runs() -> list[dict]:
    return run_ranks(_hf_train, 2, ("llama", "qwen3"), {"cp": 2}, timeout_s=180)


def test_a_windowed_hugging_face_config_is_refused_under_cp():
    pytest.importorskip("transformers")
    from fourfold.models.hf import hf_config
    from fourfold.models.hf_context import check_context

    config = hf_config("mistral", overrides={**HF, "sliding_window": 5})
    with pytest.raises(ValueError, match=r"sliding window shorter than the sequence is not built, got mistral with "
                       r"sliding_window=5 and sequences of 16"):
        check_context(config, 2, 16)
    check_context(config, 2, 5)  # a window as long as the sequence changes nothing


def test_auto_picks_by_the_cost_model_and_says_why():
    from fourfold.comm.cost import CostModel
    from fourfold.parallel.context.auto import choose, predict

    sizes = {"q_bytes": 1 << 19, "kv_bytes": 1 << 20, "grad_kv_bytes": 1 << 20, "heads": 8, "kv_heads": 8}  # MHA
    slow = CostModel(alpha_s=1e-4, beta_s_per_byte=1e-8)  # a slow link: bytes decide
    name, why = choose(4, slow, **sizes)
    assert name == "ulysses" and why.startswith("ulysses ") and "<= ring" in why and "cp=4" in why, why
    latency = CostModel(alpha_s=1e-2, beta_s_per_byte=1e-12)  # steps decide: all-gather 6, Ulysses 8, ring 10
    assert predict("allgather", 4, latency, **sizes) < predict("ring", 4, latency, **sizes)  # 6 steps < 10
    assert choose(4, latency, **sizes)[0] == "allgather"
    odd = {**sizes, "heads": 6, "kv_heads": 6}
    name, why = choose(4, slow, **odd)
    assert name != "ulysses" and "ulysses: 6 heads do not divide by cp=4" in why
    assert predict("ulysses", 4, slow, **odd) is None
