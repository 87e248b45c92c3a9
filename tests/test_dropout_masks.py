"""Dropout masks as one device draws them (plan dropout_masks="single_device"), on real gloo ranks.

With dropout on, every plan then trains as single-device training does: dp ranks keep their rows of
the global batch's mask, tp ranks their heads or sequence shard, pipeline stages draw past the other
stages' masks, microbatches slice the step's mask, recomputation replays it. The default (each rank its
own stream) is shown to differ, so these comparisons can fail.
"""

from __future__ import annotations

from typing import Any

import pytest
from cases import build_case, compile_case, train_plan, train_single_device
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_tp import assert_state_close

import autoshard

DROPOUT = {"dropout": 0.1, "attention": "eager"}  # eager attention: its dropout is an op of the graph
MESHES: tuple[tuple[dict[str, int], dict[str, Any]], ...] = (
    ({"dp": 4}, {}),
    ({"dp": 2, "tp": 2}, {"sequence_parallel": True}),
    ({"dp": 2, "pp": 2}, {}),
    ({"dp": 4}, {"zero": 3}),
)
GRID = [
    (family, mesh, {**extra, "recompute": choice, "dropout_masks": "single_device"})
    for family in ("gpt2", "llama", "bert")
    for choice in ("none", "full", "selective")
    for mesh, extra in MESHES
]


def _world(mesh: dict[str, int]) -> int:
    return mesh.get("dp", 1) * mesh.get("tp", 1) * mesh.get("pp", 1)


def check(ranks, family: str, mesh: dict[str, int], plan: dict[str, Any], **shape: Any) -> None:
    ref_losses, ref_state = train_single_device(family, **DROPOUT, **shape)
    results = ranks(_world(mesh)).run(train_plan, family, mesh, plan, **DROPOUT, **shape)
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx(ref_losses, rel=1e-5), f"rank {rank}"
    assert_state_close(results[0]["state"], ref_state)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "mesh", "plan"), GRID, ids=[f"{f}-{m}-{p['recompute']}" for f, m, p in GRID])
def test_dropout_matches_single_device_grid(ranks, family: str, mesh: dict[str, int], plan: dict[str, Any]) -> None:
    check(ranks, family, mesh, plan)


@settings(max_examples=2, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(GRID))
def test_dropout_matches_single_device_sample(ranks, case: tuple[str, dict[str, int], dict[str, Any]]) -> None:
    check(ranks, *case)


@pytest.mark.parametrize(
    ("mesh", "plan", "shape"),
    [
        ({"dp": 2}, {"microbatches": 4}, {}),  # gradient accumulation: each slice its rows of the step's mask
        ({"dp": 2, "pp": 2}, {"microbatches": 2}, {}),  # stage 0 draws past stage 1's masks to stay in step
        pytest.param(
            {"pp": 2, "dp": 2}, {"schedule": "interleaved_1f1b", "virtual_stages": 2, "microbatches": 2},
            {"layers": 4}, marks=pytest.mark.slow,
        ),
    ],
)  # fmt: skip
def test_microbatches_slice_the_steps_mask(ranks, mesh: dict, plan: dict, shape: dict) -> None:
    check(ranks, "gpt2", mesh, {**plan, "dropout_masks": "single_device"}, **shape)


def test_per_rank_masks_differ_from_single_device(ranks) -> None:
    """The default draws each rank's own masks: not the single-device run (so the tests above can fail)."""
    ref_losses, _ = train_single_device("gpt2", **DROPOUT)
    per_rank = ranks(2).run(train_plan, "gpt2", {"dp": 2}, {}, **DROPOUT)[0]
    assert per_rank["losses"][0] != pytest.approx(ref_losses[0], rel=1e-5)


def test_the_rewritten_graph_reads_each_mask_in_draw_order() -> None:
    case = build_case("gpt2", **DROPOUT)
    program = compile_case(case, autoshard.Mesh(dp=2, tp=2), plan={"dropout_masks": "single_device"})
    specs = program.compiled.masks
    # embedding dropout, then per block: attention probabilities, attention output, MLP output
    assert [s.index for s in specs] == list(range(7))
    attention = specs[1]
    assert attention.batch_dim == 0 and attention.tp == autoshard.Shard(1)  # heads, split over tp
    assert [str(s) for s in attention.sizes] == ["B", "4", "S", "S"]  # the global shape: all 4 heads
    code = program.captured_graph.code
    assert code.count("autoshard_graph_ops_masks_dropout(masks, ") == 7
    assert "aten.dropout" not in code and "sharded_random" not in code


def test_dropout_the_masks_cannot_reproduce_is_refused() -> None:
    case = build_case("gpt2", dropout=0.1, attention="sdpa")
    with pytest.raises(autoshard.PlanError, match=r"scaled_dot_product_attention draws its dropout mask inside"):
        compile_case(case, autoshard.Mesh(dp=2), plan={"dropout_masks": "single_device"})
    with pytest.raises(autoshard.PlanError, match=r"dropout_masks='everywhere' must be one of \('per_rank'"):
        compile_case(build_case("gpt2"), autoshard.Mesh(dp=2), plan={"dropout_masks": "everywhere"})


def test_a_model_without_dropout_draws_nothing() -> None:
    gm = compile_case(build_case("gpt2"), autoshard.Mesh(dp=2), plan={"dropout_masks": "single_device"}).captured_graph
    # p=0 draws nothing on one device either
    assert autoshard.passes.dropout_masks.catalog(gm, 1) == () and "masks" not in gm.code
