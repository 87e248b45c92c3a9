"""Every Hugging Face LM family that torch.export captures compiles offline at tp 2, pp 2 and dp2 x tp2
with ZeRO-3, or is refused by name; never an exception from inside a pass. Some train on real ranks
equal to one device.

The whole sweep (every causal-LM, masked-LM and seq2seq class of ``transformers``, about 280) takes
over an hour here and runs as ``python -m pytest -m slow tests/test_families.py``; the default run
compiles the families whose graphs once crashed a pass and trains a few not covered elsewhere. A second
sweep trains every family two steps on one rank under a recompute budget, equal to none bit for bit.
"""

from __future__ import annotations

from typing import Any

import hf_families
import pytest
import torch
from cases import train_plan, train_single_device
from test_dp_equivalence import assert_state_close

import autoshard
from autoshard.capture import capture
from autoshard.ir.placements import Shard

MESHES: tuple[tuple[dict[str, int], dict[str, Any]], ...] = (
    ({"tp": 2}, {}),
    ({"pp": 2}, {}),
    ({"dp": 2, "tp": 2}, {"zero": 3}),
)
# Families whose graphs crashed a pass before its fix: a legacy key/value cache concatenated to an
# empty 1-D tensor (XLM, Flaubert, GraniteMoE), and a no-grad region in every block (CPM-Ant).
REGRESSIONS = ("xlm:causal", "granitemoe:causal", "cpmant:causal")
# Trained on real ranks against one device: grouped-query attention with biases under FSDP in TP, and
# an encoder-decoder whose embedding is tied to the head across stages and whose decoder inputs are
# the labels shifted in place (recomputed on the decoder's stage, they once lost the in-place writes).
TRAINED = (
    ("qwen2:causal", {"dp": 2, "tp": 2}, {"zero": 3}),
    ("bart:seq2seq", {"tp": 2, "pp": 2}, {"sequence_parallel": True}),
)


def _eager_inputs(fam: dict[str, str]) -> tuple[Any, type, torch.Tensor, dict[str, Any]]:
    try:
        config, cls, model = hf_families.build(fam)
    except hf_families.Skip as why:
        pytest.skip(str(why))
    ids, kwargs = hf_families.make_inputs(model, config, fam)
    try:
        model(ids, **kwargs).loss.sum()
    except Exception as err:  # noqa: BLE001 - a family whose forward does not take text ids alone
        pytest.skip(f"eager forward fails on token ids and labels: {type(err).__name__}: {hf_families.oneline(err)}")
    try:
        capture(model, (ids,), dict(kwargs))
    except autoshard.CaptureError as why:
        pytest.skip(f"not captured: {hf_families.oneline(why)}")
    return config, cls, ids, kwargs


def _compiled(eager: tuple, mesh: dict[str, int], plan: dict[str, Any]) -> Any:
    """The family compiled offline on ``mesh`` with ``plan``, or compile's refusal (made before any work)."""
    config, cls, ids, kwargs = eager
    torch.manual_seed(0)
    try:
        return autoshard.compile(
            cls(config), autoshard.Mesh(**mesh), example_inputs=(ids,), example_kwargs=dict(kwargs), plan=plan
        )
    except autoshard.AutoshardError as refused:
        return refused


def check_family_compiles(family: str) -> None:
    eager = _eager_inputs(hf_families.by_name(family))
    for mesh, plan in MESHES:
        program = _compiled(eager, mesh, plan)
        if isinstance(program, autoshard.AutoshardError):  # refused, with its reason
            assert len(str(program)) > 40, f"{family} {mesh}: {program}"
            continue
        text = program.explain()
        report = program.tp_report
        if report is not None:  # compile refuses tp where nothing shards; so some weight is sharded here
            assert any(isinstance(p, Shard) for p in report.weights.values()), f"{family} {mesh}"
            if report.fallbacks:
                assert "no valid placement" in text
        for rank in (0, program.mesh.size - 1):
            assert program.for_rank(rank).graph_modules


@pytest.mark.parametrize("family", REGRESSIONS)
def test_family_that_crashed_a_pass_compiles(family: str) -> None:
    check_family_compiles(family)


@pytest.mark.slow
@pytest.mark.parametrize("family", [f["family"] for f in hf_families.families()])
def test_every_family_compiles(family: str) -> None:
    check_family_compiles(family)


@pytest.mark.parametrize(("family", "mesh", "plan"), TRAINED, ids=[t[0] for t in TRAINED])
def test_family_trains_like_one_device(ranks, family: str, mesh: dict[str, int], plan: dict[str, Any]) -> None:
    ref_losses, ref_state = train_single_device(f"hf:{family}")
    world = 1
    for degree in mesh.values():
        world *= degree
    results = ranks(world).run(train_plan, f"hf:{family}", mesh, plan)
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx(ref_losses, rel=1e-5), f"rank {rank}"
    assert_state_close(results[0]["state"], ref_state)


def check_experts_split(family: str) -> str:
    """A mixture-of-experts family compiles offline at dp2 with ep=2, or is refused with the reason; what happened."""
    fam = hf_families.by_name(family)
    try:
        _, _, model = hf_families.build(fam)
    except hf_families.Skip as why:
        pytest.skip(str(why))
    if not any("expert" in name for name, _ in model.named_parameters()):
        pytest.skip("no experts")
    program = _compiled(_eager_inputs(fam), {"dp": 2}, {"ep": 2})
    if isinstance(program, autoshard.AutoshardError):
        assert len(str(program)) > 40 and "ep" in str(program), f"{family}: {program}"
        return f"refused: {program}"
    split = [k for k, p in program.placements.items() if isinstance(p.ep, Shard)]
    assert split, family
    for rank in (0, 1):
        assert program.for_rank(rank).graph_modules
    return f"split {len(split)} expert weights"


@pytest.mark.parametrize("family", ["mixtral:causal", "qwen3_moe:causal", "granitemoe:causal"])
def test_mixtures_of_experts_split_or_refuse(family: str) -> None:
    check_experts_split(family)


@pytest.mark.slow
@pytest.mark.parametrize("family", [f["family"] for f in hf_families.families()])
def test_every_mixture_of_experts_splits_or_is_refused(family: str) -> None:
    check_experts_split(family)


def check_budget_trains_alike(family: str) -> int:
    """Two steps on one rank under a recompute budget of 0.5 lose exactly what they lose without one (the
    budget's regions and the matmuls that make their inputs again change what is kept, never a value); how
    many matmuls make their input again."""
    from autoshard.graph_ops import recompute

    config, cls, ids, kwargs = _eager_inputs(hf_families.by_name(family))
    losses, remade = {}, 0
    for choice in ("none", 0.5):
        torch.manual_seed(0)
        program = autoshard.compile(
            cls(config), 1, example_inputs=(ids,), example_kwargs=dict(kwargs), plan={"recompute": choice},
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        )  # fmt: skip
        graphs = program.for_rank(0).graph_modules
        remade = sum(n.target is recompute.input_recomputed for g in graphs for n in g.graph.nodes)
        losses[choice] = [program.step(ids, **kwargs) for _ in range(2)]
    assert losses[0.5] == losses["none"], family
    return remade


@pytest.mark.parametrize("family", ["bart:seq2seq", "gptj:causal"])  # an encoder-decoder; parallel blocks
def test_a_recompute_budget_trains_alike(family: str) -> None:
    assert check_budget_trains_alike(family) > 0


@pytest.mark.slow
@pytest.mark.parametrize("family", [f["family"] for f in hf_families.families()])
def test_every_family_trains_alike_under_a_recompute_budget(family: str) -> None:
    check_budget_trains_alike(family)
