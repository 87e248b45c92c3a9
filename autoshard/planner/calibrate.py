"""``Hardware.measure()``: the figures of the cost model, measured on the ranks of the current process group.

Every rank runs the same measurements; each figure is the slowest rank's (a MAX all-reduce), so every rank
gets the same Hardware and plans alike. Each timing is the fastest of a few. What it times, on the rank's
device:

- as training runs them (CPU ranks that share processors: each one's CPU time with every rank at once;
  else one rank at a time): matmuls of n x n by n x n for a few n (the fastest reached is the peak,
  ``matmul_efficiency`` 1.0, and ``matmul_half_dim`` is fitted so that ``(n / (n + half))**3`` follows
  the smaller ones, less the pass that packs their operands on a CPU), a copy of a large tensor
  (memory bandwidth) and a chain of tiny ops with autograd recording (the cost of one op: launch, or on
  a CPU the eager dispatch);
- two small GPTs' training steps (one mostly per-op overhead, one mostly matmuls), predicted from those
  figures by the planner's own profile and measured the same way: they fit one factor for the kernels'
  work and one for the per-op overhead (what single ops miss: autograd's engine, and on shared
  processors what sharing them costs besides the share); where a node has more ranks than processors,
  ``shared_cores`` is the processors;
- on CPU ranks that share cores, how long a synchronous collective after compute waits for the last rank
  (``sync_wait``);
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
from torch.distributed.constants import default_pg_timeout

from autoshard.distributed.comm import CommCounter
from autoshard.planner.hardware import PRESETS, CollectiveFit, Hardware, ring_factors
from autoshard.runtime.rank import shared_group

__all__ = ["measure"]

_SIZES = (64, 128, 256, 512, 1024)
_GPU_SIZES = (512, 1024, 2048, 4096, 8192)  # a GPU's GEMMs reach their rate only past a few thousand
_SMALL, _LARGE = 2**10, 2**24  # collective message bytes: latency-bound, bandwidth-bound
_LEAST = 0.03  # seconds each collective timing lasts: a single call is within a scheduler's noise on shared cores


_TOGETHER: list[Any] = [None]  # the group whose ranks start each timed call together (set by measure)


def _seconds(
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
    together = group if group is not None else _TOGETHER[0]

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


def _alone(fn: Callable[[], Any]) -> Any:
    """``fn()`` on each rank in turn while the others wait: what one rank does with the machine to itself."""
    group = _TOGETHER[0]
    if group is None:
        return fn()
    _TOGETHER[0] = None
    try:
        for rank in range(dist.get_world_size(group)):
            dist.barrier(group=group)
            if rank == dist.get_rank(group):
                out = fn()
        dist.barrier(group=group)
    finally:
        _TOGETHER[0] = group
    return out


def _compute_seconds(fn: Callable[[], Any], device: torch.device, least: float, shared: bool) -> float:
    """Seconds of a rank's computation as training sees it. On processors that the ranks share, its CPU time
    with every rank computing at once: the work, with what sharing costs besides (caches, switches), and
    without the slices the ranks give each other, which the planner adds back from ``shared_cores`` (the
    wall clock varies far more there). Otherwise one rank's wall clock while the others wait."""
    if shared:
        return _seconds(fn, device, least=least, clock=time.process_time)
    return _alone(lambda: _seconds(fn, device, least=least))


