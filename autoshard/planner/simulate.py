"""The pipeline schedule simulated with per-stage costs: the planner's bubble and its predicted timelines.

A schedule (autoshard/spec/schedules.py) becomes an integer table once; each simulation runs the table's
actions in order on every rank, an action starting when its rank is free and what it needs has arrived
(the producing action's end, plus the send between stages when they sit on different ranks).

Where a schedule splits backward, W takes what the stage's deferred matmuls' weight gradients cost (each a
matmul of its forward's size, and the sum into ``.grad``) and B the rest of its backward: the input
gradients, the non-matmul work, attention's activation-by-activation matmuls and any recomputation.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

from autoshard.spec.schedule_builders import build_schedule
from autoshard.spec.schedules import Schedule

__all__ = ["StageCost", "built", "costs", "in_flight", "labels", "simulate", "simulate_shared", "table"]


class StageCost(Protocol):
    """Seconds of one stage: a microbatch's forward, its backward, and the send to the next stage."""

    forward: float
    backward: float
    send: float
    weight_grad: float  # of backward: the weight gradients a split backward's W computes


@functools.lru_cache(maxsize=512)
def built(name: str, pp: int, microbatches: int, virtual_stages: int) -> Schedule:
    """A named schedule, not validated (its builder makes it right: compile validates the chosen one again)."""
    return build_schedule(name, pp, microbatches, virtual_stages, validate=False)


@dataclass(frozen=True)
class Table:
    """A schedule as integers, to simulate fast: per rank its actions as (index, stage, cost slot, index of the
    action it needs or -1, the stage whose boundary the transfer crosses or -1). Cost slots: the stages'
    forwards, backwards, then split backwards' B and W (``costs``)."""

    ranks: tuple[tuple[tuple[int, int, int, int, int], ...], ...]
    # Every action once as (rank, index, cost slot, need, link), each after the one it needs and after its
    # rank's previous one: times follow from that order alone, so a simulation is one pass over it. Need
    # and link are -1 where there is none, which reads the zero appended to the finish times and the sends.
    order: tuple[tuple[int, int, int, int, int], ...]


@functools.lru_cache(maxsize=1024)
def table(schedule: Schedule) -> Table:
    # Actions keyed as plain tuples and what each needs worked out inline (Action.needs): a 1024-rank search
    # builds tables of a million actions.
    keys = [(a.stage, a.kind, a.microbatch) for actions in schedule.ranks for a in actions]
    index = {key: i for i, key in enumerate(keys)}
    last, n = schedule.n_stages - 1, schedule.n_stages
    split = schedule.splits_backward
    rows, i = [], 0
    for rank, actions in enumerate(schedule.ranks):
        row = []
        for _ in actions:
            stage, kind, microbatch = keys[i]
            if kind == "F":
                need, slot = ((stage - 1, "F", microbatch) if stage > 0 else None), stage
            elif kind == "W":
                need, slot = (stage, "B", microbatch), 3 * n + stage
            else:
                need = (stage, "F", microbatch) if stage == last else (stage + 1, "B", microbatch)
                slot = (2 * n if split else n) + stage
            link = min(stage, need[0]) if need is not None and schedule.rank_of(need[0]) != rank else -1
            row.append((i, stage, slot, index[need] if need is not None else -1, link))
            i += 1
        rows.append(tuple(row))
    return Table(tuple(rows), _order(rows, i))


@functools.lru_cache(maxsize=1024)
def in_flight(schedule: Schedule) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """Per rank, the counts of microbatches it holds, forward's activations and W's factors, at the moments
    that can be its peak (``Schedule.held_counts``; a plan's memory needs no table)."""
    return tuple(schedule.held_counts())


@functools.lru_cache(maxsize=64)
def labels(schedule: Schedule) -> tuple[str, ...]:
    """Each action's name, in the table's index order (for timelines)."""
    return tuple(str(a) for actions in schedule.ranks for a in actions)


def costs(stages: tuple[StageCost, ...]) -> list[float]:
    """Seconds per cost slot: each stage's forward, backward, and its backward's B and W."""
    backward = [s.backward for s in stages]
    w = [s.weight_grad for s in stages]
    return [s.forward for s in stages] + backward + [b - x for b, x in zip(backward, w)] + w


