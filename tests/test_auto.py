"""``auto`` all-reduce: the pure choice from the cost model, the model file, the choice on real ranks, the bench.

Read a failure from the top: the pure tests (``choose``, ``switch_points``, ``CostModel``) need no processes;
if they pass and a multi-rank test fails, the fault is in how ranks agree on a model (``attach``), not in the
arithmetic. The last test runs ``fourfold bench allreduce`` end to end; its output is in the assertion.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys

import pytest
import torch

from fourfold.bench import main
from fourfold.bench.harness import fit_alpha_beta, fit_line, parse_size
from fourfold.comm import Communicator, allreduce, auto, ring, tree
from fourfold.testing import run_ranks

# A round model whose crossovers are easy to write down: alpha 100 us, beta 1 ns/B, gamma 0 or 1 ns/B.
LINK = auto.CostModel(alpha_s=1e-4, beta_s_per_byte=1e-9, gamma_s_per_byte=0.0)


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 8])
def test_small_messages_pick_tree_and_large_pick_ring_with_the_default_model(world_size):
    assert auto.choose(1024, 4, world_size, auto.DEFAULT)[0] == "tree"  # 4 KB: latency-bound
    # 64 MB, bandwidth-bound: the ring's bytes; at powers of two above 2 Rabenseifner sends them in fewer steps
    large = "rabenseifner" if world_size > 2 and world_size & (world_size - 1) == 0 else "ring"
    assert auto.choose(16 << 20, 4, world_size, auto.DEFAULT)[0] == large
    name, reason = auto.choose(1024, 4, world_size, auto.DEFAULT)
    assert reason.startswith("tree ") and "ring" in reason and f"G={world_size}" in reason


@pytest.mark.parametrize("world_size", [4, 8, 16])
def test_switch_point_is_the_analytical_crossover_for_powers_of_two(world_size):
    # gamma = 0, G = 2^k: Rabenseifner 2k alpha + 2(G-1)/G N beta (below the ring's 2(G-1) alpha at every size),
    # tree k alpha + k N beta, equal at N* = k alpha / ((k - 2(G-1)/G) beta) bytes.
    k, g = int(math.log2(world_size)), world_size
    n_star = k * LINK.alpha_s / ((k - 2 * (g - 1) / g) * LINK.beta_s_per_byte)
    [(numel, before, after)] = auto.switch_points(4, g, LINK)
    assert (before, after) == ("tree", "rabenseifner")
    assert abs(numel * 4 - n_star) <= 4 * g, (numel * 4, n_star)  # within a few elements (uneven segments)


def test_switch_point_at_two_ranks_is_set_by_the_reduction_cost():
    # G = 2: both send N; the ring takes one step more but adds N/2 instead of N, so N* = 2 alpha / gamma.
    model = auto.CostModel(alpha_s=1e-4, beta_s_per_byte=1e-9, gamma_s_per_byte=1e-9)
    [(numel, before, after)] = auto.switch_points(4, 2, model)
    assert (before, after) == ("tree", "ring")
    assert abs(numel * 4 - 2 * model.alpha_s / model.gamma_s_per_byte) <= 8
    assert auto.switch_points(4, 2, LINK) == []  # without gamma the tree never loses at G = 2


def test_cost_uses_the_algorithms_own_theory():
    for g in (2, 3, 4, 5, 8):
        n = 17 ** 3
        c = auto.cost("ring", n, 4, g)
        assert c.steps == 2 * (g - 1) == ring.theory(n, g, 0, 4)[1]
        assert c.wire_bytes == max(ring.theory(n, g, r, 4)[0] for r in range(g))
        t = auto.cost("tree", n, 4, g)
        most = max(tree.theory(n, g, r, 4)[0] for r in range(g))
        assert t.wire_bytes == most + (0 if g & (g - 1) == 0 else n * 4)  # + the fold, a receive
    assert auto.candidates(4) == auto.candidates(4, node_size=4) == ["ring", "tree", "rabenseifner"]
    assert auto.candidates(4, node_size=2) == ["ring", "tree", "rabenseifner", "hierarchical"]
    for g in (2, 4, 8):  # the ring's bytes (G divides N) in 2 log2 G steps
        r = auto.cost("rabenseifner", 8000, 4, g)
        assert r.wire_bytes == auto.cost("ring", 8000, 4, g).wire_bytes and r.steps == 2 * (g.bit_length() - 1)


def test_cost_model_round_trips_through_json(tmp_path):
    model = auto.CostModel(5e-5, 3e-10, 1e-11, source="test", info={"pingpong": [[4, 5e-5]]})
    path = model.save(tmp_path / "sub" / "model.json")
    back = auto.CostModel.load(path)
    assert back == model and back.info == model.info
    assert json.loads(path.read_text())["format"] == "fourfold-cost-model"


def test_default_path_and_missing_file(tmp_path, monkeypatch):
    monkeypatch.setenv("FOURFOLD_COST_MODEL", str(tmp_path / "none.json"))
    assert auto.default_path() == tmp_path / "none.json"
    assert auto.CostModel.load() is auto.DEFAULT
    LINK.save()
    assert auto.CostModel.load() == LINK


@pytest.mark.parametrize("content, words", [
    ("{not json", "must be JSON"),
    ('{"alpha_s": 1}', "format="),
    ('{"format": "fourfold-cost-model", "version": 1, "alpha_s": 1e-5}', "beta_s_per_byte"),
    ('{"format": "fourfold-cost-model", "version": 1, "alpha_s": -1, "beta_s_per_byte": 1e-9}', "alpha_s must"),
    ('{"format": "fourfold-cost-model", "version": 1, "alpha_s": "fast", "beta_s_per_byte": 1e-9}', "alpha_s must"),
])
def test_malformed_cost_model_is_refused_with_the_fix(tmp_path, content, words):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=words) as info:
        auto.CostModel.load(path)
    assert str(path) in str(info.value) and "fourfold bench allreduce" in str(info.value)


def test_bench_helpers():
    assert parse_size("4KB") == 4096 and parse_size("64mb") == 64 << 20 and parse_size("12") == 12
    for bad in ("3B", "4XB", "", "0"):
        with pytest.raises(ValueError, match="size must"):
            parse_size(bad)
    a, b = fit_line([4.0, 1e3, 1e6], [2e-5 + 4 * 3e-10, 2e-5 + 1e3 * 3e-10, 2e-5 + 1e6 * 3e-10])
    assert a == pytest.approx(2e-5) and b == pytest.approx(3e-10)
    # a link that bursts: small messages at 1 ns/B, from 1 MB its sustained 8 ns/B; the fit keeps the latter
    burst = [(n, 4e-4 + n * (1e-9 if n < 1 << 20 else 8e-9)) for n in (4, 64, 1 << 10, 4 << 10, 64 << 10,
                                                                      1 << 20, 4 << 20, 16 << 20)]
    a, b = fit_alpha_beta(burst)
    assert a == pytest.approx(4e-4, rel=1e-2) and b == pytest.approx(8e-9, rel=1e-3)
    assert fit_line(*zip(*burst, strict=True))[1] < 0.8 * 8e-9  # the old fit of every size: too fast


@pytest.mark.parametrize("argv, words", [(["allreduce", "--nproc", "1"], "nproc must be >= 2"),
                                         (["allreduce", "--algorithms", "rign"], "algorithms must be among"),
                                         (["allreduce", "--sizez", "4KB"], "Did you mean '--sizes'")])
def test_bench_refuses_bad_flags_before_starting_ranks(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _auto_on_ranks(ctx, sizes):
    records = _Records()
    logger = logging.getLogger("fourfold.comm")
    logger.addHandler(records)
    logger.setLevel(logging.DEBUG)
    # Each rank offers its own model; rank 0's (the round LINK model with gamma) must win everywhere.
    mine = auto.CostModel(1e-4, 1e-9, 1e-9) if ctx.rank == 0 else auto.CostModel(1.0, 1e-12, 0.0)
    comm = Communicator(record_messages=True)
    auto.attach(comm, mine)
    ran = []
    for numel in sizes:
        gen = torch.Generator().manual_seed(numel)
        inputs = torch.randint(-1000, 1000, (ctx.world_size, numel), generator=gen).double()  # (G, N) exact
        t = inputs[ctx.rank].clone()
        before = len(comm.messages)
        allreduce(t, "auto", comm=comm)
        assert torch.equal(t, inputs.sum(0)), f"rank {ctx.rank}: wrong sum for numel={numel}"
        ran.append(sorted({m.algorithm for m in comm.messages[before:]}))
    t = torch.full((5,), float(ctx.rank))  # no comm: rank 0 loads $FOURFOLD_COST_MODEL (absent: DEFAULT)
    allreduce(t, "auto")
    assert torch.equal(t, torch.full((5,), float(sum(range(ctx.world_size)))))
    return ran, [line.split(": ", 1)[1] for line in records.lines]


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 3])
def test_auto_sums_exactly_and_every_rank_picks_the_same(world_size, tmp_path):
    sizes = [1, 17, 17 ** 2, 17 ** 4]  # float64 with gamma = beta: tree below ~25000 (G=2), ~4200 (G=3)
    results = run_ranks(_auto_on_ranks, world_size, sizes, timeout_s=60,
                        env={"FOURFOLD_COST_MODEL": str(tmp_path / "absent.json")})
    ran, logs = results[0]
    assert all(r == results[0] for r in results), results  # same algorithms, same predicted reasons
    assert ran[0] == ["tree"] and ran[-1] == ["ring"], ran
    expected = [auto.choose(n, 8, world_size, auto.CostModel(1e-4, 1e-9, 1e-9))[0] for n in sizes]
    assert [r[0] for r in ran] == expected
    assert logs[0].startswith("auto chose tree: tree ") and "alpha 100.0 us" in logs[0]
    assert logs[-1].startswith("auto chose tree") and f"alpha {auto.DEFAULT.alpha_s * 1e6:.1f} us" in logs[-1]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_bench_allreduce_runs_end_to_end(tmp_path):
    env = {**os.environ, "FOURFOLD_COST_MODEL": str(tmp_path / "model.json"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "fourfold.cli", "bench", "allreduce", "--nproc", "2", "--sizes", "4KB",
           "--iters", "2", "--warmup", "1", "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "targets:" in proc.stdout and "node link: alpha" in proc.stdout
    result = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert {r["algorithm"] for r in result["results"]} >= {"ring", "tree", "auto", "native"}
    for r in result["results"]:  # every algorithm but the backend's own has a theory, and its bytes equal it
        assert (r["sent_bytes_theory"] is None) == (r["algorithm"] == "native"), r
        if r["sent_bytes_theory"] is not None:
            assert r["sent_bytes_counted"] == r["sent_bytes_theory"], r  # bytes counted equal the theory
    assert result["command"].startswith("fourfold bench allreduce --nproc 2")
    assert auto.CostModel.load(tmp_path / "model.json").alpha_s == result["cost_model"]["alpha_s"]
