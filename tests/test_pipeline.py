"""Pipeline parallelism on real gloo ranks: equivalence with single-device training, per schedule (tier 2)."""

from __future__ import annotations

import re

import pytest
import torch
from cases import SEQ, build_case, compile_case, pipeline_state_roundtrip, train_pipeline, train_single_device
from hypothesis import given, settings
from hypothesis import strategies as st

import autoshard
from autoshard.spec.schedules import Schedule, ScheduleError

RTOL, ATOL = 1e-5, 1e-6

# (mesh, plan, layers): pp 2 and 4 with each schedule, and dp2 x pp2.
CONFIGS = {
    "pp2-gpipe": ({"pp": 2}, {"schedule": "gpipe", "microbatches": 4}, 2),
    "pp2-1f1b": ({"pp": 2}, {"schedule": "1f1b", "microbatches": 4}, 2),
    "pp2-interleaved": ({"pp": 2}, {"schedule": "interleaved_1f1b", "virtual_stages": 2, "microbatches": 4}, 4),
    # 5 blocks over 2 x 2 virtual stages: stages of unequal block counts
    "pp2-interleaved-uneven": ({"pp": 2}, {"schedule": "interleaved_1f1b", "virtual_stages": 2, "microbatches": 4}, 5),
    "pp4-gpipe": ({"pp": 4}, {"schedule": "gpipe", "microbatches": 4}, 4),
    "pp4-1f1b": ({"pp": 4}, {"schedule": "1f1b", "microbatches": 8}, 4),
    "pp4-interleaved": ({"pp": 4}, {"schedule": "interleaved_1f1b", "virtual_stages": 2, "microbatches": 4}, 8),
    "dp2xpp2-1f1b": ({"dp": 2, "pp": 2}, {"schedule": "1f1b", "microbatches": 2}, 2),
    "pp2-zb_h1": ({"pp": 2}, {"schedule": "zb_h1", "microbatches": 4}, 2),
    "pp4-zb_h1": ({"pp": 4}, {"schedule": "zb_h1", "microbatches": 8}, 4),
    "pp4-zb_h2": ({"pp": 4}, {"schedule": "zb_h2", "microbatches": 8}, 4),
    "dp2xpp2-zb_h1": ({"dp": 2, "pp": 2}, {"schedule": "zb_h1", "microbatches": 4}, 2),
}


def check_equivalent(results: list[dict], family: str, **reference) -> None:
    ref_losses, ref_state = train_single_device(family, **reference)
    for result in results:  # every rank returns the global loss
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=RTOL, atol=0)
    state = results[0]["state"]
    assert set(state) == set(ref_state)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, rtol=RTOL, atol=ATOL, msg=lambda m, k=key: f"{k}: {m}")


PIPELINE_FAMILIES = ["gpt2", "llama", "bert"]


@pytest.mark.slow
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("family", PIPELINE_FAMILIES)
def test_pipeline_matches_single_device(ranks, family: str, config: str) -> None:
    check_pipeline(ranks, family, config)


# The grid above (36 runs) runs with -m slow; every run draws four of its points.
@settings(max_examples=4)
@given(family=st.sampled_from(PIPELINE_FAMILIES), config=st.sampled_from(list(CONFIGS)))
def test_pipeline_matches_single_device_sample(ranks, family: str, config: str) -> None:
    check_pipeline(ranks, family, config)


def test_interleaving_over_blocks_that_do_not_divide_evenly(ranks) -> None:
    check_pipeline(ranks, "llama", "pp2-interleaved-uneven")


def check_pipeline(ranks, family: str, config: str) -> None:
    """Equal to one device; per-rank in-flight microbatches, microbatch rows and sent bytes as scheduled."""
    mesh, plan, layers = CONFIGS[config]
    world = mesh.get("dp", 1) * mesh["pp"]
    results = ranks(world).run(train_pipeline, family, mesh, plan, layers=layers)
    check_equivalent(results, family, layers=layers)
    pp, m = mesh["pp"], plan["microbatches"]
    v = plan.get("virtual_stages", 1)
    for rank, result in enumerate(results):
        stage_rank = rank // mesh.get("dp", 1)  # pp is the outermost mesh dimension
        expected = {
            "gpipe": m,  # every microbatch's activations are held until the backwards start
            "1f1b": min(m, pp - stage_rank),  # at most pp in flight: warm-up pp - 1 - rank, then one more
            "interleaved_1f1b": min(m * v, (pp - stage_rank - 1) * 2 + (v - 1) * pp + 1),
            "zb_h1": min(m, pp),  # rank r holds r W's back on top of 1F1B's pp - r (a W frees what it reads)
            # the first rank's warm-up; later ranks hold W's back until nothing else can run (the tail)
            "zb_h2": min(m, 2 * pp - 1),
        }[plan["schedule"]]
        assert result["peak_in_flight"] == expected, (rank, result["peak_in_flight"], expected)
        # An eager stage's B adds its matmuls' weight gradients into .grad in place, every microbatch's
        # (a fused multiply-add each: runtime/pipeline.py), where a zero-bubble schedule's W would.
        assert result["weight_grads_deferred"] >= m, result["weight_grads_deferred"]
        # Each stage ran on microbatches of the dp rank's rows, not on its whole batch.
        rows = result["microbatch_sizes"]["B"]
        assert rows == 8 // mesh.get("dp", 1) // m
        # Sent per step: the hidden state (rows x SEQ x 32 fp32) of every microbatch forward from each
        # local stage but the last, and its gradient back from each but the first; nothing else.
        stages = [s for s in range(pp * v) if s % pp == stage_rank]
        sends = sum((s < pp * v - 1) + (s > 0) for s in stages)
        assert result["volumes"][-1]["send"] == m * sends * rows * SEQ * 32 * 4
        # Each rank holds its own stages' parameters, not the whole model.
        assert 0 < len(result["param_names"]) < len(results[0]["state"])


