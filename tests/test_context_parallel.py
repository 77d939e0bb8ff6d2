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
from fourfold.engine.sent import bytes_by_axis
from fourfold.models import GPTConfig, TinyGPT
from fourfold.observe.trace import Tracer
from fourfold.parallel.context import ALGORITHMS, ContextShard, attend, causal_work, pieces, positions, theory
from fourfold.testing import run_ranks
from helpers import TOL64, batches, max_error, optimizer, reference_run, shard

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
       "zero3": {"cp": 2, "zero": 3}}
FOUR = {"cp4 ring": {"cp": 4}, "cp4 ulysses": {"cp": 4, "cp_algorithm": "ulysses"},
        "dp2 cp2": {"dp": 2, "cp": 2}, "cp2 tp2 sp": {"cp": 2, "tp": 2, "sequence_parallel": True},
        "cp2 pp2 1f1b": {"cp": 2, "pp": 2, "schedule": "1f1b", "microbatches": 2},
        "cp2 dp2 zero1 ac": {"cp": 2, "dp": 2, "zero": 1, "activation_checkpointing": "full"}}


def _train(ctx, layouts: dict[str, dict]) -> dict[str, dict]:
    out = {}
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
        out[label] = {"losses": losses, "state": engine.state_dict(), "cp_bytes": sent}
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
        assert run["cp_bytes"] > 0, (label, rank)  # the attention's messages, counted on the cp axis
