"""Tensor allocations during one call, from the profiler's memory events: what the CPU benchmarks measure.

The CPU analog of torch.cuda.max_memory_allocated (after reset_peak_memory_stats). Buffers that gloo
allocates outside torch are not tensors and not counted, as NCCL's own buffers are not on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def allocation_trace(fn: Callable[[], Any]) -> tuple[Any, int, int]:
    """fn's result, the bytes it left allocated, and the peak above the start while it ran."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = prof.profiler.kineto_results.events()
    changes = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    current = peak = 0
    for _, nbytes in changes:
        current += nbytes
        peak = max(peak, current)
    return result, current, peak
