"""The pieces of a full tensor that one rank holds, in the form torch.distributed.checkpoint stores.

A rank holds a tensor of the model's state as a tp slice (``Shard(dim, blocks)``: one or several
ranges along ``dim``), and under ZeRO as a range of that slice's flat elements. DCP stores and
reshards rectangular chunks of the full tensor, so ``pieces`` cuts a flat range into contiguous
boxes, maps each box through the tp slice to full coordinates, and returns views of the rank's own
storage: saving reads them, loading writes into them. ``Pieces`` is one key's set, with the three
methods DCP's planners ask a sharded tensor for (as DTensor implements them).
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, StorageMeta, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from autoshard.ir.placements import Shard

__all__ = ["Pieces", "PiecesLoadPlanner", "PiecesSavePlanner", "SafeReader", "flat_boxes", "pieces"]


def flat_boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Cover the row-major elements ``[start, end)`` of a tensor of ``shape`` with contiguous boxes:
    (offsets, sizes, flat index of the box's first element), in order."""
    if start >= end:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    (r0, c0), (r1, c1) = divmod(start, inner), divmod(end, inner)

    def within(row: int, lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
        return [((row, *o), (1, *s), row * inner + f) for o, s, f in flat_boxes(shape[1:], lo, hi)]

    if r0 == r1:
        return within(r0, c0, c1)
    boxes = within(r0, c0, inner) if c0 else []
    first_full = r0 + 1 if c0 else r0
    if r1 > first_full:
        boxes.append(((first_full, *[0] * (len(shape) - 1)), (r1 - first_full, *shape[1:]), first_full * inner))
    return boxes + (within(r1, 0, c1) if c1 else [])


@dataclass(frozen=True)
class TpSlice:
    """Which slice of the full tensor a tp rank holds: ``Shard(dim, blocks)`` at ``rank`` of ``degree``."""

    shard: Shard
    rank: int
    degree: int

    def segments(self, full_size: int) -> list[tuple[int, int, int]]:
        """(local start, local end, full start) of each contiguous run along the sharded dimension."""
        block = full_size // self.shard.blocks
        step = block // self.degree
        return [(b * step, (b + 1) * step, b * block + self.rank * step) for b in range(self.shard.blocks)]


def pieces(
    storage: torch.Tensor,
    local_shape: tuple[int, ...],
    start: int,
    end: int,
    slices: tuple[TpSlice, ...],
    full_shape: tuple,
) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """(full offsets, view) of each box of local flat elements ``[start, end)``; ``storage`` is 1-D and
    holds exactly those elements. ``slices``: how the rank's tensor is cut from the full one, a dimension
    each (tp's, and ep's experts along dim 0)."""
    out = []
    for offsets, sizes, first in flat_boxes(tuple(local_shape), start, end):
        out.append((offsets, storage[first - start : first - start + math.prod(sizes)].view(sizes)))
    for cut in slices:
        dim, moved_out = cut.shard.dim, []
        for offsets, box in out:
            lo, hi = offsets[dim], offsets[dim] + box.shape[dim]
            for seg_lo, seg_hi, full_lo in cut.segments(full_shape[dim]):
                a, b = max(lo, seg_lo), min(hi, seg_hi)
                if a < b:
                    moved = (*offsets[:dim], full_lo + a - seg_lo, *offsets[dim + 1 :])
                    moved_out.append((moved, box.narrow(dim, a - lo, b - a)))
        out = moved_out
    return out


class Pieces:
    """One key of the checkpoint on this rank: the full size and dtype, and the rank's chunks of it."""

    def __init__(self, size: tuple[int, ...], dtype: torch.dtype, chunks: list[tuple[tuple[int, ...], torch.Tensor]]):
        self.full_size = torch.Size(size)
        self.dtype = dtype
        self.chunks = {torch.Size(offsets): tensor for offsets, tensor in chunks}

    def size(self) -> torch.Size:
        return self.full_size

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=tensor.size()),
                    properties=TensorProperties.create_from_tensor(tensor),
                    size=self.full_size,
                ),
            )
            for offsets, tensor in self.chunks.items()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=t.size()) for o, t in self.chunks.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.chunks[torch.Size(index.offset)]


class PiecesSavePlanner(DefaultSavePlanner):
    """DCP's planner, reading a ``Pieces`` chunk by its offset (the default looks up plain tensors only)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Pieces) else super().lookup_object(index)


class PiecesLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, writing into a ``Pieces`` chunk. The state dict is flat already, and DCP's set-up
    (meta-tensor initialisation) would replace every object it does not know by None."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False) -> None:
        self.original_state_dict = self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Pieces) else super().lookup_tensor(index)


# What DCP's metadata file may name: its own records, torch sizes, dtypes and layouts, and paths.
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": None,
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": None,
    "torch.serialization": {"_get_layout"},
    "torch": {"Size", *(str(t).removeprefix("torch.") for t in vars(torch).values() if isinstance(t, torch.dtype))},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict", "slice"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        names = _ALLOWED.get(module, set())
        if module not in _ALLOWED or (names is not None and name not in names):
            raise pickle.UnpicklingError(f"the metadata names {module}.{name}, which a checkpoint never holds")
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """DCP's file reader with a metadata file read by an allow-list (DCP's own unpickles anything);
    tensor data is already read with ``weights_only``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
