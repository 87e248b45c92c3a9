"""Tensor parallelism on real gloo ranks equals single-device training, with Megatron's collectives."""

from __future__ import annotations

import re

import pytest
import torch
from cases import (
    SEQ,
    VOCAB,
    build_case,
    compile_case,
    sgd_momentum,
    tp_dropout_probe,
    tp_state_and_forward,
    train_pipeline,
    train_single_device,
    train_tp,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_dp_equivalence import RTOL

import autoshard

MESHES = {"tp2": {"tp": 2}, "tp4": {"tp": 4}, "dp2xtp2": {"dp": 2, "tp": 2}}
HIDDEN = 32


# A row-parallel linear sums each output over tp partial products (split-K), so sums run in another
# order than on one device; after 3 AdamW steps one GPT-2 element in 4096 lands 1.2e-6 away, and one
# Llama element in 1024 (GQA at tp=4, a gradient near zero that Adam normalizes) 2.34e-6. The floor is
# 0.3% of one step at lr=1e-3; the relative tolerance stays 1e-5.
TP_ATOL = 3e-6


def assert_state_close(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(
            actual[key], expected[key], rtol=RTOL, atol=TP_ATOL, msg=lambda m, k=key: f"{k}: {m}"
        )


def _blocks(collectives: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {layer: counts for layer, counts in collectives.items() if layer.rsplit(".", 1)[-1].isdigit()}


MEGATRON = {"all_reduce fwd": 2, "all_reduce bwd": 2}
# Sequence parallel: all-gather into each sharded region, reduce-scatter out of it (and the converse backward).
MEGATRON_SP = {"all_gather fwd": 2, "reduce_scatter fwd": 2, "all_gather bwd": 2, "reduce_scatter bwd": 2}


TP_FAMILIES = ["gpt2", "llama", "bert"]


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["", "sp"])
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("family", TP_FAMILIES)
def test_tp_matches_single_device(ranks, family: str, mesh: str, sequence_parallel: bool) -> None:
    check_tp(ranks, family, mesh, sequence_parallel)


# The grid above (18 runs, about 3 minutes here) runs with -m slow; every run draws three of its points.
@settings(max_examples=3)
@given(family=st.sampled_from(TP_FAMILIES), mesh=st.sampled_from(list(MESHES)), sequence_parallel=st.booleans())
def test_tp_matches_single_device_sample(ranks, family: str, mesh: str, sequence_parallel: bool) -> None:
    check_tp(ranks, family, mesh, sequence_parallel)


def check_tp(ranks, family: str, mesh: str, sequence_parallel: bool) -> None:
    """Equal to one device, with Megatron's collective count per block and 1/tp of each sharded weight held."""
    ref_losses, ref_state = train_single_device(family)
    layout = MESHES[mesh]
    world = layout.get("dp", 1) * layout["tp"]
    plan = {"sequence_parallel": True} if sequence_parallel else None
    results = ranks(world).run(train_tp, family, layout, plan)
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx(ref_losses, rel=RTOL), f"rank {rank}"
    assert_state_close(results[0]["state"], ref_state)
    # Megatron's optimum, counted in the rewritten graph: per block 2 all-reduces forward, 2 backward.
    blocks = _blocks(results[0]["collectives"])
    assert len(blocks) == 2
    for layer, counts in blocks.items():
        assert counts == (MEGATRON_SP if sequence_parallel else MEGATRON), layer
    # No collective moves the logits: none is larger than one hidden state (at the example batch of 8).
    assert results[0]["largest_collective"] <= 8 * SEQ * HIDDEN
    # Each rank holds 1/tp of every sharded weight, and all of every replicated one.
    for result in results:
        for name, placement in result["placements"].items():
            share = result["full_bytes"][name] // (layout["tp"] if placement.startswith("S") else 1)
            assert result["held_bytes"][name] == share, name


def test_tp_shards_every_matrix_weight_megatron_style() -> None:
    program = compile_case(build_case("llama"), autoshard.Mesh(tp=4))
    placements = {n: str(p["tp"]) for n, p in program.for_rank(0).placements.items()}
    block = "model.layers.0."
    assert placements[block + "self_attn.q_proj.weight"] == "S(0)"  # column-parallel: output features
    assert placements[block + "self_attn.k_proj.weight"] == "S(0)"
    assert placements[block + "self_attn.v_proj.weight"] == "S(0)"
    assert placements[block + "self_attn.o_proj.weight"] == "S(1)"  # row-parallel: input features
    assert placements[block + "mlp.gate_proj.weight"] == "S(0)"
    assert placements[block + "mlp.up_proj.weight"] == "S(0)"
    assert placements[block + "mlp.down_proj.weight"] == "S(1)"
    assert placements["model.embed_tokens.weight"] == "S(0)"  # vocab-parallel
    assert placements["lm_head.weight"] == "S(0)"
    assert placements[block + "input_layernorm.weight"] == "R"
    code = program.graph_modules[0].code
    assert "vocab_parallel_cross_entropy" in code and "vocab_parallel_embedding" in code
    # Literal head counts in repeat_kv's expand/reshape became local counts (8 heads, 4 KV heads, tp=4).
    assert re.search(r"expand\.default\(\w+, \[sym_size_int_\d+, 1, 2, sym_size_int_\d+, 4\]\)", code)
    assert re.search(r"reshape\.default\(expand_\d+, \[sym_size_int_\d+, 2, sym_size_int_\d+, 4\]\)", code)


def test_fused_qkv_is_sharded_strided_without_a_gather() -> None:
    program = compile_case(build_case("gpt2"), autoshard.Mesh(tp=2))
    placements = {n: str(p["tp"]) for n, p in program.for_rank(0).placements.items()}
    assert placements["transformer.h.0.attn.c_attn.weight"] == "S(1)x3"  # each rank: its q, k and v columns
    assert placements["transformer.h.0.attn.c_attn.bias"] == "S(0)x3"
    assert placements["lm_head.weight"] == "S(0)"  # tied with the input embedding: vocab-parallel on both
    code = program.graph_modules[0].code
    assert "all_gather" not in code
    assert "torch.ops.aten.split.Tensor(view_2, 16, 2)" in code  # local q, k, v widths


def test_fewer_kv_heads_than_tp_ranks(ranks) -> None:
    """Llama with 8 query heads and 2 KV heads at tp=4: q sharded by heads, k and v replicated then sliced."""
    ref_losses, ref_state = train_single_device("llama", kv_heads=2)
    results = ranks(4).run(train_tp, "llama", {"tp": 4}, kv_heads=2)
    assert results[0]["losses"] == pytest.approx(ref_losses, rel=RTOL)
    assert_state_close(results[0]["state"], ref_state)
    placements = results[0]["placements"]
    assert placements["model.layers.0.self_attn.q_proj.weight"] == "S(0)"
    assert placements["model.layers.0.self_attn.k_proj.weight"] == "R"
    for counts in _blocks(results[0]["collectives"]).values():
        # Each rank slices its heads out of the replicated k and v: free forward, an all-gather backward.
        assert counts == {"all_reduce fwd": 2, "all_reduce bwd": 2, "all_gather bwd": 2}
    assert "self_attn.k_proj.weight" in results[0]["explain"].split("replicated: ")[0].rsplit("\n", 1)[-1]


def test_heads_and_vocab_that_do_not_divide_fall_back_and_say_so(ranks) -> None:
    """GPT-2 with 3 heads and a vocabulary of 65 at tp=2: attention and embeddings replicated, MLPs sharded."""
    shape = {"width": 36, "heads": 3, "vocab": 65}
    ref_losses, ref_state = train_single_device("gpt2", **shape)
    results = ranks(2).run(train_tp, "gpt2", {"tp": 2}, **shape)
    assert results[0]["losses"] == pytest.approx(ref_losses, rel=RTOL)
    assert_state_close(results[0]["state"], ref_state)
    placements = results[0]["placements"]
    assert placements["transformer.h.0.attn.c_attn.weight"] == "R"
    assert placements["transformer.h.0.mlp.c_fc.weight"] == "S(1)"
    assert placements["lm_head.weight"] == "R"
    explain = results[0]["explain"]
    assert placements["transformer.wpe.weight"] == "R"  # sharding it would add an all-reduce: not worth it
    assert "65 rows/features not divisible by tp=2" in explain
    assert "h.0.attn.c_attn.weight" in explain and "replicated: sharding it would make view_" in explain


@settings(max_examples=5, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tp=st.sampled_from([2, 4]), multiples=st.lists(st.integers(1, 6), min_size=2, max_size=5))
def test_random_mlps_shard_optimally(ranks, tp: int, multiples: list[int]) -> None:
    """Widths divisible by tp: linears pair up column/row, one all-reduce each way per pair and no other."""
    sizes = tuple(tp * m for m in multiples)
    ref_losses, ref_state = train_single_device("mlp", sizes=sizes)
    results = ranks(tp).run(train_tp, "mlp", {"tp": tp}, sizes=sizes)
    assert results[0]["losses"] == pytest.approx(ref_losses, rel=RTOL)
    assert_state_close(results[0]["state"], ref_state)
    linears = len(sizes) - 1
    totals: dict[str, int] = {}
    for counts in results[0]["collectives"].values():
        for op, n in counts.items():
            totals[op] = totals.get(op, 0) + n
    # Every row-parallel linear's partial sums are reduced once; every column-parallel linear but the
    # first (whose input needs no gradient) has its input's gradient reduced once.
    expected = {"all_reduce fwd": linears // 2, "all_reduce bwd": (linears + 1) // 2 - 1}
    assert totals == {op: n for op, n in expected.items() if n}


@settings(max_examples=2, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tp=st.sampled_from([2, 4]), heads_per_rank=st.integers(1, 2), head_dim=st.sampled_from([2, 4, 6]))
def test_random_attention_shapes_shard_optimally(ranks, tp: int, heads_per_rank: int, head_dim: int) -> None:
    heads = tp * heads_per_rank
    shape = {"width": heads * head_dim, "heads": heads, "layers": 1}
    ref_losses, ref_state = train_single_device("gpt2", **shape)
    results = ranks(tp).run(train_tp, "gpt2", {"tp": tp}, **shape)
    assert results[0]["losses"] == pytest.approx(ref_losses, rel=RTOL)
    assert_state_close(results[0]["state"], ref_state)
    (counts,) = _blocks(results[0]["collectives"]).values()
    assert counts == MEGATRON


def test_vit_style_model_shards_its_blocks(ranks) -> None:
    """A ViT: patch convolution replicated (no rule: listed), encoder blocks Megatron-style, classes sharded."""
    ref_losses, ref_state = train_single_device("vit")
    results = ranks(2).run(train_tp, "vit", {"tp": 2})
    assert results[0]["losses"] == pytest.approx(ref_losses, rel=RTOL)
    assert_state_close(results[0]["state"], ref_state)
    for counts in _blocks(results[0]["collectives"]).values():
        assert counts == MEGATRON
    assert "ops without a sharding rule (inputs replicated): aten.conv2d.default x1" in results[0]["explain"]


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["", "sp"])
def test_dropout_masks_agree_where_replicated_and_differ_where_sharded(ranks, sequence_parallel: bool) -> None:
    results = ranks(2).run(tp_dropout_probe, {"sequence_parallel": sequence_parallel})
    first, second = results
    assert first["losses"] == second["losses"]
    # Replicated weights stay identical across tp ranks only if the replicated activations saw equal masks.
    assert first["replicated"].keys() == second["replicated"].keys() and first["replicated"]
    for key, value in first["replicated"].items():
        assert torch.equal(value, second["replicated"][key]), key
    assert torch.equal(first["shared"], second["shared"])  # the shared stream: equal on every tp rank
    assert not torch.equal(first["own"], second["own"])  # each rank's own stream: distinct
    # Attention dropout runs on head shards, and with sequence parallel hidden dropout on sequence shards.
    graph = first["graph"]
    assert "sharded_random(tp, torch.ops.aten.scaled_dot_product_attention.default" in graph
    assert ("sharded_random(tp, torch.ops.aten.dropout.default" in graph) == sequence_parallel


def test_state_round_trip_and_forward_calls(ranks) -> None:
    for result in ranks(2).run(tp_state_and_forward):
        assert result["changed"] and result["restored"]
        assert result["start_matches_model"]  # full_state_dict joins the shards into the model's own tensors
        assert result["logits_shape"] == (8, SEQ, VOCAB)  # forward-only calls join sharded outputs
        assert result["logits_error"] < 1e-5


def test_clipping_across_tp_shards(ranks) -> None:
    # SGD, not Adam: Adam's update does not change when every gradient is scaled alike, so a wrong
    # global norm that every rank agrees on would go unseen.
    norms: list[float] = []
    ref_losses, ref_state = train_single_device("llama", max_grad_norm=0.05, optimizer=sgd_momentum, norms=norms)
    results = ranks(2).run(train_tp, "llama", {"tp": 2}, {"max_grad_norm": 0.05}, optimizer=sgd_momentum)
    for result in results:  # the norm over every shard, each replicated weight counted once
        assert result["grad_norms"] == pytest.approx(norms, rel=1e-5)
    assert results[0]["losses"] == pytest.approx(ref_losses, rel=RTOL)
    assert_state_close(results[0]["state"], ref_state)


def test_tp_that_shards_nothing_is_refused_before_any_rank_runs() -> None:
    case = build_case("mlp", sizes=(3, 5, 7))
    msg = "tp=2 shards none of MLP's weights (layers.0.weight: 5 rows/features not divisible by tp=2; "
    with pytest.raises(autoshard.PlanError, match=re.escape(msg)):
        compile_case(case, autoshard.Mesh(tp=2))
    with pytest.raises(autoshard.PlanError, match="sequence_parallel=True shards activations across the tp group"):
        compile_case(build_case("mlp"), autoshard.Mesh(dp=2), plan={"sequence_parallel": True})


THREE_D = {
    "gpt2-pp2xtp2": ("gpt2", {"pp": 2, "tp": 2}, {"microbatches": 2}, 2),
    "llama-pp2xtp2-sp-clip": (
        "llama", {"pp": 2, "tp": 2}, {"microbatches": 2, "sequence_parallel": True, "max_grad_norm": 0.05}, 2,
    ),
    "bert-pp2xtp2-interleaved": (
        "bert", {"pp": 2, "tp": 2}, {"microbatches": 4, "schedule": "interleaved_1f1b", "virtual_stages": 2}, 4,
    ),
    "gpt2-dp2xpp2xtp2": ("gpt2", {"dp": 2, "pp": 2, "tp": 2}, {"microbatches": 2}, 2),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("config", THREE_D)
def test_tp_with_pipeline_matches_single_device(ranks, config: str) -> None:
    check_tp_with_pipeline(ranks, config)


# All four with -m slow; every run draws two.
@settings(max_examples=2)
@given(config=st.sampled_from(list(THREE_D)))
def test_tp_with_pipeline_matches_single_device_sample(ranks, config: str) -> None:
    check_tp_with_pipeline(ranks, config)


def check_tp_with_pipeline(ranks, config: str) -> None:
    """Tensor parallel inside pipeline stages (and dp around them): each stage graph keeps Megatron's count."""
    family, mesh, plan, layers = THREE_D[config]
    norms: list[float] = []
    ref_losses, ref_state = train_single_device(
        family, layers=layers, max_grad_norm=plan.get("max_grad_norm"), norms=norms
    )
    world = mesh.get("dp", 1) * mesh["pp"] * mesh["tp"]
    results = ranks(world).run(train_pipeline, family, mesh, plan, layers=layers)
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx(ref_losses, rel=RTOL), f"rank {rank}"
    assert_state_close(results[0]["state"], ref_state)
    if norms:  # clipping: the norm over every stage and shard, each tied or replicated weight once
        assert all(r["grad_norms"] == pytest.approx(norms, rel=1e-5) for r in results)
    expected = MEGATRON_SP if plan.get("sequence_parallel") else MEGATRON
    for result in results:
        blocks = _blocks(result["collectives"])
        assert len(blocks) == layers // mesh["pp"]  # this rank's stages' blocks only
        assert all(counts == expected for counts in blocks.values())


@pytest.mark.parametrize(
    "plan",
    [
        pytest.param({"zero": 1}, marks=pytest.mark.slow),
        pytest.param({"zero": 2, "max_grad_norm": 0.05}, marks=pytest.mark.slow),
        {"zero": 1, "sequence_parallel": True, "max_grad_norm": 0.05},
    ],
    ids=["zero1", "zero2-clip", "zero1-sp-clip"],
)
def test_tp_with_zero_matches_single_device(ranks, plan: dict) -> None:
    """dp2 x tp2 with ZeRO over dp: optimizer state (and gradients) of each tp shard sharded over dp."""
    optimizer = sgd_momentum if "max_grad_norm" in plan else None  # (see test_clipping_across_tp_shards)
    norms: list[float] = []
    ref_losses, ref_state = train_single_device(
        "llama", max_grad_norm=plan.get("max_grad_norm"), optimizer=optimizer, norms=norms
    )
    results = ranks(4).run(train_tp, "llama", {"dp": 2, "tp": 2}, plan, optimizer=optimizer)
    if norms:
        assert all(r["grad_norms"] == pytest.approx(norms, rel=1e-5) for r in results)
    assert results[0]["losses"] == pytest.approx(ref_losses, rel=RTOL)
    assert_state_close(results[0]["state"], ref_state)
    assert all(r["volumes"][-1]["reduce_scatter"] > 0 for r in results)
