"""Tests that fail on the bugs the equivalence tests let through (tests/mutants/ plants them).

On real gloo ranks, each strategy's update under plain SGD (lr=1, no momentum) is compared step by
step with single-device training: the update is the reduced gradient itself, so a gradient scaled by
dp or by the microbatch count, or clipped by a wrong coefficient, fails where Adam would hide it.
"""

from __future__ import annotations

import functools

import pytest
import torch
from cases import compile_case, train_zero
from gap_cases import (
    GAP_MODELS,
    assert_updates_close,
    make_case,
    single_device_updates,
    train_single_device_as_program,
    train_updates,
)

import autoshard
from autoshard.graph_ops import zero

# mesh, plan: every strategy alone, and ZeRO-3 inside a TP mesh and across pipeline stages.
STRATEGIES = {
    "dp2": ({"dp": 2}, {}),
    "zero1": ({"dp": 2}, {"zero": 1}),
    "zero2": ({"dp": 2}, {"zero": 2}),
    "zero3": ({"dp": 2}, {"zero": 3}),
    "zero3-dp4": ({"dp": 4}, {"zero": 3}),
    "tp2": ({"tp": 2}, {}),
    "pp2": ({"pp": 2}, {"microbatches": 2}),
    "dp2xtp2-zero3": ({"dp": 2, "tp": 2}, {"zero": 3}),
    "dp2xpp2-zero3": ({"dp": 2, "pp": 2}, {"zero": 3, "microbatches": 2}),
    # zero-bubble: a weight that two matmuls of one stage read gets both gradients in one W, summed
    "dp2xpp2-zb_h1": ({"dp": 2, "pp": 2}, {"microbatches": 2, "schedule": "zb_h1"}),
    "dp2xpp2-zero3-zb_h1": ({"dp": 2, "pp": 2}, {"zero": 3, "microbatches": 2, "schedule": "zb_h1"}),
}


def _world(mesh: dict[str, int]) -> int:
    return mesh.get("dp", 1) * mesh.get("tp", 1) * mesh.get("pp", 1)


@functools.cache
def reference(name: str, steps: int, max_grad_norm: float | None = None) -> dict:
    return single_device_updates(name, steps, max_grad_norm=max_grad_norm)


def run(ranks, name: str, mesh: dict, plan: dict, steps: int, max_grad_norm: float | None = None) -> list[dict]:
    if max_grad_norm is not None:
        plan = {**plan, "max_grad_norm": max_grad_norm}
    results = ranks(_world(mesh)).run(train_updates, name, mesh, plan, steps)
    ref = reference(name, steps, max_grad_norm)
    for rank, result in enumerate(results):  # every rank returns the global loss
        assert result["losses"] == pytest.approx(ref["losses"], rel=1e-5), rank
    assert_updates_close(results[0]["states"], ref["states"])
    return results


@pytest.mark.parametrize("model", GAP_MODELS)
def test_zero3_gathers_each_layer_once_and_frees_it_after_its_last_reader(model: str) -> None:
    """Offline: one group per layer (embed, two blocks, head), freed once, right after the last op in
    forward that reads any of its parameters (the second call of a reused module, the later block of a
    shared weight), and not before."""
    gm = compile_case(make_case(model), autoshard.Mesh(dp=2), plan={"zero": 3}).graph_modules[0]
    nodes = list(gm.graph.nodes)

    def marked(node):  # the op a mark follows (an op reading two groups gets one mark on another)
        while node.target is zero.mark:
            node = node.args[0]
        return node

    gathers = [n for n in nodes if n.target is zero.gather]
    assert [g.args[1] for g in gathers] == [0, 1, 2, 3]
    for gather in gathers:
        readers = {reader for view in gather.users for reader in view.users}
        last = max(readers, key=nodes.index)
        frees = [n for n in nodes if n.target is zero.mark and n.args[2] == gather.args[1] and n.args[3]]
        assert [marked(f.args[0]) for f in frees] == [last], gather.args[1]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("model", GAP_MODELS)
