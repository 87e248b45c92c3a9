"""Process groups over sets of ranks, made once per process and shared by every program in it."""

from __future__ import annotations

import atexit
import itertools
from collections.abc import Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from autoshard.spec.mesh import Mesh

__all__ = ["broadcast_tensors", "expert_groups", "make_group", "shared_group", "tied_groups"]


_groups: dict[tuple[tuple[int, ...], timedelta], tuple[Any, Any]] = {}  # -> (default group, group)
# Freed before the interpreter tears down, as c10d frees its own: a gloo group destroyed during module
# teardown aborts the process ("terminate called without an active exception").
atexit.register(_groups.clear)


def shared_group(ranks: Iterable[int], timeout: timedelta) -> dist.ProcessGroup:
    """The process group over ``ranks``, one per process for each ranks and timeout: every program of the
    process reuses it. Each group holds its own connections and creating one gets slower as groups pile
    up, so a process that compiles many programs (a notebook, a sweep, a test session) would leak them.
    Every rank creates every group, in the same order, so every rank hits or misses alike; a new default
    group (after destroy_process_group) starts afresh."""
    world = dist.group.WORLD
    for stale in [k for k, (w, _) in _groups.items() if w is not world]:
        del _groups[stale]  # groups of a destroyed default group
    key = (tuple(ranks), timeout)
    made = _groups.get(key)
    if made is None:
        made = _groups[key] = (world, dist.new_group(list(ranks), timeout=timeout))
    return made[1]


def make_group(
    mesh: Mesh, rank: int, dim: str, timeout: timedelta, world: dist.ProcessGroup | None
) -> dist.ProcessGroup | None:
    """This rank's process group along mesh dimension ``dim`` (every rank creates every group, in order)."""
    if mesh.degree(dim) == dist.get_world_size():
        return world
    mine = None
    for ranks in mesh.groups(dim):
        group = shared_group(ranks, timeout)
        if rank in ranks:
            mine = group
    return mine


def expert_groups(
    mesh: Mesh, rank: int, ep: int, timeout: timedelta
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """This rank's expert-parallel group and its expert-data-parallel group (Mesh.expert_groups), every
    rank creating every group in the same order."""
    mine: list[Any] = [None, None]
    for kind in (0, 1):
        for ranks in dict.fromkeys(tuple(mesh.expert_groups(r, ep)[kind]) for r in range(mesh.size)):
            group = shared_group(ranks, timeout)
            if rank in ranks:
                mine[kind] = group
    return mine[0], mine[1]


def tied_groups(
    mesh: Mesh, rank: int, tied_sets: list[tuple[int, ...]], timeout: timedelta
) -> dict[tuple[int, ...], Any]:
    """For each set of pipeline ranks sharing a tied weight, this rank's group among them (one group per
    dp x cp x tp place; every rank creates every group, in order)."""
    mine: dict[tuple[int, ...], Any] = {}
    for pp_ranks in tied_sets:
        for dp, cp, tp in itertools.product(range(mesh.dp), range(mesh.cp), range(mesh.tp)):
            ranks = [mesh.rank_of(pp=r, dp=dp, cp=cp, tp=tp) for r in pp_ranks]
            group = shared_group(ranks, timeout)
            if rank in ranks:
                mine[pp_ranks] = group
    return mine


def broadcast_tensors(tensors: list[torch.Tensor], device: torch.device, src: int, group: dist.ProcessGroup) -> None:
    """Every rank of ``group`` takes rank ``src``'s values of ``tensors``: one broadcast per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in dict.fromkeys(tensors):
        if tensor.numel():
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
    with torch.no_grad():
        for same_dtype in by_dtype.values():
            flat = torch.cat([t.reshape(-1).to(device) for t in same_dtype])
            dist.broadcast(flat, src=src, group=group)
            for t, value in zip(same_dtype, flat.split([t.numel() for t in same_dtype])):
                t.copy_(value.view_as(t))
