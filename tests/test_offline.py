"""Offline compile for virtual meshes of many ranks: plans and per-rank graphs, no process group (tier 2)."""

from __future__ import annotations

import re

import pytest
import torch
from cases import build_case

import autoshard
from autoshard import Mesh, Replicate


@pytest.fixture(scope="module")
def gpt2_case():
    return build_case("gpt2", batch=256)


def compile_gpt2(case, mesh, **kw):
    batch = case.batches[0]
    return autoshard.compile(case.model, mesh, batch.inputs, batch.kwargs, **kw)


def test_256_rank_data_parallel_program_offline(gpt2_case) -> None:
    program = compile_gpt2(gpt2_case, Mesh(dp=256))
    assert program.plan == autoshard.Plan(dp=256)
    view = program.for_rank(255)
    assert view.coords == {"pp": 0, "dp": 255, "cp": 0, "tp": 0}
    assert view.placements["lm_head.weight"] == {
        "pp": Replicate(),
        "dp": Replicate(),
        "cp": Replicate(),
        "tp": Replicate(),
        "ep": Replicate(),
    }
    assert "aten.scaled_dot_product_attention" in view.graph_code()
    assert str(view).startswith("rank 255 (pp=0, dp=255, cp=0, tp=0): 1 graph(s)")
    # Compile is deterministic: every rank's graph is the same code.
    assert program.for_rank(0).graph_code() == view.graph_code()


def test_offline_program_cannot_step(gpt2_case) -> None:
    program = compile_gpt2(gpt2_case, Mesh(dp=4), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    ids = gpt2_case.batches[0].inputs[0]
    msg = (
        "step() needs a process group of 4 ranks, but none is initialized: this program was compiled offline "
        "for inspection; call torch.distributed.init_process_group() before autoshard.compile "
        "(e.g. under torchrun --nproc-per-node 4)"
    )
    with pytest.raises(autoshard.DistributedError, match=re.escape(msg)):
        program.step(program.local_batch(ids), labels=program.local_batch(ids))


def test_int_mesh_lets_the_planner_choose(gpt2_case) -> None:
    program = compile_gpt2(gpt2_case, 16)
    report = program.plan_report
    assert program.mesh == Mesh(dp=report.winner.dp, tp=report.winner.tp, pp=report.winner.pp)
    assert program.mesh.size == 16 and report.chosen.fits
    shapes = {(c.plan.dp, c.plan.tp, c.plan.pp) for c in report.candidates}
    # every factorization within the constraints: pp at most the 2 blocks, tp dividing the 4 heads
    assert {(16, 1, 1), (8, 2, 1), (4, 4, 1), (8, 1, 2), (4, 2, 2), (2, 4, 2)} == shapes


def test_every_strategy_composes_offline(gpt2_case) -> None:
    """FSDP inside a TP mesh with a pipeline: each parameter's placement is one record per mesh dimension."""
    program = compile_gpt2(gpt2_case, Mesh(dp=2, tp=2, pp=2), plan={"zero": 3, "microbatches": 2})
    first, last = program.for_rank(0), program.for_rank(7)
    qkv = first.placements["transformer.h.0.attn.c_attn.weight"]
    assert (str(qkv["pp"]), str(qkv["dp"]), str(qkv["tp"])) == ("@0", "S(0)", "S(1)x3")
    assert "transformer.h.1.attn.c_attn.weight" in last.placements
    assert "transformer.h.0.attn.c_attn.weight" not in last.placements
    # GPT-2's tied embedding and head: held by the first and the last pipeline rank, sharded over dp and tp.
    tied = last.placements["lm_head.weight"]
    assert (str(tied["pp"]), str(tied["dp"]), str(tied["tp"])) == ("@0,1", "S(0)", "S(0)")
    assert str(program.placements["lm_head.weight"]) == "lm_head.weight (64, 32): pp @0,1, dp S(0), tp S(0)"
    assert "autoshard_graph_ops_zero_gather" in last.graph_code() and "pipeline_recv" in last.graph_code()
    assert "tied across pipeline ranks [0, 1]" in program.explain()


def test_three_dimensional_program_offline(gpt2_case) -> None:
    program = compile_gpt2(gpt2_case, Mesh(dp=2, tp=2, pp=2), plan={"microbatches": 2})
    view = program.for_rank(7)
    assert view.coords == {"pp": 1, "dp": 1, "cp": 0, "tp": 1}
    assert str(view.placements["transformer.h.1.attn.c_attn.weight"]["tp"]) == "S(1)x3"
    assert "transformer.h.0.attn.c_attn.weight" not in view.placements  # the other stage's
    assert "autoshard_graph_ops_tp_all_reduce" in view.graph_code()
    assert "autoshard_graph_ops_pipeline_recv" in view.graph_code()


def test_plan_that_contradicts_the_mesh(gpt2_case) -> None:
    msg = "plan asks for dp=2 but the mesh has dp=4; drop dp from the plan or change the mesh"
    with pytest.raises(autoshard.PlanError, match=re.escape(msg)):
        compile_gpt2(gpt2_case, Mesh(dp=4), plan={"dp": 2})


def test_local_batch_slices_in_dp_rank_order(gpt2_case) -> None:
    program = compile_gpt2(gpt2_case, Mesh(dp=4))
    x = torch.arange(8)
    assert program.local_batch(x).tolist() == [0, 1]  # offline: rank 0
    msg = "a batch of 6 rows is not divisible by dp=4; use a global batch that is a multiple of 4"
    with pytest.raises(autoshard.InputError, match=re.escape(msg)):
        program.local_batch(torch.arange(6))
