"""Every strategy composes: any dp x tp x pp with ZeRO 0-3 and sequence parallelism equals single-device training.

The whole grid on 4 ranks (GPT-2 with its embedding and head tied across pipeline stages, Llama with
grouped-query attention) runs with ``-m slow``; every CI run takes a hypothesis-drawn sample of it
and the combinations that are new to the runtime (FSDP inside a TP mesh, ZeRO-3 across pipeline
stages, ZeRO with tied stages, all three at once on 8 ranks).
"""

from __future__ import annotations

import functools

import pytest
import torch
from cases import (
    eval_logits,
    grouped_adamw,
    sgd_momentum,
    train_plan,
    train_single_device,
    train_single_device_scheduled,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tp import assert_state_close

FAMILIES = ("gpt2", "llama")
LAYERS = 4  # pp = 4 needs a block per stage
MESHES_4 = ({"dp": 4}, {"dp": 2, "tp": 2}, {"dp": 2, "pp": 2}, {"tp": 4}, {"tp": 2, "pp": 2}, {"pp": 4})


def _grid() -> list[tuple[str, dict, int, bool]]:
    cases = []
    for family in FAMILIES:
        for mesh in MESHES_4:
            for zero in (0, 1, 2, 3):
                for sp in (False, True):
                    if (zero and mesh.get("dp", 1) == 1) or (sp and mesh.get("tp", 1) == 1):
                        continue
                    cases.append((family, mesh, zero, sp))
    return cases


GRID = _grid()


def _id(case: tuple[str, dict, int, bool]) -> str:
    family, mesh, zero, sp = case
    return f"{family}-{'x'.join(f'{d}{n}' for d, n in mesh.items())}-zero{zero}{'-sp' if sp else ''}"


@functools.cache
def reference(family: str, layers: int, max_grad_norm: float | None = None) -> tuple[list[float], dict]:
    return train_single_device(family, layers=layers, max_grad_norm=max_grad_norm)


def run_case(ranks, family: str, mesh: dict, plan: dict, layers: int = LAYERS, **kw) -> list[dict]:
    world = mesh.get("dp", 1) * mesh.get("tp", 1) * mesh.get("pp", 1)
    if mesh.get("pp", 1) > 1:
        plan = {"microbatches": 2, **plan}
    results = ranks(world).run(train_plan, family, mesh, plan, layers=layers, **kw)
    if "optimizer" not in kw:
        ref_losses, ref_state = reference(family, layers, plan.get("max_grad_norm"))
        for rank, result in enumerate(results):  # every rank returns the global loss
            assert result["losses"] == pytest.approx(ref_losses, rel=1e-5), rank
        assert_state_close(results[0]["state"], ref_state)
    return results


def test_grid_has_every_factorization_and_stage() -> None:
    assert len(GRID) == 42
    assert {(tuple(m.items()), z) for _, m, z, _ in GRID} >= {((("tp", 2), ("pp", 2)), 0), ((("dp", 2), ("pp", 2)), 3)}


@settings(max_examples=2)
@given(case=st.sampled_from(GRID))
def test_grid_sample(ranks, case) -> None:
    family, mesh, zero, sp = case
    run_case(ranks, family, mesh, {"zero": zero, "sequence_parallel": sp})


@pytest.mark.slow
@pytest.mark.parametrize("case", GRID, ids=[_id(c) for c in GRID])
def test_grid(ranks, case) -> None:
    family, mesh, zero, sp = case
    run_case(ranks, family, mesh, {"zero": zero, "sequence_parallel": sp})


@pytest.mark.parametrize(
    "family, sequence_parallel",
    [
        ("gpt2", False),
        pytest.param("gpt2", True, marks=pytest.mark.slow),
        pytest.param("llama", False, marks=pytest.mark.slow),
        pytest.param("llama", True, marks=pytest.mark.slow),
    ],
    ids=["gpt2-", "gpt2-sp", "llama-", "llama-sp"],
)
def test_zero3_inside_a_tensor_parallel_mesh(ranks, family: str, sequence_parallel: bool) -> None:
    """torchtitan's FSDP + TP: each tp shard of a weight further sharded over dp, gathered per layer."""
    run_case(ranks, family, {"dp": 2, "tp": 2}, {"zero": 3, "sequence_parallel": sequence_parallel})


@pytest.mark.parametrize("zero", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3])
def test_zero_with_weights_tied_across_stages(ranks, zero: int) -> None:
    """GPT-2's embedding and head on the first and last stage: tied gradients summed, then sharded."""
    run_case(ranks, "gpt2", {"dp": 2, "pp": 2}, {"zero": zero})


