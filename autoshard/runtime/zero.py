"""ZeRO at run time: flat parameter groups sharded over the data-parallel group.

Stage 1 and 2 (ZeroDataParallel): every group of parameters lives in one flat buffer, padded to a
multiple of dp; the parameters become views into it. Gradients are reduce-scattered per group from
post-accumulate-grad hooks while backward runs; each rank steps the optimizer on its own 1/dp slice
and the updated slices are all-gathered back. Stage 1 keeps the full gradient buffer; stage 2
allocates it for the backward only and keeps just the gradient shard.

Stage 3 (Zero3Runtime): parameters are sharded at rest. The rewritten graph calls ``gather`` before a
group's first use (which also prefetches the next group), ``mark`` on the output of each op that
uses the group (the last one frees the gathered buffer; in backward each gathers it again before
that op's backward runs), and the gather's backward reduce-scatters the group's gradient.

ShardOptimizer is shared by all stages: fp32 master shards (separate when the compute dtype is not
fp32 or when offloaded to the CPU), global-norm clipping across shards, the user's optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoshard.errors import PlanError
from autoshard.runtime.comm import CommCounter, same_view
from autoshard.runtime.grad_sync import InOrderLauncher
from autoshard.runtime.optim import clip_by_global_norm, make_optimizer, optimizer_state_bytes

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "FlatLayout",
    "ShardOptimizer",
    "UnboundZero3Runtime",
    "Zero3Runtime",
    "Zero3Trainer",
    "ZeroDataParallel",
    "check_elementwise",
    "gather",
    "layouts_from_slots",
    "mark",
]

ELEMENTWISE_OPTIMIZERS = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "RMSprop", "NAdam", "RAdam", "Rprop", "ASGD")
    if hasattr(torch.optim, name)
)


def check_elementwise(optimizer: torch.optim.Optimizer, zero: int) -> None:
    if not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
        names = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
        raise PlanError(
            f"ZeRO stage {zero} steps the optimizer on flat 1/dp shards of the parameters, which is only "
            f"equal to unsharded training for optimizers whose update is elementwise; "
            f"{type(optimizer).__name__} is not known to be ({names} are); use one of those or zero=0"
        )


@dataclass
class FlatLayout:
    """Parameters laid out one after another in a flat buffer padded to a multiple of dp."""

    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    dp: int
    dp_rank: int
    shapes: list[torch.Size] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.shapes = [p.shape for p in self.params]

    @property
    def padded(self) -> int:
        return math.ceil(self.numel / self.dp) * self.dp

    @property
    def shard_numel(self) -> int:
        return self.padded // self.dp

    @property
    def lo(self) -> int:
        return self.dp_rank * self.shard_numel

    def flatten(
        self, dtype: torch.dtype, device: torch.device, values: dict[int, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The parameters (or ``values[id(param)]`` where given) in one padded flat tensor."""
        flat = torch.zeros(self.padded, dtype=dtype, device=device)
        for param, offset in zip(self.params, self.offsets):
            source = values[id(param)] if values is not None and id(param) in values else param.detach()
            flat[offset : offset + source.numel()].copy_(source.reshape(-1))
        return flat

    def own(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a flat (padded) buffer laid out like this group."""
        return flat[self.lo : self.lo + self.shard_numel]

    def master_shard(self, values: dict[int, torch.Tensor], device: torch.device) -> torch.Tensor:
        """This rank's slice of the fp32 master values."""
        return self.own(self.flatten(torch.float32, device, values)).clone()

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o : o + math.prod(s)].view(s) for o, s in zip(self.offsets, self.shapes)]

    def own_ranges(self, select: Callable[[nn.Parameter], bool]) -> list[tuple[int, int]]:
        """Where the selected parameters lie in this rank's shard: (start, end) in shard coordinates."""
        ranges = []
        for param, offset, shape in zip(self.params, self.offsets, self.shapes):
            start, end = max(offset, self.lo), min(offset + math.prod(shape), self.lo + self.shard_numel)
            if start < end and select(param):
                ranges.append((start - self.lo, end - self.lo))
        return ranges


