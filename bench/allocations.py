"""Tensor allocations during one call, from the profiler's memory events: what the CPU benchmarks measure.

The CPU analog of torch.cuda.max_memory_allocated (after reset_peak_memory_stats). Buffers that gloo
allocates outside torch are not tensors and not counted, as NCCL's own buffers are not on a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable, Iterator
from typing import Any

# glibc's mallopt parameters and their defaults (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _GLIBC_DEFAULT = -1, -3, 128 * 1024
_KEEP = {"MALLOC_MMAP_THRESHOLD_": 2**30, "MALLOC_TRIM_THRESHOLD_": 2**31 - 1}


def allocation_trace(fn: Callable[[], Any]) -> tuple[Any, int, int]:
    """fn's result, the bytes it left allocated, and the peak above the start while it ran."""
    import gc

    from torch.profiler import ProfilerActivity, profile

    gc.collect()  # garbage of earlier work freed inside the trace would count against fn's allocations
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = prof.profiler.kineto_results.events()
    changes = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    current = peak = 0
    for _, nbytes in changes:
        current += nbytes
        peak = max(peak, current)
    return result, current, peak


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]  # fmt: skip


def malloc_net(fn: Callable[[], Any]) -> tuple[Any, int]:
    """fn's result and the bytes it left allocated, as glibc's allocator counts them (in use in the main arena,
    where this thread's tensors come from, plus every mapped block).

    Unlike the profiler's memory events, this sees a free on any thread: a gloo collective's tensors are often
    let go on gloo's worker thread once it completes, a free the profiler does not record (it counted a tp
    all-gather's 16 + 4 MiB as held for good, more or fewer of them by rank and run). It counts what is not a
    tensor too: Python's objects (kilobytes beside a forward's activations) and what kernels set up on their
    first call (27 MiB on a first CPU forward here), so measure a warm model.
    """
    import gc

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2

    def in_use() -> int:
        gc.collect()
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd

    before = in_use()
    result = fn()
    return result, in_use() - before


@contextlib.contextmanager
def caching_allocator() -> Iterator[None]:
    """Inside, freed host memory stays with the process for reuse, as the CUDA caching allocator keeps it.

    glibc maps every block above 128 KiB fresh from the kernel and unmaps it when freed, so each large
    activation page-faults in again: on this machine a product of 64 MiB took 27 ms that way and 5 ms
    from reused memory. That cost grows with the bytes a step allocates, which is exactly what
    recomputation changes, so the step-time ratios are measured inside this. Rank processes started
    inside inherit it through glibc's environment variables. Outside glibc it does nothing.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        yield
        return
    before = {name: os.environ.get(name) for name in _KEEP}
    os.environ.update({name: str(value) for name, value in _KEEP.items()})
    libc.mallopt(_M_MMAP_THRESHOLD, _KEEP["MALLOC_MMAP_THRESHOLD_"])
    libc.mallopt(_M_TRIM_THRESHOLD, _KEEP["MALLOC_TRIM_THRESHOLD_"])
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, _GLIBC_DEFAULT)
        libc.mallopt(_M_TRIM_THRESHOLD, _GLIBC_DEFAULT)
        libc.malloc_trim(0)
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