def _order(rows: list[tuple[tuple[int, int, int, int, int], ...]], count: int) -> tuple[tuple[int, ...], ...]:
    """The actions in an order that runs each one after what it needs (a schedule that deadlocks: the
    actions before the deadlock; compile names the rule it breaks)."""
    done = [False] * count
    cursor = [0] * len(rows)
    order = []
    progressed = True
    while progressed:
        progressed = False
        for rank, actions in enumerate(rows):
            c = cursor[rank]
            while c < len(actions) and (actions[c][3] < 0 or done[actions[c][3]]):
                index, stage, slot, need, link = actions[c]
                order.append((rank, index, slot, need, link))
                done[index] = True
                c += 1
                progressed = True
            cursor[rank] = c
    return tuple(order)


@functools.lru_cache(maxsize=8192)  # plans that differ only in ZeRO stage or offload share their stages
def simulate(
    schedule: Schedule, stages: tuple[StageCost, ...], timeline: bool = False, gap: float = 0.0
) -> tuple[float, list[float], tuple]:
    """Run the schedule's action table with each stage's costs: (makespan, busy seconds per rank, and with
    ``timeline`` per rank its (action, start, end)). ``gap``: what a rank spends before each action outside
    any (Hardware.action_gap: the hand-over's bookkeeping once what the action needs is there), idle time."""
    steps = table(schedule)
    cost = costs(stages)
    send = [s.send for s in stages] + [0.0]
    names = labels(schedule) if timeline else ()
    finish = [0.0] * (sum(len(r) for r in steps.ranks) + 1)  # the last: the zero of no need
    pp = len(steps.ranks)
    free, busy = [0.0] * pp, [0.0] * pp
    rows: list[list[tuple[str, float, float]]] = [[] for _ in range(pp)]
    for rank, index, slot, need, link in steps.order:
        start, ready = free[rank], finish[need] + send[link]
        if ready > start:
            start = ready
        start += gap
        duration = cost[slot]
        free[rank] = finish[index] = start + duration
        busy[rank] += duration
        if timeline:
            rows[rank].append((names[index], start, start + duration))
    return max(free), busy, tuple(tuple(r) for r in rows)


@functools.lru_cache(maxsize=1024)
def simulate_shared(
    schedule: Schedule,
    stages: tuple[StageCost, ...],
    cores: float,
    copies: int,
    timeline: bool = False,
    gap: float = 0.0,
) -> tuple[float, list[float], tuple]:
    """``simulate`` on ranks that share ``cores`` cores (CPU ranks on one machine): the stage costs are one
    rank's alone, and every action computing at a moment proceeds at min(1, cores / computing), where
    ``copies`` ranks run each pipeline rank's actions in step (dp x tp per stage). A pipeline's ranks then
    compute faster while the others wait in the bubble, as they do on shared cores."""
    steps = table(schedule)
    cost = costs(stages)
    send = [s.send for s in stages]
    names = labels(schedule) if timeline else ()
    finish = [-1.0] * sum(len(r) for r in steps.ranks)
    pp = len(steps.ranks)
    busy, cursor, free = [0.0] * pp, [0] * pp, [0.0] * pp  # free: when the rank's last action ended
    rows: list[list[tuple[str, float, float]]] = [[] for _ in range(pp)]
    running: dict[int, list[float]] = {}  # rank -> [action index, work left, start]
    now = 0.0
    while True:
        waits = []  # when actions whose input is on its way can start
        for rank in range(pp):
            if rank in running or cursor[rank] >= len(steps.ranks[rank]):
                continue
            index, stage, slot, need, link = steps.ranks[rank][cursor[rank]]
            ready = free[rank]
            if need >= 0:
                if finish[need] < 0:
                    continue
                ready = max(ready, finish[need] + (send[link] if link >= 0 else 0.0))
            ready += gap
            if ready > now * (1 + 1e-12):
                waits.append(ready)
                continue
            running[rank] = [index, cost[slot], now]
        if not running:
            if not waits:
                break  # done, or a custom schedule that deadlocks: compile names the rule it breaks
            now = min(waits)
            continue
        rate = min(1.0, cores / (copies * len(running)))
        step = min(work for _, work, _ in running.values()) / rate
        if waits:
            step = min(step, min(waits) - now)
        now += step
        for rank in list(running):
            index, work, start = running[rank]
            busy[rank] += step
            running[rank][1] = work - step * rate
            if running[rank][1] <= 1e-12 * max(1.0, work):
                finish[int(index)] = free[rank] = now
                if timeline:
                    rows[rank].append((names[int(index)], start, now))
                cursor[rank] += 1
                del running[rank]
    return now, busy, tuple(tuple(r) for r in rows)
