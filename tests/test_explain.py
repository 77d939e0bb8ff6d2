"""``fourfold explain``: the labels, and a real run of the ring whose printed steps match the textbook ring."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fourfold.cli.explain import masks_label


def test_masks_label_names_the_contributing_ranks():
    assert masks_label(0b1, 2) == "a2"
    assert masks_label(0b101, 2) == "a2+c2"
    assert masks_label(0b1111) == "a+b+c+d"


def _explain(tmp_path, algorithm: str, world: int, *flags: str) -> str:
    """``fourfold explain ALGORITHM --world G`` in its own process: its text, once its picture is drawn."""
    png = tmp_path / f"{algorithm}.png"
    out = subprocess.run([sys.executable, "-m", "fourfold", "explain", algorithm, "--world", str(world), "--out",
                          str(png), *flags], capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert png.stat().st_size > 10_000
    return out.stdout


@pytest.mark.timeout(120)
def test_explain_ring_prints_share_reduce_then_share_only_and_draws(tmp_path):
    text = _explain(tmp_path, "ring", 3)
    # G-1 = 2 reduce-scatter steps then 2 all-gather steps, 3 messages each: 12 messages of 1/3 of the tensor
    assert text.count("(reduce-scatter)") == 2 and text.count("(all-gather)") == 2
    assert "12 messages in 4 steps" in text
    # step 0: rank 0 sends its own segment 2 (member i sends segment i-1) to its right neighbour
    assert "rank 0 -> rank 1: segment 2 = a2" in text
    # after the reduce-scatter each rank owns one complete segment, which it sends first in the all-gather
    assert "rank 0 -> rank 1: segment 0 = a0+b0+c0" in text
    assert "12 segment-sized pieces moved, each 1/3 of the tensor (4 sent by every rank)" in text  # 2(G-1)/G


@pytest.mark.timeout(120)
def test_explain_hierarchical_shows_nodes_where_asked_and_says_one_node_is_a_ring(tmp_path, capsys):
    text = _explain(tmp_path, "hierarchical", 4, "--ranks-per-node", "2")
    phases = ["intra-node reduce-scatter", "inter-node reduce-scatter", "inter-node all-gather",
              "intra-node all-gather"]
    assert [f"step {i} ({p}):" in text for i, p in enumerate(phases)] == [True] * 4, text
    assert "rank 0 -> rank 2: segment 1 = a1+b1" in text  # across nodes: rank 0 of node 0 to rank 0 of node 1
    from fourfold.cli.explain import main

    with pytest.raises(SystemExit):
        main(["ring", "--ranks-per-node", "2"])
    assert "--ranks-per-node is hierarchical's" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["hierarchical", "--world", "4", "--ranks-per-node", "3"])
    assert "Pass one of 1, 2, 4" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_explain_master_shows_the_root_sending_what_the_others_send_twice_over(tmp_path):
    """The single master's lesson is its asymmetry: the root sends (G-1) whole tensors, each other rank one. An
    average per rank (4 pieces at G = 3) would match no rank."""
    text = _explain(tmp_path, "master", 3)
    assert "sent by rank 0: 6, 1: 3, 2: 3; the busiest rank sends 6" in text, text[-400:]


@pytest.mark.timeout(120)
def test_explain_auto_names_its_choice_and_its_legend_a_segment_that_exists(tmp_path):
    text = _explain(tmp_path, "auto", 2)
    assert "a1+b1 = the sum of ranks 0 and 1's segment 1" in text, text  # segments 0 and 1 only
    assert "\nauto chose " in text and " predicted for 16 B over G=2" in text, text  # and why
    assert "2 messages in 1 step;" in text, text


def test_explain_refuses_native_and_bad_world(capsys):
    from fourfold.cli.explain import main

    with pytest.raises(SystemExit):
        main(["native", "--world", "2"])
    assert "native's steps are inside the backend" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["rign", "--world", "2"])
    assert "got 'rign'. Did you mean 'ring'?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["ring", "--world", "1"])
    assert "--world must be in 2..16, got 1" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_explain_draws_a_non_power_of_two_world_whose_folded_ranks_sit_out(tmp_path):
    # the module's own example: rank 4 folds into rank 0 and records fewer states than the exchanges drawn
    text = _explain(tmp_path, "tree", 5)
    # the exchanges numbered alike on every rank: the fold first, the unfold last, each in its own step
    assert "step 0 (fold):\n  rank 4 -> rank 0: the whole tensor = e\n" in text, text
    assert "step 3 (unfold):\n  rank 0 -> rank 4: the whole tensor = a+b+c+d+e\n" in text, text
    assert "10 messages in 4 steps" in text


def test_the_ranks_exchanges_merge_into_one_order():
    from fourfold.cli.explain import _global_order

    fold, d0, d1, unfold = ("fold", 0), ("doubling", 0), ("doubling", 1), ("unfold", 0)
    # rank 0 takes part in all; rank 1 in the doubling only; rank 4 in the fold and the unfold
    assert _global_order([[d0, d1], [fold, unfold], [fold, d0, d1, unfold]]) == [fold, d0, d1, unfold]


def test_explain_ring_attention_draws_whose_blocks_each_rank_holds_from_a_real_run(tmp_path, capsys):
    out = subprocess.run([sys.executable, "-m", "fourfold", "explain", "ring-attention", "--cp", "3", "--out",
                          str(tmp_path / "ra.png")], capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "rank 0 holds positions 0-1, 10-11" in text  # head-tail: chunks 0 and 5 of 6
    step1 = next(line for line in text.splitlines() if line.strip().startswith("1 "))
    assert step1.split()[1:3] == ["K/V", "2"]  # rank 0 attends to its left neighbour's block one step on
    assert "head-tail cut: (query, key) pairs per rank [26, 26, 26] (max / mean 1.00)" in text, text
    sent = text.split("each rank sent [")[1]
    assert len({*sent.split("]")[0].split(", "), sent.split("theory ")[1].split()[0]}) == 1, text  # = theory
    assert "largest difference from one process's attention" in text and (tmp_path / "ra.png").is_file()
    from fourfold.cli.explain import main

    with pytest.raises(SystemExit):
        main(["ring-attention", "--cp", "3", "--seq-len", "10"])
    assert "multiple of 2 x cp = 6" in capsys.readouterr().err
