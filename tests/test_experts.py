"""Expert parallelism: mixture-of-experts layers split over ep ranks carved out of dp equal single-device training."""

from __future__ import annotations

import functools

import pytest
from cases import train_plan, train_single_device
from expert_cases import EP_OPS, exchanges_per_step
from test_tp import assert_state_close

MOE = ("hf:mixtral:causal", "hf:qwen2_moe:causal", "hf:olmoe:causal")


@functools.cache
def reference(family: str, max_grad_norm: float | None = None) -> tuple[list[float], dict]:
    return train_single_device(family, max_grad_norm=max_grad_norm)


def run_ep(ranks, family: str, mesh: dict, plan: dict) -> list[dict]:
    world = mesh.get("dp", 1) * mesh.get("tp", 1) * mesh.get("pp", 1)
    results = ranks(world).run(train_plan, family, mesh, plan)
    ref_losses, ref_state = reference(family, plan.get("max_grad_norm"))
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx(ref_losses, rel=1e-5), rank
    assert_state_close(results[0]["state"], ref_state)
    return results


@pytest.mark.parametrize("family", MOE)
def test_ep2_equals_single_device(ranks, family) -> None:
    run_ep(ranks, family, {"dp": 4}, {"ep": 2})


@pytest.mark.parametrize(
    "plan",
    [
        {"ep": 4},
        {"ep": 2, "zero": 1},
        {"ep": 2, "zero": 2},
        {"ep": 2, "microbatches": 2},
        {"ep": 2, "recompute": "full"},
        {"ep": 4, "max_grad_norm": 0.05},
    ],
    ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()),
)
def test_ep_plans_equal_single_device(ranks, plan) -> None:
    run_ep(ranks, "hf:mixtral:causal", {"dp": 4}, plan)


def test_ep_with_pipeline(ranks) -> None:
    run_ep(ranks, "hf:mixtral:causal", {"dp": 2, "pp": 2}, {"ep": 2, "microbatches": 2})


def test_all_to_alls_per_layer(ranks) -> None:
    """Per MoE layer and step: forward exchanges counts, dispatches and combines (3 all-to-alls); backward
    returns the combine's and the dispatch's gradients (2). Each rank holds E / ep experts."""
    results = ranks(4).run(exchanges_per_step, "hf:mixtral:causal", {"dp": 4}, {"ep": 2})
    layers = 2
    for result in results:
        assert result["calls"] == {op: layers for op in EP_OPS}
        assert result["experts"] and all(shape[0] == 4 // 2 for shape in result["experts"].values())
