"""Local ranks: a pool of worker processes that form one real gloo process group, reused across calls.

Starting processes and a process group takes seconds; the demo, the benchmarks and the test suite
start a pool once and send it many functions:

    with LocalRanks(4) as ranks:
        results = ranks.run(fn, arg)     # fn(rank, world_size, arg) on every rank; list of results by rank
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from autoshard.distributed import gloo_via_host

__all__ = ["LocalRanks", "RankFailure", "init_from_torchrun"]


def init_from_torchrun(timeout: timedelta | None = None) -> Any:
    """Under torchrun: join the process group (NCCL with a GPU per rank, gloo on CPU) and return this
    rank's device (``cuda:LOCAL_RANK`` or ``cpu``). Build the model there before compiling."""
    import torch
    import torch.distributed as dist

    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() > int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    _refuse_a_restart_on_the_shared_store()
    kwargs = {"timeout": timeout} if timeout is not None else {}
    dist.init_process_group("nccl" if use_cuda else "gloo", **kwargs)
    atexit.register(_leave_process_group)
    return device


def _leave_process_group() -> None:
    """At exit, while the interpreter is whole: a script that never calls destroy_process_group() otherwise
    leaves gloo's worker threads to the interpreter's teardown, which can abort the process
    ("terminate called without an active exception"; pytorch/pytorch PR 179291 describes it) and fail
    the torchrun job."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


SHARED_STORE_FIX = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"


def _refuse_a_restart_on_the_shared_store() -> None:
    """torchrun's agent shares its rendezvous store with the workers and keeps it across restarts, so a
    restarted worker can read the failed attempt's process-group addresses and hang or fail to connect
    (pytorch/pytorch#135712). Fail the restarted attempt at once with the fix instead."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        from autoshard.errors import DistributedError

        raise DistributedError(
            f"this is restart {os.environ['TORCHELASTIC_RESTART_COUNT']} of a torchrun job whose workers share "
            f"the agent's store, which still holds the failed attempt's addresses (process groups would hang); "
            f"launch torchrun with {SHARED_STORE_FIX} in its environment so every attempt gets a fresh store"
        )
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and os.environ.get("RANK") == "0":
        import logging

        logging.getLogger("autoshard").warning(
            "torchrun --max-restarts without %s: a restarted attempt would read stale addresses from the "
            "shared store, so it will stop with this fix named instead of resuming",
            SHARED_STORE_FIX,
        )


class RankFailure(RuntimeError):
    """A function raised on one or more ranks; the message carries each rank's traceback."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cores_of_ranks(world_size: int, threads: int) -> list[set[int]] | None:
    """Cores of this process's own (its affinity) dealt out, ``threads`` a rank; None where there are too few
    for every rank to have cores of its own, or no way to pin (not Linux)."""
    if not hasattr(os, "sched_getaffinity") or not os.path.isdir("/proc/self/task"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if world_size * threads > len(cores):
        return None
    return [set(cores[r * threads : (r + 1) * threads]) for r in range(world_size)]


def _exit_with_parent(parent: int) -> None:
    """A rank whose parent is gone (killed, so it never closed the pool) ends too, instead of holding its memory
    and cores: ``daemon=True`` ends the ranks only where the parent exits through Python."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    device: str,
    threads: int,
    cores: set[int] | None,
    inbox: Any,
    outbox: Any,
) -> None:
    if cores is not None:  # every thread now (importing torch starts some); later ones (gloo's) inherit it
        for thread in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(thread), cores)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())  # NCCL: one GPU per rank; else they share
    if backend == gloo_via_host.BACKEND:
        gloo_via_host.register()
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=300),
    )
    outbox.put(("ready", rank, None))
    while True:
        message = inbox.get()
        if message is None:
            break
        fn, args, kwargs = message
        try:
            outbox.put(("ok", rank, fn(rank, world_size, *args, **kwargs)))
        except BaseException:  # noqa: BLE001 - sent back to the caller with the traceback
            outbox.put(("error", rank, traceback.format_exc()))
    dist.destroy_process_group()


