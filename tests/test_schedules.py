"""Pipeline schedules as data: builders, printing, parsing and the validator (tier 1, no ranks)."""

from __future__ import annotations

import re
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autoshard.spec.schedule_builders import build_schedule, gpipe, interleaved_1f1b, one_f_one_b
from autoshard.spec.schedules import Action, Schedule, ScheduleError

shapes = st.tuples(st.integers(1, 6), st.integers(1, 10))


@given(shapes)
def test_gpipe_and_1f1b_bubble_is_the_textbook_one(shape) -> None:
    pp, m = shape
    for schedule in (gpipe(pp, m), one_f_one_b(pp, m)):
        schedule.validate()
        expected = Fraction(pp - 1, m + pp - 1)
        assert all(Fraction(f).limit_denominator(1000) == expected for f in schedule.idle_fraction())


@given(shapes, st.integers(1, 4))
def test_interleaving_shrinks_the_bubble_by_v(shape, v: int) -> None:
    pp, groups = shape
    m = pp * groups
    schedule = interleaved_1f1b(pp, m, v)
    schedule.validate()
    expected = Fraction(pp - 1, v * m + pp - 1)
    assert all(Fraction(f).limit_denominator(1000) == expected for f in schedule.idle_fraction())


@given(shapes)
def test_activations_in_flight(shape) -> None:
    pp, m = shape
    assert gpipe(pp, m).peak_in_flight() == [m] * pp  # GPipe holds every microbatch
    assert max(one_f_one_b(pp, m).peak_in_flight()) <= pp  # 1F1B at most pp


def test_table_and_text_round_trip() -> None:
    schedule = one_f_one_b(2, 3)
    assert str(schedule) == "rank 0: 0F0 0F1 0B0 0F2 0B1 0B2\nrank 1: 1F0 1B0 1F1 1B1 1F2 1B2"
    assert Schedule.parse(str(schedule), name="1f1b").ranks == schedule.ranks
    assert schedule.table().splitlines()[1:] == [
        "rank 0: 0F0 0F1   . 0B0 0F2 0B1   . 0B2",
        "rank 1:   . 1F0 1B0 1F1 1B1 1F2 1B2   .",
    ]


def test_a_deadlocking_order_is_refused_before_any_send() -> None:
    with pytest.raises(ScheduleError, match=re.escape("rule 2: custom rank 1 runs 1B0 before its forward")):
        Schedule.parse("rank 0: 0F0 0B0\nrank 1: 1B0 1F0").validate()
    # Out of order on rank 0, but every receive can still be matched: valid.
    Schedule.parse("rank 0: 0F1 0F0 0B0 0B1\nrank 1: 1F0 1B0 1F1 1B1").validate()
    # Rank 0 waits for microbatch 0's gradient while rank 1 waits for microbatch 1's activations.
    msg = "rule 3: custom deadlocks at time 1: rank 0 waits at 0B0 for 1B0, rank 1 waits at 1F1 for 0F1"
    with pytest.raises(ScheduleError, match=re.escape(msg)):
        Schedule.parse("rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F1 1B1 1F0 1B0").validate()
    msg = (
        "rule 3: custom deadlocks at time 3: rank 0 waits at 0B1 for 1B1, rank 1 waits at 1B1 for 2B1, "
        "rank 2 waits at 2F0 for 1F0"
    )
    with pytest.raises(ScheduleError, match=re.escape(msg)):
        Schedule.parse("rank 0: 0F0 0F1 0B1 0B0\nrank 1: 1F1 1B1 1F0 1B0\nrank 2: 2F0 2B0 2F1 2B1").validate()


def test_rule_one_messages() -> None:
    with pytest.raises(
        ScheduleError, match=re.escape("rule 1: custom runs 1F0 on rank 0, but stage 1 lives on rank 1")
    ):
        Schedule.parse("rank 0: 0F0 1F0 0B0 1B0\nrank 1: ", microbatches=1).validate()
    with pytest.raises(ScheduleError, match=re.escape("rule 1: custom never runs 1B0")):
        Schedule.parse("rank 0: 0F0 0B0\nrank 1: 1F0").validate()
    with pytest.raises(ScheduleError, match=re.escape("rule 1: custom runs 0F0 twice")):
        Schedule.parse("rank 0: 0F0 0F0 0B0\nrank 1: 1F0 1B0").validate()


