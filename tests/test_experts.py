"""Expert parallelism: mixture-of-experts layers split over ep ranks carved out of dp equal single-device training."""

from __future__ import annotations

import functools

import pytest
import torch
from cases import (
    build_case,
    compile_case,
    sgd_momentum,
    train_plan,
    train_single_device,
    train_single_device_mixed,
)
from checkpoint_cases import load_and_train, train_and_save
from compiled_cases import train_compiled
from expert_cases import EP_OPS, exchanges_per_step, explained_load
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tp import assert_state_close

import autoshard
from autoshard.errors import PlanError

MOE = ("hf:mixtral:causal", "hf:qwen2_moe:causal", "hf:olmoe:causal")


def assert_moe_state_close(actual: dict, expected: dict, tp: bool = False) -> None:
    """test_tp's tolerance; under tp with the floor at 1% of one AdamW step (lr 1e-3): a Mixtral's embedding
    gradient sums the router's and the experts' split-K partial products in another order, and Adam
    normalizes an element whose gradient is near zero (one element in 16384 measured 4.2e-6 away)."""
    if not tp:
        return assert_state_close(actual, expected)
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


@functools.cache
def reference(family: str, max_grad_norm: float | None = None) -> tuple[list[float], dict]:
    return train_single_device(family, max_grad_norm=max_grad_norm)


def run_ep(ranks, family: str, mesh: dict, plan: dict) -> list[dict]:
    world = mesh.get("dp", 1) * mesh.get("tp", 1) * mesh.get("pp", 1)
    results = ranks(world).run(train_plan, family, mesh, plan)
    ref_losses, ref_state = reference(family, plan.get("max_grad_norm"))
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx(ref_losses, rel=1e-5), rank
    assert_moe_state_close(results[0]["state"], ref_state, tp=mesh.get("tp", 1) > 1)
    return results


# Every family at ep 2 and the plans that compose with ep on Mixtral: the whole grid with -m slow, a
# hypothesis-drawn sample of it in every run (ZeRO-3 and gradient accumulation run in every one too).
GRID = [(family, {"ep": 2}) for family in MOE] + [
    ("hf:mixtral:causal", plan)
    for plan in (
        {"ep": 4},
        {"ep": 2, "zero": 1},
        {"ep": 2, "zero": 2},
        {"ep": 2, "zero": 3},
        {"ep": 2, "microbatches": 2},
        {"ep": 2, "recompute": "full"},
        {"ep": 4, "max_grad_norm": 0.05},
    )
]


def _id(case: tuple[str, dict]) -> str:
    return case[0].removeprefix("hf:").removesuffix(":causal") + "-" + "-".join(f"{k}{v}" for k, v in case[1].items())


@pytest.mark.slow
@pytest.mark.parametrize("case", GRID, ids=_id)
def test_ep_grid(ranks, case) -> None:
    run_ep(ranks, case[0], {"dp": 4}, case[1])


@settings(max_examples=2)
@given(case=st.sampled_from(GRID))
def test_ep_grid_sample(ranks, case) -> None:
    run_ep(ranks, case[0], {"dp": 4}, case[1])


def test_ep4_with_zero3_and_accumulation(ranks) -> None:
    run_ep(ranks, "hf:mixtral:causal", {"dp": 4}, {"ep": 4, "zero": 3, "microbatches": 2})


def test_ep_with_pipeline(ranks) -> None:
    run_ep(ranks, "hf:mixtral:causal", {"dp": 2, "pp": 2}, {"ep": 2, "microbatches": 2})


