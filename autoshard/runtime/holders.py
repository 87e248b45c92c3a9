"""Parameter holders: what holds this rank's parameters and keeps their gradients in sync over dp.

One holder per ZeRO stage, behind one small interface, for every plan (a pipeline rank's stages
share one holder; tensor parallelism only changes the tensors it is given):

    begin(armed)        before the first backward of a step; armed: reduce as gradients arrive
    arm(stage)          before ``stage``'s last backward (microbatches): its groups reduce from now on
    end()               after the last backward: every reduction waited for, gradients final
    grad_views(select)  the final gradients of the selected parameters (whole, or this rank's shard of them)
    group_grad(gid)     one flat group's final gradient (summed over other ranks by tied-weight groups)
    masters             the tensors the optimizer steps: None (the parameters themselves) or fp32 shards
    after_step()        write the update back into the parameters the graphs read
    full_values()       every held parameter whole along dp (a collective); load_values() the converse
    grad_slot(param)    where a zero-bubble W, outside autograd, writes a weight's first gradient of a step

ReplicatedHolder is data parallelism (DDP's bucketed all-reduce overlapped with backward);
ShardedHolder is ZeRO-1/2 (reduce-scatter, sharded optimizer step, all-gather); runtime/zero.py
holds ZeRO-3. Groups launch strictly in one order, the same on every rank of the dp group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoshard.distributed.comm import CommCounter, same_view
from autoshard.runtime.flat import FlatLayout
from autoshard.runtime.launcher import InOrderLauncher
from autoshard.runtime.masters import Masters

__all__ = ["Groups", "Holder", "Masters", "ReplicatedHolder", "ShardedGrads", "ShardedHolder"]


@dataclass(frozen=True)
class Groups:
    """This rank's flat groups: layouts by group id, the order they launch in, and the stage arming each
    (the stage whose last backward on this rank completes the group's gradients)."""

    layouts: dict[int, FlatLayout]
    order: list[int]
    owner: dict[int, int]
    dp: int = 1  # the plan's: every gradient is divided by it (the mean over the global batch)
    comms: dict[int, CommCounter] = field(default_factory=dict)  # groups reduced over other ranks (experts)


class Holder:
    """The interface every strategy's holder implements (see the module docstring)."""

    name = "holder"
    dp_sharded = False  # whether the final gradients are this rank's dp shard
    masters: Masters | None = None

    def __init__(self, groups: Groups, comm: CommCounter, reduce_dtype: torch.dtype | None = None) -> None:
        self.layouts, self.order, self.owner = groups.layouts, groups.order, groups.owner
        self.comm = comm
        self.comms = groups.comms
        self.dp = groups.dp
        self.reduce_dtype = reduce_dtype  # the plan's: gradients are reduced in it (None: their own dtype)

    def wire(self, grads: torch.Tensor) -> torch.Tensor:
        """What goes on the wire for a flat gradient: itself, or a copy in the reduction dtype."""
        return grads if self.reduce_dtype in (None, grads.dtype) else grads.to(self.reduce_dtype)

    def comm_of(self, g: int) -> CommCounter:
        """What group ``g``'s gradients are reduced (and its shards gathered) over: the dp group's counter, or
        for an expert group that of the dp / ep ranks holding the same experts."""
        return self.comms.get(g, self.comm)

    def params(self) -> list[nn.Parameter]:
        return [p for g in self.order for p in self.layouts[g].params]

    def groups_of(self, stage: int) -> list[int]:
        return [g for g in self.order if self.owner[g] == stage]

    def begin(self, armed: bool) -> None: ...
    def arm(self, stage: int) -> None: ...
    def end(self) -> None: ...
    def after_step(self) -> None: ...
    def grad_slot(self, param: torch.Tensor) -> torch.Tensor | None: ...  # None: W's first gradient is kept fresh

    def grad_views(self, select: Callable[[nn.Parameter], bool]) -> list[torch.Tensor]:
        raise NotImplementedError

    def group_grad(self, gid: int) -> torch.Tensor | None:
        raise NotImplementedError

    def full_values(self) -> dict[int, torch.Tensor]:
        return {id(p): p.detach() for p in self.params()}

    def master_values(self) -> dict[int, torch.Tensor]:
        """Every parameter's fp32 master, whole along dp (a collective); {} where the masters are the
        parameters themselves (fp32 on the device)."""
        if self.masters is None or not self.masters.separate:
            return {}
        out = {}
        for g in self.order:
            layout = self.layouts[g]
            full = torch.empty(layout.padded, dtype=torch.float32, device=layout.device)
            # Offloaded masters live on the host: through the device, where the collective runs.
            self.comm_of(g).all_gather(full, self.masters.tensors[g].detach().to(layout.device).reshape(-1))
            out.update({id(p): v.clone() for p, v in zip(layout.params, layout.views(full))})
        return out

    def load_values(self, values: dict[int, torch.Tensor]) -> None:
        with torch.no_grad():
            for p in self.params():
                p.copy_(values[id(p)])

    def reload_masters(self, values: dict[int, torch.Tensor]) -> None:
        """The masters from the loaded ``values`` at their own precision (fp32 values into bf16 parameters
        keep their fp32 bits in the masters), not from the rounded parameters."""
        if self.masters is not None:
            self.masters.reload(
                {g: self.layouts[g].own(self.layouts[g].flatten(torch.float32, values)) for g in self.order}
            )

    def memory(self) -> dict[str, int]:
        raise NotImplementedError

    def describe(self) -> str:
        sizes = sum(self.layouts[g].numel * self.layouts[g].params[0].element_size() for g in self.order)
        return f"{self.name}: {len(self.order)} flat groups, {sizes / 2**20:.2f} MiB of parameters"


def _nbytes(tensors: Iterable[torch.Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class ReplicatedHolder(Holder):
    """Data parallel: every dp rank holds every parameter; gradient buckets all-reduced while backward runs.

    A step's first gradient of a parameter is copied into its view of the bucket, and ``.grad`` becomes
    that view, so later microbatches accumulate straight into the buffer (DDP's gradient_as_bucket_view);
    the buckets are not zeroed each step, only the slots no gradient reached before their bucket is
    reduced. A complete bucket is divided by dp and all-reduced asynchronously (DDP's overlap).
    """

    name = "data parallel (bucketed all-reduce)"

    def __init__(self, groups: Groups, comm: CommCounter, reduce_dtype: torch.dtype | None = None) -> None:
        super().__init__(groups, comm, reduce_dtype)
        layouts, order = self.layouts, self.order
        # An expert group held by one rank is only divided: its gradients stay where autograd put them.
        self.unbucketed = {g for g in order if self.dp > 1 and layouts[g].dp == 1}
        self.buffers = {
            g: torch.zeros(lay.padded, dtype=lay.dtype, device=lay.device)
            for g, lay in layouts.items()
            if g not in self.unbucketed
        }
        self.views = {g: layouts[g].views(self.buffers[g]) for g in order if g not in self.unbucketed}
        self.view_of = {id(p): v for g in self.views for p, v in zip(layouts[g].params, self.views[g])}
        self.filled: set[int] = set()  # parameters whose view holds this step's gradient
        self.works: dict[int, Any] = {}
        # A gradient is in its bucket when it counts.
        self.launcher = InOrderLauncher(
            order, {g: lay.params for g, lay in layouts.items()}, self._launch, self._into_bucket
        )
        self.in_graph: set[int] = set()  # buckets a compiled backward graph reduces itself (runtime/compiled.py)

    def begin(self, armed: bool) -> None:
        for g in self.order:
            if g in self.in_graph:  # the backward graph returns its gradients as views of the reduced bucket
                self.buffers[g] = self.buffers[g].new_empty(0)
            for param in self.layouts[g].params:
                param.grad = None
        self.filled = set()
        self.works = {}
        self.launcher.reset(self.order if armed else ())

    def _into_bucket(self, param: torch.Tensor) -> None:
        view = self.view_of.get(id(param))
        if (
            view is None
            or param.grad is None
            or param.grad is view
            or self.launcher.group_of[id(param)] in self.in_graph
        ):
            return  # unbucketed, held back for a zero-bubble W, accumulating in place, or a compiled backward's bucket
        view.copy_(param.grad)
        param.grad = view
        self.filled.add(id(param))

    def grad_slot(self, param: torch.Tensor) -> torch.Tensor | None:
        """Where a zero-bubble W writes ``param``'s first gradient of a step, outside autograd: its bucket view."""
        if id(param) not in self.view_of or self.launcher.group_of[id(param)] in self.in_graph:
            return None  # unbucketed, or a compiled backward's bucket: no view to write
        self.filled.add(id(param))  # the caller writes the gradient there
        return self.view_of[id(param)]

    def _zero_unfilled(self, g: int) -> None:
        """Slots no gradient reached this step (a parameter frozen since) hold an earlier step's: zeros go into the
        reduction, so a summed group (tied weights) reads none of it."""
        for param in self.layouts[g].params if g in self.views else ():
            if id(param) not in self.filled:
                self.view_of[id(param)].zero_()

    def arm(self, stage: int) -> None:
        self.launcher.arm(self.groups_of(stage))

    def _launch(self, g: int) -> None:
        if g in self.unbucketed:
            for param in self.layouts[g].params:
                if param.grad is not None:
                    param.grad.div_(self.dp)
        elif self.dp > 1 and g not in self.in_graph:
            self._zero_unfilled(g)
            wire = self.wire(self.buffers[g]).div_(self.dp)
            self.works[g] = (self.comm_of(g).all_reduce(wire, async_op=True), wire)

    def end(self) -> None:
        self.launcher.flush()
        for g in self.order:
            if g in self.works:
                work, wire = self.works.pop(g)
                work.wait()
                if wire is not self.buffers[g]:
                    self.buffers[g].copy_(wire)
            for param in self.layouts[g].params:
                if id(param) not in self.launcher.arrived:
                    param.grad = None  # unused this step: like single-device training, no gradient

    def grad_views(self, select: Callable[[nn.Parameter], bool]) -> list[torch.Tensor]:
        return [p.grad for p in self.params() if p.grad is not None and select(p)]

    def group_grad(self, gid: int) -> torch.Tensor:
        self._zero_unfilled(gid)
        for param, view in zip(self.layouts[gid].params, self.views[gid]):
            param.grad = view  # summed with other ranks' copies: a gradient even where none arrived here
        return self.buffers[gid]

    def memory(self) -> dict[str, int]:
        grads = [p.grad for g in self.in_graph | self.unbucketed for p in self.layouts[g].params if p.grad is not None]
        reduced = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in grads}  # one per bucket
        gradients = _nbytes(self.buffers.values()) + sum(reduced.values())
        return {"parameters": _nbytes(self.params()), "gradients": gradients}


class ShardedGrads(Holder):
    """What ZeRO's holders share: final gradients as this rank's dp shard of each group, fp32 masters."""

    dp_sharded = True

    def __init__(self, groups: Groups, comm: CommCounter, reduce_dtype: torch.dtype | None = None) -> None:
        super().__init__(groups, comm, reduce_dtype)
        self.grad_shards: dict[int, torch.Tensor | None] = dict.fromkeys(self.order)

    def grad_views(self, select: Callable[[nn.Parameter], bool]) -> list[torch.Tensor]:
        out = []
        for g in self.order:
            shard = self.grad_shards[g]
            if shard is not None:
                out += [shard[a:b] for a, b in self.layouts[g].own_ranges(select)]
        return out

    def group_grad(self, gid: int) -> torch.Tensor:
        if self.grad_shards[gid] is None:
            layout = self.layouts[gid]
            self.grad_shards[gid] = torch.zeros(layout.shard_numel, dtype=layout.dtype, device=layout.device)
        return self.grad_shards[gid]

    def memory(self) -> dict[str, int]:
        return {"gradients": _nbytes(self.grad_shards.values())}


class ShardedHolder(ShardedGrads):
    """ZeRO stages 1 and 2: each group in one flat buffer (the parameters are views into it);
    gradients reduce-scattered while backward runs; each rank's optimizer steps its shard; the
    updated shards are all-gathered back. Stage 1 keeps the full gradient buffers; stage 2 allocates
    them for the backward only and keeps just its shard.
    """

    def __init__(
        self,
        groups: Groups,
        comm: CommCounter,
        stage: int,
        offload: bool,
        initial: dict[int, torch.Tensor] | None,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        """``initial``: fp32 starting values of this rank's shard per group (mixed precision), else None."""
        super().__init__(groups, comm, reduce_dtype)
        layouts, order = self.layouts, self.order
        self.name = f"ZeRO-{stage} (reduce-scatter, sharded step, all-gather)"
        self.stage = stage
        self.flats = {}
        for g in order:
            flat = layouts[g].flatten()
            for param, view in zip(layouts[g].params, layouts[g].views(flat)):
                param.data = view  # the model's parameters now live in the flat buffer
            self.flats[g] = flat
        self.masters = Masters({g: layouts[g].own(self.flats[g]) for g in order}, offload, initial)
        self.grad_flats: dict[int, torch.Tensor | None] = {
            g: torch.zeros_like(self.flats[g]) if stage == 1 else None for g in order
        }
        self.works: dict[int, Any] = {}
        self.launcher = InOrderLauncher(order, {g: layouts[g].params for g in order}, self._launch)

    def begin(self, armed: bool) -> None:
        for g in self.order:
            if self.grad_flats[g] is None:
                self.grad_flats[g] = torch.zeros_like(self.flats[g])
            else:
                self.grad_flats[g].zero_()
            for param, view in zip(self.layouts[g].params, self.layouts[g].views(self.grad_flats[g])):
                param.grad = view
            self.grad_shards[g] = None
        self.works = {}
        self.launcher.reset(self.order if armed else ())

    def arm(self, stage: int) -> None:
        self.launcher.arm(self.groups_of(stage))

    def _launch(self, g: int) -> None:
        layout, full = self.layouts[g], self.grad_flats[g]
        wire = self.wire(full)
        if self.stage == 1 and wire is full and self.comm_of(g).reduces_in_place():
            self.grad_shards[g] = layout.own(full)  # stage 1 keeps the buffer: its own chunk gets the result
        else:
            self.grad_shards[g] = wire.new_empty(layout.shard_numel)
        wire.div_(self.dp)
        # The full gradient buffer is not read again, so gloo may reduce in place (no temporaries).
        self.works[g] = self.comm_of(g).reduce_scatter(self.grad_shards[g], wire, async_op=True, in_place=True)

    def end(self) -> None:
        self.launcher.flush()
        for g in self.order:
            self.works.pop(g).wait()
            layout = self.layouts[g]
            if self.stage == 1 and self.grad_shards[g].dtype == layout.dtype:  # else the shard in reduce_dtype
                owned = layout.own(self.grad_flats[g])
                if not same_view(owned, self.grad_shards[g]):
                    owned.copy_(self.grad_shards[g])
                self.grad_shards[g] = owned
            else:
                for param in layout.params:
                    param.grad = None
                self.grad_flats[g] = None  # only the shard stays

    def after_step(self) -> None:
        self.masters.write_back()
        works = [
            self.comm_of(g).all_gather(self.flats[g], self.layouts[g].own(self.flats[g]), async_op=True, in_place=True)
            for g in self.order
        ]
        for work in works:
            work.wait()

    def load_values(self, values: dict[int, torch.Tensor]) -> None:
        super().load_values(values)
        self.reload_masters(values)

    def memory(self) -> dict[str, int]:
        grads = _nbytes([*self.grad_flats.values(), *(s for g, s in self.grad_shards.items() if self.stage == 2)])
        return {"parameters": _nbytes(self.flats.values()), "gradients": grads}