def _matmul(device: torch.device, dtype: torch.dtype, shared: bool, packing: float = 0.0) -> tuple[float, float]:
    """(peak FLOP/s, half dimension). ``packing``: the memory bandwidth at which the GEMMs pack their operands
    before multiplying, where they do (``Hardware.packs_operands``: matmul_seconds adds that pass, so the fit
    leaves it out); 0 where the multiply hides it."""
    sizes = _GPU_SIZES if device.type == "cuda" else _SIZES
    rates = {}
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        seconds = _compute_seconds(lambda a=a, b=b: a @ b, device, 0.05, shared)
        moved = 3 * n * n * a.element_size() / packing if packing else 0.0
        rates[n] = 2 * n**3 / max(seconds - moved, 0.5 * seconds)  # noise in the bandwidth cannot make it free
    peak = max(rates.values())
    best, best_error = 1.0, float("inf")
    for half in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256):
        error = sum((rates[n] / peak - (n / (n + half)) ** 3 / (max(sizes) / (max(sizes) + half)) ** 3) ** 2
                    for n in sizes)  # fmt: skip
        if error < best_error:
            best, best_error = float(half), error
    peak /= (max(sizes) / (max(sizes) + best)) ** 3  # the asymptote the largest size approaches
    return peak, best


def _memory_bandwidth(device: torch.device, shared: bool) -> float:
    x = torch.empty(2**26 if device.type == "cuda" else 2**24, device=device)  # 256 MiB past a GPU's L2; 64 MiB
    y = torch.empty_like(x)
    return 2 * x.numel() * x.element_size() / _compute_seconds(lambda: y.copy_(x), device, 0.05, shared)


def _host_link(device: torch.device) -> tuple[float, float]:
    """A GPU's (host link bandwidth, host memory bandwidth): 256 MiB copied between pinned host memory and
    the device (the slower direction: offload moves gradients down and parameters up), and copied within
    host memory (what the host's optimizer step streams through). Every rank at once: they share both."""
    host = torch.empty(2**26, pin_memory=True)
    on_device = torch.empty(2**26, device=device)
    down = _seconds(lambda: host.copy_(on_device, non_blocking=True), device, least=0.05)
    up = _seconds(lambda: on_device.copy_(host, non_blocking=True), device, least=0.05)
    other = torch.empty_like(host)
    within = _seconds(lambda: other.copy_(host), torch.device("cpu"), least=0.05)
    nbytes = host.numel() * host.element_size()
    return nbytes / max(down, up), 2 * nbytes / within


def _op_overhead(device: torch.device, shared: bool) -> float:
    x = torch.ones(4, device=device, requires_grad=True)
    ops = 200

    def chain() -> torch.Tensor:
        y = x
        for _ in range(ops):
            y = y * 1.0
        return y

    return _compute_seconds(chain, device, 0.05, shared) / ops


def _sync_wait(device: torch.device, group: Any, calls: int = 60) -> float:
    """What a synchronous collective over ``group`` waits beyond its own time when it follows compute (ranks
    that share cores arrive apart): the median time in a tiny all-reduce right after some compute, less its
    median alone. How far apart ranks arrive varies from one call to the next (where the scheduler's slices
    fall), so each call is timed by itself and the typical one kept. Every rank of the world runs it at
    once (each in its own group), as training's groups do."""
    a, b = torch.randn(256, 512, device=device), torch.randn(512, 256, device=device)
    tiny = torch.ones(256, device=device)

    def timed_sync() -> float:
        start = time.perf_counter()
        dist.all_reduce(tiny, group=group)
        return time.perf_counter() - start

    after, alone = [], []
    dist.barrier(group=group)
    for _ in range(calls):
        for _ in range(6):
            a @ b
        after.append(timed_sync())
    dist.barrier(group=group)
    for _ in range(calls):
        alone.append(timed_sync())
    return max(0.0, statistics.median(after[5:]) - statistics.median(alone[5:]))


# Two small GPTs (vocab, dim, heads, layers, sequence, rows): the first's step is mostly per-op overhead, the
# second's mostly matmuls, so their two timings fit the scale of the kernels' work and of the per-op overhead
# apart, and noise in the single-op timings cannot tilt one against the other.
_WORKLOADS = ((512, 128, 4, 2, 64, 4), (2048, 256, 8, 2, 128, 4))
# On a GPU the second is still overhead-bound: one whose matmuls take milliseconds (bf16 autocast).
_GPU_WORKLOADS = ((512, 128, 4, 2, 64, 4), (8192, 2048, 16, 2, 1024, 8))