@dataclass
class TensorParallelShards:
    """What ZeRO over dp needs when tp ranks hold other slices of the model in the same flat layout.

    ``partial``: per group, the shard ranges of gradients each tp rank holds only partially (weights
    replicated over tp but used on sequence shards): they are summed over tp once reduced over dp.
    ``replicated``: per group, the ranges of weights every tp rank holds whole: in the gradient norm
    they count on tp rank 0 only.
    """

    tp: Any  # runtime.tp.TensorParallel
    partial: list[list[tuple[int, int]]]
    replicated: list[list[tuple[int, int]]]

    def sum_partial(self, shards: list[torch.Tensor | None]) -> None:
        self.tp.sum_each_([s[a:b] for s, ranges in zip(shards, self.partial) if s is not None for a, b in ranges])

    def counted(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """The elements this rank counts in the global norm: all on tp rank 0, the sharded weights elsewhere."""
        if self.tp.rank == 0:
            return shards
        out = []
        for shard, ranges in zip(shards, self.replicated):
            start = 0
            for a, b in [*ranges, (shard.numel(), shard.numel())]:
                if a > start:
                    out.append(shard[start:a])
                start = b
        return out


def layouts_from_slots(slots: Iterable[tuple[nn.Parameter, int, int, int]], dp: int, dp_rank: int) -> list[FlatLayout]:
    """Group (param, group index, offset, numel) slots into FlatLayouts, by group index."""
    by_group: dict[int, list[tuple[int, nn.Parameter]]] = {}
    sizes: dict[int, int] = {}
    for param, group, offset, numel in slots:
        by_group.setdefault(group, []).append((offset, param))
        sizes[group] = max(sizes.get(group, 0), offset + numel)
    layouts = []
    for group in sorted(by_group):
        entries = sorted(by_group[group], key=lambda e: e[0])
        layouts.append(FlatLayout([p for _, p in entries], [o for o, _ in entries], sizes[group], dp, dp_rank))
    return layouts


class ShardOptimizer:
    """The user's optimizer over fp32 master shards, one per flat group.

    ``compute_shards`` are this rank's slices of the parameters in the compute dtype. When they are
    fp32 and not offloaded, the master shards are those very tensors; otherwise master shards are
    separate fp32 copies (on the CPU with offload) and the update is copied back after each step.
    """

    def __init__(
        self,
        compute_shards: list[torch.Tensor],
        factory: Callable[[Any], torch.optim.Optimizer],
        zero: int,
        offload: bool,
        comm: CommCounter,
        initial_masters: list[torch.Tensor] | None = None,
        tp_shards: TensorParallelShards | None = None,
    ) -> None:
        """``initial_masters``: fp32 starting values when the compute shards were rounded (mixed precision)."""
        self.tp_shards = tp_shards
        self.last_grad_norm: torch.Tensor | None = None  # before clipping, when the step clipped
        self.compute_shards = compute_shards
        self.offload = offload
        self.comm = comm
        self.separate = offload or any(s.dtype != torch.float32 for s in compute_shards)
        if self.separate:
            device = torch.device("cpu") if offload else None
            sources = initial_masters or [s.detach() for s in compute_shards]
            self.masters = [
                nn.Parameter(v.to(device=device or s.device, dtype=torch.float32, copy=True))
                for s, v in zip(compute_shards, sources)
            ]
        else:
            self.masters = [nn.Parameter(s.detach()) for s in compute_shards]  # shares storage
        self.optimizer = make_optimizer(factory, self.masters)
        check_elementwise(self.optimizer, zero)

    def reload_masters(self) -> None:
        """After the compute parameters were overwritten (load_state_dict): copy them into the masters."""
        if self.separate:
            with torch.no_grad():
                for shard, master in zip(self.compute_shards, self.masters):
                    master.copy_(shard.detach())

    def set_grads(self, grads: list[torch.Tensor | None]) -> None:
        for master, grad in zip(self.masters, grads):
            if grad is None:
                master.grad = None
            elif self.separate:
                master.grad = grad.to(device=master.device, dtype=torch.float32)
            else:
                master.grad = grad

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Scale the shard gradients so that the global (all shards) L2 norm is at most max_norm."""
        grads = [m.grad for m in self.masters if m.grad is not None]
        shards = self.tp_shards
        if shards is None:
            return clip_by_global_norm(grads, grads, max_norm, self.comm.all_reduce, self.compute_shards[0].device)

        def over_dp_and_tp(tensor: torch.Tensor) -> None:
            self.comm.all_reduce(tensor)
            shards.tp.sum_(tensor)

        device = self.compute_shards[0].device
        return clip_by_global_norm(shards.counted(grads), grads, max_norm, over_dp_and_tp, device)

    def step(self, max_grad_norm: float | None = None) -> None:
        if max_grad_norm is not None:
            self.last_grad_norm = self.clip_grad_norm(max_grad_norm)
        self.optimizer.step()
        if self.separate:
            with torch.no_grad():
                for shard, master in zip(self.compute_shards, self.masters):
                    shard.copy_(master.detach())
        for m in self.masters:
            m.grad = None

    def state_bytes(self) -> tuple[int, int]:
        """(optimizer state bytes, separate fp32 master bytes) held by this rank."""
        state = optimizer_state_bytes(self.optimizer)
        masters = sum(m.numel() * m.element_size() for m in self.masters) if self.separate else 0
        return state, masters


class ZeroDataParallel:
    """ZeRO stages 1 and 2: flat groups, reduce-scatter while backward runs, sharded step, all-gather."""

    def __init__(
        self,
        layouts: list[FlatLayout],
        stage: int,
        offload: bool,
        factory: Callable[[Any], torch.optim.Optimizer],
        comm: CommCounter,
        master_values: dict[int, torch.Tensor] | None = None,
        tp_shards: TensorParallelShards | None = None,
    ) -> None:
        self.layouts = layouts
        self.tp_shards = tp_shards
        self.stage = stage
        self.comm = comm
        self.flats: list[torch.Tensor] = []
        for layout in layouts:
            first = layout.params[0]
            flat = layout.flatten(first.dtype, first.device)
            for param, view in zip(layout.params, layout.views(flat)):
                param.data = view  # the model's parameters now live in the flat buffer
            self.flats.append(flat)
        self.dp = layouts[0].dp if layouts else 1
        owned = [lay.own(flat) for flat, lay in zip(self.flats, layouts)]
        masters = (
            [lay.master_shard(master_values, f.device) for lay, f in zip(layouts, self.flats)]
            if master_values
            else None
        )
        self.shard_opt = ShardOptimizer(owned, factory, stage, offload, comm, masters, tp_shards)
        # Stage 1 keeps full gradient buffers; stage 2 allocates them per backward.
        self.grad_flats: list[torch.Tensor | None] = [
            torch.zeros_like(flat) if stage == 1 else None for flat in self.flats
        ]
        # Reduce-scatter outputs: kept by stage 2 (its gradient shard). Stage 1 keeps the full buffer
        # and takes its own chunk of it (reduced there in place on gloo, copied there otherwise).
        self.grad_shards: list[torch.Tensor | None] = [None] * len(layouts)
        self._works: list[Any] = [None] * len(layouts)
        self.launcher = InOrderLauncher([lay.params for lay in layouts], self._launch)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.shard_opt.optimizer

    def prepare(self, armed: bool = True) -> None:
        """Before a backward (``armed=False``: launch nothing until ``launcher.reset()``, see BucketedGradSync)."""
        for g, layout in enumerate(self.layouts):
            if self.grad_flats[g] is None:
                self.grad_flats[g] = torch.zeros_like(self.flats[g])
            else:
                self.grad_flats[g].zero_()
            for param, view in zip(layout.params, layout.views(self.grad_flats[g])):
                param.grad = view
            self._works[g] = None
        self.launcher.reset(armed)

    def _launch(self, g: int) -> None:
        layout = self.layouts[g]
        if self.stage == 1 and self.comm.reduces_in_place():
            # Stage 1 keeps the full buffer: its own chunk receives the result, no extra shard.
            self.grad_shards[g] = layout.own(self.grad_flats[g])
        elif self.grad_shards[g] is None:
            self.grad_shards[g] = self.grad_flats[g].new_empty(layout.shard_numel)
        self.grad_flats[g].div_(self.dp)
        # The full gradient buffer is not read again, so gloo may reduce in place (no temporaries).
        self._works[g] = self.comm.reduce_scatter(self.grad_shards[g], self.grad_flats[g], async_op=True, in_place=True)

    def finish(self) -> None:
        self.launcher.flush()
        grads = []
        for g, layout in enumerate(self.layouts):
            self._works[g].wait()
            self._works[g] = None
            if self.stage == 1:
                owned = layout.own(self.grad_flats[g])
                if not same_view(owned, self.grad_shards[g]):
                    owned.copy_(self.grad_shards[g])
                self.grad_shards[g] = None
                grads.append(owned)
            else:
                for param in layout.params:
                    param.grad = None
                self.grad_flats[g] = None  # only the shard stays
                grads.append(self.grad_shards[g])
        if self.tp_shards is not None:
            self.tp_shards.sum_partial(grads)
        self.shard_opt.set_grads(grads)

    def step(self, max_grad_norm: float | None) -> None:
        self.shard_opt.step(max_grad_norm)
        works = [
            self.comm.all_gather(flat, layout.own(flat), async_op=True, in_place=True)
            for flat, layout in zip(self.flats, self.layouts)
        ]
        for work in works:
            work.wait()

    def memory(self) -> dict[str, int]:
        params = sum(f.numel() * f.element_size() for f in self.flats)
        grads = sum(g.numel() * g.element_size() for g in [*self.grad_flats, *self.grad_shards] if g is not None)
        state, masters = self.shard_opt.state_bytes()
        return {"parameters": params, "gradients": grads, "optimizer": state + masters}


class _Gather(torch.autograd.Function):
    """Forward: all-gather a group's parameters. Backward: reduce-scatter their gradients."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, runtime: Zero3Runtime, group: int) -> tuple[torch.Tensor, ...]:
        ctx.runtime, ctx.group = runtime, group
        runtime.ensure_gathered(group)
        runtime.prefetch(group + 1)
        return tuple(runtime.layouts[group].views(runtime.fulls[group]))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, None, None]:
        ctx.runtime.reduce_scatter_grads(ctx.group, grads)
        return None, None, None


