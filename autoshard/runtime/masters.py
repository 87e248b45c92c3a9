"""The tensors the optimizer steps under ZeRO: this rank's fp32 shard of each flat group.

When the compute shards are fp32 and stay on the device, the masters are those shards (shared storage).
With lower-precision parameters or offload they are separate fp32 copies, and the update is copied back
into the compute shards after each step. With offload (ZeRO-Offload) they live in host memory: the
gradients go down, the host steps the optimizer, the update goes up.

Offloaded from a GPU, the host tensors that cross the bus are page-locked (registered with CUDA in place:
the caching host allocator would round each group up to a power of two), and the crossings overlap the
host's work: the groups are stepped in waves; while the host steps wave k, wave k+1's gradients come down
on a side stream and wave k-1's update goes up. Each wave is one ``optimizer.step()`` over the masters
whose gradients are set (the others have none, so an elementwise optimizer skips them); only two waves of
gradients are ever on the host.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch
from torch import nn

__all__ = ["Masters", "WAVES"]

WAVES = 8  # optimizer steps per offloaded step: more overlap the copies better, each costs a step() call


class Masters:
    """This rank's master shards by group id, and the optimizer step over them (see the module docstring)."""

    def __init__(self, compute: dict[int, torch.Tensor], offload: bool, initial: dict[int, torch.Tensor] | None):
        """``initial``: fp32 starting values per group where the compute shards were rounded (mixed precision)."""
        self.compute = compute
        self.offload = offload
        self.separate = offload or any(t.dtype != torch.float32 for t in compute.values())
        on_gpu = offload and any(t.is_cuda for t in compute.values())
        self.stream = torch.cuda.Stream(next(t.device for t in compute.values() if t.is_cuda)) if on_gpu else None
        self.tensors: dict[int, nn.Parameter] = {}
        self._registered: list[int] = []  # host pointers registered with CUDA, released with this object
        for g, shard in compute.items():
            if self.separate:
                source = initial[g] if initial else shard.detach()
                if offload:
                    master = self._host_empty(source.numel()).view(source.shape)
                    master.copy_(source)
                else:
                    master = source.to(device=shard.device, dtype=torch.float32, copy=True)
                self.tensors[g] = nn.Parameter(master)
            else:
                self.tensors[g] = nn.Parameter(shard.detach())  # shares storage
        # Offload: the groups in waves of about equal size, two host buffers for a wave's gradients.
        self.waves = _waves([(g, t.numel()) for g, t in self.tensors.items()]) if offload else []
        largest = max((sum(self.tensors[g].numel() for g in wave) for wave in self.waves), default=0)
        self._buffers = [self._host_empty(largest) for _ in range(min(2, len(self.waves)))]
        self._grads: dict[int, torch.Tensor | None] = {}
        self._uploads: dict[int, torch.Tensor] = {}  # offload: updated masters arriving on the device
        # Offload, the last step: seconds the host stepped, and waited for copies down and up (what they
        # did not hide behind its work).
        self.last_seconds: dict[str, float] = {}
        if self._registered:
            weakref.finalize(self, _unregister, list(self._registered))

    def _host_empty(self, numel: int) -> torch.Tensor:
        """An fp32 host tensor; page-locked when the copies cross to a GPU."""
        tensor = torch.empty(numel, dtype=torch.float32)
        if self.stream is not None and numel:
            code = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), numel * 4, 0)
            if int(getattr(code, "value", code)) == 0:  # else it stays pageable: slower copies, same values
                self._registered.append(tensor.data_ptr())
        return tensor

    def host_tensors(self) -> list[torch.Tensor]:
        """Offload: the host tensors that cross to the device and back (masters, gradient buffers)."""
        return [*self.tensors.values(), *self._buffers] if self.offload else []

    def set_grads(self, grads: dict[int, torch.Tensor | None]) -> None:
        """The final gradient shards of this step (offload: they go down wave by wave, in ``step``)."""
        if self.offload:
            self._grads = dict(grads)
            return
        for g, master in self.tensors.items():
            grad = grads.get(g)
            if grad is None:
                master.grad = None
            else:
                master.grad = grad.to(master.device, torch.float32) if self.separate else grad

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step the optimizer over the masters (offload: wave by wave, the copies overlapping the host's work)."""
        if not self.offload:
            optimizer.step()
            return
        seconds = dict.fromkeys(("host_step", "wait_down", "wait_up"), 0.0)
        ready = self._ready_event()
        arrived = [self._download(0, ready)] if self.waves else []
        for k, wave in enumerate(self.waves):
            if k + 1 < len(self.waves):
                arrived.append(self._download(k + 1, ready))  # into the other buffer, while this wave steps
            start = time.perf_counter()
            if arrived[k] is not None:
                arrived[k].synchronize()
            seconds["wait_down"] += time.perf_counter() - start
            offset = 0
            for g in wave:
                master = self.tensors[g]
                if self._grads.get(g) is not None:
                    master.grad = self._buffers[k % 2][offset : offset + master.numel()].view_as(master)
                offset += master.numel()
            start = time.perf_counter()
            optimizer.step()
            seconds["host_step"] += time.perf_counter() - start
            for g in wave:
                self.tensors[g].grad = None
            self._upload(wave)
        self._grads = {}
        self.last_seconds = seconds

    def _ready_event(self) -> Any:
        """The device's work so far (the backward, the clipping): what the copies down wait for."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _download(self, k: int, ready: Any) -> Any:
        """Copy wave ``k``'s gradients into host buffer k % 2 (on a GPU: started on the side stream)."""
        buffer, offset = self._buffers[k % 2], 0
        if self.stream is None:
            for g in self.waves[k]:
                n = self.tensors[g].numel()
                if self._grads.get(g) is not None:
                    buffer[offset : offset + n].copy_(self._grads[g].reshape(-1))
                offset += n
            return None
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            for g in self.waves[k]:
                n, grad = self.tensors[g].numel(), self._grads.get(g)
                if grad is not None:
                    down = grad.detach().reshape(-1).to(torch.float32)  # converted on the device: one copy down
                    buffer[offset : offset + n].copy_(down, non_blocking=True)
                    down.record_stream(self.stream)
                offset += n
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def _upload(self, wave: list[int]) -> None:
        """Start copying the wave's updated masters up (on a GPU: into fp32 staging on the side stream)."""
        if self.stream is None:
            return
        with torch.cuda.stream(self.stream):
            for g in wave:
                staging = torch.empty(self.tensors[g].shape, dtype=torch.float32, device=self.compute[g].device)
                staging.copy_(self.tensors[g].detach(), non_blocking=True)
                self._uploads[g] = staging

    def write_back(self) -> None:
        """The update into the compute shards the graphs read."""
        with torch.no_grad():
            if self._uploads:
                # The host may change the masters next (a load): the copies up from them end first.
                start = time.perf_counter()
                self.stream.synchronize()
                self.last_seconds["wait_up"] = time.perf_counter() - start
            for g, master in self.tensors.items():
                if g in self._uploads:
                    staging = self._uploads.pop(g)
                    staging.record_stream(torch.cuda.current_stream())  # allocated on the side stream
                    self.compute[g].copy_(staging)
                elif self.separate:
                    self.compute[g].copy_(master.detach())
                master.grad = None

    def reload(self, values: dict[int, torch.Tensor] | None = None) -> None:
        """After the compute shards were overwritten (a state dict was loaded): the masters from ``values``
        (this rank's shard per group, at the precision it was loaded in), else from the compute shards."""
        if self.separate:
            with torch.no_grad():
                for g, master in self.tensors.items():
                    master.copy_((values[g] if values is not None else self.compute[g]).detach())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values()) if self.separate else 0


def _waves(sizes: list[tuple[int, int]]) -> list[list[int]]:
    """Consecutive groups in at most WAVES waves of about equal numel."""
    total = sum(n for _, n in sizes)
    waves: list[list[int]] = [[]]
    filled = 0
    for g, n in sizes:
        if waves[-1] and filled >= total * len(waves) / WAVES:
            waves.append([])
        waves[-1].append(g)
        filled += n
    return [w for w in waves if w]


def _unregister(pointers: list[int]) -> None:
    for pointer in pointers:
        torch.cuda.cudart().cudaHostUnregister(pointer)
