"""Several ranks on one GPU: gloo collectives on CUDA tensors, staged through host memory.

NCCL refuses two ranks on one device ("Duplicate GPU detected"), and gloo moves CUDA tensors for some
collectives only: its send/recv and the coalesced all-gather that functional collectives issue take
the device pointer as if it were host memory. This process group runs every collective on gloo over
host copies of its tensors, so that ranks sharing a GPU (the equivalence checks on a one-GPU machine,
``LocalRanks(n, device="cuda")``) run every plan with every tensor on the device. Each call copies
its tensors to the host, starts gloo's collective there, and copies the results back into the device
tensors when the work is waited for (functional collectives: at ``wait_tensor``), so asynchronous
collectives stay asynchronous. It is for checking, not for speed: real multi-GPU runs use NCCL.

    init_process_group(BACKEND, ...)      # after register(); every new_group() gets one too
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["BACKEND", "GlooViaHost", "register"]

BACKEND = "gloo_via_host"


def register() -> None:
    """Make ``BACKEND`` a torch.distributed backend name (idempotent)."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> GlooViaHost:
    return GlooViaHost(store, rank, size, timeout)


class _StagedWork(dist._Work):
    """Gloo's works on the host copies; ``wait`` waits for them and copies the results to the device."""

    def __init__(self, works: Sequence[Any], finish: Callable[[], None]) -> None:
        super().__init__()
        self._works, self._finish, self._done = list(works), finish, False
        self._future: torch.futures.Future = torch.futures.Future()

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            for work in self._works:
                work.wait()
            self._finish()
            self._done = True
            self._future.set_result(None)
        return True

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done

    def get_future(self) -> torch.futures.Future:
        return self._future


class _Staging:
    """Host copies of one call's tensors, and what to copy back once the collective is done."""

    def __init__(self, always: bool) -> None:
        self.always = always  # stage host tensors too (tests exercise the copies on a CPU-only machine)
        self.back: list[tuple[torch.Tensor, torch.Tensor]] = []

    def host(self, tensor: torch.Tensor, result: bool = False) -> torch.Tensor:
        """The host tensor gloo works on; ``result``: copied back into ``tensor`` when done."""
        if tensor.device.type == "cpu" and not self.always and tensor.is_contiguous():
            return tensor
        # A pageable copy from the device waits for the kernels that wrote the tensor on its stream.
        staged = tensor.detach().to("cpu", copy=True).contiguous()
        if result:
            self.back.append((tensor, staged))
        return staged

    def empty(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host buffer for a pure output (nothing to copy to the host first)."""
        if tensor.device.type == "cpu" and not self.always and tensor.is_contiguous():
            return tensor
        staged = torch.empty(tensor.shape, dtype=tensor.dtype)
        self.back.append((tensor, staged))
        return staged

    def finish(self) -> None:
        with torch.no_grad():
            for tensor, staged in self.back:
                tensor.copy_(staged)
        self.back = []


def _method(shape: str, name: str, kind: str) -> Callable[..., _StagedWork]:
    """A process-group method that runs gloo's ``name`` through ``GlooViaHost.<shape>``."""

    def method(self: GlooViaHost, *args: Any) -> _StagedWork:
        return getattr(self, shape)(name, kind, *args)

    method.__name__ = name
    return method


class GlooViaHost(dist.ProcessGroup):
    """A process group whose collectives run on gloo over host copies of their tensors."""

    stage_host_tensors = False  # tests set it to exercise the staging without a GPU

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._group_name = ""
        self._group_desc = ""

    # ---- what torch asks of a process group written in Python ----------------------------------
    def getBackendName(self) -> str:
        return BACKEND

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    def _call(self, start: Callable[[_Staging], Any]) -> _StagedWork:
        staging = _Staging(self.stage_host_tensors)
        works = start(staging)
        return _StagedWork(works if isinstance(works, list) else [works], staging.finish)

    # ---- collectives ---------------------------------------------------------------------------
    def _in_place(self, name: str, kind: str, tensors: list[torch.Tensor], opts: Any = None) -> _StagedWork:
        """A collective whose results land in its inputs (all-reduce, broadcast, reduce)."""
        opts = _opts(opts, kind)
        return self._call(lambda s: getattr(self._gloo, name)([s.host(t, True) for t in tensors], opts))

    def _out_of_place(
        self, name: str, kind: str, outputs: Any, inputs: Any, opts: Any = None, *extra: Any
    ) -> _StagedWork:
        """A collective from ``inputs`` into ``outputs`` (tensors or nested lists of them, as gloo takes them)."""
        opts = _opts(opts, kind)
        return self._call(
            lambda s: getattr(self._gloo, name)(_nested(s.empty, outputs), _nested(s.host, inputs), *extra, opts)
        )

    def _pairwise(self, name: str, kind: str, outputs: list, inputs: list, opts: Any = None) -> _StagedWork:
        """A coalesced collective as one gloo call per (output, input) pair (gloo's own needs host tensors)."""
        opts = _opts(opts, kind)
        return self._call(
            lambda s: [getattr(self._gloo, name)(s.empty(o), s.host(i), opts) for o, i in zip(outputs, inputs)]
        )

    # The collectives torch calls by name: each through one of the three shapes above.
    allreduce = _method("_in_place", "allreduce", "AllreduceOptions")
    allreduce_coalesced = _method("_in_place", "allreduce_coalesced", "AllreduceCoalescedOptions")
    broadcast = _method("_in_place", "broadcast", "BroadcastOptions")
    reduce = _method("_in_place", "reduce", "ReduceOptions")
    allgather = _method("_out_of_place", "allgather", "AllgatherOptions")
    _allgather_base = all_gather_single = _method("_out_of_place", "_allgather_base", "AllgatherOptions")
    allgather_into_tensor_coalesced = _method("_pairwise", "_allgather_base", "AllgatherOptions")
    reduce_scatter = _method("_out_of_place", "reduce_scatter", "ReduceScatterOptions")
    _reduce_scatter_base = reduce_scatter_single = _method(
        "_out_of_place", "_reduce_scatter_base", "ReduceScatterOptions"
    )
    reduce_scatter_tensor_coalesced = _method("_pairwise", "_reduce_scatter_base", "ReduceScatterOptions")
    gather = _method("_out_of_place", "gather", "GatherOptions")
    scatter = _method("_out_of_place", "scatter", "ScatterOptions")

    def alltoall_base(
        self, output: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], opts: Any = None
    ) -> _StagedWork:
        return self._out_of_place("alltoall_base", "AllToAllOptions", output, inp, opts, out_splits, in_splits)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> _StagedWork:
        return self._call(lambda s: self._gloo.send([s.host(t) for t in tensors], dst, tag))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> _StagedWork:
        return self._call(lambda s: self._gloo.recv([s.empty(t) for t in tensors], src, tag))

    def barrier(self, opts: Any = None) -> _StagedWork:
        return self._call(lambda s: self._gloo.barrier(_opts(opts, "BarrierOptions")))


def _nested(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    return [_nested(fn, v) for v in value] if isinstance(value, (list, tuple)) else fn(value)


def _opts(opts: Any, kind: str) -> Any:
    from torch._C import _distributed_c10d

    return getattr(_distributed_c10d, kind)() if opts is None else opts
