"""Data-parallel gradient synchronization: bucketed all-reduce, overlapped with backward.

Every trainable parameter's ``.grad`` is a view into its bucket's flat buffer, so autograd
accumulates straight into the buffer (no copy). A post-accumulate-grad hook counts arrivals; when a
bucket is complete it is pre-divided by the dp degree and all-reduced asynchronously while backward
goes on. Buckets launch strictly in bucket order, so every rank issues the same collectives in the
same order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autoshard.runtime.comm import CommCounter
from autoshard.runtime.optim import optimizer_state_bytes, weak_grad_hook

__all__ = ["BucketedGradSync", "DataParallelTrainer", "GradBucket", "InOrderLauncher"]


@dataclass
class GradBucket:
    buffer: torch.Tensor
    params: list[torch.nn.Parameter]
    views: list[torch.Tensor]
    work: dist.Work | None = None


class InOrderLauncher:
    """Counts gradient arrivals per group and launches each complete group, strictly in group order.

    Every rank runs the same graph, so every rank launches the same collectives in the same order.
    Arrivals come from post-accumulate-grad hooks (held weakly, see weak_grad_hook).
    """

    def __init__(self, groups: list[list[torch.nn.Parameter]], launch: Callable[[int], None]) -> None:
        self.sizes = [len(params) for params in groups]
        self.group_of = {id(p): g for g, params in enumerate(groups) for p in params}
        self.launch = launch
        self.arrived: set[int] = set()
        self._pending = list(self.sizes)
        self._next = 0
        self._active = False
        for params in groups:
            for p in params:
                p.register_post_accumulate_grad_hook(weak_grad_hook(self._on_grad))

    def reset(self, armed: bool = True) -> None:
        """Before a backward. Unarmed, arrivals are ignored until the next reset (earlier microbatches)."""
        self.arrived.clear()
        self._pending = list(self.sizes)
        self._next = 0
        self._active = armed

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self._active or id(param) in self.arrived:
            return  # a backward outside step(), or a second arrival
        self.arrived.add(id(param))
        self._pending[self.group_of[id(param)]] -= 1
        self._launch_ready(force=False)

    def _launch_ready(self, force: bool) -> None:
        while self._next < len(self.sizes) and (force or self._pending[self._next] == 0):
            self.launch(self._next)
            self._next += 1

    def flush(self) -> None:
        """After backward: launch the groups still waiting (parameters that got no gradient)."""
        self._launch_ready(force=True)
        self._active = False


class BucketedGradSync:
    """All-reduce-mean of gradients over a data-parallel group, in buckets, while backward runs."""

    def __init__(
        self,
        slots: list[tuple[torch.nn.Parameter, int, int, int]],
        comm: CommCounter,
        dp: int,
    ) -> None:
        """``slots``: (parameter, bucket index, offset, numel) for every trainable parameter."""
        self.comm = comm
        self.dp = dp
        self.buckets: list[GradBucket] = []
        n_buckets = 1 + max((b for _, b, _, _ in slots), default=-1)
        sizes = [0] * n_buckets
        for _, b, offset, numel in slots:
            sizes[b] = max(sizes[b], offset + numel)
        dtypes = [None] * n_buckets
        for param, b, _, _ in slots:
            dtypes[b] = param.dtype
        for b in range(n_buckets):
            device = next(p.device for p, pb, _, _ in slots if pb == b)
            self.buckets.append(GradBucket(torch.zeros(sizes[b], dtype=dtypes[b], device=device), [], []))
        for param, b, offset, numel in slots:
            bucket = self.buckets[b]
            bucket.params.append(param)
            bucket.views.append(bucket.buffer[offset : offset + numel].view_as(param))
        self.launcher = InOrderLauncher([b.params for b in self.buckets], self._launch)

    def prepare(self, armed: bool = True) -> None:
        """Before a backward: zero the buffers and point every ``.grad`` at its slot.

        ``armed=False``: gradients accumulate without launching until ``launcher.reset()`` arms the
        launcher before the last backward (pipeline microbatches).
        """
        for bucket in self.buckets:
            bucket.buffer.zero_()
            bucket.work = None
            for param, view in zip(bucket.params, bucket.views):
                param.grad = view
        self.launcher.reset(armed)

    def _launch(self, index: int) -> None:
        bucket = self.buckets[index]
        if self.dp == 1:
            return
        bucket.buffer.div_(self.dp)
        bucket.work = self.comm.all_reduce(bucket.buffer, async_op=True)

    def finish(self) -> None:
        """After backward: reduce what is left, wait for every bucket, and drop grads that never came."""
        self.launcher.flush()
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
            for param in bucket.params:
                if id(param) not in self.launcher.arrived:
                    param.grad = None  # unused this step: like single-device training, no gradient


class DataParallelTrainer:
    """Plain data parallel: every rank keeps everything; gradients all-reduced in buckets."""

    def __init__(
        self,
        sync: BucketedGradSync,
        optimizer: torch.optim.Optimizer,
        params: list[torch.nn.Parameter],
        clip: Callable[[float], torch.Tensor] | None = None,
    ):
        """``clip``: clipping across the ranks that hold other shards of the model (tensor parallel)."""
        self.sync = sync
        self.optimizer = optimizer
        self.params = params
        self.clip = clip
        self.last_grad_norm: torch.Tensor | None = None  # before clipping, when the step clipped

    def prepare(self) -> None:
        self.sync.prepare()

    def finish(self) -> None:
        self.sync.finish()

    def step(self, max_grad_norm: float | None) -> None:
        if max_grad_norm is not None and self.clip is not None:
            self.last_grad_norm = self.clip(max_grad_norm)
        elif max_grad_norm is not None:
            # Gradients are identical on every rank after the all-reduce: clip locally.
            self.last_grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_grad_norm)
        self.optimizer.step()

    def memory(self) -> dict[str, int]:
        params = sum(p.numel() * p.element_size() for p in self.params)
        grads = sum(b.buffer.numel() * b.buffer.element_size() for b in self.sync.buckets)
        return {"parameters": params, "gradients": grads, "optimizer": optimizer_state_bytes(self.optimizer)}
