"""The model's state across ranks, read off each tensor's ParamPlacement.

``full_state`` joins it on rank 0: the holder gathers dp shards (ZeRO-3), tp shards are gathered
over tp, stacked experts over ep, and each tensor comes from the first pipeline rank that holds it (a loop's
expert: from the rank of the first ep group that runs it). ``load_full_state``
is the converse: every rank takes its share of a full state dict. ``local_state`` is what this rank
holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from autoshard.errors import InputError
from autoshard.ir.placements import OnRank, OnStages, Shard

if TYPE_CHECKING:
    from autoshard.runtime.rank import RankRuntime

__all__ = ["full_state", "load_full_state", "local_state", "masters_kept"]


def local_state(rt: RankRuntime) -> dict[str, torch.Tensor]:
    """This rank's tensors by key (tp slices as held); under ZeRO-3 its flat shards, then its buffers."""
    if rt.plan.zero == 3:
        shards = {f"zero3.shards.{g}": s.detach() for g, s in rt.holder.runtime.shards.items()}
        params = {id(p) for p in rt.holder.params()}
        return shards | {k: t.detach() for k, t in rt.tensors.items() if id(t) not in params and _held(rt, k)}
    return {key: t.detach() for key, t in rt.tensors.items() if _held(rt, key)}


def _held(rt: RankRuntime, key: str) -> bool:
    return rt.compiled.placements[key].held_on(rt.coords, rt.plan.ep)


def masters_kept(rt: RankRuntime) -> bool:
    """Whether the plan keeps fp32 master weights apart from the parameters (bf16 parameters, offload);
    the same answer on every rank."""
    plan = rt.plan
    return plan.zero >= 1 and (plan.offload or plan.param_dtype not in (None, torch.float32))


def full_state(rt: RankRuntime, masters: bool = False) -> dict[str, torch.Tensor]:
    """On rank 0: every key of the model's state dict, full shapes; elsewhere {}. A collective.
    ``masters``: trainable parameters as their fp32 masters where the plan keeps them apart."""
    placements = rt.compiled.placements
    whole = rt.holder.full_values()  # whole along dp (ZeRO-3 gathers)
    masters = masters and masters_kept(rt)
    if masters:
        whole.update(rt.holder.master_values())
    values: dict[int, torch.Tensor] = {}
    for key, tensor in rt.tensors.items():
        if id(tensor) in values or not _held(rt, key):
            continue
        value = whole.get(id(tensor), tensor.detach())
        tp = placements[key].tp
        values[id(tensor)] = rt.tp.gather(value, tp) if isinstance(tp, Shard) and rt.tp is not None else value
        if isinstance(placements[key].ep, Shard) and rt.ep is not None:
            values[id(tensor)] = rt.ep.gather(values[id(tensor)])
    owner = {}
    for key, placement in placements.items():
        first_pp = placement.pp.ranks[0] if isinstance(placement.pp, OnStages) else 0
        ep_rank = placement.ep.rank if isinstance(placement.ep, OnRank) else 0  # its expert's ep rank, first group
        owner[key] = rt.mesh.rank_of(pp=first_pp, dp=ep_rank)
    out = {k: values[id(rt.tensors[k])].clone() for k in rt.tensors if owner[k] == 0} if rt.rank == 0 else {}
    for src in sorted(set(owner.values()) - {0}):
        keys = list(dict.fromkeys(k for k in rt.tensors if owner[k] == src))
        by_dtype: dict[torch.dtype, list[str]] = {}
        for key in keys:
            dtype = torch.float32 if masters and placements[key].trainable else rt.tensors[key].dtype
            by_dtype.setdefault(dtype, []).append(key)
        for dtype, group in by_dtype.items():
            numels = [torch.Size(placements[k].shape).numel() for k in group]
            if rt.rank == src:
                flat = torch.cat([values[id(rt.tensors[k])].reshape(-1) for k in group])
                dist.send(flat, dst=0, group=rt.p2p_group)
            elif rt.rank == 0:
                flat = torch.empty(sum(numels), dtype=dtype, device=rt.device)
                dist.recv(flat, src=src, group=rt.p2p_group)
                for key, piece in zip(group, flat.split(numels)):
                    out[key] = piece.view(placements[key].shape).clone()
    return {key: out[key] for key in rt.tensors} if rt.rank == 0 else {}


def check_full_state(placements: dict[str, Any], state_dict: dict[str, torch.Tensor]) -> None:
    """Refuse a state dict whose keys or shapes differ from the model's, before anything changes."""
    missing = sorted(set(placements) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(placements))
    if missing or unexpected:
        raise InputError(f"state dict keys do not match the model: missing {missing}, unexpected {unexpected}")
    for key, placement in placements.items():
        value = state_dict[key]
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(placement.shape):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise InputError(f"{key}: shape {got} in the state dict, {tuple(placement.shape)} in the model")


def load_full_state(rt: RankRuntime, state_dict: dict[str, torch.Tensor]) -> None:
    """Every rank keeps its share of a full state dict (the original model's keys and shapes)."""
    placements = rt.compiled.placements
    check_full_state(placements, state_dict)
    in_holder = {id(p) for p in rt.holder.params()}
    values: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for key, tensor in rt.tensors.items():
            if not _held(rt, key):
                continue
            value = state_dict[key].to(device=rt.device)
            if id(tensor) not in in_holder or not value.is_floating_point():
                value = value.to(tensor.dtype)  # a parameter keeps its precision: masters may take it
            tp = placements[key].tp
            if isinstance(tp, Shard) and rt.tp is not None:
                value = tp.local(value, rt.tp.rank, rt.tp.degree)
            if isinstance(placements[key].ep, Shard) and rt.ep is not None:
                value = placements[key].ep.local(value, rt.ep.rank, rt.ep.degree)
            if id(tensor) in in_holder:
                values[id(tensor)] = value
            else:
                tensor.copy_(value)
        rt.holder.load_values(values)
