"""Data-parallel runtime on real gloo ranks: overlap, communication volume, process-group checks."""

from __future__ import annotations

import re

import pytest
from cases import device_mesh_probe, error_message, groups_after_compiles, overlap_probe, state_roundtrip


@pytest.mark.parametrize("family", ["mlp", "gpt2"])
def test_buckets_are_reduced_while_backward_runs(ranks, family: str) -> None:
    results = ranks(2).run(overlap_probe, family)
    for seen in results:
        assert seen["buckets"] > 2
        # Every bucket was launched from a gradient hook before backward returned.
        assert seen["launched_during_backward"] == seen["buckets"]
        # Plain data parallel all-reduces each gradient byte once per step (ring cost 2 psi).
        assert seen["bytes_reduced"] == seen["param_bytes"]


def test_programs_of_one_process_share_their_process_groups(ranks) -> None:
    # Groups are never destroyed while the process lives: a new set per compile would pile up.
    for counts in ranks(4).run(groups_after_compiles, {"dp": 2, "tp": 2}, 3):
        assert counts[0] > 1
        assert counts == [counts[0]] * 3


def test_mesh_that_does_not_match_the_world_size(ranks) -> None:
    messages = ranks(4).run(error_message, "mlp", {"dp": 2, "tp": 3})
    expected = (
        "MeshError: mesh dp(2) x tp(3) x pp(1) = 6 != world size 4; choose degrees whose product is 4, "
        "or launch 6 ranks (torchrun --nproc-per-node 6)"
    )
    assert messages == [expected] * 4


def test_int_mesh_that_does_not_match_the_world_size(ranks) -> None:
    messages = ranks(2).run(error_message, "mlp", 4)
    assert messages == ["MeshError: mesh=4 ranks != world size 2; pass mesh=2 or launch 4"] * 2


def test_mesh_from_a_torch_device_mesh(ranks) -> None:
    assert ranks(2).run(device_mesh_probe) == ["Mesh(dp=2, tp=1, pp=1; 2 ranks)"] * 2


def test_state_dict_round_trip(ranks) -> None:
    assert ranks(2).run(state_roundtrip, "gpt2") == [True, True]


def test_failure_on_a_rank_is_reported_with_its_traceback(ranks) -> None:
    from autoshard.launch import RankFailure

    with pytest.raises(RankFailure, match=re.escape("2 rank(s) failed:")):
        ranks(2).run(error_message, "no-such-family", {"dp": 2})
    assert ranks(2).run(device_mesh_probe)  # the pool is usable afterwards
