"""``Hardware.measure()``: the figures of the cost model, measured on the ranks of the current process group.

Every rank runs the same measurements; each figure is the slowest rank's (a MAX all-reduce), so every rank
gets the same Hardware and plans alike. Each timing is the fastest of a few. What it times, on the rank's
device:

- as training runs them (CPU ranks that share processors: each one's CPU time with every rank at once;
  CPU ranks with cores of their own: the wall clock, every rank at once; GPUs one rank at a time):
  matmuls of n x n by n x n for a few n (the fastest reached is the peak, ``matmul_efficiency`` 1.0, and
  ``matmul_half_dim`` is fitted so that ``(n / (n + half))**3`` follows the smaller ones, less the pass
  that packs their operands on a CPU), a copy of a large tensor (memory bandwidth), a chain of tiny ops
  with autograd recording (the cost of one op: launch, or on a CPU the eager dispatch) and, on a CPU, the
  kernels that run slower than its memory moves (planner/kernels.py: GELU, softmax, ...), each on its own;
- two small GPTs' training steps (one mostly per-op overhead, one mostly matmuls), predicted from those
  figures by the planner's own profile and measured the same way: they fit one factor for the kernels'
  work and one for the per-op overhead (what single ops miss: autograd's engine, and on shared
  processors what sharing them costs besides the share); where a host has more ranks than processors (those
  its ranks may run on, together), ``shared_cores`` is the processors;
- on CPU ranks that share cores, how long a synchronous collective after compute waits for the last rank
  (``sync_wait``); on CPU ranks, what the pipeline runtime spends between two actions (``action_gap``);
- all-reduce, all-gather, reduce-scatter (issued as the runtime issues them, distributed/comm.py), an
  all-to-all and a send/receive pair at four sizes over the whole group and over pairs of neighbouring
  ranks: a latency per ring step and a bus bandwidth per operation and group size through the smallest
  and the largest, and the timings themselves (``Hardware.collectives``; the cost model reads a size
  between off them, and the line beyond).
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from autoshard.distributed.comm import CommCounter
from autoshard.distributed.groups import shared_group
from autoshard.planner import kernels, timing
from autoshard.planner.links import CollectiveFit, ring_factors
from autoshard.planner.timing import compute_seconds, seconds
from autoshard.planner.workloads import GPU_WORKLOADS, WORKLOADS, scales, workload

if TYPE_CHECKING:
    from autoshard.planner.hardware import Hardware

__all__ = ["measure", "shared_processors"]

_SIZES = (64, 128, 256, 512, 1024)
_GPU_SIZES = (512, 1024, 2048, 4096, 8192)  # a GPU's GEMMs reach their rate only past a few thousand
_SMALL, _LARGE = 2**10, 2**24  # collective message bytes: latency-bound, bandwidth-bound
_COLLECTIVE_SIZES = (_SMALL, 2**17, 2**21, _LARGE)  # and between, where the cost leaves the line through those
_LEAST = 0.03  # seconds each collective timing lasts: a single call is within a scheduler's noise on shared cores


def _matmul(device: torch.device, dtype: torch.dtype, shared: bool, packing: float = 0.0) -> tuple[float, float]:
    """(peak FLOP/s, half dimension). ``packing``: the memory bandwidth at which the GEMMs pack their operands
    before multiplying, where they do (``Hardware.packs_operands``: matmul_seconds adds that pass, so the fit
    leaves it out); 0 where the multiply hides it."""
    sizes = _GPU_SIZES if device.type == "cuda" else _SIZES
    rates = {}
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        seconds = compute_seconds(lambda a=a, b=b: a @ b, device, 0.05, shared)
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
    return 2 * x.numel() * x.element_size() / compute_seconds(lambda: y.copy_(x), device, 0.05, shared)


def _kernel_rates(device: torch.device, shared: bool) -> list[tuple[str, float, float]]:
    """(kernel, forward, backward bytes/s) of each of planner/kernels.py's kernels on a CPU, on a 1024 x 1024 tensor,
    in the cost model's bytes (what the node reads and writes; backward twice that). A GPU's run at its memory
    bandwidth: none."""
    if device.type != "cpu":
        return []
    rates = []
    for name, forward in kernels.TIMED.items():
        x = torch.randn(1024, 1024, device=device, requires_grad=True)
        y = forward(x)
        grad = torch.randn_like(y)
        moved = 2 * x.numel() * x.element_size()  # read and written
        ahead = compute_seconds(lambda x=x, forward=forward: forward(x.detach()), device, 0.01, shared)
        back = compute_seconds(
            lambda y=y, x=x, grad=grad: torch.autograd.grad(y, x, grad, retain_graph=True), device, 0.01, shared
        )
        rates.append((name, moved / ahead, 2 * moved / back))
    return rates


def _optimizer_bandwidth(shared: bool) -> float:
    """Bytes/s of an AdamW step on the host as the planner counts its traffic (``ADAM_PASSES`` four-byte passes
    over each element), over tensors of a quarter million elements, as a model trained on CPUs has: a
    parameter's passes run back to back over tensors the caches partly keep, which a copy's bandwidth misses
    (7.7M elements on 4 ranks sharing 2 cores stepped in 52 ms here, where the copy's figure gave 103)."""
    from autoshard.planner.costing import ADAM_PASSES

    params = [torch.zeros(2**18, requires_grad=True) for _ in range(16)]
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    optimizer.step()  # the state, made once
    elements = sum(p.numel() for p in params)
    return ADAM_PASSES * 4 * elements / compute_seconds(optimizer.step, torch.device("cpu"), 0.05, shared)


def _host_link(device: torch.device) -> tuple[float, float]:
    """A GPU's (host link bandwidth, host memory bandwidth): 256 MiB copied between pinned host memory and
    the device (the slower direction: offload moves gradients down and parameters up), and copied within
    host memory (what the host's optimizer step streams through). Every rank at once: they share both."""
    host = torch.empty(2**26, pin_memory=True)
    on_device = torch.empty(2**26, device=device)
    down = seconds(lambda: host.copy_(on_device, non_blocking=True), device, least=0.05)
    up = seconds(lambda: on_device.copy_(host, non_blocking=True), device, least=0.05)
    other = torch.empty_like(host)
    within = seconds(lambda: other.copy_(host), torch.device("cpu"), least=0.05)
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

    return compute_seconds(chain, device, 0.05, shared) / ops


def _sync_wait(device: torch.device, group: dist.ProcessGroup, calls: int = 60) -> float:
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


def _action_gap(device: torch.device, group: dist.ProcessGroup | None, me: int, calls: int = 30) -> float:
    """What the pipeline runtime spends between two actions once the next one's input has arrived
    (runtime/pipeline.py: the wait on the arrived receive, then the following receive made and posted): rank 1
    of ``group`` times that on rank 0's messages (64 KiB, an activation's order), the median of ``calls``;
    every rank gets it (a broadcast), the others only wait."""
    first, second = (0, 1) if group is None else (dist.get_global_rank(group, 0), dist.get_global_rank(group, 1))
    numel, times, work = 2**14, [], torch.ones(64, 64, device=device)
    for call in range(calls if me in (0, 1) else 0):
        if me == 0:
            dist.send(torch.ones(numel, device=device), dst=second, group=group, tag=2 * call)
            dist.send(torch.ones(numel, device=device), dst=second, group=group, tag=2 * call + 1)
            continue
        arrived = dist.irecv(torch.empty(numel, device=device), src=first, group=group, tag=2 * call)
        busy = time.perf_counter() + 0.002  # the action before, computing: the message arrives meanwhile
        while time.perf_counter() < busy:
            torch.mm(work, work)
        start = time.perf_counter()
        arrived.wait()
        following = dist.irecv(torch.empty(numel, device=device), src=first, group=group, tag=2 * call + 1)
        times.append(time.perf_counter() - start)
        following.wait()
    gap = torch.tensor([statistics.median(times) if times else 0.0], dtype=torch.float64, device=device)
    dist.broadcast(gap, src=second, group=group)
    return float(gap.item())


def _fit(op: str, n: int, small: float, large: float, ceiling: float) -> tuple[float, float]:
    """(bus bandwidth, latency per step) through the two timings, in the ring model Hardware uses. The
    bandwidth is at most ``ceiling`` (the device's memory bandwidth: every byte sent is at least copied), so
    noise that makes the large message look as fast as the small one cannot make the link look free."""
    factor, steps = ring_factors(op, n)
    bandwidth = min(ceiling, factor * (_LARGE - _SMALL) / max(large - small, 1e-9))
    latency = max(0.0, small - factor * _SMALL / bandwidth) / steps
    return bandwidth, latency


def _collective(
    op: str, group: dist.ProcessGroup, ranks: list[int], me: int, device: torch.device, nbytes: int
) -> float:
    """Seconds of ``op`` on ``nbytes`` (the full size), issued the way the runtime issues it (CommCounter)."""
    n = len(ranks)
    numel = max(n, nbytes // 4 // n * n)
    comm = CommCounter(group)
    full = torch.ones(numel, device=device)
    mine = full[ranks.index(me) * (numel // n) :][: numel // n]
    if op == "all_reduce":
        return seconds(lambda: comm.all_reduce(full), device, least=_LEAST, group=group)
    if op == "all_gather":
        return seconds(lambda: comm.all_gather(full, mine, in_place=True), device, least=_LEAST, group=group)
    if op == "reduce_scatter":
        return seconds(lambda: comm.reduce_scatter(mine, full, in_place=True), device, least=_LEAST, group=group)
    if op == "all_to_all":  # expert parallelism's dispatch and combine: equal shares to every rank
        out = torch.empty_like(full)
        return seconds(lambda: dist.all_to_all_single(out, full, group=group), device, least=_LEAST, group=group)
    x = full
    index = ranks.index(me)  # send_recv: the first half sends to the second (pairs: one each way)
    peer = ranks[index ^ 1]

    def exchange() -> None:
        if index % 2 == 0:
            dist.send(x, peer, group=group)
        else:
            dist.recv(x, peer, group=group)

    return seconds(exchange, device, least=_LEAST, group=group)


def _own_processors() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def shared_processors(group: dist.ProcessGroup | None) -> float:
    """The processors the CPU ranks of this rank's host share (``_shared_processors``), from every rank of
    ``group`` (default: the world)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return 0.0
    entries: list[tuple[str, list[int]] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(entries, (socket.gethostname(), _own_processors()), group=group)
    return _shared_processors([e for e in entries if e is not None])


def _shared_processors(affinities: list[tuple[str, list[int]]]) -> float:
    """The processors this host's ranks share where they outnumber them, else 0.0 (each computes on its own).
    ``affinities``: every rank's (host, processors). The processors are those of the host's ranks together,
    not this rank's alone: ranks pinned to a core each (autoshard.launch does so where there are cores
    enough) share none, though each may run on one processor only."""
    host = socket.gethostname()
    here = [set(cpus) for name, cpus in affinities if name == host]
    processors = len(set().union(*here))
    return float(processors) if len(here) > processors else 0.0


def _groups(world: int) -> list[list[list[int]]]:
    """The group layouts measured: the whole world, and pairs of neighbours (when the world is larger)."""
    layouts = [[list(range(world))]]
    if world > 2:
        layouts.append([[r, r + 1] for r in range(0, world - 1, 2)])
    return layouts


def measure(
    base: Hardware, group: dist.ProcessGroup | None = None, *, name: str | None = None, memory_bytes: int | None = None
) -> Hardware:
    """Calibrate the ranks of ``group`` (default: the world); call on every rank of it. ``base``: the preset
    whose figures the calibration does not measure (the links between nodes, the overlap)."""
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if distributed else 1
    me = dist.get_rank(group) if distributed else 0
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype_name = "bfloat16" if cuda else "float32"
    timing.TOGETHER[0] = (group if group is not None else dist.group.WORLD) if distributed and world > 1 else None
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    # Ranks of a host with more of them than processors share them: as many compute at once as there are
    # processors (what sharing costs besides, caches and switches, is in the CPU times measured under load).
    shared = 0.0 if cuda else shared_processors(group)
    try:
        bandwidth, overhead = _memory_bandwidth(device, shared > 0), _op_overhead(device, shared > 0)
        peak, half = _matmul(device, getattr(torch, dtype_name), shared > 0, bandwidth if base.packs_operands else 0.0)
        rates = _kernel_rates(device, shared > 0)
        # On a CPU the host is the device: its link is its memory, its optimizer step every step's.
        link, host_memory = _host_link(device) if cuda else (0.0, _optimizer_bandwidth(shared > 0))
        probe = base.with_(peak_flops={dtype_name: peak, "float32": peak}, matmul_efficiency=1.0,
                           matmul_half_dim=half, memory_bandwidth=bandwidth, op_overhead=overhead,
                           kernel_rates=tuple(rates))  # fmt: skip
        workloads = GPU_WORKLOADS if cuda else WORKLOADS
        work, each_op = scales([workload(device, probe, shared > 0, size) for size in workloads])
        # each kernel's rates last: (forward, backward) in TIMED's order
        figures = [peak / work, half, bandwidth / work, overhead * each_op, shared, link, host_memory]
        figures += [r / work for _, ahead, back in rates for r in (ahead, back)]
    finally:
        timing.TOGETHER[0] = None
    fits: list[tuple[str, str, int, list[float]]] = []
    waits: list[tuple[int, float]] = []  # (group size, sync wait) on CPU ranks
    action_gap = 0.0  # a GPU's host runs ahead of its kernels: the runtime's bookkeeping hides
    if distributed and world > 1 and not cuda:
        action_gap = _action_gap(device, group, me)
    if distributed and world > 1:
        for layout in _groups(world):
            made = [shared_group(ranks, default_pg_timeout) for ranks in layout]  # every rank makes every group
            mine = next(i for i, ranks in enumerate(layout) if me in ranks) if any(me in r for r in layout) else None
            if not cuda:  # every rank alike (kept only where ranks share cores, below)
                # A rank outside every group of the layout (an odd world's last) waits on none.
                dist.barrier(group=group)
                waits.append((len(layout[0]), _sync_wait(device, made[mine]) if mine is not None else 0.0))
            for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "all_to_all"):
                times = [0.0] * len(_COLLECTIVE_SIZES)
                if mine is not None:
                    ranks = layout[mine]
                    times = [_collective(op, made[mine], ranks, me, device, size) for size in _COLLECTIVE_SIZES]
                n = len(layout[0])
                scope = "intra" if n <= per_node else "inter"
                fits.append((op, scope, n, times))
        timings = [t for *_, times in fits for t in times] + [w for _, w in waits]
        timings = torch.tensor(timings, dtype=torch.float64, device=device)
        local = torch.tensor(figures, dtype=torch.float64, device=device)
        local[0] = -local[0]  # the slowest rank's: MAX of the negation
        local[2] = -local[2]
        local[4] = -local[4]
        local[5:] = -local[5:]  # the host figures and the kernels' rates: the slowest rank's
        dist.all_reduce(timings, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        figures = [-local[0].item(), local[1].item(), -local[2].item(), local[3].item(), *(-local[4:]).tolist()]
        k = len(_COLLECTIVE_SIZES)
        fits = [(op, scope, n, timings[k * i : k * (i + 1)].tolist()) for i, (op, scope, n, _) in enumerate(fits)]
        waits = [(n, timings[k * len(fits) + i].item()) for i, (n, _) in enumerate(waits)]
    peak, half, bandwidth, overhead, shared, link, host_memory, *each_rate = figures
    rates = [(name, each_rate[2 * i], each_rate[2 * i + 1]) for i, (name, *_) in enumerate(rates)]
    if not cuda:
        link = bandwidth
    waits = waits if shared else []  # ranks with cores of their own arrive together
    sync = next((w for n, w in waits if n == world), 0.0)
    collectives = []
    for op, scope, n, times in fits:
        bw, latency = _fit(op, n, times[0], times[-1], bandwidth)
        collectives.append(CollectiveFit(op, scope, n, bw, latency, tuple(zip(_COLLECTIVE_SIZES, times))))
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
        action_gap=action_gap,
        kernel_rates=tuple(rates),
        source=f"Hardware.measure() on {world} rank(s), {time.strftime('%Y-%m-%d')}",
    )
