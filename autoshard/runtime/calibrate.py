"""``Hardware.measure()``: the figures of the cost model, measured on the ranks of the current process group.

Every rank runs the same measurements; each figure is the slowest rank's (a MAX all-reduce), so every rank
gets the same Hardware and plans alike. What it times, on the rank's device:

- matmuls of n x n by n x n for a few n: the fastest reached is the peak (``matmul_efficiency`` 1.0), and
  ``matmul_half_dim`` is fitted so that ``(n / (n + half))**3`` follows the smaller ones;
- a copy of a large tensor (memory bandwidth) and a chain of tiny ops with autograd recording (the cost
  of one op: launch, or on a CPU the eager dispatch);
- a small GPT's training step, predicted from those figures by the planner's own profile and measured
  one rank at a time: the ratio scales the compute figures (what single ops miss: autograd's engine);
  measured with every rank at once, CPU ranks that share cores give ``shared_cores`` (how many of them
  compute at full speed together);
- all-reduce, all-gather, reduce-scatter (issued as the runtime issues them, runtime/comm.py) and a
  send/receive pair at two sizes over the whole group and over pairs of neighbouring ranks: a latency
  per ring step and a bus bandwidth per operation and group size (``Hardware.collectives``), the
  nearest of which the cost model uses.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from autoshard.hardware import PRESETS, CollectiveFit, Hardware, ring_factors
from autoshard.runtime.comm import CommCounter

__all__ = ["measure"]

_SIZES = (64, 128, 256, 512, 1024)
_SMALL, _LARGE = 2**10, 2**22  # collective message bytes: latency-bound, bandwidth-bound


_TOGETHER: list[Any] = [None]  # the group whose ranks start each timed call together (set by measure)


def _seconds(fn: Callable[[], Any], device: torch.device, repeat: int = 5, least: float = 0.0) -> float:
    """Seconds one call of ``fn`` takes: the median of ``repeat`` timings after a warm-up, each of enough
    calls to last ``least`` seconds. Under a process group every rank starts each timing together, so
    ranks that share a machine's cores measure the share of them they get while training."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    start = time.perf_counter()
    fn()
    sync()
    calls = max(1, int(least / max(time.perf_counter() - start, 1e-9)))
    if _TOGETHER[0] is not None:  # every rank makes as many calls (the slowest rank's count)
        count = torch.tensor([calls], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MIN, group=_TOGETHER[0])
        calls = int(count.item())
    times = []
    for _ in range(repeat):
        if _TOGETHER[0] is not None:
            dist.barrier(group=_TOGETHER[0])
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def _matmul(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(peak FLOP/s, half dimension)."""
    rates = {}
    for n in _SIZES:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        rates[n] = 2 * n**3 / _seconds(lambda a=a, b=b: a @ b, device, least=0.05)
    peak = max(rates.values())
    best, best_error = 1.0, float("inf")
    for half in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256):
        error = sum((rates[n] / peak - (n / (n + half)) ** 3 / (max(_SIZES) / (max(_SIZES) + half)) ** 3) ** 2
                    for n in _SIZES)  # fmt: skip
        if error < best_error:
            best, best_error = float(half), error
    peak /= (max(_SIZES) / (max(_SIZES) + best)) ** 3  # the asymptote the largest size approaches
    return peak, best


def _memory_bandwidth(device: torch.device) -> float:
    x = torch.empty(2**24, device=device)  # 64 MiB
    y = torch.empty_like(x)
    return 2 * x.numel() * x.element_size() / _seconds(lambda: y.copy_(x), device, least=0.05)


def _op_overhead(device: torch.device) -> float:
    x = torch.ones(4, device=device, requires_grad=True)
    ops = 200

    def chain() -> torch.Tensor:
        y = x
        for _ in range(ops):
            y = y * 1.0
        return y

    return _seconds(chain, device, least=0.05) / ops


def _workload(device: torch.device, hardware: Hardware) -> tuple[float, float, float]:
    """A small GPT's training step (forward, loss, backward): predicted from ``hardware`` by the planner's
    own profile, measured with every rank at once, and measured one rank at a time (the others waiting)."""
    from autoshard import passes
    from autoshard.capture import capture
    from autoshard.demo import TinyGPT, next_token_loss
    from autoshard.planner.profile import profile_graph

    torch.manual_seed(0)
    model = TinyGPT(vocab=512, dim=128, heads=4, layers=2, max_seq=64).to(device)
    ids = torch.randint(0, 512, (4, 64), device=device)
    target = torch.randint(0, 512, (4, 64), device=device)

    def step() -> None:
        next_token_loss(model(ids), target).backward()

    together = _seconds(step, device, least=0.3)
    alone = together
    group = _TOGETHER[0]
    if group is not None:
        _TOGETHER[0] = None
        for rank in range(dist.get_world_size(group)):
            dist.barrier(group=group)
            if rank == dist.get_rank(group):
                alone = _seconds(step, device, least=0.3)
        dist.barrier(group=group)
        _TOGETHER[0] = group
    captured = capture(model, (ids,), None, next_token_loss, target)
    passes.analyze(captured.gm, captured.rename)
    profile = profile_graph(captured.gm, captured.example_sizes, hardware.kernels, 0.0)
    predicted = 0.0
    for name in ("pre", *profile.blocks, "post"):
        if name in profile.parts:
            times = profile.part(name, 1, False).times(captured.example_sizes, hardware, torch.float32)
            predicted += times.forward + times.backward
    return predicted, together, alone


def _fit(op: str, n: int, small: float, large: float) -> tuple[float, float]:
    """(bus bandwidth, latency per step) through the two timings, in the ring model Hardware uses."""
    factor, steps = ring_factors(op, n)
    bandwidth = factor * (_LARGE - _SMALL) / max(large - small, 1e-9)
    latency = max(0.0, small - factor * _SMALL / bandwidth) / steps
    return bandwidth, latency


def _collective(op: str, group: Any, ranks: list[int], me: int, device: torch.device, nbytes: int) -> float:
    """Seconds of ``op`` on ``nbytes`` (the full size), issued the way the runtime issues it (CommCounter)."""
    n = len(ranks)
    numel = max(n, nbytes // 4 // n * n)
    comm = CommCounter(group)
    full = torch.ones(numel, device=device)
    mine = full[ranks.index(me) * (numel // n) :][: numel // n]
    if op == "all_reduce":
        return _seconds(lambda: comm.all_reduce(full), device)
    if op == "all_gather":
        return _seconds(lambda: comm.all_gather(full, mine, in_place=True), device)
    if op == "reduce_scatter":
        return _seconds(lambda: comm.reduce_scatter(mine, full, in_place=True), device)
    x = full
    index = ranks.index(me)  # send_recv: the first half sends to the second (pairs: one each way)
    peer = ranks[index ^ 1]

    def exchange() -> None:
        if index % 2 == 0:
            dist.send(x, peer, group=group)
        else:
            dist.recv(x, peer, group=group)

    return _seconds(exchange, device)


def _groups(world: int) -> list[list[list[int]]]:
    """The group layouts measured: the whole world, and pairs of neighbours (when the world is larger)."""
    layouts = [[list(range(world))]]
    if world > 2:
        layouts.append([[r, r + 1] for r in range(0, world - 1, 2)])
    return layouts


def measure(group: Any = None, *, name: str | None = None, memory_bytes: int | None = None) -> Hardware:
    """Calibrate the ranks of ``group`` (default: the world); call on every rank of it."""
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if distributed else 1
    me = dist.get_rank(group) if distributed else 0
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype_name = "bfloat16" if cuda else "float32"
    _TOGETHER[0] = (group if group is not None else dist.group.WORLD) if distributed and world > 1 else None
    base = PRESETS["cpu"] if not cuda else PRESETS["h100-80gb"]
    try:
        peak, half = _matmul(device, getattr(torch, dtype_name))
        bandwidth, overhead = _memory_bandwidth(device), _op_overhead(device)
        probe = base.with_(peak_flops={dtype_name: peak, "float32": peak}, matmul_efficiency=1.0,
                           matmul_half_dim=half, memory_bandwidth=bandwidth, op_overhead=overhead)  # fmt: skip
        predicted, together, alone = _workload(device, probe)
        factor = min(8.0, max(0.25, alone / predicted))  # what single ops miss (autograd's engine, caches)
        shared = world / (together / alone) if not cuda and together > alone * 1.05 else 0.0
        figures = [peak / factor, half, bandwidth / factor, overhead * factor, shared]
    finally:
        _TOGETHER[0] = None
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    fits: list[tuple[str, str, int, float, float]] = []
    if distributed and world > 1:
        for layout in _groups(world):
            made = [dist.new_group(ranks) for ranks in layout]  # every rank makes every group
            mine = next(i for i, ranks in enumerate(layout) if me in ranks) if any(me in r for r in layout) else None
            for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv"):
                times = [0.0, 0.0]
                if mine is not None:
                    ranks = layout[mine]
                    times = [_collective(op, made[mine], ranks, me, device, size) for size in (_SMALL, _LARGE)]
                n = len(layout[0])
                scope = "intra" if n <= per_node else "inter"
                fits.append((op, scope, n, *times))
        timings = torch.tensor([t for *_, s, lg in fits for t in (s, lg)], dtype=torch.float64, device=device)
        local = torch.tensor(figures, dtype=torch.float64, device=device)
        local[0] = -local[0]  # the slowest rank's: MAX of the negation
        local[2] = -local[2]
        local[4] = -local[4]
        dist.all_reduce(timings, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        figures = [-local[0].item(), local[1].item(), -local[2].item(), local[3].item(), -local[4].item()]
        fits = [(op, scope, n, timings[2 * i].item(), timings[2 * i + 1].item())
                for i, (op, scope, n, *_) in enumerate(fits)]  # fmt: skip
    peak, half, bandwidth, overhead, shared = figures
    collectives = []
    for op, scope, n, small, large in fits:
        bw, latency = _fit(op, n, small, large)
        collectives.append(CollectiveFit(op, scope, n, bw, latency))
    if memory_bytes is None:
        if cuda:
            memory_bytes = torch.cuda.get_device_properties(device).total_memory
        else:
            memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, per_node)
    intra = next((c for c in collectives if c.op == "all_reduce" and c.scope == "intra"), None)
    return base.with_(
        name=name or f"measured {device.type} x {world}",
        devices_per_node=per_node,
        memory_bytes=int(memory_bytes),
        peak_flops={dtype_name: peak, **({"float32": peak} if dtype_name == "float32" else {})},
        matmul_efficiency=1.0,
        matmul_half_dim=half,
        memory_bandwidth=bandwidth,
        op_overhead=overhead,
        intra_bandwidth=intra.bandwidth if intra else base.intra_bandwidth,
        intra_latency=intra.latency if intra else base.intra_latency,
        host_bandwidth=bandwidth if not cuda else base.host_bandwidth,
        host_memory_bandwidth=bandwidth if not cuda else base.host_memory_bandwidth,
        collectives=tuple(collectives),
        shared_cores=shared,
        source=f"Hardware.measure() on {world} rank(s), {time.strftime('%Y-%m-%d')}",
    )