def test_too_few_microbatches_for_interleaving() -> None:
    msg = "interleaved 1F1B needs microbatches divisible by pp: 6 microbatches, pp=4; use a multiple of 4"
    with pytest.raises(ScheduleError, match=re.escape(msg)):
        build_schedule("interleaved_1f1b", pp=4, microbatches=6, virtual_stages=2)
    with pytest.raises(ScheduleError, match=re.escape("1f1b runs one stage per rank; virtual_stages=2 needs")):
        build_schedule("1f1b", pp=2, microbatches=4, virtual_stages=2)
    with pytest.raises(ScheduleError, match=re.escape("microbatches=0 must be at least 1")):
        build_schedule("gpipe", pp=2, microbatches=0)


def _runs_without_deadlock(schedule: Schedule) -> bool:
    """An oracle independent of the validator: the rank orders plus data dependencies form a DAG."""
    n_stages = schedule.n_stages
    edges: dict[Action, set[Action]] = {}
    for actions in schedule.ranks:
        for a in actions:
            edges.setdefault(a, set())
        for before, after in zip(actions, actions[1:]):
            edges[after].add(before)
    for a in list(edges):
        need = a.needs(n_stages)
        if need is not None:
            edges[a].add(need)
        if a.kind == "B":
            edges[a].add(Action(a.stage, "F", a.microbatch))
    indegree = {a: len(deps) for a, deps in edges.items()}
    users: dict[Action, list[Action]] = {a: [] for a in edges}
    for a, deps in edges.items():
        for d in deps:
            users[d].append(a)
    ready = [a for a, n in indegree.items() if n == 0]
    seen = 0
    while ready:
        a = ready.pop()
        seen += 1
        for u in users[a]:
            indegree[u] -= 1
            if indegree[u] == 0:
                ready.append(u)
    return seen == len(edges)


@given(
    shape=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    name=st.sampled_from(["gpipe", "1f1b"]),
    data=st.data(),
)
def test_validator_accepts_exactly_the_valid_orders(shape, name: str, data) -> None:
    pp, m = shape
    base = build_schedule(name, pp, m)
    ranks = tuple(tuple(data.draw(st.permutations(list(actions)))) for actions in base.ranks)
    schedule = Schedule(name, pp, m, 1, ranks)
    try:
        schedule.validate()
        accepted = True
    except ScheduleError:
        accepted = False
    assert accepted == _runs_without_deadlock(schedule)


# One refused schedule per check of the validator, each breaking that rule only (a broken rule 2 would
# also deadlock, so only the rule named in the message shows that rule 2 itself refused it).
BROKEN = {
    "rule 1: ranks for pp": (Schedule("custom", 2, 1, 1, ((Action(0, "F", 0), Action(0, "B", 0)),)), 1),
    "rule 1: not in this pipeline": ("rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F0 1B0 1F1 1B1", 1),
    "rule 1: wrong rank": ("rank 0: 0F0 0B0 1F0\nrank 1: 1B0", 1),
    "rule 1: twice": ("rank 0: 0F0 0F0 0B0\nrank 1: 1F0 1B0", 1),
    "rule 1: never runs": ("rank 0: 0F0 0B0\nrank 1: 1F0", 1),
    "rule 2: backward first": ("rank 0: 0F0 0B0\nrank 1: 1B0 1F0", 2),
    "rule 2: backward first, earlier stage": ("rank 0: 0B0 0F0\nrank 1: 1F0 1B0", 2),
    "rule 3: deadlock": ("rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F1 1B1 1F0 1B0", 3),
}


@pytest.mark.parametrize("case", BROKEN)
def test_each_rule_refuses_its_own_broken_schedule(case: str) -> None:
    schedule, rule = BROKEN[case]
    if isinstance(schedule, str):  # microbatches fixed at 1 where the schedule names a microbatch beyond it
        schedule = Schedule.parse(schedule, microbatches=1 if "pipeline" in case else None)
    with pytest.raises(ScheduleError, match=f"^rule {rule}: "):
        schedule.validate()
