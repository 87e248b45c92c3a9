"""This rank's expert-parallel group as the module the graph ops of graph_ops/experts.py are called with.

The runtime binds it into every rank graph under the name ``ep``: the group (ep consecutive dp ranks),
this rank in it, the counted collectives of dispatch and combine, and each step's expert load.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import fx
from torch.fx.graph_module import _assign_attr

from autoshard.distributed.comm import CommCounter, all_gather_tensor
from autoshard.graph_ops.experts import UnboundExpertParallel
from autoshard.ir.meta import ZERO3, get_zero3_gather

__all__ = ["ExpertParallel", "repoint_slots"]


class ExpertParallel(UnboundExpertParallel):
    """This rank's expert-parallel group: its rank in it, the degree, and counted all-to-alls."""

    def __init__(self, group: dist.ProcessGroup, comm: CommCounter) -> None:
        super().__init__(dist.get_world_size(group))
        self.group = group
        self.rank = dist.get_rank(group)
        self.comm = comm
        # NCCL moves device tensors; gloo's all-to-all takes CPU ones.
        self.on_host = dist.get_backend(group) != "nccl"

    def route(self, counts: torch.Tensor, layer: str = "") -> torch.Tensor:
        """The routing of one layer's rows from the rows each of the E experts gets here (see the module doc)."""
        wire = counts.to(torch.int64).contiguous()
        wire = wire.cpu() if self.on_host else wire
        every = wire.new_empty(self.degree * wire.numel())
        self.comm.count("ep_counts", every.numel() * every.element_size())
        with self.comm.timing("ep_counts"):
            all_gather_tensor(every, wire, group=self.group)
        every = every.cpu().view(self.degree, -1)  # the one host sync of a layer's forward
        load = every.sum(0)
        self.loads[layer] = load + self.loads[layer] if layer in self.loads else load
        local = every.shape[1] // self.degree
        send = every[self.rank].view(self.degree, local)
        receive = every[:, self.rank * local : (self.rank + 1) * local]
        return torch.stack([send, receive])

    def exchange(self, rows: torch.Tensor, send: list[int], receive: list[int], op: str) -> torch.Tensor:
        """Rows ``send[i]`` to ep rank i, ``receive[i]`` from it (an all-to-all), counted under ``op``."""
        wire = rows.contiguous().cpu() if self.on_host else rows.contiguous()
        out = wire.new_empty((sum(receive), *rows.shape[1:]))
        self.comm.count(op, wire.numel() * wire.element_size())
        with self.comm.timing(op):
            dist.all_to_all_single(out, wire, receive, send, group=self.group)
        return out.to(rows.device)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every ep rank's experts of one weight, joined along dim 0 (a collective)."""
        wire = local.detach().contiguous()
        wire = wire.cpu() if self.on_host else wire
        whole = wire.new_empty((self.degree * wire.shape[0], *wire.shape[1:]))
        self.comm.count("all_gather", whole.numel() * whole.element_size())
        all_gather_tensor(whole, wire, group=self.group)
        return whole.to(local.device)


def repoint_slots(
    source: fx.GraphModule, graphs: list[fx.GraphModule], slots: dict[str, tuple[str, ...]], ep: ExpertParallel | None
) -> None:
    """Each slot of a loop over experts reads this rank's expert there (passes/expert_loops.py): its get_attr
    nodes and ZeRO-3 gather records, in the graphs (and the recompute regions they call), which take the
    weights from ``source`` (the captured graph, which holds every one)."""
    for gm in graphs if ep is not None and slots else ():
        for slot, targets in slots.items():  # the graph itself holds its weights (a ZeRO-3 gather finds them there)
            if _holds(gm, slot):
                _assign_attr(source.get_parameter(targets[ep.rank]), gm, targets[ep.rank])
        _repoint(source, gm, slots, ep.rank)


def _holds(gm: fx.GraphModule, target: str) -> bool:
    try:
        gm.get_parameter(target)
    except AttributeError:
        return False
    return True


def _repoint(source: fx.GraphModule, gm: fx.GraphModule, slots: dict[str, tuple[str, ...]], ep_rank: int) -> None:
    for node in gm.graph.nodes:
        sub = getattr(gm, node.target, None) if node.op == "get_attr" else None
        if isinstance(sub, fx.GraphModule):
            _repoint(source, sub, slots, ep_rank)
        elif node.op == "get_attr" and node.target in slots:
            node.target = slots[node.target][ep_rank]
            _assign_attr(source.get_parameter(node.target), gm, node.target)
        if ZERO3 in node.meta:
            record = get_zero3_gather(node)
            targets = tuple(slots[t][ep_rank] if t in slots else t for t in record.targets)
            node.meta[ZERO3] = dataclasses.replace(record, targets=targets)
    gm.recompile()