class LocalRanks:
    """``world_size`` local processes in one process group, kept alive between ``run`` calls.

    ``device="cpu"`` (the default): gloo ranks on the CPU. ``device="cuda"``: each rank on a GPU of its
    own over NCCL where there are enough of them, else the ranks share the GPUs and their collectives
    run on gloo through host memory (autoshard/distributed/gloo_via_host.py; NCCL refuses two ranks on one GPU).

    ``pin`` (CPU ranks): where every rank can have ``threads`` cores of its own, each rank's process (its
    compute threads and gloo's) stays on its cores. Unpinned, ranks sharing cores with each other's gloo
    threads can fall into a state where posting a receive waits a scheduler tick, 4-6 ms (most likely on
    gloo's thread, which takes the connection's lock too, waiting for a core): 2 ranks on 2 cores, in some
    pools every receive of one rank (13 of a zbv step's 13), in others none; pinned, none over 0.15 ms. With
    more ranks than cores nothing is pinned.
    """

    def __init__(
        self,
        world_size: int,
        backend: str | None = None,
        threads: int = 1,
        timeout: float = 600.0,
        device: str = "cpu",
        pin: bool = True,
    ) -> None:
        import torch

        from autoshard.errors import DistributedError

        if device not in ("cpu", "cuda"):
            raise DistributedError(f"LocalRanks(device={device!r}): the device is 'cpu' or 'cuda'")
        if device == "cuda" and not torch.cuda.is_available():
            raise DistributedError("LocalRanks(device='cuda'): this torch sees no CUDA device; use device='cpu'")
        if backend is None:
            gpus = torch.cuda.device_count() if device == "cuda" else 0
            backend = "gloo" if device == "cpu" else "nccl" if gpus >= world_size else gloo_via_host.BACKEND
        if backend == "nccl":
            if torch.cuda.device_count() < world_size:
                raise DistributedError(
                    f"LocalRanks({world_size}, backend='nccl') needs a CUDA device per rank, but this torch sees "
                    f"{torch.cuda.device_count()}; use backend='gloo' on the CPU, or fewer ranks"
                )
            device = "cuda"
        self.world_size = world_size
        self.backend = backend
        self.device = device
        self.threads = threads
        self.cores = _cores_of_ranks(world_size, threads) if pin and device == "cpu" else None
        self.timeout = timeout
        self._ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._inboxes: list[Any] = []
        self._outbox: Any = None

    def start(self) -> LocalRanks:
        if self._procs:
            return self
        port = _free_port()
        self._outbox = self._ctx.Queue()
        for rank in range(self.world_size):
            inbox = self._ctx.Queue()
            proc = self._ctx.Process(
                target=_worker,
                args=(
                    rank,
                    self.world_size,
                    port,
                    self.backend,
                    self.device,
                    self.threads,
                    None if self.cores is None else self.cores[rank],
                    inbox,
                    self._outbox,
                ),
                daemon=True,
            )
            proc.start()
            self._procs.append(proc)
            self._inboxes.append(inbox)
        self._collect("ready")
        return self

    def _collect(self, expect: str) -> list[Any]:
        import queue

        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        waited = 0.0
        while len(results) + len(errors) < self.world_size:
            try:
                kind, rank, payload = self._outbox.get(timeout=1.0)
                waited = 0.0
            except queue.Empty:
                waited += 1.0
                # A rank that died answers nothing: report it now, not after the timeout.
                for r, proc in enumerate(self._procs):
                    if r not in results and r not in errors and not proc.is_alive():
                        errors[r] = f"rank {r} died (exit code {proc.exitcode})"
                if waited < (self.timeout if not errors else 30):
                    continue
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                self.close(force=True)
                waiting = sorted(set(range(self.world_size)) - set(results) - set(errors))
                detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
                raise RankFailure(
                    f"ranks {waiting} did not answer (dead: {dead}); the pool was shut down{detail}"
                ) from None
            if kind == "error":
                errors[rank] = payload
            else:
                results[rank] = payload
        if errors:
            if len(errors) < self.world_size:
                # The ranks that succeeded may have issued collectives the failed ones never matched.
                self.close(force=True)
            detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise RankFailure(f"{len(errors)} rank(s) failed:{detail}")
        return [results[r] for r in range(self.world_size)] if expect != "ready" else []

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; return the results by rank."""
        self.start()
        for inbox in self._inboxes:
            inbox.put((fn, args, kwargs))
        return self._collect("ok")

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def close(self, force: bool = False) -> None:
        if not force:
            for inbox in self._inboxes:
                inbox.put(None)
            for proc in self._procs:
                proc.join(timeout=10)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._procs, self._inboxes = [], []

    def __enter__(self) -> LocalRanks:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