class _Mark(torch.autograd.Function):
    """Identity on the output of an op that used a group's parameters.

    Forward: frees the gathered group after its last use. Backward: gathers the group again (and
    prefetches the one used before it) before the op's backward needs the parameters.
    """

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, runtime: Zero3Runtime, group: int, free: bool) -> torch.Tensor:
        ctx.runtime, ctx.group = runtime, group
        if free:
            runtime.free(group)
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        ctx.runtime.ensure_gathered(ctx.group)
        ctx.runtime.prefetch(ctx.group - 1)
        return grad, None, None, None


def gather(runtime: Zero3Runtime, group: int) -> tuple[torch.Tensor, ...]:
    """Graph op: this group's full parameters, gathered from the dp shards."""
    return _Gather.apply(runtime.shards[group], runtime, group)


def mark(y: torch.Tensor, runtime: Zero3Runtime, group: int, free: bool) -> torch.Tensor:
    """Graph op: ``y`` came from parameters of ``group``; ``free``: that was their last use in forward."""
    return _Mark.apply(y, runtime, group, free)


class UnboundZero3Runtime(nn.Module):
    """Stands in for a rank's Zero3Runtime in graphs compiled offline; a Program replaces it to run."""

    def forward(self) -> None:
        raise RuntimeError("this ZeRO-3 graph was compiled offline; only a Program on a process group runs it")


