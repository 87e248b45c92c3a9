"""The planner's terms against closed forms worked here by hand, on GPT-2 (2 blocks) and a toy machine whose
links and memory have round figures: per-rank model states for every ZeRO stage under tp and pp, with bf16
parameters and offload; the gradient reduction's window with and without accumulation; ZeRO's traffic;
the offloaded step. The per-rank parameter counts come from the compiler's placements, not the planner's
profile, so a term cannot drift without a test naming it."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math

import pytest
import torch
from cases import build_case

import autoshard
from autoshard import passes
from autoshard.capture import capture
from autoshard.capture.cast import cast_model
from autoshard.errors import PlanError
from autoshard.ir.cost import summarize
from autoshard.ir.meta import evaluate_expr
from autoshard.ir.placements import OnStages, Shard
from autoshard.planner.costing import ADAM_KERNELS, ADAM_PASSES, HOST_OP_OVERHEAD, Costing
from autoshard.planner.hardware import Hardware
from autoshard.planner.profile import profile_graph
from autoshard.spec.plan import Plan

# Round figures: a ring collective over 2 ranks moves (n-1)/n or 2(n-1)/n of the tensor at 1 GB/s, no latency.
TOY = Hardware(
    name="toy", devices_per_node=8, memory_bytes=2**40, peak_flops={"float32": 1e12, "bfloat16": 4e12},
    matmul_efficiency=1.0, matmul_half_dim=0.0, memory_bandwidth=1e11, op_overhead=0.0,
    intra_bandwidth=1e9, intra_latency=0.0, inter_bandwidth=1e8, inter_latency=0.0,
    host_bandwidth=2e9, host_memory_bandwidth=5e9, overlap=0.5,
)  # fmt: skip
DP, BW = 2, 1e9


def _costing(case, dtype: torch.dtype | None) -> Costing:
    """The planner's costing of the model as compile profiles it: cast to the plan's param_dtype first."""
    batch = case.batches[0]
    model, inputs, kwargs = copy.deepcopy(case.model), batch.inputs, batch.kwargs
    if dtype is not None:
        model, inputs, kwargs, _ = cast_model(dtype, model, inputs, kwargs, None)
    captured = capture(model, inputs, kwargs)
    passes.analyze(captured.gm, captured.rename)
    cost = summarize(captured.gm)
    sizes = captured.example_sizes
    flops = float(evaluate_expr(cost.flops_fwd + cost.flops_bwd, sizes))
    return Costing(profile_graph(captured.gm, sizes, TOY.kernels, flops), sizes, TOY)


@pytest.fixture(scope="module")
def model_and_costing():
    case = build_case("gpt2")
    return case, _costing(case, None)


@pytest.fixture(scope="module")
def bf16_costing(model_and_costing):
    return _costing(model_and_costing[0], torch.bfloat16)


_held_cache: dict[tuple[int, int], list[dict[str, list[int]]]] = {}


def held_per_rank(case, tp: int, pp: int) -> list[dict[str, list[int]]]:
    """Per pipeline rank: each part's (embeddings "pre", "block<i>", "post") tp-local element counts of the
    unique trainable tensors it holds, from the compiled program's placements; a tied tensor counts on
    every stage that holds it, in the part that first reads it (the embeddings) on the first and as a
    copy ("tied") elsewhere."""
    if (tp, pp) in _held_cache:
        return _held_cache[(tp, pp)]
    model = copy.deepcopy(case.model)
    keys_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        keys_of.setdefault(id(p), []).append(name)
    numel = {id(p): p.numel() for p in model.parameters()}
    batch = case.batches[0]
    plan = {"microbatches": 2} if pp > 1 else {}
    program = autoshard.compile(model, autoshard.Mesh(dp=DP, tp=tp, pp=pp), batch.inputs, batch.kwargs, plan=plan)
    placements = program.placements
    out = []
    for rank in range(pp):
        parts: dict[str, list[int]] = {}
        for pid, keys in keys_of.items():
            held = [k for k in keys if placements[k].held_on({"pp": rank, "dp": 0}, 1)]
            if not held:
                continue
            first = keys[0]  # the first reader's key
            local = numel[pid] // (tp if isinstance(placements[held[0]].tp, Shard) else 1)
            if first.startswith("transformer.h."):
                part = "block" + first.split(".")[2]
            elif first.startswith(("transformer.wte", "transformer.wpe")):
                first_stage = min(placements[first].pp.ranks) if isinstance(placements[first].pp, OnStages) else 0
                part = "pre" if rank == first_stage else "tied"
            else:
                part = "post"
            parts.setdefault(part, []).append(local)
        out.append(parts)
    _held_cache[(tp, pp)] = out
    return out


def expected_states(parts: dict[str, list[int]], plan: Plan) -> tuple[int, int, int, int, int]:
    """(weights, gradients, optimizer, masters, gathered) bytes of one rank at the end of backward."""
    itemsize = 2 if plan.param_dtype == torch.bfloat16 else 4
    elements = sum(sum(v) for v in parts.values())
    w = elements * itemsize
    largest = max(sum(v) * itemsize for part, v in parts.items() if part != "tied")
    shard = DP if plan.zero >= 1 else 1
    weights, grads, gathered = w, w, 0
    if plan.zero == 3:
        weights = w // DP
        gathered = 2 * largest  # a layer gathered and the next prefetched
        # accumulating microbatches keep the whole gradient buffers; else each layer's until reduce-scattered
        grads = w // DP + (w if plan.microbatches > 1 else 2 * largest)
    optimizer = 2 * elements * 4 // shard  # Adam's two fp32 moments
    masters = elements * 4 // shard if itemsize == 2 else 0
    if plan.offload:
        optimizer = masters = 0  # on the host
    return weights, grads, optimizer, masters, gathered


def _plans():
    for tp, pp, zero, bf16, offload, micro in itertools.product((1, 2), (1, 2), (0, 1, 2, 3), (False, True),
                                                                (False, True), (1, 2)):  # fmt: skip
        try:
            yield Plan(dp=DP, tp=tp, pp=pp, zero=zero, offload=offload, microbatches=micro,
                       param_dtype=torch.bfloat16 if bf16 else None)  # fmt: skip
        except PlanError:
            continue


PLANS = list(_plans())


@pytest.mark.parametrize("plan", PLANS, ids=str)
def test_model_states_per_rank(model_and_costing, bf16_costing, plan: Plan) -> None:
    case, costing = model_and_costing
    costing = bf16_costing if plan.param_dtype is not None else costing
    memory = costing.candidate(plan, with_timeline=False).memory
    got = (memory.weights, memory.gradients, memory.optimizer, memory.masters, memory.gathered)
    per_rank = [expected_states(parts, plan) for parts in held_per_rank(case, plan.tp, plan.pp)]
    assert got in per_rank, f"{plan}: {got}, by hand {per_rank}"


@pytest.mark.parametrize("micro", [1, 2, 4])
@pytest.mark.parametrize("zero", [0, 1, 2])
def test_the_gradient_reduction_hides_behind_the_last_backward_only(model_and_costing, zero: int, micro: int) -> None:
    """Accumulating microbatches reduce their gradients once, during the last microbatch's backward: the window
    is one microbatch's backward, whatever the count; what overlap cannot hide, at least the last bucket's
    share, is exposed. ZeRO 1-2 then gather the updated parameters, exposed whole."""
    case, costing = model_and_costing
    plan = Plan(dp=DP, zero=zero, microbatches=micro, bucket_mb=0.01)  # buckets of 10 kB: a dozen
    time = costing.candidate(plan, with_timeline=False).time
    rows = costing.sizes["B"] // DP // micro
    stage = costing._stages(plan, rows)[0]
    elements = sum(sum(v) for v in held_per_rank(case, 1, 1)[0].values())
    grad_bytes = elements * 4
    calls = math.ceil(grad_bytes / plan.bucket_bytes)
    if zero == 0:
        seconds = grad_bytes * 2 * (DP - 1) / DP / BW  # ring all-reduce
        last = seconds * min(1.0, plan.bucket_bytes / grad_bytes)
    else:
        seconds = grad_bytes * (DP - 1) / DP / BW  # reduce-scatter
        last = seconds / calls
    assert calls > 1 and seconds - TOY.overlap * stage.backward > last  # the window decides here
    expected = max(seconds - TOY.overlap * stage.backward, last)
    if zero:
        expected += grad_bytes * (DP - 1) / DP / BW  # the all-gather of the updated fp32 parameters
    assert time.dp_comm == pytest.approx(expected, rel=1e-9)
    assert time.compute == pytest.approx(micro * (stage.forward + stage.backward - stage.tp_comm), rel=1e-9)


@pytest.mark.parametrize("micro", [1, 2])
def test_zero3_gathers_every_layer_twice_a_microbatch(model_and_costing, micro: int) -> None:
    case, costing = model_and_costing
    plan = Plan(dp=DP, zero=3, microbatches=micro)
    time = costing.candidate(plan, with_timeline=False).time
    parts = held_per_rank(case, 1, 1)[0]
    w = sum(sum(v) for v in parts.values()) * 4
    largest = max(sum(v) * 4 for v in parts.values())
    gathers = 2 * micro * w * (DP - 1) / DP / BW  # forward and backward, each layer's group
    exposed = max(gathers - TOY.overlap * time.compute, 0.0)
    assert time.zero3 == pytest.approx(exposed + largest * (DP - 1) / DP / BW, rel=1e-9)


@pytest.mark.parametrize("zero", [0, 1])
def test_cpu_ranks_step_at_the_hosts_optimizer_bandwidth_devices_at_their_memorys(model_and_costing, zero) -> None:
    """A device's step streams its memory (20 passes of fp32 an element); CPU ranks step at the bandwidth
    Hardware.measure() times an AdamW step at (their caches keep part of each parameter's passes), the
    host's figure; ZeRO steps a dp share. No cores shared here: the step once."""
    case, costing = model_and_costing
    master = sum(sum(v) for v in held_per_rank(case, 1, 1)[0].values()) * 4 // (DP if zero else 1)
    plan = Plan(dp=DP, zero=zero)
    device = costing.candidate(plan, with_timeline=False).time.optimizer
    assert device == pytest.approx(ADAM_PASSES * master / TOY.memory_bandwidth, rel=1e-9)  # op_overhead 0
    on_cpu = Costing(costing.profile, costing.sizes, dataclasses.replace(TOY, kernels="cpu"))
    host = on_cpu.candidate(plan, with_timeline=False).time.optimizer
    assert host == pytest.approx(ADAM_PASSES * master / TOY.host_memory_bandwidth, rel=1e-9)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_the_offloaded_step_moves_the_shard_down_and_up_and_steps_it_on_the_host(model_and_costing, zero) -> None:
    case, costing = model_and_costing
    time = costing.candidate(Plan(dp=DP, zero=zero, offload=True), with_timeline=False).time
    master = sum(sum(v) for v in held_per_rank(case, 1, 1)[0].values()) * 4 // DP
    assert time.offload == pytest.approx(2 * master / TOY.host_bandwidth, rel=1e-9)
    assert time.optimizer == pytest.approx(
        ADAM_PASSES * master / TOY.host_memory_bandwidth + ADAM_KERNELS * HOST_OP_OVERHEAD, rel=1e-9
    )
