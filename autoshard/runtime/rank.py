"""One rank's runtime: the components its plan needs, set up in one fixed order, and one training step.

Set-up, the same order on every rank (collectives inside must match):
  1. process groups along dp, tp and pp, one per set of pipeline ranks sharing tied weights, and with
     ep the expert-parallel groups and the groups of ranks holding the same experts;
  2. tensor parallelism: the shared random state, every sharded tensor cut to this rank's slice (and
     every stacked expert weight to this rank's experts; other ranks' experts of a loop released);
  3. pipeline: tensors no stage of this rank reads are released;
  4. every dp replica starts from the first dp rank's values (DDP's broadcast);
  5. the holder of the plan's ZeRO stage takes this rank's flat groups (runtime/holders.py, zero.py);
  6. the runtime modules are bound into this rank's graphs; the optimizer is built;
  7. with torch_compile, each graph is wrapped by torch.compile (runtime/compiled.py).

A step is the same for every plan: the driver (one graph, or the pipeline schedule) runs forward
and backward while the holder reduces gradients over dp; then partial gradients are summed over
tp and tied weights' over their pipeline ranks, the global norm is taken (and clipped), the
optimizer steps and the holder writes the update back.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import fx, nn

from autoshard.distributed import funcol
from autoshard.distributed.comm import CommCounter
from autoshard.distributed.groups import broadcast_tensors, expert_groups, make_group, shared_group, tied_groups
from autoshard.distributed.tracing import span
from autoshard.errors import InputError
from autoshard.graph_ops.batch_stats import BatchStatistics
from autoshard.graph_ops.context import ContextParallel
from autoshard.graph_ops.experts import on_native_kernel
from autoshard.graph_ops.masks import SingleDeviceMasks
from autoshard.graph_ops.pipeline import PipelineChannel
from autoshard.ir.meta import GRAD_BUCKET, MODEL_PREFIX, ZERO3, get_grad_bucket, get_shape, get_zero3_gather
from autoshard.ir.placements import ParamPlacement, Shard
from autoshard.passes.context_parallel import RUNTIME_ATTR as CP_ATTR
from autoshard.passes.dropout_masks import MASKS_ATTR
from autoshard.passes.infra import all_nodes
from autoshard.runtime.compiled import rank_compiler
from autoshard.runtime.expert_parallel import ExpertParallel, repoint_slots
from autoshard.runtime.flat import layouts_from_slots
from autoshard.runtime.holders import Groups, Holder, ReplicatedHolder, ShardedHolder
from autoshard.runtime.optim import (
    clip_by_global_norm,
    make_optimizer,
    optimizer_like,
    optimizer_state_bytes,
    with_fused_kernel,
)
from autoshard.runtime.pipeline import PipelineRunner, split_microbatches
from autoshard.runtime.tensor_parallel import TensorParallel
from autoshard.runtime.zero import Zero3Holder
from autoshard.spec.mesh import REPLICAS

if TYPE_CHECKING:
    from autoshard.compiler.compiled import Compiled

__all__ = ["RankRuntime"]

TP_ATTR, PIPE_ATTR, ZERO3_ATTR, EP_ATTR = "tp", "pipe", "zero3", "ep"  # the graphs' get_attr names of runtime modules
STATS_ATTR = "dp_stats"


def state_tensors(compiled: Compiled) -> dict[str, torch.Tensor]:
    """The model's state by key, as the captured graph holds it (the same tensors the graphs read)."""
    gm = compiled.captured.gm
    out = {}
    for key, original in compiled.model.state_dict(keep_vars=True).items():
        try:
            out[key] = gm.get_parameter(MODEL_PREFIX + key)
        except AttributeError:
            try:
                out[key] = gm.get_buffer(MODEL_PREFIX + key)
            except AttributeError:
                out[key] = original  # not read by the graph: it never changes
    return out


