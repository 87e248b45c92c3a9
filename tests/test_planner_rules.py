"""The planner's arithmetic on a model cost written by hand (tier 1): memory per ZeRO stage, the meshes it
considers, the data-parallel rule of thumb and its default microbatches."""

from __future__ import annotations

import pytest
import sympy

from autoshard.cost import LayerCost, ModelCost
from autoshard.hardware import Hardware
from autoshard.plan import Plan
from autoshard.planner import choose_plan, default_microbatches
from autoshard.planner.costing import Costing
from autoshard.planner.search import SIMPLER_WITHIN

GIB = 2**30


def model_cost(param_bytes: int, activation_bytes: int = 0, flops: int = 10**12) -> ModelCost:
    blocks = tuple(LayerCost(f"h.{i}", sympy.Integer(0), sympy.Integer(0), 0, sympy.Integer(0)) for i in range(8))
    f, a = sympy.Integer(flops), sympy.Integer(activation_bytes)
    return ModelCost(f, 2 * f, param_bytes, a, blocks)


HW = Hardware.preset("a100-80gb")


def estimate(plan: Plan, cost: ModelCost) -> int:
    return Costing(cost, {"B": 64}, HW).candidate(plan).memory.total


def choose(cost: ModelCost):
    return choose_plan(8, {}, Costing(cost, {"B": 64}, HW), {"B": 64}, HW)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_memory_per_rank_follows_the_zero_formulas(zero: int) -> None:
    """Psi bytes of weights, as many of gradients, K = 2 Psi of optimizer state; each stage shards one more."""
    psi, dp = 1024 * GIB // 1024, 4
    memory = estimate(Plan(dp=dp, zero=zero), model_cost(psi))
    weights, grads, optimizer = psi, psi, 2 * psi
    expected = {
        0: weights + grads + optimizer,
        1: weights + grads + optimizer / dp,
        2: weights + (grads + optimizer) / dp,
        3: (weights + grads + optimizer) / dp,
    }[zero]
    assert memory == int(expected)


def test_tensor_and_pipeline_parallelism_split_the_model_states() -> None:
    psi = GIB
    memory = estimate(Plan(dp=1, tp=2, pp=2, microbatches=4), model_cost(psi))
    assert memory == int(4 * psi / 4)


def test_every_factorization_of_the_world_size_is_a_candidate() -> None:
    report = choose(model_cost(GIB))
    shapes = {(c.plan.dp, c.plan.tp, c.plan.pp) for c in report.candidates}
    expected = {(dp, tp, pp) for dp in (1, 2, 4, 8) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8) if dp * tp * pp == 8}
    assert shapes == expected
    zeros = {(c.plan.dp, c.plan.zero) for c in report.candidates if (c.plan.tp, c.plan.pp) == (1, 1)}
    assert zeros == {(8, 0), (8, 1), (8, 2), (8, 3)}  # ZeRO is only a candidate where dp > 1


def test_a_model_that_fits_trains_data_parallel_even_when_a_split_is_predicted_faster() -> None:
    # Huge activations make tensor parallelism look cheap per rank; the model (1 GiB) fits plain dp.
    cost = model_cost(GIB, activation_bytes=40 * GIB, flops=10**15)
    report = choose(cost)
    assert (report.winner.tp, report.winner.pp) == (1, 1) and report.winner.dp == 8
    assert "with plain data parallelism" in report.reason


def test_a_model_that_does_not_fit_plain_dp_takes_the_fastest_plan_that_fits() -> None:
    # Weights, gradients and two Adam moments: 4 x 21 GiB, more than 80 GiB without ZeRO.
    report = choose(model_cost(21 * GIB))
    assert report.chosen.fits
    fitting = [c for c in report.candidates if c.fits]
    assert report.chosen.step_time <= min(c.step_time for c in fitting) * (1 + SIMPLER_WITHIN)
    assert not any(c.fits for c in report.candidates if c.plan.zero == 0 and (c.plan.tp, c.plan.pp) == (1, 1))


@pytest.mark.parametrize(
    ("rows", "pp", "schedule", "expected"),
    [(8, 2, "1f1b", 8), (12, 2, "1f1b", 6), (7, 2, "gpipe", 7), (5, 4, "1f1b", 5), (12, 4, "interleaved_1f1b", 12),
     (6, 4, "interleaved_1f1b", 4)],
)  # fmt: skip
def test_default_microbatches_are_the_most_that_divide_the_rows(rows: int, pp: int, schedule: str, expected) -> None:
    assert default_microbatches(rows, pp, schedule) == expected
