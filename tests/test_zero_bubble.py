"""Zero-bubble pipelines: backward split into B (input gradients) and W (weight gradients).

Schedules as data (tier 1): ZB-H1 keeps every rule, holds no more microbatches than 1F1B's first rank, and
its simulated bubble shrinks. On real gloo ranks (tier 2): equal to single-device training, with the
weight gradients of the stages' matmuls computed in W.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from cases import build_case, compile_case, train_local_batches, train_pipeline, train_single_device
from compiled_cases import train_compiled
from hypothesis import given, settings
from hypothesis import strategies as st
from test_pipeline import ATOL, RTOL
from test_tp import TP_ATOL

import autoshard
from autoshard.graph_ops.weight_grad import WEIGHT_GRADS, matmul_deferring_weight_grad
from autoshard.planner.simulate import simulate
from autoshard.spec.schedule_builders import build_schedule, dualpipev, one_f_one_b, zb_h1, zb_h2, zbv
from autoshard.spec.schedules import Action, Schedule, ScheduleError


@dataclass(frozen=True)
class Cost:
    forward: float
    backward: float
    send: float = 0.0

    @property
    def weight_grad(self) -> float:  # W: half the backward, as much as B
        return self.backward / 2


@given(st.integers(1, 6), st.integers(1, 12))
def test_zb_h1_is_valid_and_holds_at_most_what_1f1b_holds_on_its_first_rank(pp: int, m: int) -> None:
    schedule = zb_h1(pp, m)
    schedule.validate()
    assert schedule.splits_backward
    for rank, actions in enumerate(schedule.ranks):
        kinds = [a.kind for a in actions]
        assert kinds.count("W") == kinds.count("B") == kinds.count("F") == m
        # Forwards and B's run in 1F1B's order: the split only adds W's.
        assert [a for a in actions if a.kind != "W"] == list(one_f_one_b(pp, m).ranks[rank])
    assert max(schedule.peak_in_flight()) == max(one_f_one_b(pp, m).peak_in_flight())


def test_what_a_split_backward_holds_at_its_peak() -> None:
    """The counts the planner's memory reads (Schedule.held_counts): zb_h1's last rank, measured at pp=4 with
    8 microbatches, peaks in a B with three microbatches waiting for their W. The one in B still keeps its
    activations while the gradients its W will read build up: (1, 3, 1); after it, four wait for their W
    and none is in B. No other moment holds more. 1F1B holds only activations, at most pp microbatches."""
    assert zb_h1(4, 8).held_counts()[3] == ((1, 3, 1), (0, 4, 0))
    assert one_f_one_b(4, 8).held_counts() == [((p, 0, 0),) for p in one_f_one_b(4, 8).peak_in_flight()]


@given(st.sets(st.tuples(st.integers(0, 8), st.integers(0, 8), st.integers(0, 1)), min_size=1, max_size=16))
def test_held_counts_keeps_exactly_the_moments_nothing_else_covers(moments: set) -> None:
    """The frontier held_counts keeps (a sweep, fast on a search's long schedules) is the definition's: the
    moments that no other moment holds at least as much as in every count."""
    from autoshard.spec.schedules import _frontier

    covered = lambda m: any(o != m and all(a >= b for a, b in zip(o, m)) for o in moments)  # noqa: E731
    assert sorted(_frontier(moments)) == sorted(m for m in moments if not covered(m))


@pytest.mark.parametrize("send", [0.0, 0.1])
@pytest.mark.parametrize(("pp", "m", "most"), [(4, 8, 0.55), (2, 8, 0.55)])
def test_zb_h1_bubble_against_1f1b_when_b_and_w_are_each_a_forward(pp: int, m: int, most: float, send: float) -> None:
    """F, B and W one unit each (1F1B's backward two): the simulated idle share per rank, with hand-overs
    free and taking a tenth of a forward (what gloo's take on the development machine)."""
    stages = tuple(Cost(1.0, 2.0, send) for _ in range(pp))
    makespan_zb, busy_zb, _ = simulate(zb_h1(pp, m), stages)
    makespan_1f1b, busy_1f1b, _ = simulate(one_f_one_b(pp, m), stages)
    assert busy_zb == busy_1f1b  # the same work
    idle_zb = 1 - sum(busy_zb) / (pp * makespan_zb)
    idle_1f1b = 1 - sum(busy_1f1b) / (pp * makespan_1f1b)
    assert idle_zb <= most * idle_1f1b, (idle_zb, idle_1f1b)


@given(st.integers(1, 6), st.integers(1, 16))
def test_zb_h2_warms_up_longer_and_runs_without_a_gap_once_it_has_the_microbatches(pp: int, m: int) -> None:
    schedule = zb_h2(pp, m)
    schedule.validate()
    for rank, actions in enumerate(schedule.ranks):
        kinds = [a.kind for a in actions]
        assert kinds.count("W") == kinds.count("B") == kinds.count("F") == m
        # The first B waits for the forward to reach the last stage and come back: 2(pp-r)-1 forwards fit.
        assert kinds.index("B") == min(m, 2 * (pp - rank) - 1)
    assert max(schedule.peak_in_flight()) <= 2 * pp - 1  # twice 1F1B's first rank, less one
    if m >= 2 * pp - 1:
        # A parallelogram: rank r idles r units before its first action and pp-1-r after its last, none
        # between, so one step's tail overlaps the next step's head.
        for rank, row in enumerate(schedule.timeline()):
            busy = [t for t, action in enumerate(row) if action is not None]
            assert busy == list(range(rank, rank + 3 * m)), (rank, row)


@given(st.integers(1, 8), st.integers(1, 24))
def test_zbv_is_valid_on_its_v_and_holds_what_1f1b_holds_on_its_first_rank(pp: int, m: int) -> None:
    schedule = zbv(pp, m)
    schedule.validate()  # rule 1 checks every action on the rank the V places its stage
    for rank, actions in enumerate(schedule.ranks):
        assert {a.stage for a in actions} == {rank, 2 * pp - 1 - rank}
    # Stages half of 1F1B's: 2pp of them held is 1F1B's first rank's pp whole ones.
    assert max(schedule.peak_in_flight()) <= 2 * pp


@given(st.integers(1, 8), st.integers(0, 16))
def test_dualpipev_orders_its_actions_as_torch_does(pp: int, extra: int) -> None:
    """DualPipeV against torch.distributed.pipelining's ScheduleDualPipeV, whose order it follows (its
    overlapped forward-and-backward and its whole backwards written out as F, B, W): the same actions in the same
    order on every rank; valid on its V, holding at most 2pp + 1 stage-microbatches."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules as torch_schedules

    m = 2 * pp + extra
    schedule = dualpipev(pp, m)
    schedule.validate()
    kinds = {torch_schedules.FORWARD: "F", torch_schedules.BACKWARD_INPUT: "B", torch_schedules.BACKWARD_WEIGHT: "W"}

    def written_out(action) -> list[tuple[int, str, int]]:  # noqa: ANN001 - torch's _Action
        kind = action.computation_type
        if kind == torch_schedules.OVERLAP_F_B:
            return [step for sub in action.sub_actions for step in written_out(sub)]
        if kind == torch_schedules.FULL_BACKWARD:
            return [(action.stage_index, k, action.microbatch_index) for k in "BW"]
        return [(action.stage_index, kinds[kind], action.microbatch_index)]

    for rank, actions in enumerate(schedule.ranks):
        theirs = torch_schedules.ScheduleDualPipeV._calculate_single_rank_operations(
            SimpleNamespace(pp_group_size=pp, _n_microbatches=m), rank
        )
        expected = [step for action in theirs if action is not None for step in written_out(action)]
        assert [(a.stage, a.kind, a.microbatch) for a in actions] == expected, rank
    assert max(schedule.peak_in_flight()) <= 2 * pp + 1
    with pytest.raises(ScheduleError, match="at least as many microbatches as stages"):
        dualpipev(pp, 2 * pp - 1)


@pytest.mark.parametrize(
    ("pp", "m", "send"), [(4, 8, 0.0), (2, 8, 0.0), (4, 4, 0.0), (8, 16, 0.0), (4, 8, 0.1), (2, 8, 0.1), (4, 16, 0.1)]
)
def test_zbv_bubble_against_1f1b_when_b_and_w_are_each_a_forward(pp: int, m: int, send: float) -> None:
    """With hand-overs taking a tenth of a stage's forward too: each B has a W's slack before the other rank
    needs its gradient (a schedule list-built for free hand-overs idled 0.59x of 1F1B at pp=2 then)."""
    one_stage = tuple(Cost(1.0, 2.0, send) for _ in range(pp))
    half_stages = tuple(Cost(0.5, 1.0, send) for _ in range(2 * pp))  # the same blocks cut in twice the stages
    makespan_v, busy_v, _ = simulate(zbv(pp, m), half_stages)
    makespan_1f1b, busy_1f1b, _ = simulate(one_f_one_b(pp, m), one_stage)
    idle_v = 1 - sum(busy_v) / (pp * makespan_v)
    idle_1f1b = 1 - sum(busy_1f1b) / (pp * makespan_1f1b)
    assert idle_v <= 0.35 * idle_1f1b, (idle_v, idle_1f1b)


def test_the_validator_knows_w_follows_its_b_and_comes_once_for_each() -> None:
    good = str(zb_h1(2, 2))
    early = good.replace("0B0 0W0", "0W0 0B0")
    with pytest.raises(ScheduleError, match=r"rule 2: .* runs 0W0 before its backward 0B0"):
        Schedule.parse(early).validate()
    missing = good.replace(" 0W1", "")
    with pytest.raises(ScheduleError, match=r"rule 1: .* never runs 0W1"):
        Schedule.parse(missing).validate()
    assert "0W1" in build_schedule("zb_h1", 2, 2).table()
    assert Action.parse("3W7") == Action(3, "W", 7)


@pytest.mark.parametrize("kind", ["linear", "addmm", "mm"])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_a_deferring_matmul_equals_the_op_and_its_gradients_exactly(kind: str, autocast) -> None:
    """Forward, input and bias gradients at once; the weight's in W: bit for bit what the op gives."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8) if kind == "linear" else torch.randn(6, 8)
    x.requires_grad_(True)
    weight = torch.nn.Parameter(torch.randn(5, 8) if kind == "linear" else torch.randn(8, 5))
    bias = None if kind == "mm" else torch.nn.Parameter(torch.randn(5))
    aten = torch.ops.aten
    ops = {"linear": lambda: aten.linear(x, weight, bias), "addmm": lambda: aten.addmm(bias, x, weight)}
    ops["mm"] = lambda: aten.mm(x, weight)
    arrivals = []
    weight.register_post_accumulate_grad_hook(lambda p: arrivals.append(WEIGHT_GRADS.holds_back(p)))

    def run(fn):
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            return fn()

    reference = run(ops[kind])
    grad = torch.randn_like(reference)
    reference.backward(grad)
    expected = [t.grad.clone() for t in (x, weight, bias) if t is not None]
    for t in (x, weight, bias):
        if t is not None:
            t.grad = None
    arrivals.clear()
    out = run(lambda: matmul_deferring_weight_grad(kind, x, weight, bias))
    assert torch.equal(out, reference)
    with WEIGHT_GRADS.collect() as deferred:
        out.backward(grad)
    assert weight.grad is None and len(deferred) == 1
    assert arrivals in ([], [True])  # autograd's empty accumulation in B is no arrival
    WEIGHT_GRADS.apply(deferred)
    assert arrivals[-1] is False and not deferred
    got = [t.grad for t in (x, weight, bias) if t is not None]
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_an_earlier_w_adds_into_the_gradient_with_no_product_of_its_own() -> None:
    """A W that does not complete its stage adds a@b into ``.grad`` in one fused multiply-add: bit for bit the
    product then the sum (fp32), with nothing of the weight's size allocated (a product, then an add, would
    cost a write and a read of it)."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(256, 128))
    x = torch.randn(4, 128)
    with WEIGHT_GRADS.collect() as deferred:
        matmul_deferring_weight_grad("linear", x, weight).backward(torch.randn(4, 256))
    factors = deferred[0].factors()
    weight.grad = torch.randn(256, 128)
    expected = weight.grad + factors[0].mm(factors[1])
    grad = weight.grad
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        WEIGHT_GRADS.apply(deferred, completes=False)
    allocated = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    assert weight.grad is grad and torch.equal(grad, expected)
    assert max(allocated, default=0) < weight.numel() * weight.element_size()


# (family, mesh, plan, layers): the schedules' edge cases: tied embedding across four stages, dp with
# ZeRO's reduce-scatter after the last W, tp collectives inside B, recomputed regions replayed in B.
ZB_RUNS = {
    "gpt2-pp4": ("gpt2", {"pp": 4}, {"microbatches": 8}, 4),
    "llama-pp4": ("llama", {"pp": 4}, {"microbatches": 8}, 4),
    "gpt2-dp2xpp2-zero1": ("gpt2", {"dp": 2, "pp": 2}, {"microbatches": 4, "zero": 1}, 2),
    "llama-dp2xpp2-zero2": ("llama", {"dp": 2, "pp": 2}, {"microbatches": 4, "zero": 2}, 2),
    "gpt2-dp2xpp2-zero3": ("gpt2", {"dp": 2, "pp": 2}, {"microbatches": 4, "zero": 3}, 2),
    "llama-tp2xpp2": ("llama", {"tp": 2, "pp": 2}, {"microbatches": 4}, 2),
    "gpt2-pp2-recompute": ("gpt2", {"pp": 2}, {"microbatches": 4, "recompute": "full"}, 2),
    "bert-dp2xpp2": ("bert", {"dp": 2, "pp": 2}, {"microbatches": 2}, 2),
}


ZB_SCHEDULES = ("zb_h1", "zb_h2", "zbv", "dualpipev")
# dualpipev needs microbatches >= 2 x pp (its stages): every run but bert's 2
ZB_GRID = [(r, s) for r in ZB_RUNS for s in ZB_SCHEDULES if s != "dualpipev" or ZB_RUNS[r][2]["microbatches"] >= 4]


@pytest.mark.slow
@pytest.mark.parametrize(("run", "schedule"), ZB_GRID)
def test_zero_bubble_matches_single_device(ranks, run: str, schedule: str) -> None:
    check_zero_bubble(ranks, run, schedule)


# The grid above (14 runs, about 2 minutes here) runs with -m slow; the default run takes these, one
# edge case each, and a hypothesis-drawn point of the grid.
@pytest.mark.parametrize(
    ("run", "schedule"),
    [
        ("gpt2-pp4", "zbv"),
        ("llama-dp2xpp2-zero2", "zb_h1"),
        ("llama-tp2xpp2", "zbv"),
        ("gpt2-pp2-recompute", "zb_h1"),
        ("gpt2-dp2xpp2-zero3", "zb_h2"),
        ("gpt2-dp2xpp2-zero1", "dualpipev"),
    ],
)
def test_zero_bubble_matches_single_device_on_its_edges(ranks, run: str, schedule: str) -> None:
    check_zero_bubble(ranks, run, schedule)


@settings(max_examples=1)
@given(case=st.sampled_from(ZB_GRID))
def test_zero_bubble_matches_single_device_sample(ranks, case: tuple[str, str]) -> None:
    check_zero_bubble(ranks, *case)


def check_zero_bubble(ranks, run: str, schedule: str) -> None:
    family, mesh, plan, layers = ZB_RUNS[run]
    v = 2 if schedule in ("zbv", "dualpipev") else 1  # two stages a rank, so twice the blocks
    world = mesh.get("dp", 1) * mesh.get("tp", 1) * mesh["pp"]
    results = ranks(world).run(train_pipeline, family, mesh, {"schedule": schedule, **plan}, layers=layers * v)
    ref_losses, ref_state = train_single_device(family, layers=layers * v)
    atol = TP_ATOL if mesh.get("tp", 1) > 1 else ATOL  # tp's all-reduces sum in another order
    for result in results:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=RTOL, atol=0)
        # every stage's matmuls hold their weight gradients for W (each step, each microbatch); no more
        # stage-microbatches in flight than 1F1B's first rank holds
        assert result["weight_grads_deferred"] >= 3 * plan["microbatches"], result["weight_grads_deferred"]
        bound = {"zb_h2": 2 * mesh["pp"] - 1, "dualpipev": 2 * mesh["pp"] + 1}.get(schedule, mesh["pp"] * v)
        assert result["peak_in_flight"] <= bound
    state = results[0]["state"]
    assert set(state) == set(ref_state)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, rtol=RTOL, atol=atol, msg=lambda m, k=key: f"{k}: {m}")


def _gradients_outside_their_buckets(rank: int, world_size: int, mesh: dict[str, int], schedule: str) -> list[str]:
    """Train with ``schedule``; before every action, the parameters whose gradient is not in its bucket."""
    case = build_case("gpt2", steps=2, layers=4)  # zbv: two stages a rank
    program = compile_case(case, autoshard.Mesh(**mesh), plan={"schedule": schedule, "microbatches": 4})
    runtime = program.runtime
    buckets = {b.untyped_storage().data_ptr() for b in runtime.holder.buffers.values()}
    strays, before = [], runtime.runner.before_action

    def check(action: Action) -> None:
        for name, param in program.named_parameters():
            if param.grad is not None and param.grad.untyped_storage().data_ptr() not in buckets:
                strays.append(f"{name} before {action}")
        before(action)

    runtime.runner.before_action = check
    train_local_batches(program, case)
    return strays


@pytest.mark.parametrize(
    ("mesh", "schedule"),
    [
        ({"pp": 2}, "zb_h1"),
        ({"pp": 2}, "1f1b"),
        pytest.param({"dp": 2, "pp": 2}, "zbv", marks=pytest.mark.slow),
    ],
)
def test_a_w_writes_a_weights_first_gradient_into_its_bucket(ranks, mesh: dict[str, int], schedule: str) -> None:
    """Data parallel buckets hold the gradients: a W that ran before the stage's last keeps no weight-sized
    tensor of its own beside the bucket (a step's peak would grow by a weight a weight, 4.3x 1F1B's at pp2);
    nor does an eager 1F1B's B, which adds its weight gradients itself as W would."""
    world = mesh.get("dp", 1) * mesh["pp"]
    for strays in ranks(world).run(_gradients_outside_their_buckets, mesh, schedule):
        assert not strays, strays[:5]


@pytest.mark.parametrize(
    "run",
    [
        "gpt2-dp2xpp2-zero3",
        pytest.param("llama-tp2xpp2", marks=pytest.mark.slow),
        pytest.param("gpt2-dp2xpp2-zero1", marks=pytest.mark.slow),
    ],
)
def test_zb_h1_computes_what_1f1b_computes_bit_for_bit(ranks, run: str) -> None:
    """The split reorders work, not arithmetic: the same ops on the same values, summed in the same order,
    and the same collectives (ZeRO-3 reduce-scatters each group once a step, after the stage's last W)."""
    family, mesh, plan, layers = ZB_RUNS[run]
    world = mesh.get("dp", 1) * mesh.get("tp", 1) * mesh["pp"]
    results = [
        ranks(world).run(train_pipeline, family, mesh, {"schedule": schedule, **plan}, layers=layers)
        for schedule in ("1f1b", "zb_h1")
    ]
    for key, value in results[0][0]["state"].items():
        assert torch.equal(results[1][0]["state"][key], value), key
    for one_f_one_b_rank, zb_rank in zip(*results):
        assert zb_rank["volumes"] == one_f_one_b_rank["volumes"]


@pytest.mark.parametrize(
    ("family", "mesh", "plan", "layers"),
    [
        pytest.param(
            "gpt2", {"dp": 2, "pp": 2}, {"microbatches": 2, "schedule": "zb_h1", "zero": 1}, 2, marks=pytest.mark.slow
        ),
        ("llama", {"dp": 2, "pp": 2}, {"microbatches": 2, "schedule": "zbv"}, 4),
        pytest.param(  # ZeRO-3 under inductor: the gathers stay eager too
            "llama", {"dp": 2, "pp": 2}, {"microbatches": 2, "schedule": "zb_h1", "zero": 3}, 2, marks=pytest.mark.slow
        ),
        pytest.param(
            "gpt2", {"dp": 2, "pp": 2}, {"microbatches": 4, "schedule": "dualpipev"}, 4, marks=pytest.mark.slow
        ),
    ],
)
def test_zero_bubble_under_torch_compile_matches_single_device(ranks, family, mesh, plan, layers) -> None:
    """Inductor compiles the work between the matmuls; the matmuls stay eager and hold their weight gradients."""
    results = ranks(4).run(train_compiled, family, mesh, plan, "inductor", layers=layers)
    ref_losses, ref_state = train_single_device(family, layers=layers)
    for result in results:
        assert result["losses"] == pytest.approx(ref_losses, rel=RTOL)
        assert result["compile_seconds"] > 0 and result["graphs"]
        assert result["weight_grads_deferred"] >= 3 * plan["microbatches"]
    state = results[0]["state"]
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, rtol=RTOL, atol=ATOL, msg=lambda m, k=key: f"{k}: {m}")


def test_the_reports_timeline_draws_w_apart_from_f_and_b() -> None:
    from autoshard.inspection.html import ACTION_COLORS, timeline

    lane = [("0F0", 0.0, 1.0), ("0B0", 1.0, 2.0), ("0W0", 2.0, 3.0)]
    html = timeline([("pp rank 0", lane)], "zb")
    for kind in "FBW":
        assert f'fill="{ACTION_COLORS[kind]}"' in html, kind
    assert ACTION_COLORS["W"] not in timeline([("pp rank 0", lane[:2])], "1f1b")  # no W, no W in the legend


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_a_zero_bubble_stage_keeps_and_recomputes_what_a_1f1b_stage_does(recompute: str) -> None:
    """The analyses see the matmul a deferring op runs: the same bytes kept (matmuls as matmuls), and selective
    recomputation keeps the weight matmuls it keeps under 1F1B. Planned offline, no process group."""
    import autoshard
    from autoshard.demo import TinyGPT, next_token_loss, successor_batch

    ids, target = successor_batch(0, 8, 32)

    def saved(schedule: str) -> list:
        torch.manual_seed(0)
        plan = {"schedule": schedule, "microbatches": 2, "recompute": recompute}
        program = autoshard.compile(
            TinyGPT(), autoshard.Mesh(pp=2), (ids,), loss_fn=next_token_loss, example_target=target, plan=plan
        )
        return [
            (name, memory.kept, memory.transient, memory.layers) for name, memory in program.cost.saved_for_backward
        ]

    assert saved("zb_h1") == saved("1f1b")