def test_zero3_interleaved_pipeline_with_tied_weights_and_clipping(ranks) -> None:
    plan = {"zero": 3, "schedule": "interleaved_1f1b", "virtual_stages": 2, "max_grad_norm": 0.05}
    run_case(ranks, "gpt2", {"dp": 2, "pp": 2}, plan)


def test_clipping_norm_on_a_3d_mesh_is_the_single_device_norm(ranks) -> None:
    """SGD shows a wrong clipping scale that Adam would hide; the norm itself is compared too."""
    norms: list[float] = []
    ref_losses, ref_state = train_single_device(
        "gpt2", layers=LAYERS, max_grad_norm=0.05, optimizer=sgd_momentum, norms=norms
    )
    plan = {"zero": 3, "max_grad_norm": 0.05, "sequence_parallel": True}
    results = run_case(ranks, "gpt2", {"dp": 2, "tp": 2}, plan, optimizer=sgd_momentum)
    assert results[0]["grad_norms"] == pytest.approx(norms, rel=1e-5)
    assert results[0]["losses"] == pytest.approx(ref_losses, rel=1e-5)
    assert_state_close(results[0]["state"], ref_state)


@pytest.mark.parametrize(
    "family, plan",
    [
        pytest.param("llama", {"zero": 3, "sequence_parallel": True}, marks=pytest.mark.slow),  # 45 s here
        pytest.param("gpt2", {"zero": 1}, marks=pytest.mark.slow),  # 8 ranks start in 30 s here
    ],
    ids=["llama-zero3-sp", "gpt2-zero1"],
)
def test_dp_tp_pp_on_eight_ranks(ranks, family: str, plan: dict) -> None:
    run_case(ranks, family, {"dp": 2, "tp": 2, "pp": 2}, plan, layers=2)


@pytest.mark.parametrize("mesh, plan", [({"dp": 2, "tp": 2}, {"zero": 3}), ({"dp": 2, "pp": 2}, {"zero": 1})])
def test_parameter_groups_and_lr_schedule(ranks, mesh: dict, plan: dict) -> None:
    """No weight decay on norms and biases, and a LambdaLR on program.optimizer, as on one device."""
    ref_losses, ref_state, ref_lrs = train_single_device_scheduled("gpt2", layers=LAYERS)
    results = run_case(ranks, "gpt2", mesh, plan, optimizer=grouped_adamw, lr_schedule=True)
    for result in results:
        assert result["losses"] == pytest.approx(ref_losses, rel=1e-5)
        assert [g["weight_decay"] for g in result["param_groups"]] == [0.1, 0.0]
        assert [g["lr"] for g in result["param_groups"]] == pytest.approx(ref_lrs)
    assert_state_close(results[0]["state"], ref_state)


@pytest.mark.parametrize(
    "mesh, plan",
    [
        ({"dp": 2, "tp": 2}, {"zero": 3}),
        ({"pp": 2}, {"microbatches": 2}),
        pytest.param({"tp": 2, "pp": 2}, {"microbatches": 2}, marks=pytest.mark.slow),
    ],
    ids=["dp2xtp2-zero3", "pp2", "tp2xpp2"],
)
def test_eval_mode_matches_the_model_in_eval_mode(ranks, mesh: dict, plan: dict) -> None:
    world = mesh.get("dp", 1) * mesh.get("tp", 1) * mesh.get("pp", 1)
    for result in ranks(world).run(eval_logits, "gpt2", mesh, plan, dropout=0.1):
        assert result["eval_error"] < 1e-5  # dropout off, on every rank (pipeline outputs broadcast)
        assert result["train_differs"]  # in training mode dropout is on


def test_eval_mode_uses_batch_norm_running_statistics_without_updating_them(ranks) -> None:
    result = ranks(2).run(eval_logits, "mlp", {"dp": 2}, {}, batchnorm=True)[0]
    assert result["eval_error"] < 1e-6 and result["state_unchanged"]


def test_bf16_parameters_with_offload_across_pipeline_stages(ranks) -> None:
    from cases import train_single_device_mixed
    from test_zero import assert_bf16_close

    plan = {"zero": 3, "offload": True, "param_dtype": torch.bfloat16, "microbatches": 2}
    results = ranks(4).run(train_plan, "llama", {"dp": 2, "pp": 2}, plan, layers=2)
    ref_losses, ref_state = train_single_device_mixed("llama", torch.bfloat16, layers=2)
    assert results[0]["losses"] == pytest.approx(ref_losses, rel=1e-2)
    assert_bf16_close(results[0]["state"], ref_state)
