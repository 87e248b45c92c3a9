"""Mesh and Plan: validation, rank coordinates, printing (tier 1, no process group)."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from autoshard import Mesh, MeshError, Plan, PlanError


def test_mesh_size_and_str() -> None:
    mesh = Mesh(dp=2, tp=4, pp=2)
    assert mesh.size == 16
    assert str(mesh) == "Mesh(dp=2, tp=4, pp=2; 16 ranks)"
    assert mesh.product_str() == "dp(2) x tp(4) x pp(2) = 16"


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_mesh_rejects_non_positive_degrees(bad) -> None:
    msg = (
        f"mesh degree tp={bad!r} is not a positive integer; "
        f"give every degree as an int >= 1, e.g. Mesh(dp=2, tp=1, pp=1)"
    )
    with pytest.raises(MeshError, match=re.escape(msg)):
        Mesh(dp=2, tp=bad)


def test_mesh_world_size_mismatch_message() -> None:
    msg = (
        "mesh dp(2) x tp(3) x pp(1) = 6 != world size 4; choose degrees whose product is 4, "
        "or launch 6 ranks (torchrun --nproc-per-node 6)"
    )
    with pytest.raises(MeshError, match=re.escape(msg)):
        Mesh(dp=2, tp=3).check_world_size(4)


@given(dp=st.integers(1, 8), tp=st.integers(1, 8), pp=st.integers(1, 4))
def test_mesh_coords_are_a_bijection(dp: int, tp: int, pp: int) -> None:
    mesh = Mesh(dp=dp, tp=tp, pp=pp)
    seen = set()
    for rank in range(mesh.size):
        c = mesh.coords(rank)
        assert mesh.rank_of(**c) == rank
        seen.add((c["pp"], c["dp"], c["tp"]))
    assert len(seen) == mesh.size
    for dim in ("dp", "tp", "pp"):
        groups = mesh.groups(dim)
        assert sorted(r for g in groups for r in g) == list(range(mesh.size))
        assert all(len(g) == mesh.degree(dim) for g in groups)


def test_tp_ranks_are_neighbours() -> None:
    mesh = Mesh(dp=2, tp=4, pp=2)
    assert mesh.group("tp", 5) == [4, 5, 6, 7]
    assert mesh.group("dp", 5) == [1, 5]
    assert mesh.group("pp", 5) == [5, 13]


def test_mesh_rank_out_of_range() -> None:
    with pytest.raises(MeshError, match=re.escape("rank 8 is outside this mesh of 8 ranks (0..7)")):
        Mesh(dp=8).coords(8)


def test_mesh_table_lists_every_rank() -> None:
    table = Mesh(dp=2, tp=2).table().splitlines()
    assert table[0].split() == ["rank", "pp", "dp", "tp"]
    assert [line.split() for line in table[1:]] == [
        ["0", "0", "0", "0"],
        ["1", "0", "0", "1"],
        ["2", "0", "1", "0"],
        ["3", "0", "1", "1"],
    ]


def test_plan_validation_messages() -> None:
    with pytest.raises(PlanError, match=re.escape("plan field zero=4 must be one of 0, 1, 2, 3")):
        Plan(zero=4)
    with pytest.raises(PlanError, match=re.escape("plan field schedule='zigzag' must be one of")):
        Plan(schedule="zigzag")
    with pytest.raises(PlanError, match=re.escape("plan field dp=0 must be a positive integer")):
        Plan(dp=0)
    with pytest.raises(PlanError, match=re.escape("unknown plan field 'microbatch'; did you mean 'microbatches'?")):
        Plan.check_overrides({"microbatch": 2})
    with pytest.raises(PlanError, match=re.escape("unknown plan field 'zer'; did you mean 'zero'?")):
        Plan.check_overrides({"zer": 3})


def test_every_combination_is_a_plan() -> None:
    for zero in (0, 1, 2, 3):
        for mesh in ({"dp": 2, "tp": 2, "pp": 2}, {"dp": 8}, {"tp": 2, "pp": 4}):
            if zero and mesh.get("dp", 1) == 1:
                continue
            Plan(**mesh, zero=zero, microbatches=2, sequence_parallel=mesh.get("tp", 1) > 1)
    Plan(dp=2, tp=2, pp=2, zero=3, offload=True, param_dtype=torch.bfloat16, schedule="gpipe")
    with pytest.raises(PlanError, match=re.escape("offload=True keeps ZeRO's optimizer shards on the CPU: it needs")):
        Plan(dp=4, offload=True)


def test_plan_is_frozen_and_printable() -> None:
    plan = Plan(dp=4)
    assert str(plan) == "Plan(dp=4, tp=1, pp=1, zero=0, bucket=25MiB)"
    assert plan.mesh == Mesh(dp=4)
    with pytest.raises(AttributeError):
        plan.dp = 2  # type: ignore[misc]
