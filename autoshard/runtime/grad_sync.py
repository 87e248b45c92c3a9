"""Data-parallel gradient synchronization: bucketed all-reduce, overlapped with backward.

Every trainable parameter's ``.grad`` is a view into its bucket's flat buffer, so autograd
accumulates straight into the buffer (no copy). A post-accumulate-grad hook counts arrivals; when a
bucket is complete it is pre-divided by the dp degree and all-reduced asynchronously while backward
goes on. Buckets launch strictly in bucket order, so every rank issues the same collectives in the
same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from autoshard.runtime.comm import CommCounter
from autoshard.runtime.optim import optimizer_state_bytes, weak_grad_hook

__all__ = ["BucketedGradSync", "GradBucket"]


@dataclass
class GradBucket:
    buffer: torch.Tensor
    params: list[torch.nn.Parameter]
    views: list[torch.Tensor]
    pending: int = 0
    work: dist.Work | None = None


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
        self.bucket_of: dict[int, int] = {}
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
            self.bucket_of[id(param)] = b
        self._hooks = [
            p.register_post_accumulate_grad_hook(weak_grad_hook(self._on_grad_ready)) for p, _, _, _ in slots
        ]
        self._ready: set[int] = set()
        self._next_launch = 0
        self._active = False

    def prepare(self) -> None:
        """Before a backward: zero the buffers and point every ``.grad`` at its slot."""
        for bucket in self.buckets:
            bucket.buffer.zero_()
            bucket.pending = len(bucket.params)
            bucket.work = None
            for param, view in zip(bucket.params, bucket.views):
                param.grad = view
        self._ready.clear()
        self._next_launch = 0
        self._active = True

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._active or id(param) in self._ready:
            return
        self._ready.add(id(param))
        bucket = self.buckets[self.bucket_of[id(param)]]
        bucket.pending -= 1
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.pending > 0 and not force:
                return
            self._launch(bucket)
            self._next_launch += 1

    def _launch(self, bucket: GradBucket) -> None:
        if self.dp == 1:
            return
        bucket.buffer.div_(self.dp)
        bucket.work = self.comm.all_reduce(bucket.buffer, async_op=True)

    def finish(self) -> None:
        """After backward: reduce what is left, wait for every bucket, and drop grads that never came."""
        self._launch_ready(force=True)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
            for param in bucket.params:
                if id(param) not in self._ready:
                    param.grad = None  # unused this step: like single-device training, no gradient
        self._active = False

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


class DataParallelTrainer:
    """Plain data parallel: every rank keeps everything; gradients all-reduced in buckets."""

    def __init__(self, sync: BucketedGradSync, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]):
        self.sync = sync
        self.optimizer = optimizer
        self.params = params

    def prepare(self) -> None:
        self.sync.prepare()

    def finish(self) -> None:
        self.sync.finish()

    def step(self, max_grad_norm: float | None) -> None:
        if max_grad_norm is not None:
            # Gradients are identical on every rank after the all-reduce: clip locally.
            torch.nn.utils.clip_grad_norm_(self.params, max_grad_norm)
        self.optimizer.step()

    def memory(self) -> dict[str, int]:
        params = sum(p.numel() * p.element_size() for p in self.params)
        grads = sum(b.buffer.numel() * b.buffer.element_size() for b in self.sync.buckets)
        return {"parameters": params, "gradients": grads, "optimizer": optimizer_state_bytes(self.optimizer)}