def test_every_strategy_on_models_that_reuse_weights(ranks, model: str, strategy: str) -> None:
    """A block that calls one module twice, and a weight shared by two blocks: ZeRO-3 must keep a
    group gathered until its last use by any op, not the last use of its last parameter."""
    mesh, plan = STRATEGIES[strategy]
    run(ranks, model, mesh, plan, steps=3)


GPT2_STRATEGIES = {
    **{k: STRATEGIES[k] for k in ("dp2", "zero1", "zero2", "zero3")},
    "tp2": ({"tp": 2}, {}),  # vocab-parallel embedding and cross-entropy
    "tp2-sp": ({"tp": 2}, {"sequence_parallel": True}),
    "pp2": ({"pp": 2}, {"microbatches": 4}),  # weights tied across the stages
    "dp2xpp2-zero1": ({"dp": 2, "pp": 2}, {"zero": 1, "microbatches": 2}),
}


@pytest.mark.parametrize("strategy", GPT2_STRATEGIES)
def test_first_update_is_the_single_device_gradient(ranks, strategy: str) -> None:
    """GPT-2, one step: the reduced gradient equals the single-device gradient of the global batch."""
    mesh, plan = GPT2_STRATEGIES[strategy]
    run(ranks, "gpt2", mesh, plan, steps=1)


CLIP_STRATEGIES = {k: STRATEGIES[k] for k in ("dp2", "zero2", "zero3-dp4", "tp2", "pp2")}


@pytest.mark.parametrize("limit", ["below", "above"])
@pytest.mark.parametrize("strategy", CLIP_STRATEGIES)
def test_clipping_limit_below_and_above_the_norm(ranks, strategy: str, limit: str) -> None:
    """Below every step's norm the gradients shrink to the limit; above it they stay as they are."""
    norms = reference("reuse", 3, max_grad_norm=float("inf"))["grad_norms"]
    max_grad_norm = 0.5 * min(norms) if limit == "below" else 2.0 * max(norms)
    mesh, plan = CLIP_STRATEGIES[strategy]
    results = run(ranks, "reuse", mesh, plan, steps=3, max_grad_norm=max_grad_norm)
    expected = reference("reuse", 3, max_grad_norm)["grad_norms"]
    for result in results:  # the norm before clipping, the same on every rank
        assert result["grad_norms"] == pytest.approx(expected, rel=1e-5)


@functools.cache
def bf16_reference(family: str, dp: int) -> tuple[list[float], dict]:
    return train_single_device_as_program(family, torch.bfloat16, dp)


def assert_bf16_tight(state: dict, ref_state: dict) -> None:
    """At least 99.9% of the elements identical, none more than one bf16 step (2**-7 relative) apart."""
    assert state.keys() == ref_state.keys()
    same = total = 0
    for key, expected in ref_state.items():
        actual = state[key]
        assert actual.dtype == expected.dtype == torch.bfloat16, key
        same += int((actual == expected).sum())
        total += expected.numel()
        torch.testing.assert_close(actual, expected, rtol=2**-7, atol=1e-8, msg=lambda m, k=key: f"{k}: {m}")
    assert same / total >= 0.999, f"{total - same} of {total} elements differ"


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_bf16_parameters_match_a_reference_that_computes_as_the_program(ranks, zero: int) -> None:
    """bf16 compute with fp32 masters copied from the fp32 originals, the gradient summed as two dp ranks
    sum it: equal to the last bit here, so masters started from bf16-rounded weights fail (a third of the
    elements differ after 3 steps, 5% by more than one bf16 step). GPT-2 only: its exported graph computes
    bf16 gradients bit for bit as eager does; Llama's differs in the last bit of some (tests/test_zero.py
    compares it more loosely)."""
    plan = {"zero": zero, "param_dtype": torch.bfloat16, "offload": zero == 2}
    result = ranks(2).run(train_zero, "gpt2", plan)[0]
    ref_losses, ref_state = bf16_reference("gpt2", 2)
    assert result["losses"] == pytest.approx(ref_losses, rel=1e-6)
    assert_bf16_tight(result["state"], ref_state)
