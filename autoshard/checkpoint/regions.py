"""What one rank holds, as regions of the full tensors a checkpoint stores by the original model's keys:
the model's state (whole, a tp slice, this rank's experts, or its part of a flat ZeRO shard), fp32 masters kept apart,
and the optimizer's state per master; in the form torch.distributed.checkpoint writes and reads."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from autoshard.checkpoint.chunks import Pieces, TpSlice, pieces
from autoshard.errors import InputError
from autoshard.ir.placements import Shard

if TYPE_CHECKING:
    from autoshard.runtime.rank import RankRuntime

__all__ = [
    "Region",
    "as_pieces",
    "canonical_keys",
    "master_regions",
    "model_regions",
    "optimizer_params",
    "optimizer_regions",
]


@dataclass
class Region:
    """Local flat elements ``[start, end)`` of one key's tensor (tp slice of ``local_shape``), held in
    the 1-D ``storage``."""

    fqn: str
    full_shape: tuple[int, ...]
    storage: torch.Tensor
    local_shape: tuple[int, ...]
    start: int
    end: int
    tp: tuple[TpSlice, ...]  # how the rank's tensor is cut from the full one


def _tp_slice(rt: RankRuntime, key: str) -> tuple[TpSlice, ...]:
    """How the tensor this rank holds is cut from the full one: its tp slice, and its ep rank's experts."""
    placement, cuts = rt.compiled.placements[key], []
    if isinstance(placement.tp, Shard) and rt.tp is not None:
        cuts.append(TpSlice(placement.tp, rt.tp.rank, rt.tp.degree))
    if isinstance(placement.ep, Shard) and rt.ep is not None:
        cuts.append(TpSlice(placement.ep, rt.ep.rank, rt.ep.degree))
    return tuple(cuts)


def _whole(rt: RankRuntime, fqn: str, key: str, tensor: torch.Tensor) -> Region:
    full = tuple(rt.compiled.placements[key].shape)
    return Region(fqn, full, tensor.detach().view(-1), tuple(tensor.shape), 0, tensor.numel(), _tp_slice(rt, key))


def _in_flat(
    rt: RankRuntime, fqn: str, key: str, shard: torch.Tensor, lo: int, offset: int, shape: tuple
) -> Region | None:
    """The part of a parameter (at ``offset`` in its flat group) inside a shard starting at ``lo``."""
    numel = int(torch.Size(shape).numel())
    a, b = max(offset, lo), min(offset + numel, lo + shard.numel())
    if a >= b:
        return None
    full = tuple(rt.compiled.placements[key].shape)
    storage = shard.detach().view(-1)[a - lo : b - lo]
    return Region(fqn, full, storage, tuple(shape), a - offset, b - offset, _tp_slice(rt, key))


def canonical_keys(rt: RankRuntime) -> dict[int, str]:
    """The first held key of each tensor (a tied weight has several)."""
    out: dict[int, str] = {}
    for key, tensor in rt.tensors.items():
        if rt.compiled.placements[key].held_on(rt.coords, rt.plan.ep):
            out.setdefault(id(tensor), key)
    return out


def model_regions(rt: RankRuntime, source: dict[str, str] | None = None) -> list[Region]:
    """``model.<key>`` for every held key (``source`` renames a key's fqn, e.g. to its master)."""
    regions: list[Region] = []
    flat_of = {}
    if rt.plan.zero == 3:
        for g, layout in rt.holder.layouts.items():
            for param, offset, shape in zip(layout.params, layout.offsets, layout.shapes):
                flat_of[id(param)] = (rt.holder.runtime.shards[g], layout.lo, offset, shape)
    for key, tensor in rt.tensors.items():
        if not rt.compiled.placements[key].held_on(rt.coords, rt.plan.ep):
            continue
        fqn = (source or {}).get(key, f"model.{key}")
        if id(tensor) in flat_of:
            region = _in_flat(rt, fqn, key, *flat_of[id(tensor)])
            regions += [region] if region is not None else []
        else:
            regions.append(_whole(rt, fqn, key, tensor))
    return regions


def master_regions(rt: RankRuntime, prefix: str | dict[str, str] = "master") -> list[Region]:
    masters, keys, regions = rt.holder.masters, canonical_keys(rt), []
    if masters is None or not masters.separate:
        return []
    for g, master in masters.tensors.items():
        layout = rt.holder.layouts[g]
        for param, offset, shape in zip(layout.params, layout.offsets, layout.shapes):
            key = keys[id(param)]
            fqn = prefix.get(key, f"model.{key}") if isinstance(prefix, dict) else f"{prefix}.{key}"
            region = _in_flat(rt, fqn, key, master, layout.lo, offset, shape)
            regions += [region] if region is not None else []
    return regions


def optimizer_params(rt: RankRuntime) -> list[tuple[torch.Tensor, list[tuple[str, int, tuple, int]]]]:
    """Each tensor the optimizer steps, with the (key, offset in it, local shape, flat group lo) of
    every parameter it covers (the parameter itself, or the params of a flat master shard)."""
    keys, out = canonical_keys(rt), []
    masters = rt.holder.masters
    if masters is None:
        for group in rt.optimizer.param_groups:
            out += [(p, [(keys[id(p)], 0, tuple(p.shape), 0)]) for p in group["params"] if id(p) in keys]
        return out
    for g, master in masters.tensors.items():
        layout = rt.holder.layouts[g]
        params = zip(layout.params, layout.offsets, layout.shapes)
        covered = [(keys[id(p)], o, tuple(s), layout.lo) for p, o, s in params]
        out.append((master, covered))
    return out


def optimizer_regions(rt: RankRuntime, states: dict[int, dict[str, torch.Tensor]]) -> list[Region]:
    regions: list[Region] = []
    for opt_param, covered in optimizer_params(rt):
        for name, value in states.get(id(opt_param), {}).items():
            if not isinstance(value, torch.Tensor) or (value.dim() and value.shape != opt_param.shape):
                raise InputError(
                    f"optimizer state {name!r} of {covered[0][0]} is a {type(value).__name__} of shape "
                    f"{getattr(value, 'shape', None)}: checkpoints hold per-element or scalar tensor state"
                )
            for key, offset, shape, lo in covered:
                fqn = f"optim.{key}.{name}"
                if value.dim() == 0:
                    regions.append(Region(fqn, (), value.view(-1), (), 0, 1, ()))
                elif rt.holder.masters is None:
                    regions.append(_whole(rt, fqn, key, value))
                else:
                    region = _in_flat(rt, fqn, key, value, lo, offset, shape)
                    regions += [region] if region is not None else []
    return regions


def as_pieces(regions: list[Region]) -> dict[str, Pieces]:
    by_fqn: dict[str, list] = defaultdict(list)
    dtypes = {}
    for r in regions:
        by_fqn[r.fqn] += pieces(r.storage, r.local_shape, r.start, r.end, r.tp, r.full_shape)
        dtypes[r.fqn] = (r.full_shape, r.storage.dtype)
    return {fqn: Pieces(dtypes[fqn][0], dtypes[fqn][1], chunks) for fqn, chunks in by_fqn.items()}
