"""Tree (recursive doubling) and hierarchical all-reduce: exact sums, bitwise agreement, bytes as in theory.

Spawning ranks is the cost, so each world size G = 1..5 starts one group of ranks that runs every algorithm
variant × length × dtype and returns one record per case; the test then checks the records here, so a failure
names its case: ``tree G=3 n=7 float16 rank 2: ...``.

* Inputs are a function of (rank, length, dtype), so every rank can rebuild everyone's and the exact sum.
* int32, int64 and float64 must be exact (the float64 inputs are multiples of 2^-10 below 2^10, so every
  partial sum is exact in any order).
* float32, float16, bfloat16 (inputs uniform in [-1, 1)) must satisfy, elementwise,
  |result - exact| <= (G-1) * eps * sum_r |x_r|: G-1 roundings of at most eps/2 of a partial sum each, the
  usual bound for recursive summation, with a factor 2 of slack; it grows with G.
* Every rank's result must have the same bytes (sha1), and ``comm.stats`` must equal ``theory()`` exactly.
* Hierarchical runs with every node size g dividing G, taken from LOCAL_WORLD_SIZE through the registry (the
  "virtual nodes", e.g. 2 x 2 at G=4) and once from the ``node_size`` argument; with g = 1 or g = G it must be
  the flat ring, bit for bit.
"""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
import torch.distributed as dist

from fourfold import comm as fcomm
from fourfold.comm import hierarchical, ring, tree
from fourfold.testing import run_ranks

DTYPES = [torch.int32, torch.int64, torch.float64, torch.float32, torch.float16, torch.bfloat16]
EXACT = {torch.int32, torch.int64, torch.float64}


def _lengths(world_size: int) -> list[int]:
    return sorted({0, 1, 7, world_size - 1, 17**3, 2**20 + 3})


def _variants(world_size: int) -> list[tuple[str, int | None, str]]:
    """``(algorithm, node size, where the node size comes from)``."""
    sizes = [g for g in range(1, world_size + 1) if world_size % g == 0]
    out = [("tree", None, "-")] + [("hierarchical", g, "env") for g in sizes]
    if len(sizes) > 2:
        out.append(("hierarchical", sizes[1], "arg"))  # e.g. node_size=2 at G=4
    return out


def _input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input: distinct integers k in [-2^20, 2^20) from a multiplicative hash (far cheaper
    than a generator at 2^20 elements), as they are (ints), times 2^-10 (float64) or 2^-20 (the others)."""
    salt = 1_000_003 * rank + 7919 * numel + 104_729 * DTYPES.index(dtype)
    stride = 2_654_435_761  # odd, so the N < 2^21 values of one rank are distinct
    k = (torch.arange(numel, dtype=torch.int64) * stride + salt) % 2**21 - 2**20
    if not dtype.is_floating_point:
        return k.to(dtype)
    return k.to(dtype) * 2.0**-10 if dtype == torch.float64 else (k.double() * 2.0**-20).to(dtype)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.view(torch.uint8).numpy().tobytes()).hexdigest()


def _reference(inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(exact sum, tolerance)``: the tolerance is None for the exact dtypes, elementwise for the others."""
    dtype, world_size = inputs[0].dtype, len(inputs)
    if dtype in EXACT:  # ints: no overflow at these sizes; float64: exact by construction
        return torch.stack(inputs).sum(0), None
    wide = torch.stack([x.double() for x in inputs])  # (G, N) exact in float64
    return wide.sum(0), (world_size - 1) * torch.finfo(dtype).eps * wide.abs().sum(0)


def _error(result: torch.Tensor, reference: tuple[torch.Tensor, torch.Tensor | None]) -> str:
    """'' when ``result`` is the sum (exactly, or within the stated tolerance), else why not."""
    exact, tol = reference
    if tol is None:
        if torch.equal(result, exact):
            return ""
        bad = (result != exact).nonzero()
        return f"{bad.numel()} elements differ, first at {bad[0].item()}: {result[bad[0]].item()} vs " \
            f"{exact[bad[0]].item()}"
    err = (result.double() - exact).abs()
    bad = (err > tol).nonzero()
    if bad.numel() == 0:
        return ""
    return f"{bad.numel()} elements beyond tolerance, first at {bad[0].item()}: " \
        f"error {err[bad[0]].item():.3g} > {tol[bad[0]].item():.3g}"


