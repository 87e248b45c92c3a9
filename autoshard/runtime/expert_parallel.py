"""This rank's expert-parallel group as the module the graph ops of graph_ops/experts.py are called with.

The runtime binds it into every rank graph under the name ``ep``: the group (ep consecutive dp ranks),
this rank in it, the counted collectives of dispatch and combine, and each step's expert load.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autoshard.distributed.comm import CommCounter, all_gather_tensor
from autoshard.graph_ops.experts import UnboundExpertParallel

__all__ = ["ExpertParallel"]


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