def test_all_to_alls_per_layer(ranks) -> None:
    """Per MoE layer and step: forward gathers the row counts, dispatches and combines (an all-gather of E
    integers a rank, 2 all-to-alls); backward returns the combine's and the dispatch's gradients (2
    all-to-alls). Each rank holds E / ep experts."""
    results = ranks(4).run(exchanges_per_step, "hf:mixtral:causal", {"dp": 4}, {"ep": 2})
    layers = 2
    for result in results:
        assert result["calls"] == {op: layers for op in EP_OPS}
        assert result["experts"] and all(shape[0] == 4 // 2 for shape in result["experts"].values())


def test_checkpoint_reshards_experts(ranks, tmp_path) -> None:
    """Saved at ep=2 under ZeRO-1, loaded at ep=4, at ep=1, and at ep=2 with each expert split over tp=2:
    training goes on as on one device."""
    family, path = "hf:mixtral:causal", str(tmp_path / "ck")
    ranks(4).run(train_and_save, family, {"dp": 4}, {"ep": 2, "zero": 1}, 3, 1, path)
    ref_losses, ref_state = reference(family)
    for mesh, plan in (({"dp": 4}, {"ep": 4}), ({"dp": 4}, {"ep": 1, "zero": 2}), ({"dp": 2, "tp": 2}, {"ep": 2})):
        resumed = ranks(4).run(load_and_train, family, mesh, plan, 3, path)
        assert resumed[0]["losses"] == pytest.approx(ref_losses[1:], rel=1e-5), plan
        assert_moe_state_close(resumed[0]["state"], ref_state, tp=mesh.get("tp", 1) > 1)


def test_hand_written_grouped_mm_moe(ranks) -> None:
    """A model's own torch._grouped_mm experts (bf16: the op's only dtype on the CPU), fp32 masters: the losses
    those of one device to bf16's precision, and the state that of plain data parallelism (the same bf16
    rounding of gradients per rank) to one bf16 unit."""
    plan = {"zero": 1, "param_dtype": torch.bfloat16}
    split = ranks(4).run(train_plan, "moe", {"dp": 4}, {**plan, "ep": 2})
    replicated = ranks(4).run(train_plan, "moe", {"dp": 4}, plan)
    ref_losses, _ = train_single_device_mixed("moe", torch.bfloat16)
    assert split[0]["losses"] == pytest.approx(ref_losses, rel=1e-2)
    assert split[0]["losses"] == pytest.approx(replicated[0]["losses"], rel=1e-3)
    for key, expected in replicated[0]["state"].items():
        torch.testing.assert_close(split[0]["state"][key], expected, rtol=1.6e-2, atol=1e-3, msg=key)


@pytest.mark.parametrize(
    ("family", "mesh", "plan", "words"),
    [
        ("gpt2", {"dp": 4}, {"ep": 2}, "has none that autoshard recognises"),
        ("hf:mixtral:causal", {"dp": 8}, {"ep": 8}, "does not divide the 4 experts"),
        ("hf:mixtral:causal", {"dp": 6}, {"ep": 4}, "must divide dp=6"),
        ("moe_mixing_rows", {"dp": 4}, {"ep": 2, "zero": 1, "param_dtype": torch.bfloat16}, "not computed row by row"),
        ("moe_loop_mixed", {"dp": 4}, {"ep": 2}, "runs expert 1 differently from expert 0"),
    ],
    ids=["dense", "experts", "dp", "mixing", "loop-mixed"],
)
def test_ep_refusals(family, mesh, plan, words) -> None:
    """What ep cannot split is refused at compile, before any rank works, with the reason."""
    case = build_case(family, batch=mesh.get("dp", 1) * 2)
    with pytest.raises(PlanError) as error:
        compile_case(case, autoshard.Mesh(**mesh), plan=plan)
    assert words in str(error.value)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_ep_under_torch_compile(ranks, backend) -> None:
    """The dispatch and combine stay eager (their split sizes change every step); the rest is compiled."""
    family = "hf:mixtral:causal"
    results = ranks(4).run(train_compiled, family, {"dp": 4}, {"ep": 2}, backend)
    ref_losses, ref_state = reference(family)
    assert results[0]["losses"] == pytest.approx(ref_losses, rel=1e-4)
    assert_state_close(results[0]["state"], ref_state)
    assert results[0]["calls"][0]["ep_dispatch"] == 2  # the last step: one a layer


def test_explain_and_metrics_show_the_experts(ranks) -> None:
    results = ranks(4).run(explained_load, "hf:mixtral:causal", {"dp": 4}, {"ep": 2})
    for result in results:
        assert len(result["load"]) == 2 and all(1.0 <= v <= 4 / 2 for v in result["load"].values())
        assert "expert load max/mean" in result["line"]
    text = results[0]["explain"]
    assert "expert parallel (ep=2 out of dp=4)" in text and text.count("4 experts, 2 a rank") == 2
    # The two ranks of one ep group route the same rows, so they measure the same load.
    assert results[0]["load"] == results[1]["load"]


@pytest.mark.parametrize(
    ("mesh", "plan"),
    [
        ({"dp": 2, "tp": 2}, {}),
        ({"dp": 2, "tp": 2}, {"ep": 2, "zero": 1}),
        ({"dp": 2, "tp": 2}, {"ep": 2, "sequence_parallel": True}),
        ({"tp": 2, "pp": 2}, {"microbatches": 2}),
    ],
    ids=["dp2-tp2", "dp2-ep2-tp2-zero1", "dp2-ep2-tp2-sp", "tp2-pp2"],
)
def test_experts_under_tensor_parallelism(ranks, mesh, plan) -> None:
    """Each expert's gate/up projection column-sharded (strided: each rank its gate and up halves) and its down
    projection row-sharded, as Megatron shards an MLP; with ep, each rank's own experts so."""
    results = run_ep(ranks, "hf:mixtral:causal", mesh, plan)
    assert results[0]["state"]  # consolidated from tp and ep shards alike


@pytest.mark.parametrize(("family", "ep"), [("hf:mixtral:causal", 4), ("moe_loop", 2)])
def test_clipping_counts_each_expert_once(ranks, family, ep) -> None:
    """The global norm sums each expert's gradient once: on the first dp / ep replica of every ep rank (at
    ep = dp, each expert's only rank, whose gradients are divided by dp with no exchange). (SGD with momentum:
    AdamW would hide a wrong clipping factor or a wrong mean, being scale-free.)"""
    plan = {"ep": ep, "max_grad_norm": 0.05}
    results = ranks(4).run(train_plan, family, {"dp": 4}, plan, optimizer=sgd_momentum)
    norms: list[float] = []
    ref_losses, ref_state = train_single_device(family, max_grad_norm=0.05, optimizer=sgd_momentum, norms=norms)
    assert results[0]["grad_norms"] == pytest.approx(norms, rel=1e-5)
    assert results[0]["losses"] == pytest.approx(ref_losses, rel=1e-5)
    assert_state_close(results[0]["state"], ref_state)


@pytest.mark.parametrize(
    ("mesh", "plan"),
    [
        ({"dp": 4}, {}),
        ({"dp": 2, "pp": 2}, {"zero": 3, "microbatches": 2}),
        ({"dp": 4}, {"ep": 2}),
        ({"dp": 4}, {"ep": 4, "zero": 1}),
        ({"dp": 4}, {"ep": 2, "zero": 3, "recompute": "full"}),
        ({"dp": 2, "tp": 2}, {"ep": 2, "microbatches": 2}),
        ({"dp": 2, "pp": 2}, {"ep": 2, "zero": 2, "microbatches": 2}),
        ({"dp": 2, "pp": 2}, {"ep": 2, "zero": 3, "recompute": "full", "microbatches": 2}),
    ],
    ids=[
        "dp4",
        "dp2-pp2-zero3",
        "ep2",
        "ep4-zero1",
        "ep2-zero3-recompute",
        "ep2-tp2-accumulate",
        "ep2-pp2-zero2",
        "ep2-pp2-zero3-recompute",
    ],
)
def test_a_loop_over_experts(ranks, mesh, plan) -> None:
    """Experts in a Python loop (rows read from the data, each expert its own weights): planned at balanced
    routing, trained as one device trains them; under ep each rank runs its own experts in the loop's first
    places (and holds only their weights)."""
    results = run_ep(ranks, "moe_loop", mesh, plan)
    ep, tp = plan.get("ep", 1), mesh.get("tp", 1)
    for rank, result in enumerate(results):
        if plan.get("zero") != 3:  # (ZeRO-3's parameters are empty at rest)
            experts = {int(k.split(".")[3]) for k in result["held"] if ".experts." in k}
            ep_rank = rank // tp % mesh["dp"] % ep
            assert experts == set(range(ep_rank * 4 // ep, (ep_rank + 1) * 4 // ep)), rank


def test_a_loop_over_experts_checkpoint(ranks, tmp_path) -> None:
    """Each loop expert's weights are stored whole by the rank that runs it: saved at ep=2, loaded at ep=4 and at
    ep=1, training goes on as on one device."""
    family, path = "moe_loop", str(tmp_path / "ck")
    ranks(4).run(train_and_save, family, {"dp": 4}, {"ep": 2, "zero": 1}, 3, 1, path)
    ref_losses, ref_state = reference(family)
    for plan in ({"ep": 4}, {"ep": 1, "zero": 3}):
        resumed = ranks(4).run(load_and_train, family, {"dp": 4}, plan, 3, path)
        assert resumed[0]["losses"] == pytest.approx(ref_losses[1:], rel=1e-5), plan
        assert_state_close(resumed[0]["state"], ref_state)


@pytest.mark.slow
def test_a_loop_over_experts_under_torch_compile(ranks) -> None:
    """torch_compile=True (aot_eager) with ep=2 on a loop over experts: the dispatch and combine stay eager."""
    family = "moe_loop"
    ref_losses, ref_state = reference(family)
    compiled = ranks(4).run(train_compiled, family, {"dp": 4}, {"ep": 2}, "aot_eager")
    assert compiled[0]["losses"] == pytest.approx(ref_losses, rel=1e-4)
    assert_state_close(compiled[0]["state"], ref_state)


@pytest.mark.parametrize("plan", [{}, {"ep": 2}], ids=["dp4", "dp4-ep2"])
def test_the_router_balancing_loss_is_the_global_batchs(ranks, plan) -> None:
    """Mixtral's load-balancing loss multiplies each expert's share of tokens by its mean router probability,
    over the batch: each rank's sums are summed over dp (and the count of rows with them), so the loss and
    its gradient are those of the global batch, as one device computes them."""
    run_ep(ranks, "mixtral_aux", {"dp": 4}, plan)