def _every_case(ctx) -> list[dict]:
    """All variants × lengths × dtypes on this rank: one record each."""
    world_size, me = ctx.world_size, ctx.rank
    comms = {v: fcomm.Communicator(timeout_s=60, record_messages=True) for v in _variants(world_size)}
    ring_comm = fcomm.Communicator(timeout_s=60)
    records = []
    for numel in _lengths(world_size):
        for dtype in DTYPES:
            mine = _input(me, numel, dtype)
            # Building the reference is most of this test's time: for the largest length only rank 0 checks
            # the value; the others' results are the same bits (checked) or the test fails anyway.
            checks = me == 0 or numel < 2**20
            reference = _reference([_input(r, numel, dtype) for r in range(world_size)]) if checks else None
            # The ring's bits, for hierarchical g = 1 and g = G (exact dtypes match any correct sum anyway).
            flat_ring = mine if dtype in EXACT else \
                fcomm.allreduce(mine.clone(), algorithm="ring", comm=ring_comm, check=False)
            for variant, c in comms.items():
                name, g, source = variant
                t = mine.clone()
                c.stats.reset()
                c.messages.clear()
                if name == "hierarchical" and source == "arg":
                    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)  # the argument must win over it
                    hierarchical.allreduce(c, t, node_size=g)
                    expect = hierarchical.theory(numel, world_size, me, t.element_size(), node_size=g)
                else:
                    os.environ["LOCAL_WORLD_SIZE"] = str(g or world_size)
                    fcomm.allreduce(t, algorithm=name, comm=c, check=False)  # shapes agree: skip a collective
                    module = tree if name == "tree" else hierarchical
                    expect = module.theory(numel, world_size, me, t.element_size())
                m = c.messages
                records.append(dict(
                    case=f"{name}{'' if g is None else f' g={g} ({source})'} G={world_size} n={numel} "
                         f"{str(dtype).replace('torch.', '')} rank {me}",
                    key=(variant, numel, dtype), digest=_digest(t),
                    error=_error(t, reference) if reference else "",
                    same_as_ring=dtype in EXACT or _digest(t) == _digest(flat_ring),
                    counted=(c.stats.sent_bytes, c.stats.sent_messages), theory=expect,
                    recv_bytes=c.stats.recv_bytes,
                    recorded=(len(m), all(x.label for x in m),
                              all(0 <= x.offset and x.offset + x.numel <= numel for x in m))))
    return records


def _refusals(ctx) -> dict[str, str]:
    """Bad node sizes, refused with the same ValueError on every rank, before any message."""
    out = {}
    c = fcomm.Communicator(timeout_s=30)
    t = torch.ones(5)
    for key, call in (("arg", lambda: hierarchical.allreduce(c, t, node_size=3)),
                      ("zero", lambda: hierarchical.allreduce(c, t, node_size=0))):
        try:
            call()
        except ValueError as e:
            out[key] = str(e)
    os.environ["LOCAL_WORLD_SIZE"] = "3"  # nodes {0,1,2} and {3}: not whole nodes
    try:
        fcomm.allreduce(t, algorithm="hierarchical", comm=c)
    except ValueError as e:
        out["env"] = str(e)
    # Subgroups: nodes are global ranks // LOCAL_WORLD_SIZE, so with 2 per node {0, 2} is 1 rank on each of
    # 2 nodes (g=1), and {1, 2, 3} is 1 + 2 (refused).
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    pair, triple = dist.new_group([0, 2]), dist.new_group([1, 2, 3])  # every rank must create both
    if ctx.rank in (0, 2):
        x = torch.tensor([float(ctx.rank + 1)])
        fcomm.allreduce(x, algorithm="hierarchical", comm=fcomm.Communicator(pair, timeout_s=30))
        out["pair"] = x.item()
    if ctx.rank in (1, 2, 3):
        try:
            fcomm.allreduce(t, algorithm="hierarchical", comm=fcomm.Communicator(triple, timeout_s=30))
        except ValueError as e:
            out["triple"] = str(e)
    dist.barrier()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_sum_bitwise_and_bytes(world_size):
    ranks = run_ranks(_every_case, world_size, timeout_s=100)
    for rank_records in zip(*ranks, strict=True):
        first = rank_records[0]
        assert len({r["digest"] for r in rank_records}) == 1, f"{first['case']}: ranks disagree bitwise"
        for r in rank_records:
            assert r["error"] == "", f"{r['case']}: {r['error']}"
            assert r["counted"] == r["theory"], f"{r['case']}: (bytes, messages) sent vs theory"
            assert r["recorded"] == (r["counted"][1], True, True), f"{r['case']}: recorded messages"
        assert sum(r["counted"][0] for r in rank_records) == sum(r["recv_bytes"] for r in rank_records)
        (name, g, _), _, _ = first["key"]
        if name == "hierarchical" and g in (1, world_size):
            assert all(r["same_as_ring"] for r in rank_records), f"{first['case']}: not the flat ring's bits"


