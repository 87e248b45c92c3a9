"""How the calibration times things: the fastest of a few timings, every rank of the measured group starting
each together (so ranks that share a machine's cores measure the share they get while training), or one
rank at a time, or in CPU time where ranks share processors."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["TOGETHER", "alone", "compute_seconds", "seconds"]

TOGETHER: list[Any] = [None]  # the group whose ranks start each timed call together (set by measure)


def seconds(
    fn: Callable[[], Any],
    device: torch.device,
    repeat: int = 5,
    least: float = 0.0,
    group: Any = None,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Seconds one call of ``fn`` takes: the fastest of ``repeat`` timings after a warm-up, each of enough
    calls to last ``least`` seconds (on a machine shared with other work, that work only ever adds to a
    timing). Under a process group every rank starts each timing together, so ranks that share a machine's
    cores measure the share of them they get while training; ``group``: the ranks that run ``fn`` together
    (a collective's), default the whole measured group; ``clock``: what is timed (``time.process_time``:
    this process's CPU time)."""
    together = group if group is not None else TOGETHER[0]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    start = time.perf_counter()
    fn()
    sync()
    calls = max(1, int(least / max(time.perf_counter() - start, 1e-9)))
    if together is not None:  # every rank makes as many calls (the slowest rank's count)
        count = torch.tensor([calls], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MIN, group=together)
        calls = int(count.item())
    times = []
    for _ in range(repeat):
        if together is not None:
            dist.barrier(group=together)
        start = clock()
        for _ in range(calls):
            fn()
        sync()
        times.append((clock() - start) / calls)
    return min(times)


def alone(fn: Callable[[], Any]) -> Any:
    """``fn()`` on each rank in turn while the others wait: what one rank does with the machine to itself."""
    group = TOGETHER[0]
    if group is None:
        return fn()
    TOGETHER[0] = None
    try:
        for rank in range(dist.get_world_size(group)):
            dist.barrier(group=group)
            if rank == dist.get_rank(group):
                out = fn()
        dist.barrier(group=group)
    finally:
        TOGETHER[0] = group
    return out


def compute_seconds(fn: Callable[[], Any], device: torch.device, least: float, shared: bool) -> float:
    """Seconds of a rank's computation as training sees it. On processors that the ranks share, its CPU time
    with every rank computing at once: the work, with what sharing costs besides (caches, switches), and
    without the slices the ranks give each other, which the planner adds back from ``shared_cores`` (the
    wall clock varies far more there). CPU ranks with cores of their own: the wall clock, every rank at once
    too (they still share the memory and its caches: timed one at a time, two pinned ranks here computed
    a pipeline's stages 10-15% faster than they do while training). Otherwise (a GPU each) one rank's wall
    clock while the others wait."""
    if shared:
        return seconds(fn, device, least=least, clock=time.process_time)
    if device.type == "cpu":
        return seconds(fn, device, least=least)
    return alone(lambda: seconds(fn, device, least=least))