class Zero3Runtime(nn.Module):
    """ZeRO stage 3 state: parameter shards at rest, gathered buffers, gradient shards."""

    def __init__(self, layouts: list[FlatLayout], comm: CommCounter) -> None:
        super().__init__()
        self.layouts = layouts
        self.comm = comm
        self.dp = layouts[0].dp if layouts else 1
        self.shards = nn.ParameterList()
        self.fulls: list[torch.Tensor] = []
        for layout in layouts:
            first = layout.params[0]
            dtype = first.dtype
            flat = layout.flatten(dtype, first.device)
            self.shards.append(nn.Parameter(layout.own(flat).clone()))
            del flat
            full = torch.empty(layout.padded, dtype=dtype, device=first.device)
            full.untyped_storage().resize_(0)
            self.fulls.append(full)
            for param in layout.params:  # the unsharded parameters are released: the shards hold them now
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        n = len(layouts)
        self._gathered = [False] * n
        self._pending: list[Any] = [None] * n
        self._versions = [0] * n
        self._reductions: list[tuple[int, Any, torch.Tensor, torch.Tensor]] = []
        self.grad_shards: list[torch.Tensor | None] = [None] * n
        self.peak_gathered_bytes = 0

    def _full_bytes(self, group: int) -> int:
        return self.layouts[group].padded * self.fulls[group].element_size()

    def gathered_bytes(self) -> int:
        return sum(f.untyped_storage().nbytes() for f in self.fulls)

    def _launch(self, group: int) -> None:
        full = self.fulls[group]
        full.untyped_storage().resize_(self._full_bytes(group))
        # Refilling a buffer that autograd saved is safe here: nothing read it since it was freed.
        # The backend may copy into it at any time until wait(), so _wait restores this version.
        self._versions[group] = full._version
        self._pending[group] = self.comm.all_gather(full, self.shards[group].detach(), async_op=True)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes())

    def _wait(self, group: int) -> None:
        if self._pending[group] is not None:
            self._pending[group].wait()
            self._pending[group] = None
            torch._C._autograd._unsafe_set_version_counter((self.fulls[group],), (self._versions[group],))

    def ensure_gathered(self, group: int) -> None:
        if not self._gathered[group] and self._pending[group] is None:
            self._launch(group)
        self._wait(group)
        self._gathered[group] = True

    def prefetch(self, group: int) -> None:
        if 0 <= group < len(self.layouts) and not self._gathered[group] and self._pending[group] is None:
            self._launch(group)

    def free(self, group: int) -> None:
        self._wait(group)
        self.fulls[group].untyped_storage().resize_(0)
        self._gathered[group] = False

    def reduce_scatter_grads(self, group: int, grads: tuple[torch.Tensor | None, ...]) -> None:
        layout = self.layouts[group]
        flat = torch.zeros(layout.padded, dtype=self.fulls[group].dtype, device=self.fulls[group].device)
        for offset, shape, grad in zip(layout.offsets, layout.shapes, grads):
            if grad is not None:
                flat[offset : offset + math.prod(shape)].copy_(grad.reshape(-1))
        flat.div_(self.dp)
        out = flat.new_empty(layout.shard_numel)
        work = self.comm.reduce_scatter(out, flat, async_op=True)
        self._reductions.append((group, work, out, flat))
        self.free(group)

    def prepare(self) -> None:
        self.grad_shards = [None] * len(self.layouts)

    def finish(self) -> list[torch.Tensor | None]:
        for group, work, out, _flat in self._reductions:
            work.wait()
            current = self.grad_shards[group]
            self.grad_shards[group] = out if current is None else current.add_(out)
        self._reductions.clear()
        for group in range(len(self.layouts)):  # prefetched in backward but not needed any more
            if self._gathered[group] or self._pending[group] is not None:
                self.free(group)
        return list(self.grad_shards)

    def full_parameters(self) -> list[list[torch.Tensor]]:
        """Every group's parameters, gathered (a collective: call on every rank)."""
        out = []
        for group, layout in enumerate(self.layouts):
            full = self.fulls[group].new_empty(layout.padded)
            self.comm.all_gather(full, self.shards[group].detach())
            out.append([v.clone() for v in layout.views(full)])
        return out