class RankRuntime:
    """This rank's share of the program: groups, tensor parallelism, holder, optimizer and driver."""

    def __init__(self, compiled: Compiled, factory: Callable[[Any], torch.optim.Optimizer] | None, comm: CommCounter):
        plan = self.plan = compiled.plan
        mesh = self.mesh = plan.mesh
        self.compiled = compiled
        self.comm = comm
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        coords = self.coords = mesh.coords(self.rank)
        self.replicas = mesh.degree(REPLICAS)  # the ranks holding the same parameters: dp x cp
        self.tensors = state_tensors(compiled)
        self.placement_of: dict[int, ParamPlacement] = {id(self.tensors[k]): p for k, p in compiled.placements.items()}
        first = next(iter(self.tensors.values()), torch.empty(0))
        self.device = first.device
        self.schedule = compiled.schedule
        stages = [s for s in compiled.stages if self.schedule.rank_of(s.stage) == coords["pp"]] if self.schedule else []
        self.stages = {s.stage: s for s in stages}
        self.graphs: dict[int, fx.GraphModule] = {s.stage: s.gm for s in stages} or {0: compiled.captured.gm}
        distributed = dist.is_initialized()
        # 1. process groups, every one with the compile-time timeout
        timeout = timedelta(seconds=compiled.timeout)
        self.world_group = shared_group(range(mesh.size), timeout) if distributed else None
        groups = (timeout, self.world_group)
        # Gradients are reduced over the ranks holding the same parameters: dp x cp (cp ranks hold other tokens).
        self.dp_group = make_group(mesh, self.rank, REPLICAS, *groups) if distributed else None
        comm.group = self.dp_group
        tp_group = make_group(mesh, self.rank, "tp", *groups) if distributed and plan.tp > 1 else None
        self.pp_group = make_group(mesh, self.rank, "pp", *groups) if distributed and plan.pp > 1 else None
        self.cp: ContextParallel | None = None
        self.rows_group = self.dp_group  # the ranks holding other rows (statistics of the batch are over them)
        if distributed and plan.cp > 1:
            cp_group = make_group(mesh, self.rank, "cp", *groups)
            self.cp = ContextParallel(plan.cp, coords["cp"], cp_group, comm)
            self.rows_group = make_group(mesh, self.rank, "dp", *groups)
        self.ep: ExpertParallel | None = None
        self.expert_comm: CommCounter | None = None  # over the ranks that hold the same experts
        if distributed and plan.ep > 1:
            ep_group, replicas = expert_groups(mesh, self.rank, plan.ep, timeout)
            self.ep = ExpertParallel(ep_group, comm)
            self.expert_comm = CommCounter(replicas, comm.calls, comm.volume_bytes, seconds=comm.seconds)
        self.p2p_group = self.world_group if plan.pp > 1 else None
        tied_sets = sorted({p.pp.ranks for p in compiled.placements.values() if p.tied})
        self.ties: dict[tuple[int, ...], Any] = tied_groups(mesh, self.rank, tied_sets, timeout)
        # 2. tensor parallelism
        self.tp = (
            TensorParallel.for_rank(mesh, self.rank, self.device, tp_group, comm)
            if distributed and plan.tp > 1
            else None
        )
        masters = dict(compiled.master_values or {})
        for tensor in dict.fromkeys(self.tensors.values()):
            placement = self.placement_of[id(tensor)]
            for cut, group in ((placement.tp, self.tp), (placement.ep, self.ep)):  # tp slice; this rank's experts
                if isinstance(cut, Shard) and group is not None:
                    tensor.data = cut.local(tensor.data, group.rank, group.degree).clone()
                    if id(tensor) in masters:
                        masters[id(tensor)] = cut.local(masters[id(tensor)], group.rank, group.degree)
            # 3. pipeline: another stage's tensor (under ep, another ep rank's expert of a loop over experts)
            if not placement.held_on(coords, plan.ep):
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
                masters.pop(id(tensor), None)
        # 4. every dp replica starts alike (the ranks holding the same experts, for experts)
        if distributed and mesh.degree(REPLICAS) > 1:
            experts = {id(t) for t in self.tensors.values() if self.placement_of[id(t)].expert}
            for expert in (False, True):
                tensors = [t for t in dict.fromkeys(self.tensors.values()) if (id(t) in experts) == expert]
                tensors += [m for key, m in masters.items() if (key in experts) == expert]
                if not expert:
                    broadcast_tensors(tensors, self.device, self.mesh.group(REPLICAS, self.rank)[0], self.dp_group)
                elif self.expert_comm is not None and plan.dp > plan.ep:
                    broadcast_tensors(
                        tensors, self.device, mesh.expert_groups(self.rank, plan.ep)[1][0], self.expert_comm.group
                    )
        # 5. the holder of this rank's flat groups (a loop's slots read this rank's experts); dropout masks
        repoint_slots(compiled.captured.gm, list(self.graphs.values()), compiled.experts.slots, self.ep)
        self.holder = self._make_holder(masters)
        compiled.master_values = None  # the holder keeps this rank's fp32 shards; the whole copies can go
        self.masks = self._make_masks() if compiled.masks else None
        # 6. bind, and the optimizer
        self.channel = PipelineChannel() if self.schedule else None
        for gm in self.graphs.values():
            self.bind(gm)
            if compiled.torch_compile is None:  # dynamo traces the fallback; eagerly torch's kernel is faster
                on_native_kernel(gm)
        self.optimizer = self._make_optimizer(factory) if factory is not None else None
        # 7. torch.compile: each graph compiled (on its first call), else the graphs themselves
        self.compiler = rank_compiler(self) if compiled.torch_compile is not None else None
        whole = self.schedule is None  # one graph: (loss, *the model's outputs), only the loss is differentiated
        calls = {s: self.compiler.compile(gm, not whole) if self.compiler else gm for s, gm in self.graphs.items()}
        self.calls = {s: self.autocast_call(call) for s, call in calls.items()}
        self.runner = self._make_runner() if self.schedule else None
        self.partial = {id(t) for t in self.tensors.values() if self.placement_of[id(t)].partial_over_tp}
        self.last_grad_norm: torch.Tensor | None = None
        self.last_step_memory: dict[str, int] = {}
        self.step_seconds = 0.0
        self.steps = 0  # optimizer steps taken (checkpoints keep it)
        self._loss = torch.zeros((), dtype=torch.float64, device=self.device)  # kept across steps

    # ---- set-up ---------------------------------------------------------------------------------
    def bind(self, gm: fx.GraphModule) -> None:
        """Put this rank's runtime modules where a graph's get_attr nodes read them."""
        if self.tp is not None:
            gm.add_submodule(TP_ATTR, self.tp)
        if isinstance(self.holder, Zero3Holder):
            gm.add_submodule(ZERO3_ATTR, self.holder.runtime)
        if self.channel is not None:
            gm.add_submodule(PIPE_ATTR, self.channel)
        if self.masks is not None:
            gm.add_submodule(MASKS_ATTR, self.masks)
        if self.ep is not None:
            gm.add_submodule(EP_ATTR, self.ep)
        if self.cp is not None:
            gm.add_submodule(CP_ATTR, self.cp)
        if hasattr(gm, STATS_ATTR) and self.rows_group is not None:  # statistics over the global batch
            funcol.register_counter(self.rows_group.group_name, self.comm)
            gm.add_submodule(STATS_ATTR, BatchStatistics(self.plan.dp, self.rows_group.group_name))

    def _make_masks(self) -> SingleDeviceMasks:
        # Every rank follows rank 0's generator state at compile: what one device would draw from.
        state = self.compiled.rng_state.to(self.device)
        if dist.is_initialized():
            dist.broadcast(state, src=0, group=self.world_group)
        return SingleDeviceMasks(self.compiled.masks, state.cpu(), self.coords, self.mesh)

    def _slots(self) -> list[tuple[nn.Parameter, int, int, int]]:
        """(parameter, group, offset, numel) of every trainable parameter this rank's graphs read."""
        slots = []
        for gm in self.graphs.values():
            for node in all_nodes(gm):  # a ZeRO-3 gather may sit in a recompute region
                if ZERO3 in node.meta:
                    record = get_zero3_gather(node)
                    for target, offset, numel in zip(record.targets, record.offsets, record.numels):
                        slots.append((gm.get_parameter(target), record.group, offset, numel))
                elif node.op == "get_attr" and GRAD_BUCKET in node.meta:
                    slot = get_grad_bucket(node)
                    slots.append((gm.get_parameter(node.target), slot.group, slot.offset, slot.numel))
        return slots

    def _make_holder(self, masters: dict[int, torch.Tensor]) -> Holder:
        plan = self.plan
        layouts = layouts_from_slots(self._slots(), self.replicas, self.mesh.replica_index(self.rank))
        comms = {}
        for g, layout in layouts.items():
            if self.placement_of[id(layout.params[0])].expert and self.expert_comm is not None:
                # An expert group is data parallel over the dp / ep ranks holding its experts.
                layout.dp, layout.dp_rank = plan.dp // plan.ep, self.coords["dp"] // plan.ep
                comms[g] = self.expert_comm
        # Each group completes with the last backward, on this rank, of a stage that reads it: that
        # stage arms it, and groups launch in the order their stages finish (then by group id).
        finish = self.schedule.stages_by_last_backward(self.coords["pp"]) if self.schedule else [0]
        owner = {}
        for g, layout in layouts.items():
            reading = self.compiled.stages_of[id(layout.params[0])]
            owner[g] = max((s for s in reading if s in finish), key=finish.index, default=finish[-1])
        order = sorted(layouts, key=lambda g: (finish.index(owner[g]), g))
        initial = {g: lay.own(lay.flatten(torch.float32, masters)).clone() for g, lay in layouts.items()}
        initial = initial if masters else None
        groups = Groups(layouts, order, owner, self.replicas, comms)
        if plan.zero == 3:
            return Zero3Holder(groups, self.comm, plan.offload, initial, plan.reduce_dtype)
        if plan.zero in (1, 2):
            return ShardedHolder(groups, self.comm, plan.zero, plan.offload, initial, plan.reduce_dtype)
        return ReplicatedHolder(groups, self.comm, plan.reduce_dtype)

    def _make_optimizer(self, factory: Callable[[Any], torch.optim.Optimizer]) -> torch.optim.Optimizer:
        compiled = self.compiled
        if self.holder.masters is None:  # the parameters themselves: the user's factory, as written
            optimizer = make_optimizer(factory, compiled.model.parameters())
        else:
            groups: list[list[torch.Tensor]] = [[] for _ in compiled.template.param_groups]
            for g in self.holder.order:
                index = compiled.opt_groups.get(id(self.holder.layouts[g].params[0]))
                if index is not None:  # a group the user's optimizer leaves out is not stepped
                    groups[index].append(self.holder.masters.tensors[g])
            optimizer = optimizer_like(compiled.template, groups)
        if compiled.torch_compile is not None and compiled.torch_compile.fuses_pointwise:
            optimizer = with_fused_kernel(optimizer)
        return optimizer

    def autocast(self) -> Any:
        """The plan's torch.autocast on this rank's device (a no-op context without one)."""
        dtype = self.plan.autocast
        return torch.autocast(self.device.type, dtype) if dtype is not None else contextlib.nullcontext()

    def autocast_call(self, call: Callable[..., Any]) -> Callable[..., Any]:
        if self.plan.autocast is None:
            return call
        return lambda *args: self.autocast_run(call, *args)

    def autocast_run(self, call: Callable[..., Any], *args: Any) -> Any:
        with self.autocast():
            return call(*args)

    @functools.cached_property
    def input_shapes(self) -> list[Any]:  # once: every step reads them, and the captured graph does not change
        inputs = [n for n in self.compiled.captured.gm.graph.nodes if n.op == "placeholder"]
        return [next(iter(get_shape(n).tensors), None) for n in inputs]

    def _make_runner(self) -> PipelineRunner:
        coords, schedule = self.coords, self.schedule
        return PipelineRunner(
            stages=self.stages,
            schedule=schedule,
            pp_rank=coords["pp"],
            peer=lambda stage: self.mesh.rank_of(
                pp=schedule.rank_of(stage), dp=coords["dp"], cp=coords["cp"], tp=coords["tp"]
            ),
            channel=self.channel,
            input_shapes=self.input_shapes,
            group=self.p2p_group,
            max_slots=max(len(s.send) for s in self.compiled.stages),
            comm=self.comm,
            device=self.device,
            before_action=lambda action: self.at_microbatch(action.microbatch),
            calls=self.calls,
            arm_at_last_w=self.plan.zero == 3,
            grad_slot=self.holder.grad_slot,
        )

    # ---- one step -------------------------------------------------------------------------------
    def step(self, flat: list[torch.Tensor]) -> float:
        if self.optimizer is None:
            raise InputError(
                "step() needs an optimizer: compile(..., optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))"
            )
        start = time.perf_counter()
        holder, plan = self.holder, self.plan
        self.begin_masks(flat)
        if self.runner is None:  # one graph; with microbatches, gradient accumulation
            k = plan.microbatches
            holder.begin(armed=k == 1)
            parts = split_microbatches(flat, self.input_shapes, k)[0] if k > 1 else [flat]
            loss = torch.zeros((), dtype=torch.float64, device=self.device)
            for i, part in enumerate(parts):
                if i == k - 1 and k > 1:
                    holder.arm(0)  # the last microbatch's gradients complete the sum: reduce them once
                self.at_microbatch(i)
                with span(f"stage0.F+B.mb{i}"):
                    mb_loss = self.calls[0](*part)[0]
                    (mb_loss / k if k > 1 else mb_loss).backward()
                loss += mb_loss.detach().double() / k
        else:
            holder.begin(armed=False)
            total = self.runner.run(flat, holder.arm)
            loss = None if total is None else total / plan.microbatches
        if self.masks is not None:
            self.masks.end()
        holder.end()
        if self.steps == 0 and self.compiler is not None:
            self.compiler.check_compiled()
        self._sum_over_model()
        if plan.max_grad_norm is not None:
            counted = holder.grad_views(self._counts_in_norm)
            scaled = holder.grad_views(lambda p: True)
            self.last_grad_norm = clip_by_global_norm(counted, scaled, plan.max_grad_norm, self._sum_all, self.device)
        # The loss of the last stage's ranks (tp rank 0 counts it once), summed over every rank while
        # the optimizer steps: the mean over dp x cp (a cp rank's loss is its tokens' share, scaled by cp).
        last_pp = self.schedule.last_rank if self.schedule else 0
        last_stage = self.coords["pp"] == last_pp and self.coords["tp"] == 0
        self._loss.fill_(0.0)
        if loss is not None and last_stage:
            self._loss += loss.double()
        work = dist.all_reduce(self._loss, group=self.world_group, async_op=True) if dist.is_initialized() else None
        if holder.masters is not None:
            holder.masters.set_grads(holder.grad_shards)
        self.last_step_memory = self.memory()
        with span("optimizer"):
            if holder.masters is not None:
                holder.masters.step(self.optimizer)  # offload: wave by wave on the host
            else:
                self.optimizer.step()
            holder.after_step()
        if work is not None:
            work.wait()
        self.step_seconds = time.perf_counter() - start
        self.steps += 1
        return self._loss.item() / self.replicas

    def begin_masks(self, flat: list[torch.Tensor]) -> None:
        """A pass over the global batch starts: single-device dropout masks are drawn anew."""
        if self.masks is not None:
            local = split_microbatches(flat, self.input_shapes, 1)[1]
            self.masks.begin(local, self.plan.microbatches)

    def at_microbatch(self, index: int) -> None:
        if self.masks is not None:
            self.masks.microbatch = index

    def _counts_in_norm(self, param: nn.Parameter) -> bool:
        return self.placement_of[id(param)].counts_in_norm(self.coords, self.holder.dp_sharded, self.plan.ep)

    def _sum_all(self, tensor: torch.Tensor) -> None:
        if dist.is_initialized():
            dist.all_reduce(tensor, group=self.world_group)

    def _sum_over_model(self) -> None:
        """Gradients that are partial along tp, or split over tied copies on other pipeline ranks, summed."""
        if self.tp is not None and self.partial:
            self.tp.sum_each_(self.holder.grad_views(lambda p: id(p) in self.partial))
        for g in self.holder.order:
            placement = self.placement_of[id(self.holder.layouts[g].params[0])]
            if placement.tied:
                grad = self.holder.group_grad(g)
                self.comm.all_reduce(grad, group=self.ties[placement.pp.ranks])

    def memory(self) -> dict[str, int]:
        memory = self.holder.memory()
        masters = self.holder.masters.nbytes() if self.holder.masters is not None else 0
        memory["optimizer"] = optimizer_state_bytes(self.optimizer) + masters
        return memory
