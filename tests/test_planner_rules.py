"""The planner's arithmetic on real graphs: memory per ZeRO stage from the profiled parameters, the plans
the constraints allow, the simulated pipeline schedule, max_batch, and the default microbatches."""

from __future__ import annotations

import dataclasses
import os
import re
from collections import Counter

import pytest
import sympy
import torch
from cases import build_case, measured_hardware, shared_processors, small_gpt, timed_spans, tp_collectives
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard import passes
from autoshard.capture import capture
from autoshard.demo import next_token_loss
from autoshard.errors import PlanError
from autoshard.ir.cost import summarize
from autoshard.ir.meta import ZERO_GROUP, evaluate_expr, get_shape
from autoshard.planner import choose_plan, default_microbatches
from autoshard.planner.costing import ADAM_KERNELS, ADAM_PASSES, Costing, Unfit
from autoshard.planner.hardware import Hardware
from autoshard.planner.profile import profile_graph
from autoshard.planner.search import SIMPLER_WITHIN
from autoshard.planner.simulate import simulate, simulate_shared
from autoshard.planner.stages import Stage as _Stage
from autoshard.spec.plan import Plan
from autoshard.spec.schedule_builders import build_schedule

HW = Hardware.preset("a100-80gb")


@pytest.fixture(scope="module")
def gpt2():
    """GPT-2 (2 blocks, 4 heads, 8 rows) captured once: its profile, sizes, parameter bytes and ZeRO-3 groups."""
    case = build_case("gpt2")
    batch = case.batches[0]
    captured = capture(case.model, batch.inputs, batch.kwargs)
    passes.analyze(captured.gm, captured.rename)
    cost = summarize(captured.gm)
    sizes = captured.example_sizes
    flops = float(evaluate_expr(cost.flops_fwd + cost.flops_bwd, sizes))
    profile = profile_graph(captured.gm, sizes, HW.kernels, flops)
    passes.run_pass(passes.zero_groups.PASS, captured.gm)  # the gather groups the runtime forms
    groups = {n.meta[ZERO_GROUP].group for n in captured.gm.graph.nodes if ZERO_GROUP in n.meta}
    return profile, sizes, cost.param_bytes, len(groups)