def test_tied_embedding_lives_on_first_and_last_stage(ranks) -> None:
    results = ranks(2).run(train_pipeline, "gpt2", {"pp": 2}, {"microbatches": 2}, steps=1)
    names = [set(r["param_names"]) for r in results]
    tied = {"transformer.wte.weight", "lm_head.weight"}  # one parameter, under either name
    assert names[0] & tied and names[0] & tied == names[1] & tied
    assert not any(n.startswith("transformer.h.1.") for n in names[0])
    assert not any(n.startswith("transformer.h.0.") for n in names[1])


def test_state_dict_round_trip_and_forward_calls(ranks) -> None:
    first, last = ranks(2).run(pipeline_state_roundtrip)
    assert first["changed"] and first["restored"] and last["changed"] and last["restored"]
    # Each rank's state dict holds its own stages' tensors; together they cover the model.
    assert any(k.startswith("transformer.h.0.") for k in first["held"])
    assert not any(k.startswith("transformer.h.0.") for k in last["held"])
    # A forward call returns the whole logits on every pipeline rank, equal to the model's.
    assert first["logits_error"] < 1e-5 and last["logits_error"] < 1e-5
    assert first["logits_shape"] == last["logits_shape"] == (8, SEQ, 64)


def test_cut_inside_a_block_sends_several_tensors(ranks) -> None:
    """Cut by node name before attention: the residual stream and q, k, v cross, each in its own slot."""
    plan = {"microbatches": 2, "pp_cuts": ["scaled_dot_product_attention_1"]}
    results = ranks(2).run(train_pipeline, "gpt2", {"pp": 2}, plan)
    check_equivalent(results, "gpt2")
    assert "pipeline_recv(pipe, 1, 3)" in results[1]["graphs"][0]
    assert "pipeline_send(pipe, 0, 3," in results[0]["graphs"][0]


@pytest.mark.parametrize(
    "plan",
    [
        pytest.param({"zero": 1}, marks=pytest.mark.slow),
        {"zero": 2, "max_grad_norm": 0.05},
        pytest.param({"zero": 1, "offload": True}, marks=pytest.mark.slow),
    ],
)
def test_zero_with_pipeline_matches_single_device(ranks, plan: dict) -> None:
    """dp2 x pp2 with ZeRO-1/2: each stage's optimizer state (and gradients) sharded over its dp pair."""
    results = ranks(4).run(train_pipeline, "llama", {"dp": 2, "pp": 2}, {**plan, "microbatches": 2})
    check_equivalent(results, "llama", max_grad_norm=plan.get("max_grad_norm"))
    assert all(r["volumes"][-1]["reduce_scatter"] > 0 and r["volumes"][-1]["all_gather"] > 0 for r in results)


def test_clipping_across_stages(ranks) -> None:
    plan = {"microbatches": 2, "max_grad_norm": 0.05}
    norms: list[float] = []
    train_single_device("gpt2", max_grad_norm=0.05, norms=norms)
    results = ranks(2).run(train_pipeline, "gpt2", {"pp": 2}, plan)
    check_equivalent(results, "gpt2", max_grad_norm=0.05)
    assert all(r["grad_norms"] == pytest.approx(norms, rel=1e-5) for r in results)  # (Adam hides a wrong norm)


def test_stage_graphs_show_send_and_recv() -> None:
    case = build_case("gpt2", layers=4)
    program = compile_case(case, autoshard.Mesh(pp=4), plan={"microbatches": 2})
    codes = [program.for_rank(r).graph_code() for r in range(4)]
    assert "pipeline_recv" not in codes[0] and "pipeline_send(pipe, 0, 0," in codes[0]
    for stage in (1, 2):
        assert f"pipeline_recv(pipe, {stage}, 0)" in codes[stage]
        assert f"pipeline_send(pipe, {stage}, 0," in codes[stage]
    assert "pipeline_send" not in codes[3]
    # Only the hidden state crosses a cut; batch and sequence sizes are evaluated, the causal mask recomputed.
    assert "pipeline_recv(pipe, 1, 1)" not in codes[1]
    assert "pipeline_size(pipe, 'S')" in codes[1]
    assert "pipeline_stages: 4 stage graphs; 3 tensor(s) sent across cuts" in "\n".join(program.analysis_log)
    assert "schedule=1f1b, microbatches=2" in str(program.plan)
    text = program.explain()
    assert "stage 2 on pp rank 2: transformer.h.2 .. transformer.h.2, 12 parameters; receives 1, sends 1" in text
    assert "1f1b: pp=4, microbatches=2, virtual stages=1\nrank 0: 0F0 0F1" in text  # the schedule's table