def _workload(device: torch.device, hardware: Hardware, shared: bool, size: tuple[int, ...]) -> tuple[float, ...]:
    """A small GPT's training step (forward, loss, backward): (the seconds ``hardware`` predicts for its kernels'
    work, for their per-op overhead, measured as training runs it; ``shared``: ranks share processors, every
    rank at once)."""
    from autoshard import passes
    from autoshard.capture import capture
    from autoshard.demo import TinyGPT, next_token_loss
    from autoshard.planner.profile import profile_graph

    vocab, dim, heads, layers, seq, rows = size
    torch.manual_seed(0)
    model = TinyGPT(vocab=vocab, dim=dim, heads=heads, layers=layers, max_seq=seq).to(device)
    ids = torch.randint(0, vocab, (rows, seq), device=device)
    target = torch.randint(0, vocab, (rows, seq), device=device)

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # as the peak was measured

    def step() -> None:
        with torch.autocast(device.type, dtype, enabled=device.type == "cuda"):
            loss = next_token_loss(model(ids), target)
        loss.backward()

    measured = _compute_seconds(step, device, 0.3, shared)
    captured = capture(model, (ids,), None, next_token_loss, target)
    passes.analyze(captured.gm, captured.rename)
    profile = profile_graph(captured.gm, captured.example_sizes, hardware.kernels, 0.0)

    def predicted(hw: Hardware) -> float:
        total = 0.0
        for name in ("pre", *profile.blocks, "post"):
            if name in profile.parts:
                times = profile.part(name, 1, False).times(captured.example_sizes, hw, dtype)
                total += times.forward + times.backward
        return total

    work = predicted(hardware.with_(op_overhead=0.0))
    return work, predicted(hardware) - work, measured


def _scales(workloads: list[tuple[float, ...]]) -> tuple[float, float]:
    """(work, overhead): the factors by which the measured steps exceed the predicted kernels' work and per-op
    overhead (what single ops miss: autograd's engine, caches, processors shared). Two workloads give both;
    where they do not tell them apart (or disagree past belief), one factor for both."""
    (w1, o1, m1), (w2, o2, m2) = workloads
    det = w1 * o2 - w2 * o1
    if abs(det) > 1e-12:
        work, overhead = (m1 * o2 - m2 * o1) / det, (w1 * m2 - w2 * m1) / det
        if 0.25 <= work <= 8.0 and 0.25 <= overhead <= 8.0:
            return work, overhead
    both = min(8.0, max(0.25, (m1 + m2) / (w1 + o1 + w2 + o2)))
    return both, both


