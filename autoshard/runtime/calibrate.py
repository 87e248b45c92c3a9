"""``Hardware.measure()``: the figures of the cost model, measured on the ranks of the current process group.

Every rank runs the same measurements; each figure is the slowest rank's (a MAX all-reduce), so every rank
gets the same Hardware and plans alike. What it times, on the rank's device:

- matmuls of n x n by n x n for a few n: the fastest reached is the peak (``matmul_efficiency`` 1.0), and
  ``matmul_half_dim`` is fitted so that ``(n / (n + half))**3`` follows the smaller ones;
- a copy of a large tensor (memory bandwidth) and a chain of tiny ops with autograd recording (the cost
  of one op: launch, or on a CPU the eager dispatch);
- all-reduce, all-gather, reduce-scatter and a send/receive pair at two sizes over the whole group and over
  pairs of neighbouring ranks: a latency per ring step and a bus bandwidth per operation and group size
  (``Hardware.collectives``), the nearest of which the cost model uses.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from autoshard.hardware import PRESETS, CollectiveFit, Hardware

__all__ = ["measure"]

_SIZES = (64, 128, 256, 512, 1024)
_SMALL, _LARGE = 2**10, 2**22  # collective message bytes: latency-bound, bandwidth-bound


def _seconds(fn: Callable[[], Any], device: torch.device, repeat: int = 5) -> float:
    """The median of ``repeat`` timed calls after one warm-up."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _matmul(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(peak FLOP/s, half dimension)."""
    rates = {}
    for n in _SIZES:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        rates[n] = 2 * n**3 / _seconds(lambda a=a, b=b: a @ b, device)
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
    return 2 * x.numel() * x.element_size() / _seconds(lambda: y.copy_(x), device)


def _op_overhead(device: torch.device) -> float:
    x = torch.ones(4, device=device, requires_grad=True)
    ops = 200

    def chain() -> torch.Tensor:
        y = x
        for _ in range(ops):
            y = y * 1.0
        return y

    return _seconds(chain, device) / ops


def _fit(op: str, n: int, small: float, large: float) -> tuple[float, float]:
    """(bus bandwidth, latency per step) through the two timings, in the ring model Hardware uses."""
    factor, steps = {
        "all_reduce": (2 * (n - 1) / n, 2 * (n - 1)),
        "all_gather": ((n - 1) / n, n - 1),
        "reduce_scatter": ((n - 1) / n, n - 1),
        "send_recv": (1.0, 1),
    }[op]
    bandwidth = factor * (_LARGE - _SMALL) / max(large - small, 1e-9)
    latency = max(0.0, small - factor * _SMALL / bandwidth) / steps
    return bandwidth, latency


def _collective(op: str, group: Any, ranks: list[int], me: int, device: torch.device, nbytes: int) -> float:
    n = len(ranks)
    numel = nbytes // 4
    x = torch.ones(numel, device=device)
    if op == "all_reduce":
        return _seconds(lambda: dist.all_reduce(x, group=group), device)
    if op == "all_gather":
        out = torch.empty(numel * n, device=device)
        return _seconds(lambda: dist.all_gather_into_tensor(out, x, group=group), device)
    if op == "reduce_scatter":
        big = torch.ones(numel * n, device=device)
        return _seconds(lambda: dist.reduce_scatter_tensor(x, big, group=group), device)
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
    peak, half = _matmul(device, getattr(torch, dtype_name))
    figures = [peak, half, _memory_bandwidth(device), _op_overhead(device)]
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
        local[0] = -local[0]  # the slowest rank's peak: MAX of the negation
        local[2] = -local[2]
        dist.all_reduce(timings, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        figures = [-local[0].item(), local[1].item(), -local[2].item(), local[3].item()]
        fits = [(op, scope, n, timings[2 * i].item(), timings[2 * i + 1].item())
                for i, (op, scope, n, *_) in enumerate(fits)]  # fmt: skip
    peak, half, bandwidth, overhead = figures
    collectives = []
    for op, scope, n, small, large in fits:
        bw, latency = _fit(op, n, small, large)
        collectives.append(CollectiveFit(op, scope, n, bw, latency))
    base = PRESETS["cpu"] if not cuda else PRESETS["h100-80gb"]
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
        source=f"Hardware.measure() on {world} rank(s), {time.strftime('%Y-%m-%d')}",
    )
