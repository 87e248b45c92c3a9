"""The pipeline schedule simulated with per-stage costs: the planner's bubble and its predicted timelines.

A schedule (autoshard/schedules.py) becomes an integer table once; each simulation runs the table's
actions in order on every rank, an action starting when its rank is free and what it needs has arrived
(the producing action's end, plus the send between stages when they sit on different ranks).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

from autoshard.schedules import Schedule, gpipe, interleaved_1f1b, one_f_one_b

__all__ = ["StageCost", "built", "simulate", "table"]


class StageCost(Protocol):
    """Seconds of one stage: a microbatch's forward, its backward, and the send to the next stage."""

    forward: float
    backward: float
    send: float


@functools.lru_cache(maxsize=512)
def built(name: str, pp: int, microbatches: int, virtual_stages: int) -> Schedule:
    """A named schedule (built by its constructor, which is right by construction: compile validates the
    chosen one again)."""
    if name == "gpipe":
        return gpipe(pp, microbatches)
    if name == "1f1b":
        return one_f_one_b(pp, microbatches)
    return interleaved_1f1b(pp, microbatches, virtual_stages)


@dataclass(frozen=True)
class Table:
    """A schedule as integers, to simulate fast: per rank its actions as (index, stage, forward, index of the
    action it receives from or -1, the stage whose boundary the transfer crosses or -1)."""

    ranks: tuple[tuple[tuple[int, int, bool, int, int], ...], ...]
    labels: tuple[str, ...]
    in_flight: tuple[int, ...]


@functools.lru_cache(maxsize=1024)
def table(schedule: Schedule) -> Table:
    index = {a: i for i, a in enumerate(a for actions in schedule.ranks for a in actions)}
    rows = []
    for rank, actions in enumerate(schedule.ranks):
        row = []
        for action in actions:
            need = action.needs(schedule.n_stages)
            remote = need is not None and schedule.rank_of(need.stage) != rank
            link = min(action.stage, need.stage) if remote else -1
            row.append((index[action], action.stage, action.kind == "F", index[need] if need else -1, link))
        rows.append(tuple(row))
    return Table(tuple(rows), tuple(str(a) for a in index), tuple(schedule.peak_in_flight()))


@functools.lru_cache(maxsize=8192)  # plans that differ only in ZeRO stage or offload share their stages
def simulate(
    schedule: Schedule, stages: tuple[StageCost, ...], timeline: bool = False
) -> tuple[float, list[float], tuple]:
    """Run the schedule's action table with each stage's costs: (makespan, busy seconds per rank, and with
    ``timeline`` per rank its (action, start, end))."""
    steps = table(schedule)
    forward = [s.forward for s in stages]
    backward = [s.backward for s in stages]
    send = [s.send for s in stages]
    finish = [-1.0] * len(steps.labels)
    pp = len(steps.ranks)
    free, busy, cursor = [0.0] * pp, [0.0] * pp, [0] * pp
    rows: list[list[tuple[str, float, float]]] = [[] for _ in range(pp)]
    remaining = sum(len(r) for r in steps.ranks)
    while remaining:
        progressed = False
        for rank in range(pp):
            actions, c = steps.ranks[rank], cursor[rank]
            while c < len(actions):
                index, stage, is_forward, need, link = actions[c]
                ready = 0.0
                if need >= 0:
                    if finish[need] < 0:
                        break
                    ready = finish[need] + (send[link] if link >= 0 else 0.0)
                duration = forward[stage] if is_forward else backward[stage]
                start = free[rank] if free[rank] > ready else ready
                free[rank] = finish[index] = start + duration
                busy[rank] += duration
                if timeline:
                    rows[rank].append((steps.labels[index], start, start + duration))
                c += 1
                remaining -= 1
                progressed = True
            cursor[rank] = c
        if not progressed:
            break  # a custom schedule that deadlocks: compile names the rule it breaks
    return max(free), busy, tuple(tuple(r) for r in rows)


@functools.lru_cache(maxsize=1024)
def simulate_shared(
    schedule: Schedule, stages: tuple[StageCost, ...], cores: float, copies: int, timeline: bool = False
) -> tuple[float, list[float], tuple]:
    """``simulate`` on ranks that share ``cores`` cores (CPU ranks on one machine): the stage costs are one
    rank's alone, and every action computing at a moment proceeds at min(1, cores / computing), where
    ``copies`` ranks run each pipeline rank's actions in step (dp x tp per stage). A pipeline's ranks then
    compute faster while the others wait in the bubble, as they do on shared cores."""
    steps = table(schedule)
    forward = [s.forward for s in stages]
    backward = [s.backward for s in stages]
    send = [s.send for s in stages]
    finish = [-1.0] * len(steps.labels)
    pp = len(steps.ranks)
    busy, cursor = [0.0] * pp, [0] * pp
    rows: list[list[tuple[str, float, float]]] = [[] for _ in range(pp)]
    running: dict[int, list[float]] = {}  # rank -> [action index, work left, start]
    now = 0.0
    while True:
        waits = []  # when actions whose input is on its way can start
        for rank in range(pp):
            if rank in running or cursor[rank] >= len(steps.ranks[rank]):
                continue
            index, stage, is_forward, need, link = steps.ranks[rank][cursor[rank]]
            if need >= 0:
                if finish[need] < 0:
                    continue
                ready = finish[need] + (send[link] if link >= 0 else 0.0)
                if ready > now * (1 + 1e-12):
                    waits.append(ready)
                    continue
            running[rank] = [index, forward[stage] if is_forward else backward[stage], now]
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
                finish[int(index)] = now
                if timeline:
                    rows[rank].append((steps.labels[int(index)], start, now))
                cursor[rank] += 1
                del running[rank]
    return now, busy, tuple(tuple(r) for r in rows)
