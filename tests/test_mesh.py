"""Mesh arithmetic (no processes): coordinates, groups, and refusals for every factorisation of 8 ranks.

A failure here means a rank would join the wrong process group; the message shows the mesh and the axis.
"""

from __future__ import annotations

import itertools

import pytest

from fourfold.mesh import AXES, Mesh

WORLD = 8
FACTORISATIONS = [(dp, tp, pp) for dp, tp, pp in itertools.product(range(1, WORLD + 1), repeat=3)
                  if dp * tp * pp == WORLD]


def test_there_are_ten_factorisations_of_eight():
    assert len(FACTORISATIONS) == 10


@pytest.mark.parametrize("dp,tp,pp", FACTORISATIONS)
def test_coordinates_round_trip_and_tp_is_innermost(dp, tp, pp):
    mesh = Mesh(dp=dp, tp=tp, pp=pp)
    coords = [mesh.coord(r) for r in range(WORLD)]
    assert len(set(coords)) == WORLD
    for r, c in enumerate(coords):
        assert mesh.rank(pp=c.pp, dp=c.dp, tp=c.tp) == r
        assert r == c.pp * dp * tp + c.dp * tp + c.tp  # the documented layout


@pytest.mark.parametrize("dp,tp,pp", FACTORISATIONS)
def test_groups_partition_the_world_along_every_axis(dp, tp, pp):
    mesh = Mesh(dp=dp, tp=tp, pp=pp)
    for axis in AXES:
        groups = mesh.groups(axis)
        size = getattr(mesh, axis)
        assert len(groups) == WORLD // size, (mesh, axis)
        assert all(len(g) == size for g in groups), (mesh, axis)
        assert sorted(r for g in groups for r in g) == list(range(WORLD)), (mesh, axis)
        for g in groups:
            # members differ only along `axis`, and are listed in that coordinate's order
            other = [a for a in AXES if a != axis]
            cs = [mesh.coord(r) for r in g]
            assert all(getattr(c, o) == getattr(cs[0], o) for c in cs for o in other), (mesh, axis, g)
            assert [getattr(c, axis) for c in cs] == list(range(size)), (mesh, axis, g)
            for r in g:
                assert mesh.peers(r, axis) == g


def test_example_layout_from_the_docstring():
    mesh = Mesh(dp=2, tp=2, pp=2)
    assert mesh.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_for_world_fills_dp():
    assert Mesh.for_world(8, tp=2) == Mesh(dp=4, tp=2, pp=1)
    assert Mesh.for_world(8, tp=2, pp=2) == Mesh(dp=2, tp=2, pp=2)
    assert Mesh.for_world(1) == Mesh()


def test_wrong_product_names_every_value_and_a_fix():
    with pytest.raises(ValueError, match=r"got 2\*2\*2=8 vs world size 4\. Pass --dp 1 or launch 8"):
        Mesh(dp=2, tp=2, pp=2).check_world(4)
    with pytest.raises(ValueError, match=r"divisible by tp\*pp, got world_size=6, tp\*pp=2\*2=4\. Launch a "
                       r"multiple of 4 processes \(fourfold train --nproc 4\)"):
        Mesh.for_world(6, tp=2, pp=2)
    with pytest.raises(ValueError, match=r"dp\*tp\*pp must equal the world size, got 3\*1\*1=3 vs world size 4"):
        Mesh.for_world(4, dp=3)


@pytest.mark.parametrize("bad", [{"dp": 0}, {"tp": -1}, {"pp": 1.5}, {"dp": True}])
def test_non_positive_or_non_integer_sizes_refused(bad):
    with pytest.raises(ValueError, match="must be a positive integer"):
        Mesh(**bad)


def test_out_of_range_rank_and_axis_refused():
    mesh = Mesh(dp=2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        mesh.coord(2)
    with pytest.raises(ValueError, match="axis must be one of"):
        mesh.groups("ep")  # type: ignore[arg-type]