def compile_gpt2(plan: dict, mesh: autoshard.Mesh, layers: int = 2, batch: int = 8) -> autoshard.Program:
    return compile_case(build_case("gpt2", layers=layers, batch=batch), mesh, plan=plan)


@pytest.mark.parametrize(
    ("mesh", "plan", "layers", "message"),
    [
        (
            {"pp": 2}, {"schedule": "interleaved_1f1b", "virtual_stages": 2, "microbatches": 3}, 4,
            "interleaved 1F1B needs microbatches divisible by pp: 3 microbatches, pp=2; use a multiple of 2",
        ),
        (
            {"pp": 2}, {"microbatches": 3}, 2,
            "microbatches=3 does not divide the 8 rows each dp rank gets of the example batch; use a divisor of 8",
        ),
        (
            {"pp": 2, "dp": 2}, {"microbatches": 8}, 2,
            "microbatches=8 does not divide the 4 rows each dp rank gets of the example batch; use a divisor of 4",
        ),
        (
            {"pp": 4}, {"microbatches": 2}, 2,
            "4 pipeline stages (pp x virtual_stages) need at least 4 repeated blocks to cut between, "
            "but the graph has 2; use at most 2 stages",
        ),
        (
            {"pp": 2}, {"microbatches": 2, "virtual_stages": 2}, 4,
            "virtual_stages=2 puts several stages on each rank, which only schedule='interleaved_1f1b' runs",
        ),
        (
            {"pp": 2}, {"microbatches": 2, "pp_cuts": ["transformer.h.7"]}, 2,
            "pp_cuts must name 1 block(s) or node(s) that start stages 1..1, in order; ['transformer.h.7'] not usable; "
            "the blocks are ['transformer.h.1']",
        ),
    ],
)  # fmt: skip
def test_bad_pipeline_plans_fail_at_compile(mesh: dict, plan: dict, layers: int, message: str) -> None:
    with pytest.raises(autoshard.PlanError, match=re.escape(message)):
        compile_gpt2(plan, autoshard.Mesh(**mesh), layers=layers)


def test_custom_schedule_is_validated_before_any_rank_runs() -> None:
    # Rank 0 waits for 1B0 before it has sent 0F1, which rank 1 needs first: a deadlock.
    deadlock = Schedule.parse("rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F1 1B1 1F0 1B0")
    with pytest.raises(ScheduleError, match=re.escape("rule 3: custom deadlocks at time 1")):
        compile_gpt2({"schedule": deadlock}, autoshard.Mesh(pp=2))
    fine = Schedule.parse("rank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F0 1B0 1F1 1B1")
    program = compile_gpt2({"schedule": fine}, autoshard.Mesh(pp=2))
    assert "schedule=custom, microbatches=2" in str(program.plan)
    msg = "plan asks for microbatches=4 but its schedule has 2; drop microbatches from the plan"
    with pytest.raises(autoshard.PlanError, match=re.escape(msg)):
        compile_gpt2({"schedule": fine, "microbatches": 4}, autoshard.Mesh(pp=2))
    three = Schedule.parse("rank 0: 0F0 0B0\nrank 1: 1F0 1B0\nrank 2: 2F0 2B0")
    with pytest.raises(ScheduleError, match=re.escape("the custom schedule has 3 ranks but pp=2")):
        compile_gpt2({"schedule": three}, autoshard.Mesh(pp=2))


def test_fixed_cuts_by_name_and_planner_microbatches() -> None:
    program = compile_gpt2({"pp_cuts": ["transformer.h.3"]}, autoshard.Mesh(pp=2), layers=4)
    assert "pp_cuts=['transformer.h.3']" in str(program.plan)
    assert program.plan.microbatches == 8  # the most microbatches up to 4 x pp that divide the 8 rows
    names = {n for n in program.for_rank(0).placements}
    assert "transformer.h.2.mlp.c_fc.weight" in names and "transformer.h.3.mlp.c_fc.weight" not in names


@settings(max_examples=6)
@given(
    depth=st.integers(2, 6),
    pp=st.sampled_from([2, 4]),
    microbatches=st.integers(1, 8),
    schedule=st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b"]),
)
def test_random_pipelines_train_equivalently(ranks, depth: int, pp: int, microbatches: int, schedule: str) -> None:
    v = 2 if schedule == "interleaved_1f1b" else 1
    if schedule == "interleaved_1f1b":
        microbatches = pp * max(1, microbatches // pp)
    depth = max(depth, pp * v)
    sizes = tuple([16] + [24] * (depth - 1) + [4])
    plan = {"schedule": schedule, "microbatches": microbatches, "virtual_stages": v}
    results = ranks(pp).run(train_pipeline, "mlp", {"pp": pp}, plan, sizes=sizes, batch=2 * microbatches)
    check_equivalent(results, "mlp", sizes=sizes, batch=2 * microbatches)
