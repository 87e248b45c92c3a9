"""Data per rank: each data-parallel rank trains on its own share of every global batch, and every rank
of a tensor-parallel group or of a pipeline trains on the same share.

``program.data_loader(dataset, global_batch_size)`` builds the torch ``DataLoader`` that does this (a
``DistributedSampler`` over the data-parallel ranks, not the world). A rank whose stages read no input
(a pipeline's middle stages) loads nothing: its batches are placeholders of the right shapes, from
which the schedule reads the microbatch sizes.

For the first steps, ``step()`` checks what it was handed (``compile(..., check_data=3)``): the ranks
that must see the same rows see the same rows, and the data-parallel ranks do not all see the same rows
(the global batch handed to every rank, which trains each on all of it). One all-gather of two numbers
per rank a step; the error says the fix.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from autoshard.distributed.comm import all_gather_tensor
from autoshard.errors import DistributedError, InputError

if TYPE_CHECKING:
    from autoshard.runtime.rank import RankRuntime

__all__ = ["check_rows", "data_loader", "reads_inputs"]


def reads_inputs(rt: RankRuntime) -> bool:
    """Whether this rank's graphs read the step's inputs (a pipeline's middle stages read none)."""
    return rt.runner is None or any(stage.input_indices for stage in rt.stages.values())


class _Placeholders(Dataset):
    """A dataset's samples as zeros of the first sample's shapes: what a rank that reads no input gets."""

    def __init__(self, dataset: Any) -> None:
        self.length = len(dataset)
        self.sample = pytree.tree_map(lambda x: torch.zeros_like(x) if isinstance(x, torch.Tensor) else x, dataset[0])

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        return self.sample


def data_loader(
    rt: RankRuntime,
    dp_rank: int,
    dp_size: int,
    dataset: Any,
    global_batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = True,
    **kwargs: Any,
) -> DataLoader:
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise InputError(f"global_batch_size={global_batch_size!r} must be a positive number of rows")
    if global_batch_size % dp_size:
        raise InputError(
            f"a global batch of {global_batch_size} rows does not split over dp={dp_size}; use a multiple of {dp_size}"
        )
    for name in ("sampler", "batch_sampler", "batch_size"):
        if name in kwargs:
            raise InputError(
                f"data_loader sets {name} itself (each dp rank's share of {global_batch_size} rows); leave it out, "
                f"or build your own DataLoader with DistributedSampler(num_replicas=program.dp_size, "
                f"rank=program.dp_rank)"
            )
    sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)  # fmt: skip
    source = dataset if reads_inputs(rt) else _Placeholders(dataset)
    return DataLoader(source, batch_size=global_batch_size // dp_size, sampler=sampler, drop_last=drop_last, **kwargs)


def _fingerprint(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One float64 that differs, but for a vanishing chance, between two different lists of tensors."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for i, tensor in enumerate(tensors):
        x = tensor.detach().reshape(-1).to(device=device, dtype=torch.float64)
        weights = torch.arange(x.numel(), dtype=torch.float64, device=device).remainder_(1009).add_(1 + i)
        total += (x * weights).sum() + x.numel() * 7919.0 * (i + 1)
    return total


def _groups(rt: RankRuntime) -> Iterator[tuple[int, list[int]]]:
    """(dp index, the ranks that train on its share): one tensor-parallel x pipeline block per dp rank."""
    mesh = rt.mesh
    for dp in range(mesh.dp):
        grid = itertools.product(range(mesh.pp), range(mesh.cp), range(mesh.tp))
        yield dp, [mesh.rank_of(pp=p, dp=dp, cp=c, tp=t) for p, c, t in grid]


def check_rows(rt: RankRuntime, flat: list[torch.Tensor]) -> None:
    """Every rank of a dp share got the same rows; the dp shares are not all the same rows."""
    if not dist.is_initialized() or rt.mesh.size == 1:
        return
    mine = torch.stack(
        [_fingerprint(flat, rt.device), torch.tensor(float(reads_inputs(rt)), dtype=torch.float64, device=rt.device)]
    )
    everyone = torch.empty(rt.mesh.size * 2, dtype=torch.float64, device=rt.device)
    all_gather_tensor(everyone, mine, group=rt.world_group)
    prints, reads = everyone[0::2].tolist(), everyone[1::2].tolist()
    shares = {}
    for dp, ranks in _groups(rt):
        readers = [r for r in ranks if reads[r]]
        differ = [r for r in readers if prints[r] != prints[readers[0]]]
        if differ:
            raise DistributedError(
                f"ranks {readers[0]} and {differ[0]} train on the same rows (the tensor-parallel and pipeline "
                f"ranks of data-parallel share {dp}) but were handed different batches; give every rank of a "
                f"share the same rows: program.data_loader(dataset, global_batch_size), or a DistributedSampler "
                f"with num_replicas=program.dp_size and rank=program.dp_rank (not the world size and rank)"
            )
        if readers:
            shares[dp] = prints[readers[0]]
    if len(shares) > 1 and len(set(shares.values())) == 1:
        rows = next((t.shape[0] for t in flat if t.dim()), 0)
        raise DistributedError(
            f"every data-parallel rank was handed the same {rows} rows, so each would train on all of them: "
            f"step() takes this rank's share of the global batch; pass program.local_batch(global_batch) "
            f"or load with program.data_loader(dataset, global_batch_size)"
        )
