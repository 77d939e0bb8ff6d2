"""The two-level network model (``fourfold.comm.network``): rounds recorded from the algorithms themselves.

Pure, no processes: each algorithm runs once per rank on meta tensors. On one link class the model must be
``auto``'s closed forms exactly; across nodes it must see what the closed forms cannot (shared node links).
"""

from __future__ import annotations

import os

import pytest
import torch

from fourfold.comm import Communicator, auto, hierarchical, master, naive, rabenseifner, ring, tree
from fourfold.comm.network import ALGORITHMS, Network, link_bytes, messages, rounds
from fourfold.testing import run_ranks

LINK = auto.CostModel(alpha_s=3e-4, beta_s_per_byte=8e-9, gamma_s_per_byte=0.05e-9)
FAST = auto.CostModel(alpha_s=2e-5, beta_s_per_byte=0.2e-9, gamma_s_per_byte=0.05e-9)
THEORY = {"naive": naive.theory, "master": master.theory, "ring": ring.theory, "tree": tree.theory,
          "rabenseifner": rabenseifner.theory}


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("algorithm", ["ring", "tree", "rabenseifner", "naive", "master"])
def test_one_link_class_is_autos_closed_form(world_size, algorithm):
    for numel in (1, 1000, 4 << 20):
        want = auto.predict(LINK, algorithm, numel, 4, world_size)
        for g in (1, world_size):  # every rank its own node, or all on one: one class either way
            got = Network(g, LINK).predict(algorithm, numel, 4, world_size)
            assert got == pytest.approx(want, rel=1e-3 if numel > 1000 else 0.05), (g, numel)


@pytest.mark.parametrize("world_size", [2, 3, 4, 7, 8])
@pytest.mark.parametrize("algorithm", sorted(THEORY))
def test_recorded_messages_are_what_each_rank_sends(world_size, algorithm):
    numel = 1001
    msgs = messages(algorithm, numel, 4, world_size)
    for r in range(world_size):
        assert sum(m.nbytes for m in msgs if m.src == r) == THEORY[algorithm](numel, world_size, r, 4)[0], r
    fabric, links = link_bytes(msgs, world_size)  # one node: everything on the node's fabric
    assert not links and sum(out for out, _ in fabric.values()) == sum(m.nbytes for m in msgs)


def test_two_nodes_of_four_shares_per_round():
    ring_rounds = rounds("ring", 8, 4)
    assert len(ring_rounds) == 14 and all(r.node == r.network == 1 / 8 for r in ring_rounds)
    hier = rounds("hierarchical", 8, 4)  # 3 + 3 steps in the node on N/4; 2 across, 4 ranks x N/8 on one link
    assert [r.network for r in hier] == [0, 0, 0, 0.5, 0.5, 0, 0, 0]
    assert [r.node for r in hier] == [0.25] * 3 + [0, 0] + [0.25] * 3
    assert [(r.node, r.network) for r in rounds("master", 8, 4)] == [(3, 4), (3, 4)]  # root: 4N over its link
    assert [(r.node, r.network) for r in rounds("naive", 8, 4)] == [(3, 16)]  # 4 ranks x 4 peers across
    hier_bytes = link_bytes(messages("hierarchical", 800, 4, 8, 4), 4)[1]
    assert hier_bytes == {0: [3200, 3200], 1: [3200, 3200]}  # N/2 per step, 2 steps: N = 3200 B each way


def test_across_slow_links_hierarchical_beats_ring_and_master_grows_with_g():
    n = 4 << 20
    net = Network(4, FAST, LINK)
    assert net.predict("hierarchical", n, 4, 8) < 0.7 * net.predict("ring", n, 4, 8)
    one = Network(1, LINK)
    ratio = {g: one.predict("master", n, 4, g) / one.predict("ring", n, 4, g) for g in (4, 8)}
    assert ratio[4] > 2.5 and ratio[8] > 1.6 * ratio[4]
    assert one.predict("ring", n, 4, 8) < 1.2 * one.predict("ring", n, 4, 4)  # the ring stays flat


def test_refusals():
    with pytest.raises(ValueError, match="algorithm must be one of"):
        messages("butterfly", 10, 4, 4)
    with pytest.raises(ValueError, match="whole nodes of 3"):
        Network(3, LINK).predict("ring", 10, 4, 4)
    assert set(ALGORITHMS) == set(THEORY) | {"hierarchical"}
    assert hierarchical.theory(8, 8, 0, 4, 4)[0] == sum(m.nbytes for m in messages("hierarchical", 8, 4, 8, 4)
                                                        if m.src == 0)


SPLIT = auto.CostModel(2e-5, 0.2e-9, 0.05e-9, network=(3e-4, 33e-9))  # fast in a node, slow between nodes


def test_auto_across_nodes_uses_the_network_link(tmp_path):
    big = 4 << 20
    assert auto.choose(big, 4, 8, SPLIT, 4)[0] == "hierarchical"
    name, reason = auto.choose(big, 4, 8, SPLIT, 4)
    assert "between nodes of 4: alpha 300.0 us" in reason
    # without the network link the one-class closed form ranks Rabenseifner first (fewest steps, ring's bytes)
    assert auto.choose(big, 4, 8, auto.CostModel(2e-5, 0.2e-9, 0.05e-9), 4)[0] == "rabenseifner"
    assert auto.predict(SPLIT, "ring", big, 4, 8, 1) == pytest.approx(
        Network(1, SPLIT, auto.CostModel(3e-4, 33e-9, 0.05e-9)).predict("ring", big, 4, 8))
    assert auto.predict(SPLIT, "ring", big, 4, 8) == auto.predict(SPLIT, "ring", big, 4, 8, 8)  # one node
    SPLIT.save(tmp_path / "m.json")
    assert auto.CostModel.load(tmp_path / "m.json").network == (3e-4, 33e-9)
    for bad in [(1.0,), (-1.0, 1.0), (0.0, 0.0), (float("nan"), 1.0)]:
        with pytest.raises(ValueError, match="network must be"):
            auto.CostModel(1e-4, 1e-9, network=bad)


def _auto_across_two_nodes(ctx):
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # two nodes of two (run_ranks sets one node of four)
    comm = Communicator(record_messages=True)
    mine = SPLIT if ctx.rank == 0 else auto.CostModel(1.0, 1e-12)  # rank 0's model, network included, wins
    model = auto.attach(comm, mine)
    t = torch.arange(1 << 16, dtype=torch.float64) * (ctx.rank + 1)  # 512 KB: hierarchical across slow links
    auto.allreduce(comm, t)
    assert torch.equal(t, torch.arange(1 << 16, dtype=torch.float64) * 10)
    return model.network, sorted({m.algorithm for m in comm.messages})


@pytest.mark.timeout(90)
def test_attach_gives_every_rank_the_network_link():
    results = run_ranks(_auto_across_two_nodes, 4, timeout_s=60)
    for network, picks in results:
        assert network == (3e-4, 33e-9) and picks == ["hierarchical"], (network, picks)