def costing(gpt2, hardware: Hardware = HW) -> Costing:
    profile, sizes = gpt2[:2]
    return Costing(profile, sizes, hardware)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_memory_per_rank_follows_the_zero_formulas(gpt2, zero: int) -> None:
    """W bytes of weights, W of gradients, 2W of Adam's moments (fp32); each stage shards one more, as the
    runtime holds them at the end of backward (ZeRO-2 has the full gradient buffers then)."""
    w, dp = gpt2[2], 4
    memory = costing(gpt2).candidate(Plan(dp=dp, zero=zero)).memory
    largest = max(gpt2[0].part(name, 1, False).largest_param_bytes for name in gpt2[0].parts)
    expected = {
        0: (w, w, 2 * w),
        1: (w, w, 2 * w // dp),
        2: (w, w, 2 * w // dp),
        3: (w // dp, w // dp + 2 * largest, 2 * w // dp),
    }[zero]
    assert (memory.weights, memory.gradients, memory.optimizer) == expected
    assert memory.gathered == (2 * largest if zero == 3 else 0)
    assert memory.activations > 0


def test_zero3_holds_nothing_gathered_where_the_losss_gradients_peak() -> None:
    """Backward begins in the loss with everything kept and, under ZeRO-3, nothing gathered yet and no layer's
    gradients: where the loss's gradients (twice the logits: a large vocabulary over a narrow model) outweigh a
    layer's gathered parameters and gradients, that is the peak, the activations the same as without ZeRO and
    only the shards held besides."""
    import autoshard
    from autoshard.demo import TinyGPT

    ids = torch.zeros(16, 64, dtype=torch.long)
    memory = {}
    for zero in (0, 3):
        report = autoshard.plan(TinyGPT(4096, 64, 4, 2, 64), autoshard.Mesh(dp=2), (ids,), loss_fn=next_token_loss,
                                example_target=ids, plan={"zero": zero}, hardware=HW)  # fmt: skip
        memory[zero] = report.chosen.memory
    assert memory[3].gathered == 0 and memory[3].gradients == memory[3].weights
    assert memory[3].activations == memory[0].activations
    assert 2 * memory[3].weights == pytest.approx(memory[0].weights, rel=0.01)


def test_a_tied_weight_on_one_rank_is_held_once(gpt2) -> None:
    """zbv places the first and the last stage on one rank: GPT-2's embedding and the head tied to it are
    one parameter there, not a copy (a 1F1B pipeline holds a copy on the last rank, as the runtime does)."""
    from autoshard.planner.stages import rank_sums

    whole = gpt2[2]
    for plan, copies in ((Plan(pp=2, schedule="zbv", virtual_stages=2, microbatches=4), 0),
                         (Plan(pp=2, schedule="1f1b", microbatches=4), 1)):  # fmt: skip
        stages = tuple(costing(gpt2)._costed_stages(plan, 2, 1.0))
        held = sum(s.params for s in rank_sums(stages, 2, v_placement=plan.schedule == "zbv"))
        tied = sum(nbytes for s in stages for _, _, nbytes, _ in s.tied_copies)
        assert tied > 0 and held == whole + copies * tied, (plan.schedule, held, whole, tied)


def test_a_tied_weight_on_one_rank_keeps_its_gradient_in_b(gpt2) -> None:
    """zbv's last stage runs on the first stage's rank, whose embedding owns the head's tied weight: the runtime
    keeps that weight's gradient in B there (passes/weight_grad_split: it arrives whole in one place), so the
    planner's W of that stage leaves the head out, and so do the bytes held for W. Placed round-robin
    (interleaved, the same cuts) the last stage runs on another rank and the head's weight gradient is W's."""
    c = costing(gpt2)
    v_shaped = Plan(pp=2, schedule="zbv", virtual_stages=2, microbatches=4)
    round_robin = Plan(pp=2, schedule="interleaved_1f1b", virtual_stages=2, microbatches=4)
    assert c._parts_per_stage(v_shaped, 2) == c._parts_per_stage(round_robin, 2)
    head = [
        seconds
        for name in c._parts_per_stage(v_shaped, 2)[-1]
        for _, seconds in c._part(name, v_shaped).times({**c.sizes, "B": 2}, HW, torch.float32).tied_weight_grad
    ]
    v_stages, rr_stages = c._costed_stages(v_shaped, 2, 1.0), c._costed_stages(round_robin, 2, 1.0)
    assert len(head) == 1 and head[0] > 0
    assert rr_stages[-1].weight_grad - v_stages[-1].weight_grad == pytest.approx(head[0])
    assert [s.weight_grad for s in v_stages[:-1]] == [s.weight_grad for s in rr_stages[:-1]]
    assert [s.backward for s in v_stages] == [s.backward for s in rr_stages]  # B takes what W leaves
    # Nor does its matmul hold its factors (the head's input and the logits' gradient) from B to a W.
    from autoshard.planner.part_times import value

    sizes = {**c.sizes, "B": 2}
    held = [tied[1:] for n in c._parts_per_stage(v_shaped, 2)[-1] for tied in c._part(n, v_shaped).tied_held_for_w]
    assert len(held) == 1 and value(held[0][0], sizes) > value(held[0][1], sizes) > 0  # its input is forward's
    assert rr_stages[-1].held_for_w - v_stages[-1].held_for_w == pytest.approx(value(held[0][0], sizes))
    assert rr_stages[-1].w_inputs - v_stages[-1].w_inputs == pytest.approx(value(held[0][1], sizes))


def test_the_microbatch_in_its_b_adds_only_the_gradients_its_w_will_read(gpt2) -> None:
    """A split backward's W reads its matmuls' inputs and their outputs' gradients. The inputs are forward's own
    saved tensors: while a microbatch is in its B they are counted once, in forward's activations, and only the
    gradients are new; a microbatch waiting for its W holds both (Schedule.held_counts gives the moments).
    Under full recomputation the blocks' inputs are made again in B, no longer forward's."""
    from autoshard.planner.memory import rank_memory
    from autoshard.planner.simulate import built, in_flight
    from autoshard.planner.stages import rank_sums

    c = costing(gpt2)
    plan = Plan(pp=2, schedule="zb_h1", microbatches=4)
    sums = rank_sums(tuple(c._costed_stages(plan, 2, 1.0)), 2)
    assert all(0 < r.w_inputs < r.held_for_w for r in sums)
    unshared = [dataclasses.replace(r, w_inputs=0.0) for r in sums]
    counts = in_flight(built("zb_h1", 2, 4, 1))
    activations = rank_memory(plan, sums, counts, 2)[0].activations
    assert activations == c.candidate(plan).memory.activations < rank_memory(plan, unshared, counts, 2)[0].activations
    in_b = (((1, 0, 1),),) * 2  # one microbatch, in its B: its activations and its W's gradients, no more
    for r, alone in zip(sums, unshared):
        one, both = rank_memory(plan, [r], in_b[:1], 2)[0], rank_memory(plan, [alone], in_b[:1], 2)[0]
        assert both.activations - one.activations == pytest.approx(r.w_inputs, abs=1)
    again = rank_sums(tuple(c._costed_stages(dataclasses.replace(plan, recompute="full"), 2, 1.0)), 2)
    assert all(a.w_inputs < r.w_inputs and a.held_for_w == r.held_for_w for a, r in zip(again, sums))  # blocks' out


def test_a_pipelines_weight_gradients_accumulate_fused(gpt2) -> None:
    """A pipeline adds its matmuls' weight gradients with the product fused into the add (addmm_: the buffer read
    and written), where autograd's accumulation also writes and reads the product: a pipeline's backward is
    lighter by two passes over those weights' gradients a microbatch, B's the same (the saving is W's)."""
    from autoshard.planner.part_times import part_times

    c = costing(gpt2)
    pipeline, alone = Plan(pp=2, schedule="zb_h1", microbatches=4), Plan()
    names = [n for stage in c._parts_per_stage(pipeline, 2) for n in stage]
    block = c._part(next(n for n in names if n.startswith("block")), pipeline)
    times = part_times(block, {**c.sizes, "B": 2}, HW, torch.float32)
    deferred = sum(w.dims[1] * w.dims[2] for w in block.works if w.deferred) * 4  # float32 weight gradients
    assert 0 < deferred < block.param_bytes
    assert times.fused_saving == pytest.approx(HW.memory_seconds(2 * deferred, kernels=0))
    saved = sum(c._part(n, pipeline).times({**c.sizes, "B": 2}, HW, torch.float32).fused_saving for n in names)
    one = sum(s.backward for s in c._costed_stages(alone, 2, 1.0))  # pp=1: autograd accumulates
    two = sum(s.backward for s in c._costed_stages(pipeline, 2, 1.0))
    assert saved > 0 and one - two == pytest.approx(saved)


def test_a_split_backwards_w_is_the_weight_gradients_and_recomputation_is_bs(gpt2) -> None:
    """W is what the stage's deferred matmuls cost for their weights' gradients: a share of backward, the same
    with full recomputation as without (the forward a region repeats runs in B, before the input gradients)."""
    from autoshard.planner.simulate import costs

    def stages(recompute: str) -> tuple[_Stage, ...]:
        plan = Plan(pp=2, schedule="zb_h1", microbatches=4, recompute=recompute)
        return tuple(costing(gpt2)._costed_stages(plan, 2, 1.0))

    plain, again = stages("none"), stages("full")
    for s, r in zip(plain, again):
        assert 0 < s.weight_grad < s.backward and s.weight_grad == pytest.approx(r.weight_grad)
        assert r.backward - r.weight_grad == pytest.approx(s.backward - s.weight_grad + r.recompute)
    slots = costs(again)
    n = len(again)
    assert slots[3 * n :] == [s.weight_grad for s in again]  # W
    assert slots[2 * n : 3 * n] == [s.backward - s.weight_grad for s in again]  # B: the rest, recomputation too


def test_zero3_pays_each_gather_group_its_own_collectives(gpt2) -> None:
    """ZeRO-3 gathers each layer's group in forward and in backward and reduce-scatters it once: on CPU ranks,
    where those calls are synchronous, each also waits for the last rank to arrive (``sync_wait``)."""
    groups, m, wait = gpt2[3], 2, 1e-3
    cpu = Hardware.preset("cpu")
    assert groups > 2 and set(cpu.blocking) == {"all_gather", "reduce_scatter"}
    plan = Plan(dp=4, zero=3, microbatches=m)
    base = costing(gpt2, cpu).candidate(plan).time
    waiting = costing(gpt2, cpu.with_(sync_wait=wait)).candidate(plan).time
    assert waiting.zero3 - base.zero3 == pytest.approx(2 * m * groups * wait)
    assert waiting.dp_comm - base.dp_comm == pytest.approx(groups * wait)
    assert waiting.compute == base.compute


def test_tensor_and_pipeline_parallelism_split_the_model_states(gpt2) -> None:
    w = gpt2[2]
    tp = costing(gpt2).candidate(Plan(dp=1, tp=2)).memory.weights
    pp = costing(gpt2).candidate(Plan(dp=1, pp=2, microbatches=2)).memory.weights
    assert w / 2 <= tp < w  # the matrices split, norms and biases replicated
    assert pp < w  # the most loaded stage holds part of the blocks


def test_each_pipeline_stage_holds_the_parameters_it_reads(gpt2) -> None:
    """Embeddings on the first stage; the last block, final norm and the tied head (a copy) on the last."""
    model = build_case("gpt2").model
    nbytes = {name: p.numel() * p.element_size() for name, p in model.named_parameters(remove_duplicate=False)}

    def held(*prefixes: str) -> int:
        return sum(n for name, n in nbytes.items() if name.startswith(prefixes))

    stages = costing(gpt2)._stages(Plan(dp=1, pp=2, microbatches=2), 4)
    assert [s.params for s in stages] == [
        held("transformer.wte.", "transformer.wpe.", "transformer.h.0."),
        held("transformer.h.1.", "transformer.ln_f.", "lm_head."),
    ]


def test_every_plan_the_constraints_allow_is_a_candidate(gpt2) -> None:
    report = choose_plan(8, {}, costing(gpt2), gpt2[1], HW)
    shapes = {(c.plan.dp, c.plan.tp, c.plan.pp) for c in report.candidates}
    # pp at most the 2 blocks, tp dividing the 4 heads, dp dividing the 8 rows
    expected = {(8 // (t * p), t, p) for t in (1, 2, 4) for p in (1, 2) if 8 % (t * p) == 0}
    assert shapes == expected
    zeros = {c.plan.zero for c in report.candidates if (c.plan.tp, c.plan.pp) == (1, 1)}
    assert zeros == {0, 1, 2, 3}


@pytest.mark.parametrize(
    ("world", "fields", "named"),
    [
        (4, {"pp": 4}, "pp=4 is more stages than the model's 2 blocks"),
        (3, {"tp": 3}, "tp=3 does not divide the 4 attention heads"),
        (2, {"pp": 2, "schedule": "interleaved_1f1b"}, "interleaved_1f1b at pp=2 needs 4 or more blocks"),
        (2, {"schedule": "zbv"}, "a pipeline schedule or virtual stages were asked for, which pp=1 does not run"),
        (2, {"pp": 2, "schedule": "zbv"}, "zbv at pp=2 needs 4 blocks"),
        (3, {"dp": 3}, "dp=3 does not divide the global batch of 8"),
    ],
)
def test_a_refusal_names_the_constraint_that_ruled_every_plan_out(gpt2, world: int, fields: dict, named: str) -> None:
    with pytest.raises(PlanError, match=re.escape(named)) as refusal:
        choose_plan(world, fields, costing(gpt2), gpt2[1], HW)
    assert "or other values for the fixed" in str(refusal.value)


def test_a_schedule_asked_for_gets_a_pipeline(gpt2) -> None:
    """A schedule (or virtual stages) in the plan asks for a pipeline: the search does not answer with pp=1,
    which runs none (and where a zbv or interleaved plan at pp=1 was costed as one of two stages)."""
    for fields in ({"schedule": "gpipe"}, {"schedule": "zb_h1"}):
        report = choose_plan(4, fields, costing(gpt2), gpt2[1], HW)
        assert {c.plan.pp for c in report.candidates} == {2}, fields
    assert not Plan(pp=1, schedule="zbv").v_placement
    assert Plan(pp=1, schedule="interleaved_1f1b", virtual_stages=2).virtual_stages == 1


def test_the_winner_is_the_fastest_that_fits_or_simpler_within_the_models_resolution(gpt2) -> None:
    report = choose_plan(8, {}, costing(gpt2), gpt2[1], HW)
    fastest = min(c.step_time for c in report.candidates if c.fits)
    assert report.chosen.fits and report.chosen.step_time <= fastest * (1 + SIMPLER_WITHIN)


def test_a_fixed_mesh_keeps_the_defaults_that_fit(gpt2) -> None:
    from autoshard.spec.mesh import Mesh

    report = choose_plan(Mesh(dp=2, pp=2), {}, costing(gpt2), gpt2[1], HW)
    assert report.winner == Plan(dp=2, pp=2, microbatches=default_microbatches(4, 2, "1f1b"))
    tiny = HW.with_(memory_bytes=int(report.chosen.memory.total * 0.85))
    refit = choose_plan(Mesh(dp=2, pp=2), {}, costing(gpt2, tiny), gpt2[1], tiny)
    assert refit.chosen.fits and refit.winner != report.winner  # ZeRO or recomputation makes it fit


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_simulated_schedule_has_the_textbook_bubble(schedule: str) -> None:
    """Equal stages, no sends: a step of (m + pp - 1) x (F + B) (GPipe and 1F1B alike)."""
    pp, m, f, b = 4, 8, 1.0, 2.0
    stage = _Stage(f, b, 0.0, 0.0, 0.0, 0, 0, 0, 0, 0.0, 0.0)
    makespan, busy, _ = simulate(build_schedule(schedule, pp, m), (stage,) * pp)
    assert makespan == pytest.approx((m + pp - 1) * (f + b))
    assert busy == [pytest.approx(m * (f + b))] * pp
    interleaved, _, _ = simulate(build_schedule("interleaved_1f1b", pp, m, 2), (_half(stage),) * (2 * pp))
    assert m * (f + b) < interleaved < makespan  # virtual stages shrink the bubble


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_ranks_that_share_processors_compute_faster_while_others_wait(schedule: str) -> None:
    """As many processors as ranks: the plain simulation. One processor for all: nothing overlaps, so the
    step is every action's work in turn. Between: the pipeline's ranks speed up in its bubble, so the step
    is shorter than with every rank slowed to its share all step long."""
    pp, m, f, b = 4, 8, 1.0, 2.0
    stage = _Stage(f, b, 0.0, 0.0, 0.0, 0, 0, 0, 0, 0.0, 0.0)
    sched = build_schedule(schedule, pp, m)
    plain = simulate(sched, (stage,) * pp)
    own, busy, _ = simulate_shared(sched, (stage,) * pp, float(pp), 1)
    assert own == pytest.approx(plain[0]) and busy == pytest.approx(plain[1])
    one, _, _ = simulate_shared(sched, (stage,) * pp, 1.0, 1)
    assert one == pytest.approx(pp * m * (f + b))
    two, _, timeline = simulate_shared(sched, (stage,) * pp, 2.0, 1, timeline=True)
    slowed = simulate(sched, (_Stage(2 * f, 2 * b, 0.0, 0.0, 0.0, 0, 0, 0, 0, 0.0, 0.0),) * pp)[0]
    assert plain[0] < two < slowed
    assert [len(actions) for actions in timeline] == [2 * m] * pp
    # Two copies of each pipeline rank (dp 2) on as many processors as one pipeline has ranks: half speed.
    assert simulate_shared(sched, (stage,) * pp, float(pp), 2)[0] == pytest.approx(two)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_the_gap_before_each_action_is_idle_time_on_the_critical_path(schedule: str) -> None:
    """A gap before every action (Hardware.action_gap: an eager CPU runtime's hand-over bookkeeping): busy time
    is the actions' alone; the step grows by a gap per action on the critical path, 2m + 2(pp - 1) of them
    in GPipe and 1F1B over equal stages (the first microbatch's forwards down the stages, the last rank's
    2m actions, the last backward's chain back up), at least the first rank's every action in ZB-H1. Shared
    processors give the same where each rank has one."""
    pp, m, f, b, gap = 4, 8, 1.0, 2.0, 0.01
    stage = _Stage(f, b, 0.0, 0.0, 0.0, 0, 0, 0, 0, 0.0, 0.0, weight_grad=b / 2)
    sched = build_schedule(schedule, pp, m)
    plain, plain_busy, _ = simulate(sched, (stage,) * pp)
    gapped, busy, _ = simulate(sched, (stage,) * pp, gap=gap)
    assert busy == pytest.approx(plain_busy)
    if schedule != "zb_h1":
        assert gapped - plain == pytest.approx((2 * m + 2 * (pp - 1)) * gap)
    assert plain + (len(sched.ranks[0])) * gap <= gapped + 1e-9  # every action of the first rank at least
    shared, shared_busy, _ = simulate_shared(sched, (stage,) * pp, float(pp), 1, gap=gap)
    assert shared == pytest.approx(gapped) and shared_busy == pytest.approx(busy)
    assert Hardware.preset("cpu").action_gap > 0 == Hardware.preset("a100-80gb").action_gap  # a GPU's host hides it


def _half(s: _Stage) -> _Stage:
    return _Stage(s.forward / 2, s.backward / 2, 0.0, 0.0, 0.0, 0, 0, 0, 0, 0.0, 0.0)


def test_max_batch_is_the_largest_global_batch_that_fits(gpt2) -> None:
    small = HW.with_(memory_bytes=2 * 2**20)
    candidate = costing(gpt2, small).candidate(Plan(dp=2))
    largest = candidate.max_batch()
    b = sympy.Symbol("B", integer=True, positive=True)
    assert largest > 0 and largest % candidate.batch_multiple == 0
    assert candidate.memory_expr.subs(b, largest) <= small.memory_bytes
    assert candidate.memory_expr.subs(b, largest + candidate.batch_multiple) > small.memory_bytes


@pytest.mark.parametrize(
    ("rows", "pp", "schedule", "expected"),
    [(8, 2, "1f1b", 8), (12, 2, "1f1b", 6), (7, 2, "gpipe", 7), (5, 4, "1f1b", 5), (12, 4, "interleaved_1f1b", 12),
     (6, 4, "interleaved_1f1b", 4)],
)  # fmt: skip
def test_default_microbatches_are_the_most_that_divide_the_rows(rows: int, pp: int, schedule: str, expected) -> None:
    assert default_microbatches(rows, pp, schedule) == expected


def test_a_collective_between_the_sizes_timed_costs_what_they_cost() -> None:
    """A measured collective's line runs through the smallest and the largest size timed; between, its cost is
    read off the timings (linear between the nearest two, none cheaper than a smaller one: noise), so a 2 MiB
    all-reduce that costs 1.6x the line here is predicted at its cost. Beyond the sizes, and on a group size
    not timed, the line; from JSON, the same."""
    from autoshard.planner.links import CollectiveFit

    mib = 2**20
    timed = ((2**10, 1e-3), (2**17, 3e-3), (2 * mib, 2e-3), (16 * mib, 10e-3))
    fit = CollectiveFit("all_reduce", "intra", 2, 2.0e9, 1e-4, timed)
    hw = Hardware.preset("cpu").with_(collectives=(fit,))
    assert hw.collective_seconds("all_reduce", 2**10, 2) == pytest.approx(1e-3)
    assert hw.collective_seconds("all_reduce", (2**10 + 2**17) / 2, 2) == pytest.approx(2e-3)
    assert hw.collective_seconds("all_reduce", mib, 2) == pytest.approx(3e-3)  # 2 MiB's 2 ms is noise: 3 ms
    assert hw.collective_seconds("all_reduce", 9 * mib, 2) == pytest.approx(6.5e-3)
    line = lambda n, size: 2 * (n - 1) * 1e-4 + 2 * (n - 1) / n * size / 2.0e9  # noqa: E731
    assert hw.collective_seconds("all_reduce", 32 * mib, 2) == pytest.approx(line(2, 32 * mib))
    assert hw.collective_seconds("all_reduce", mib, 4) == pytest.approx(line(4, mib))
    assert Hardware.from_json(hw.to_json()).collective_seconds("all_reduce", mib, 2) == pytest.approx(3e-3)


def test_shared_processors_are_those_a_hosts_ranks_run_on_together(monkeypatch) -> None:
    """shared_cores counts the processors a host's ranks may run on together: two ranks pinned to a core each
    share none, though each sees one processor of its own; four on two processors share them."""
    import socket

    from autoshard.planner.calibrate import _shared_processors

    monkeypatch.setattr(socket, "gethostname", lambda: "a")
    assert _shared_processors([("a", [0]), ("a", [1])]) == 0.0
    assert _shared_processors([("a", [0, 1])] * 4) == 2.0
    assert _shared_processors([("a", [0]), ("a", [0])]) == 1.0
    assert _shared_processors([("a", [0, 1]), ("a", [0, 1]), ("b", [0, 1]), ("b", [0, 1])]) == 0.0  # two hosts
    assert _shared_processors([("a", [0, 1])] * 3 + [("b", [0])]) == 2.0


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="two ranks, a core each (Linux)"
)
def test_ranks_pinned_to_cores_of_their_own_do_not_share_them(ranks) -> None:
    """LocalRanks pins two ranks to a core each where there are two: each sees one processor, and the
    calibration still counts them as not sharing (it had predicted such ranks at half their speed); four
    ranks on two processors share both."""
    results = ranks(2).run(shared_processors)
    assert [len(cpus) for cpus, _ in results] == [1, 1] and results[0][0] != results[1][0]
    assert [shared for _, shared in results] == [0.0, 0.0]
    cpus = len(os.sched_getaffinity(0))  # four ranks: pinned where there are cores enough, else sharing them all
    assert [shared for _, shared in ranks(4).run(shared_processors)] == [float(cpus) if cpus < 4 else 0.0] * 4


def test_cpu_ranks_are_calibrated_computing_at_once_as_they_train(ranks) -> None:
    """CPU ranks compute at once while training, on processors of their own or not (they share the memory and
    its caches either way), so the calibration times their compute every rank at once: the two ranks' timed
    calls overlap in time. (A GPU each: one rank at a time.)"""
    for shared in (False, True):
        first, second = ranks(2).run(timed_spans, shared)
        overlap = sum(max(0.0, min(a[1], b[1]) - max(a[0], b[0])) for a, b in zip(first, second))
        assert overlap > 0.5 * sum(end - start for start, end in first), (shared, overlap)


@pytest.mark.slow  # long (15-35 s): under -m slow
def test_measure_calibrates_every_rank_alike_and_keeps_its_groups(ranks) -> None:
    from autoshard.planner.kernels import TIMED

    results = ranks(4).run(measured_hardware, 2)
    measured = [Hardware.from_json(rank[0][0]) for rank in results]
    assert all(h == measured[0] for h in measured[1:])  # every rank gets the same figures, so plans alike
    hw = measured[0]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    shared = 4 > cpus
    assert hw.shared_cores == (float(cpus) if shared else 0.0)
    assert hw.sync_wait >= 0 and (shared or hw.sync_wait == 0)
    # Where ranks share cores, every group size is timed (the whole world's is sync_wait); else none waits.
    assert [n for n, _ in hw.group_sync_waits] == ([4, 2] if shared else [])
    assert all(hw.sync(n) == w >= 0 for n, w in hw.group_sync_waits) and hw.sync(4) == hw.sync_wait
    assert {(c.op, c.group_size) for c in hw.collectives} == {
        (op, n) for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "all_to_all") for n in (4, 2)
    }
    assert all(0 < c.bandwidth <= hw.memory_bandwidth and c.latency >= 0 for c in hw.collectives)
    assert all(len(c.points) == 4 and all(t > 0 for _, t in c.points) for c in hw.collectives)  # each size timed
    assert hw.peak() > 0 and hw.memory_bandwidth > 0 and hw.op_overhead > 0 and hw.matmul_half_dim >= 1
    assert hw.action_gap > 0  # CPU ranks: the pipeline runtime's bookkeeping between two actions
    assert [name for name, *_ in hw.kernel_rates] == list(TIMED)  # CPU ranks: each slow kernel's own rate
    # The probe groups are the process's shared ones: a second calibration makes none.
    assert all(rank[1][1] == rank[0][1] for rank in results)


def test_each_backward_adds_its_gradients_into_their_buffers(gpt2) -> None:
    """A microbatch's backward costs, besides its kernels, one pass that adds each parameter's gradient into the
    buffer it accumulates in (read both, write the sum): the share of a step that does not shrink with the
    microbatch, so many small microbatches cost more than a few large ones."""
    profile, sizes = gpt2[:2]
    block = profile.part(profile.blocks[0], 1, False)
    without = dataclasses.replace(block, param_bytes=0, _times={})
    cpu = Hardware.preset("cpu")
    extra = block.times(sizes, cpu, None).backward - without.times(sizes, cpu, None).backward
    assert block.param_bytes > 0 and extra == pytest.approx(3 * block.param_bytes / cpu.memory_bandwidth)
    assert block.times(sizes, cpu, None).forward == without.times(sizes, cpu, None).forward


def test_cpu_matmuls_add_their_operand_pass_where_devices_overlap_it() -> None:
    """A CPU GEMM packs its operands before it multiplies (their bytes over the memory bandwidth, then the
    FLOPs); a GPU's kernel overlaps the two, so the slower of them counts."""
    cpu, gpu = Hardware.preset("cpu"), Hardware.preset("a100-80gb")
    dims, flops, nbytes = (256.0, 768.0, 256.0), 2 * 256 * 768 * 256, 4 * (256 * 256 + 256 * 768 + 256 * 768)
    for hw in (cpu, gpu):
        compute = flops / (hw.peak() * hw.efficiency(*dims))
        moved = nbytes / hw.memory_bandwidth
        expected = compute + moved if hw.kernels == "cpu" else max(compute, moved)
        assert hw.matmul_seconds(flops, dims, nbytes) == pytest.approx(hw.op_overhead + expected)


def test_the_optimizer_step_moves_what_torchs_adamw_moves() -> None:
    """The cost model's Adam step (ADAM_KERNELS kernels, ADAM_PASSES fp32 values an element) is what
    torch.optim.AdamW runs, one tensor at a time and foreach: its aten ops over a parameter counted as they
    execute, each reading its distinct full-size operands and writing one result."""
    numel = 1000

    class Count(TorchDispatchMode):
        kernels = passes_ = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            flat = [x for a in [*args, *(kwargs or {}).values()] for x in (a if isinstance(a, list) else [a])]
            full = {x.data_ptr() for x in flat if isinstance(x, torch.Tensor) and x.numel() == numel}
            if full:  # the step counters are one-element tensors: not a pass over the parameter
                Count.kernels += 1
                Count.passes_ += len(full) + 1
            return func(*args, **(kwargs or {}))

    for foreach in (False, True):
        param = torch.nn.Parameter(torch.randn(numel))
        param.grad = torch.randn(numel)
        optimizer = torch.optim.AdamW([param], lr=1e-3, foreach=foreach)
        optimizer.step()  # the first step creates the moments
        Count.kernels = Count.passes_ = 0
        with Count():
            optimizer.step()
        assert (Count.kernels, Count.passes_) == (ADAM_KERNELS, ADAM_PASSES), foreach


def test_ranks_that_share_processors_step_their_optimizers_as_slowly_as_they_compute(gpt2) -> None:
    """Every rank steps its optimizer at once, after the gradients are reduced: 4 ranks on 2 shared processors
    take twice the one-rank time of Adam's passes over the rank's master elements (a ZeRO shard: a quarter)."""
    shared = Hardware.preset("cpu").with_(devices_per_node=4, shared_cores=2.0)
    elements = gpt2[2] // 4  # fp32 parameters
    for zero in (0, 1):
        step = costing(gpt2, shared).candidate(Plan(dp=4, zero=zero)).time.optimizer
        alone = shared.memory_seconds(ADAM_PASSES * 4 * elements / (4 if zero else 1), kernels=ADAM_KERNELS)
        assert step == pytest.approx(2 * alone)


def test_the_profile_costs_every_collective_a_tensor_parallel_rank_issues(ranks) -> None:
    """What the planner costs for a tp step is what a tp rank issues, call for call and byte for byte: the
    rewrite's collectives, the vocab-parallel loss's own all-reduces, and the all-reduce of the embedding's
    partial sum that the first block reads (made by the part that hands it on)."""
    issued_calls, issued_bytes = ranks(2).run(tp_collectives)[0]
    model, ids, target = small_gpt()
    captured = capture(model, (ids,), None, next_token_loss, target)
    passes.analyze(captured.gm, captured.rename)
    sizes = captured.example_sizes
    profile = profile_graph(captured.gm, sizes, "cpu", 0.0)
    calls: Counter = Counter()
    volume: Counter = Counter()
    for name in ("pre", *profile.blocks, "post"):
        for comm in profile.part(name, 2, False).comms:
            full = max(evaluate_expr(comm.nbytes_in, sizes), evaluate_expr(comm.nbytes_out, sizes))
            for op in (comm.forward, comm.backward):
                if op:  # the runtime counts an all-reduce's bytes twice (in and out of the reduction)
                    calls[f"tp_{op}"] += 1
                    volume[f"tp_{op}"] += (2 if op == "all_reduce" else 1) * full
    assert issued_calls == {"tp_all_reduce": 12}  # 4 a block, the embedding's sum, the head's input, the loss's 2
    assert dict(calls) == issued_calls and dict(volume) == issued_bytes


def test_a_synchronous_collective_waits_as_long_as_its_group_size_was_measured_to() -> None:
    """Fewer ranks arrive less far apart: the wait of the nearest group size measured applies; one rank waits for
    none; a Hardware without per-size figures (a preset, an older calibration) waits ``sync_wait`` in every group."""
    cpu = Hardware.preset("cpu").with_(sync_wait=0.006)
    assert cpu.sync(1) == 0.0 and cpu.sync(2) == cpu.sync(64) == 0.006
    measured = cpu.with_(group_sync_waits=((4, 0.006), (2, 0.004)))
    assert measured.sync(2) == 0.004 and measured.sync(3) == measured.sync(8) == 0.006  # nearest by ratio
    assert Hardware.from_json(measured.to_json()) == measured


def test_sequence_parallel_sums_its_replicated_weights_gradients_once_a_step(gpt2) -> None:
    """Under sequence parallelism each rank holds part of the norms' gradients; the runtime sums them over tp in
    one all-reduce a step after backward (not one a microbatch), and the planner costs that call."""
    profile, sizes = gpt2[:2]
    cpu = Hardware.preset("cpu").with_(sync_wait=1e-3)
    partial = sum(profile.part(name, 2, True).partial_grad_bytes for name in ("pre", *profile.blocks, "post"))
    assert partial > 0 and all(profile.part(name, 2, False).partial_grad_bytes == 0 for name in profile.parts)
    without = dataclasses.replace(profile, _cache={})
    for name in profile.parts:
        without._cache[(name, 2, True)] = dataclasses.replace(profile.part(name, 2, True), partial_grad_bytes=0)
    for m in (1, 2):
        plan = Plan(tp=2, sequence_parallel=True, microbatches=m)
        summed = Costing(profile, sizes, cpu).candidate(plan).time.tp_comm
        unsummed = Costing(without, sizes, cpu).candidate(plan).time.tp_comm
        assert summed - unsummed == pytest.approx(cpu.collective_seconds("all_reduce", partial, 2) + cpu.sync(2))


@pytest.fixture(scope="module")
def gpt2_5():
    """GPT-2 with 5 blocks: no even split into 2 x 2 virtual stages."""
    case = build_case("gpt2", layers=5)
    batch = case.batches[0]
    captured = capture(case.model, batch.inputs, batch.kwargs)
    passes.analyze(captured.gm, captured.rename)
    cost = summarize(captured.gm)
    flops = float(evaluate_expr(cost.flops_fwd + cost.flops_bwd, captured.example_sizes))
    return profile_graph(captured.gm, captured.example_sizes, HW.kernels, flops), captured.example_sizes


def test_interleaving_over_blocks_that_do_not_divide_evenly_when_asked(gpt2_5) -> None:
    asked = choose_plan(2, {"pp": 2, "schedule": "interleaved_1f1b"}, costing(gpt2_5), gpt2_5[1], HW)
    assert {(c.plan.schedule, c.plan.virtual_stages) for c in asked.candidates} == {("interleaved_1f1b", 2)}
    # The open search keeps to even splits (its speed on the largest runs) and says so when nothing else is left.
    open_search = choose_plan(2, {"pp": 2}, costing(gpt2_5), gpt2_5[1], HW)
    assert all(c.plan.virtual_stages == 1 for c in open_search.candidates)


def test_the_stages_at_the_ends_take_fewer_blocks_for_the_embedding_and_the_head(gpt2_5) -> None:
    plan = Plan(dp=1, pp=2, schedule="interleaved_1f1b", virtual_stages=2, microbatches=2)
    parts = costing(gpt2_5)._parts_per_stage(plan, 4)
    blocks = [sum(name.startswith("block") for name in stage) for stage in parts]
    assert sum(blocks) == 5 and "pre" in parts[0] and "post" in parts[-1]
    assert blocks[-1] == 1 and max(blocks[1:-1]) == 2  # the head and loss weigh more than a block's share


def test_sequence_parallel_blocks_keep_their_sequence_shard_under_full_recomputation() -> None:
    # Korthikanti et al.: with sequence parallelism a fully recomputed block keeps its input as the rank's
    # sequence shard, 2sbh/t bytes (the region re-gathers it in backward), as the program runs it.
    case = build_case("llama")
    batch = case.batches[0]
    captured = capture(case.model, batch.inputs, batch.kwargs)
    passes.analyze(captured.gm, captured.rename)
    sizes = captured.example_sizes
    profile = profile_graph(captured.gm, sizes, HW.kernels, 1.0)
    block = next(name for name in profile.parts if name.startswith("block"))
    inputs = [n for n in profile.parts[block].graph.nodes if n.op == "placeholder"]
    hidden = next(n for n in inputs if get_shape(n).requires_grad)  # the hidden state; the others: rotary, mask
    whole = float(evaluate_expr(get_shape(hidden).nbytes, sizes))
    for tp, sp, kept in ((2, False, whole), (2, True, whole / 2), (4, True, whole / 4)):
        assert profile.part(block, tp, sp).at("full", sizes)[0] == pytest.approx(kept), (tp, sp)


def test_the_search_tries_recompute_budgets_where_only_full_recomputation_fits(gpt2) -> None:
    none, full = (costing(gpt2).candidate(Plan(dp=1, recompute=r), False) for r in ("none", "full"))
    # Room for a quarter of what full recomputation frees: no recomputation does not fit, a budget does.
    hw = HW.with_(memory_bytes=int(full.memory.total + 0.8 * (none.memory.total - full.memory.total)))
    report = choose_plan(1, {}, costing(gpt2, hw), gpt2[1], hw)
    chosen = report.chosen
    assert isinstance(chosen.plan.recompute, float) and chosen.fits, chosen.plan
    assert chosen.step_time < costing(gpt2, hw).candidate(Plan(dp=1, recompute="full"), False).step_time


def test_a_plan_over_the_memory_is_ranked_by_its_memory_alone(gpt2) -> None:
    """The search's shortcut: with unfit_memory_only a plan that does not fit comes back as an Unfit with the
    full candidate's memory to the byte (what the search ranks it by), and one that fits as the full candidate."""
    plans = [Plan(dp=1), Plan(dp=1, recompute="full"), Plan(dp=1, tp=2), Plan(dp=2, zero=3),
             Plan(dp=1, pp=2, microbatches=4), Plan(dp=1, pp=2, microbatches=4, schedule="zb_h1")]  # fmt: skip
    full = [costing(gpt2).candidate(plan, False) for plan in plans]
    cut = sorted(c.memory.total for c in full)[len(full) // 2]  # about half of them fit
    small = costing(gpt2, HW.with_(memory_bytes=cut))
    for plan, whole in zip(plans, full):
        screened = small.candidate(plan, False, unfit_memory_only=True)
        assert screened.memory == whole.memory and screened.fits == (whole.memory.total <= cut), plan
        assert isinstance(screened, Unfit) is not screened.fits, plan
        if screened.fits:
            assert screened.step_time == whole.step_time, plan
    assert {c.fits for c in (small.candidate(p, False, unfit_memory_only=True) for p in plans)} == {True, False}


def test_a_cpu_kernel_slower_than_memory_is_costed_at_its_measured_rate(gpt2) -> None:
    """A CPU applies a tanh, a GELU or a softmax, or draws a dropout mask, slower than it moves memory
    (planner/kernels.py): a node that runs one of them costs what Hardware.measure() timed for it, forward and
    backward (twice the bytes); every other kernel, and every matmul with its weight gradient, as before."""
    profile, sizes = gpt2[:2]
    block = profile.part(profile.blocks[0], 1, False)
    tanh = [w for w in block.works if w.kernel_name == "tanh"]
    assert len(tanh) == 1  # GPT-2's GELU, written out: 0.5 * x * (1 + tanh(...))
    moved = float(evaluate_expr(tanh[0].nbytes, sizes))
    cpu = Hardware.preset("cpu")
    slow = cpu.with_(kernel_rates=(("tanh", cpu.memory_bandwidth / 4, cpu.memory_bandwidth / 2),))
    assert slow.kernel_seconds("tanh", moved) == pytest.approx(cpu.op_overhead + 4 * moved / cpu.memory_bandwidth)
    assert slow.kernel_seconds("tanh", moved, backward=True) == pytest.approx(
        cpu.op_overhead + 4 * moved / cpu.memory_bandwidth
    )
    assert slow.kernel_seconds("gelu", moved) == cpu.kernel_seconds("tanh", moved) == cpu.memory_seconds(moved)
    before, after = block.times(sizes, cpu, None), dataclasses.replace(block, _times={}).times(sizes, slow, None)
    assert after.forward - before.forward == pytest.approx(3 * moved / cpu.memory_bandwidth)
    assert after.backward - before.backward == pytest.approx(2 * moved / cpu.memory_bandwidth)
    assert after.weight_grad == before.weight_grad  # W: the matmuls' weight gradients
    assert Hardware.from_json(slow.to_json()) == slow


def test_the_kernels_timed_apart_are_named_by_what_they_compute() -> None:
    """The erf and the tanh GELU are timed apart (4x apart on one core here); a dropout draws a mask, and so is
    timed, only in training with p > 0; an add runs at the memory bandwidth."""
    from autoshard.planner.kernels import TIMED, kernel_name

    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.GELU(approximate="tanh"), torch.nn.Dropout(0.1),
        torch.nn.Dropout(0.0), torch.nn.LayerNorm(8), torch.nn.Softmax(-1),
    )  # fmt: skip
    captured = capture(model, (torch.randn(4, 8),), None, torch.nn.functional.mse_loss, torch.randn(4, 8))
    names = [kernel_name(n) for n in captured.gm.graph.nodes if n.op == "call_function"]
    assert [n for n in names if n] == ["gelu", "gelu_tanh", "dropout", "layer_norm", "softmax"]
    assert set(TIMED) >= {"gelu", "gelu_tanh", "dropout", "layer_norm", "softmax"}


def test_a_cpu_calibration_times_each_kernel_forward_and_backward() -> None:
    from autoshard.planner.calibrate import _kernel_rates
    from autoshard.planner.kernels import TIMED

    rates = _kernel_rates(torch.device("cpu"), shared=False)
    assert [name for name, *_ in rates] == list(TIMED)
    assert all(forward > 0 and backward > 0 for _, forward, backward in rates)
    assert _kernel_rates(torch.device("meta"), shared=False) == []  # a GPU's run at its memory bandwidth