def _fit(op: str, n: int, small: float, large: float, ceiling: float) -> tuple[float, float]:
    """(bus bandwidth, latency per step) through the two timings, in the ring model Hardware uses. The
    bandwidth is at most ``ceiling`` (the device's memory bandwidth: every byte sent is at least copied), so
    noise that makes the large message look as fast as the small one cannot make the link look free."""
    factor, steps = ring_factors(op, n)
    bandwidth = min(ceiling, factor * (_LARGE - _SMALL) / max(large - small, 1e-9))
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
        return _seconds(lambda: comm.all_reduce(full), device, least=_LEAST, group=group)
    if op == "all_gather":
        return _seconds(lambda: comm.all_gather(full, mine, in_place=True), device, least=_LEAST, group=group)
    if op == "reduce_scatter":
        return _seconds(lambda: comm.reduce_scatter(mine, full, in_place=True), device, least=_LEAST, group=group)
    x = full
    index = ranks.index(me)  # send_recv: the first half sends to the second (pairs: one each way)
    peer = ranks[index ^ 1]

    def exchange() -> None:
        if index % 2 == 0:
            dist.send(x, peer, group=group)
        else:
            dist.recv(x, peer, group=group)

    return _seconds(exchange, device, least=_LEAST, group=group)


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
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    # Ranks of a node with more of them than processors share them: as many compute at once as there are
    # processors (what sharing costs besides, caches and switches, is in the CPU times measured under load).
    shared = float(cpus) if not cuda and per_node > cpus else 0.0
    try:
        bandwidth, overhead = _memory_bandwidth(device, shared > 0), _op_overhead(device, shared > 0)
        peak, half = _matmul(device, getattr(torch, dtype_name), shared > 0, bandwidth if base.packs_operands else 0.0)
        link, host_memory = _host_link(device) if cuda else (0.0, 0.0)  # on a CPU: its memory bandwidth
        probe = base.with_(peak_flops={dtype_name: peak, "float32": peak}, matmul_efficiency=1.0,
                           matmul_half_dim=half, memory_bandwidth=bandwidth, op_overhead=overhead)  # fmt: skip
        workloads = _GPU_WORKLOADS if cuda else _WORKLOADS
        work, each_op = _scales([_workload(device, probe, shared > 0, size) for size in workloads])
        figures = [peak / work, half, bandwidth / work, overhead * each_op, shared, link, host_memory]
    finally:
        _TOGETHER[0] = None
    fits: list[tuple[str, str, int, float, float]] = []
    waits: list[tuple[int, float]] = []  # (group size, sync wait) on CPU ranks
    if distributed and world > 1:
        for layout in _groups(world):
            made = [shared_group(ranks, default_pg_timeout) for ranks in layout]  # every rank makes every group
            mine = next(i for i, ranks in enumerate(layout) if me in ranks) if any(me in r for r in layout) else None
            if not cuda:  # every rank alike (kept only where ranks share cores, below)
                # A rank outside every group of the layout (an odd world's last) waits on none.
                dist.barrier(group=group)
                waits.append((len(layout[0]), _sync_wait(device, made[mine]) if mine is not None else 0.0))
            for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv"):
                times = [0.0, 0.0]
                if mine is not None:
                    ranks = layout[mine]
                    times = [_collective(op, made[mine], ranks, me, device, size) for size in (_SMALL, _LARGE)]
                n = len(layout[0])
                scope = "intra" if n <= per_node else "inter"
                fits.append((op, scope, n, *times))
        timings = [t for *_, s, lg in fits for t in (s, lg)] + [w for _, w in waits]
        timings = torch.tensor(timings, dtype=torch.float64, device=device)
        local = torch.tensor(figures, dtype=torch.float64, device=device)
        local[0] = -local[0]  # the slowest rank's: MAX of the negation
        local[2] = -local[2]
        local[4] = -local[4]
        local[5:] = -local[5:]  # the host figures: the slowest rank's
        dist.all_reduce(timings, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        figures = [-local[0].item(), local[1].item(), -local[2].item(), local[3].item(), *(-local[4:]).tolist()]
        fits = [(op, scope, n, timings[2 * i].item(), timings[2 * i + 1].item())
                for i, (op, scope, n, *_) in enumerate(fits)]  # fmt: skip
        waits = [(n, timings[2 * len(fits) + i].item()) for i, (n, _) in enumerate(waits)]
    peak, half, bandwidth, overhead, shared, link, host_memory = figures
    if not cuda:
        link = host_memory = bandwidth
    waits = waits if shared else []  # ranks with cores of their own arrive together
    sync = next((w for n, w in waits if n == world), 0.0)
    collectives = []
    for op, scope, n, small, large in fits:
        bw, latency = _fit(op, n, small, large, bandwidth)
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
        host_bandwidth=link,
        host_memory_bandwidth=host_memory,
        collectives=tuple(collectives),
        shared_cores=shared,
        sync_wait=sync,
        group_sync_waits=tuple(waits),
        source=f"Hardware.measure() on {world} rank(s), {time.strftime('%Y-%m-%d')}",
    )
