"""Collectives over torch.distributed, counted.

Every collective autoshard issues goes through a CommCounter so that tests and benchmarks can
check communication volume. ``volume`` uses the ZeRO paper's accounting, in bytes of the full
tensor: an all-reduce moves 2x its size (a reduce-scatter plus an all-gather), a reduce-scatter
or an all-gather 1x the full (unsharded) size. The pipeline's point-to-point sends are recorded
too, as "send", in bytes sent.

gloo implements reduce-scatter and all-gather with temporaries the size of the full tensor (a
16 MiB all-gather raised a rank's peak RSS by 16-48 MiB here). With ``in_place=True`` they run on
gloo as one reduce (or broadcast) per chunk, in place in the full tensor, one after another: the
same bytes on the wire, no temporaries, but synchronous. Other backends always use the native op.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from autoshard.distributed.tracing import span

__all__ = ["CommCounter", "all_gather_tensor", "same_view"]

# torch 2.13 renames the single-tensor collectives (the old names warn); older releases have only those.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


_OWN = object()  # all_reduce's default: this counter's own group


class _Done:
    """The handle of a collective that already completed."""

    def wait(self) -> bool:
        return True


class _TimedWork:
    """An asynchronous collective's handle whose wait counts as time blocked in communication."""

    def __init__(self, work: Any, counter: CommCounter, op: str) -> None:
        self.work, self.counter, self.op = work, counter, op

    def wait(self) -> Any:
        with self.counter.timing(self.op, "wait"):
            return self.work.wait()


@dataclass
class CommCounter:
    group: dist.ProcessGroup | None = None
    calls: Counter = field(default_factory=Counter)
    volume_bytes: Counter = field(default_factory=Counter)
    last_op: str = ""  # the latest operation started: what a failed step was waiting in
    seconds: Counter = field(default_factory=Counter)  # time blocked in each op: a synchronous call or a wait

    @contextlib.contextmanager
    def timing(self, op: str, what: str = "") -> Iterator[None]:
        """Count the time inside as blocked in ``op`` (and mark it in a profile)."""
        start = time.perf_counter()
        try:
            with span(f"{op}.{what}" if what else op):
                yield
        finally:
            self.seconds[op] += time.perf_counter() - start

    def _run(self, op: str, async_op: bool, fn: Any, *args: Any, **kwargs: Any) -> Any:
        with self.timing(op, "launch" if async_op else ""):
            work = fn(*args, async_op=async_op, **kwargs)
        return _TimedWork(work, self, op) if async_op and work is not None else work

    def count(self, op: str, nbytes: int) -> None:
        """Record ``nbytes`` moved by ``op`` (the pipeline's point-to-point sends count as "send")."""
        self.last_op = op
        self.calls[op] += 1
        self.volume_bytes[op] += nbytes

    def reset(self) -> None:
        self.calls.clear()
        self.volume_bytes.clear()
        self.seconds.clear()

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False, group: Any = _OWN) -> dist.Work | None:
        """Sum over this counter's group, or over ``group`` (None: the default group)."""
        self.count("all_reduce", 2 * tensor.numel() * tensor.element_size())
        return self._run("all_reduce", async_op, dist.all_reduce, tensor, group=self.group if group is _OWN else group)

    def _chunked(self, in_place: bool) -> bool:
        return in_place and self.reduces_in_place()

    def reduces_in_place(self) -> bool:
        """Whether ``reduce_scatter(..., in_place=True)`` leaves the result in the input's own chunk."""
        return dist.get_backend(self.group) == "gloo"

    def _chunks(self, full: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        size = dist.get_world_size(self.group)
        step = full.numel() // size
        ranks = [dist.get_global_rank(self.group, r) if self.group is not None else r for r in range(size)]
        return [(ranks[r], full[r * step : (r + 1) * step]) for r in range(size)]

    def reduce_scatter(
        self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False, in_place: bool = False
    ) -> dist.Work | _Done | None:
        """Sum ``inp`` (full) over the group and keep this rank's chunk in ``out``.

        ``in_place``: ``inp`` may be overwritten (on gloo its other ranks' chunks are left undefined).
        """
        self.count("reduce_scatter", inp.numel() * inp.element_size())
        if not self._chunked(in_place):
            return self._run("reduce_scatter", async_op, _reduce_scatter, out, inp, group=self.group)
        me = dist.get_rank()
        with self.timing("reduce_scatter"):
            for rank, chunk in self._chunks(inp):
                dist.reduce(chunk, dst=rank, group=self.group)
                if rank == me and not same_view(out, chunk):
                    out.copy_(chunk)
        return _Done()

    def all_gather(
        self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False, in_place: bool = False
    ) -> dist.Work | _Done | None:
        """Concatenate every rank's ``inp`` into ``out`` (full), in rank order.

        ``in_place``: ``inp`` may be this rank's chunk of ``out`` itself.
        """
        self.count("all_gather", out.numel() * out.element_size())
        if not self._chunked(in_place):
            source = inp if not _overlaps(out, inp) else inp.clone()
            return self._run("all_gather", async_op, _all_gather, out, source, group=self.group)
        me = dist.get_rank()
        with self.timing("all_gather"):
            for rank, chunk in self._chunks(out):
                if rank == me and not same_view(chunk, inp):
                    chunk.copy_(inp)
                dist.broadcast(chunk, src=rank, group=self.group)
        return _Done()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share storage (a native collective must not read what it writes)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are the very same memory (so copying one into the other is a no-op)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def is_comm_failure(error: BaseException) -> bool:
    """Whether an exception came from a collective or send/recv (a peer died, or the wait timed out)."""
    text = str(error).lower()
    return isinstance(error, dist.DistError) or any(w in text for w in ("gloo", "nccl", "connection", "timed out"))