class Zero3Trainer:
    """ZeRO stage 3: the runtime the rewritten graph calls, plus the sharded optimizer."""

    def __init__(
        self,
        runtime: Zero3Runtime,
        offload: bool,
        factory: Callable[[Any], torch.optim.Optimizer],
        comm: CommCounter,
        master_values: dict[int, torch.Tensor] | None = None,
    ) -> None:
        self.runtime = runtime
        masters = (
            [lay.master_shard(master_values, s.device) for lay, s in zip(runtime.layouts, runtime.shards)]
            if master_values
            else None
        )
        self.shard_opt = ShardOptimizer([s.data for s in runtime.shards], factory, 3, offload, comm, masters)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.shard_opt.optimizer

    def prepare(self) -> None:
        self.runtime.prepare()

    def finish(self) -> None:
        grads = self.runtime.finish()
        self.shard_opt.set_grads(grads)

    def step(self, max_grad_norm: float | None) -> None:
        self.shard_opt.step(max_grad_norm)
        self.runtime.grad_shards = [None] * len(self.runtime.layouts)

    def memory(self) -> dict[str, int]:
        rt = self.runtime
        params = sum(s.numel() * s.element_size() for s in rt.shards) + rt.gathered_bytes()
        grads = sum(g.numel() * g.element_size() for g in rt.grad_shards if g is not None)
        state, masters = self.shard_opt.state_bytes()
        return {"parameters": params, "gradients": grads, "optimizer": state + masters}