@pytest.mark.timeout(60)
def test_bad_node_size_refused_on_every_rank():
    out = run_ranks(_refusals, 4, timeout_s=45)
    for rank, o in enumerate(out):
        assert "G=4" in o["arg"] and "g=3" in o["arg"] and "node_size=" in o["arg"], o["arg"]
        assert "node_size must be a positive int" in o["zero"], o["zero"]
        assert "G=4" in o["env"] and "LOCAL_WORLD_SIZE=3" in o["env"], o["env"]
        if rank in (0, 2):
            assert o["pair"] == 4.0
        if rank in (1, 2, 3):
            assert "G=3" in o["triple"] and "node 0: 1, node 1: 2" in o["triple"], o["triple"]


@pytest.mark.timeout(10)
def test_theory_formulas():
    for world_size in range(1, 9):
        power = 1 << (world_size.bit_length() - 1)
        extra, d = world_size - power, power.bit_length() - 1
        for numel in (0, 1, 7, 48, 1000):
            total = sum(tree.theory(numel, world_size, r, 4)[0] for r in range(world_size))
            assert total == (0 if numel == 0 or world_size == 1 else (power * d + 2 * extra) * numel * 4)
            for rank in range(world_size):
                flat = ring.theory(numel, world_size, rank, 2)
                # one rank per node, or one node: the flat ring
                assert hierarchical.theory(numel, world_size, rank, 2, node_size=1) == flat
                assert hierarchical.theory(numel, world_size, rank, 2, node_size=world_size) == flat
                if world_size & (world_size - 1) == 0 and numel:
                    assert tree.theory(numel, world_size, rank, 2) == (d * numel * 2, d)
    # N divisible by G: 2(g-1)N/g inside the node plus 2(n-1)N/(n g) across, in 2(g-1) + 2(n-1) messages
    for world_size, g in ((4, 2), (6, 2), (6, 3), (8, 4)):
        n, numel = world_size // g, 24 * world_size
        for rank in range(world_size):
            assert hierarchical.theory(numel, world_size, rank, 1, node_size=g) == (
                2 * (g - 1) * numel // g + 2 * (n - 1) * numel // (n * g), 2 * (g - 1) + 2 * (n - 1))


@pytest.mark.timeout(10)
def test_node_size_resolution(monkeypatch):
    resolve = hierarchical.resolve_node_size
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert resolve(6) == 6  # no launcher: one node
    assert resolve(6, 3) == 3
    for bad in (0, -2, True, 2.0):
        with pytest.raises(ValueError, match="node_size must be a positive int"):
            resolve(6, bad)
    with pytest.raises(ValueError, match=r"G=6 .* g=4\. Pass node_size= one of 1, 2, 3, 6"):
        resolve(6, 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert resolve(8) == 4
    assert resolve(4, global_ranks=[0, 2, 4, 6]) == 2  # a strided dp group on 2 nodes of 4
    assert resolve(2, global_ranks=[1, 5]) == 1
    with pytest.raises(ValueError, match=r"G=3 .*node 0: 2, node 1: 1"):
        resolve(3, global_ranks=[0, 1, 4])
    with pytest.raises(ValueError, match="unevenly"):
        resolve(4, global_ranks=[0, 4, 1, 5])  # a node's ranks not contiguous in group order
    with pytest.raises(ValueError, match="G=6"):
        resolve(6)  # 6 ranks on nodes of 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE must be a positive int"):
        resolve(4)


@pytest.mark.parametrize("world_size", [2, 4, 8, 16])
def test_rabenseifner_moves_the_rings_bytes_in_2_log2_g_steps(world_size):
    """At powers of two: per rank exactly the ring's bytes, in 2 log2(G) messages instead of 2(G-1). (The real
    counts equal theory() in test_comm's sweep.)"""
    from fourfold.comm import rabenseifner, ring

    k = world_size.bit_length() - 1
    for numel in (world_size * 1000, world_size * 7 + 3):
        for r in range(world_size):
            rab, rng = rabenseifner.theory(numel, world_size, r, 4), ring.theory(numel, world_size, r, 4)
            assert rab[1] == 2 * k and rng[1] == 2 * (world_size - 1)
            if numel % world_size == 0:
                assert rab[0] == rng[0] == 2 * (world_size - 1) * numel // world_size * 4
        total = sum(rabenseifner.theory(numel, world_size, r, 4)[0] for r in range(world_size))
        assert total == sum(ring.theory(numel, world_size, r, 4)[0] for r in range(world_size))  # uneven too
