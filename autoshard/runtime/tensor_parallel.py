"""This rank's tensor-parallel group as the module the graph ops of graph_ops/tp.py are called with.

The runtime binds it into every rank graph under the name ``tp``: the group, this rank in it, the
collectives the runtime itself issues on it (summing partial gradients once a step, gathering a sharded
state), and the rank's own random stream for dropout on sharded values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from autoshard.distributed import funcol
from autoshard.distributed.comm import CommCounter
from autoshard.graph_ops.tp import UnboundTensorParallel, check_divisible
from autoshard.ir.placements import Shard

if TYPE_CHECKING:
    from autoshard.spec.mesh import Mesh

__all__ = ["TensorParallel"]


class TensorParallel(UnboundTensorParallel):
    """This rank's tensor-parallel group: its rank in it, the degree, and counted collectives."""

    @property
    def group_name(self) -> str:
        return self._group_name

    def __init__(self, group: dist.ProcessGroup | None, comm: CommCounter, seed: int = 0) -> None:
        """``seed``: equal on every rank of the group; this rank's own random stream starts from it and its rank."""
        super().__init__(dist.get_world_size(group))
        self.group = group
        self.rank = dist.get_rank(group)
        self.comm = comm
        self._group_name = (group or dist.group.WORLD).group_name
        funcol.register_counter(self._group_name, comm)
        self.seed = seed + 2718 + self.rank  # Megatron's offset for the model-parallel stream
        self._streams: dict[str, torch.Tensor] = {}

    @classmethod
    def for_rank(
        cls, mesh: Mesh, rank: int, device: torch.device, group: dist.ProcessGroup | None, comm: CommCounter
    ) -> TensorParallel:
        """``rank``'s tensor-parallel module. Replicated activations must see the same dropout masks on every
        tp rank: tp rank 0's random state (and seed, from which each rank's own stream for sharded activations
        derives) is shared over the group first."""
        first = mesh.group("tp", rank)[0]
        wire = device if dist.get_backend(group) == "nccl" else torch.device("cpu")  # NCCL moves CUDA tensors

        def shared(tensor: torch.Tensor) -> torch.Tensor:
            on_wire = tensor.to(wire)
            dist.broadcast(on_wire, src=first, group=group)
            return on_wire.cpu()

        torch.set_rng_state(shared(torch.get_rng_state()))
        if device.type == "cuda":  # dropout on the GPU draws from its generator, whatever the backend
            torch.cuda.set_rng_state(shared(torch.cuda.get_rng_state(device)), device)
        seed = shared(torch.tensor([torch.initial_seed() % 2**62]))
        return cls(group, comm, int(seed))

    @contextlib.contextmanager
    def rank_stream(self, device: torch.device) -> Iterator[None]:
        """Draw random numbers from this rank's own stream (distinct per tp rank), then restore the shared one."""
        cuda = device.type == "cuda"
        get = (lambda: torch.cuda.get_rng_state(device)) if cuda else torch.get_rng_state
        put = (lambda state: torch.cuda.set_rng_state(state, device)) if cuda else torch.set_rng_state
        key = str(device)
        if key not in self._streams:
            self._streams[key] = torch.Generator(device=device).manual_seed(self.seed).get_state()
        shared = get()
        put(self._streams[key])
        try:
            yield
        finally:
            self._streams[key] = get()
            put(shared)

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) in place."""
        self.comm.count("tp_all_reduce", 2 * tensor.numel() * tensor.element_size())
        with self.comm.timing("tp_all_reduce"):
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def sum_each_(self, tensors: list[torch.Tensor]) -> None:
        """All-reduce (sum) every tensor in place, in one collective over their concatenation."""
        if tensors:
            flat = self.sum_(torch.cat([t.reshape(-1) for t in tensors]))
            for tensor, total in zip(tensors, flat.split([t.numel() for t in tensors])):
                tensor.copy_(total.view_as(tensor))

    def max_(self, tensor: torch.Tensor) -> torch.Tensor:
        """All-reduce (max) in place."""
        self.comm.count("tp_all_reduce", 2 * tensor.numel() * tensor.element_size())
        with self.comm.timing("tp_all_reduce"):
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return tensor

    def gather(self, tensor: torch.Tensor, placement: Shard) -> torch.Tensor:
        """Every rank's ``placement`` slice joined into the full tensor."""
        tensor = tensor.contiguous()
        pieces = [torch.empty_like(tensor) for _ in range(self.degree)]
        self.comm.count("tp_all_gather", tensor.numel() * tensor.element_size() * self.degree)
        with self.comm.timing("tp_all_gather"):
            dist.all_gather(pieces, tensor, group=self.group)
        return placement.join(pieces)

    def reduce_scatter_(self, tensor: torch.Tensor, placement: Shard) -> torch.Tensor:
        """Sum over the group, keeping this rank's ``placement`` slice."""
        check_divisible(tensor, placement, self.degree)
        pieces = [placement.local(tensor, r, self.degree).contiguous() for r in range(self.degree)]
        out = torch.empty_like(pieces[0])
        self.comm.count("tp_reduce_scatter", tensor.numel() * tensor.element_size())
        with self.comm.timing("tp_reduce_scatter"):
            dist.reduce_scatter(out, pieces, group=self.group)
        return out
