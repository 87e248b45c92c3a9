"""autoshard.verify: one step of the compiled program against the unrewritten graph, node by node, on gloo
ranks. Three rewrites broken on purpose are each named by their node; real plans match everywhere."""

from __future__ import annotations

import copy

import pytest
import torch
from cases import build_case
from hypothesis import given, settings
from hypothesis import strategies as st

import autoshard
from autoshard.demo import TinyGPT, next_token_loss, successor_batch
from autoshard.graph_ops import tp as tp_ops
from autoshard.inspection.verify import Reference, check
from autoshard.ir.meta import PIPE, TP_COMM


def _skip_all_reduce(tp, x):  # a dropped all-reduce: each rank keeps its partial sum
    return x


def _faulty_rank(rank: int, world: int, fault: str) -> tuple[autoshard.inspection.verify.VerifyReport, str]:
    torch.manual_seed(0)
    model = TinyGPT(layers=2)
    ids, target = successor_batch(0, 8, 16)
    reference = Reference.capture(model, (ids,), None, next_token_loss, target)
    full = {k: v.detach().clone() for k, v in reference.model.state_dict().items()}
    program = autoshard.compile(model, autoshard.Mesh(tp=2, pp=2), (ids,), loss_fn=next_token_loss,
                                example_target=target, optimizer=reference.optimizer, timeout=60)  # fmt: skip
    stage0 = program.compiled.stages[0].gm
    if fault == "dropped all-reduce":
        node = next(n for n in stage0.graph.nodes if TP_COMM in n.meta and n.target is tp_ops.all_reduce)
        node.target = _skip_all_reduce
        stage0.recompile()
        expected = node.name
    elif fault == "wrong shard offset":  # tp rank 1 holds the rows of tp rank 0
        weight = stage0.get_parameter("model.blocks.0.fc.weight")
        if program.mesh.coords(rank)["tp"] == 1 and weight.numel():  # pp rank 1 released it
            weight.data.copy_(full["blocks.0.fc.weight"].chunk(2)[0])
        expected = "model_blocks_0_fc_weight"
    elif fault == "one tp rank's replicated weight":  # the norm every tp rank holds whole, off on one of them
        weight = stage0.get_parameter("model.blocks.0.ln_1.weight")
        if program.mesh.coords(rank)["tp"] == 1 and weight.numel():
            weight.data.mul_(1.5)
        expected = "model_blocks_0_ln_1_weight"
    else:  # a missing send: stage 1 would wait forever for the hidden state
        send = next(n for n in stage0.graph.nodes if PIPE in n.meta and n.meta[PIPE].direction == "send")
        stage0.graph.erase_node(send)
        stage0.recompile()
        stage1 = program.compiled.stages[1].gm
        expected = next(n.name for n in stage1.graph.nodes if PIPE in n.meta)
    return check(program, reference, (ids,), {}, target), expected


@pytest.mark.parametrize(
    "fault", ["dropped all-reduce", "wrong shard offset", "one tp rank's replicated weight", "missing send"]
)
def test_verify_names_the_node_of_a_broken_rewrite(ranks, fault: str) -> None:
    (report, expected), *_ = ranks(4).run(_faulty_rank, fault)
    assert not report.ok
    first = report.first
    assert first.node == expected, str(report)
    kind = {"dropped all-reduce": "collective", "wrong shard offset": "activation", "missing send": "structure",
            "one tp rank's replicated weight": "activation"}  # fmt: skip
    assert first.kind == kind[fault]
    if fault == "one tp rank's replicated weight":  # each tp rank's copy of a replicated value is checked
        assert first.placement == "R" and first.max_error > 0.1
    if fault != "missing send":
        assert first.stage == 0 and first.max_error > 1e-3
        before = report.checks[: report.checks.index(first)]
        assert len(before) > 5 and all(c.ok for c in before)  # everything upstream matched
    assert expected in str(report)


def _verify_family(pool, family: str, mesh: autoshard.Mesh, plan: dict) -> autoshard.inspection.verify.VerifyReport:
    case = build_case(family, steps=1, layers=2)
    batch = case.batches[0]
    return autoshard.verify(copy.deepcopy(case.model), mesh, batch.inputs, batch.kwargs, loss_fn=case.loss_fn,
                            example_target=batch.target, plan=plan, ranks=pool)  # fmt: skip


def _assert_all_match(report: autoshard.inspection.verify.VerifyReport) -> None:
    assert report.ok, str(report)
    kinds = {c.kind for c in report.checks}
    assert {"activation", "collective", "boundary", "loss", "parameter"} <= kinds
    assert abs(report.loss - report.reference_loss) < 1e-5


@settings(max_examples=1)  # one family in the default run; all three in 3D with -m slow
@given(family=st.sampled_from(["gpt2", "llama", "bert"]))
def test_verify_finds_no_divergence_under_tp_and_pp(ranks, family: str) -> None:
    _assert_all_match(_verify_family(ranks(4), family, autoshard.Mesh(tp=2, pp=2), {"microbatches": 2}))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_verify_finds_no_divergence_in_3d(ranks, family: str) -> None:
    report = _verify_family(ranks(8), family, autoshard.Mesh(dp=2, tp=2, pp=2), {"zero": 1})
    _assert_all_match(report)
    assert {c.ranks for c in report.checks if c.kind == "collective"} >= {(0, 1), (2, 3)}  # both dp replicas


def test_verify_reports_first_divergence_as_json_ready_dict() -> None:
    from autoshard.inspection.verify import NodeCheck, VerifyReport

    bad = NodeCheck("add_1", "blocks.0", "aten.add.Tensor", "activation", 0, 0.5, 1e-5, (0, 1))
    report = VerifyReport((NodeCheck("x", "", "op", "activation", 0, 0.0, 1e-5), bad), 1.0, 1.0)
    assert report.first is bad and not report.ok
    assert report.to_dict()["first_divergence"]["node"] == "add_1"
    assert "add_1" in str(report) and "max error 0.5" in str(report)


@pytest.mark.parametrize("family", ["hf:mixtral:causal", "moe_loop"])
def test_verify_compares_a_mixture_of_experts_split_over_ranks(ranks, family) -> None:
    """Inside an expert region a rank holds other ranks' rows (and its own experts): those values are not the
    device's; everything before dispatch, after combine, the loss and every parameter after the step are."""
    report = _verify_family(ranks(4), family, autoshard.Mesh(dp=4), {"ep": 2})
    assert report.ok, str(report)
    assert abs(report.loss - report.reference_loss) < 1e-5
