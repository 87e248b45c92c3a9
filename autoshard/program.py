"""Program: what compile() returns, this rank's share of the distributed training program."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import reduce
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

from autoshard.capture import Captured
from autoshard.cost import ModelCost
from autoshard.errors import DistributedError, InputError
from autoshard.mesh import MESH_DIMS
from autoshard.meta import GRAD_BUCKET, LAYER, TP, ZERO3, get_layer, get_shape, get_tp, get_zero3_gather
from autoshard.passes import pipeline_stages, tp_placement, tp_rewrite, zero3_gather_free
from autoshard.placements import Partial, Placement, Replicate, Shard
from autoshard.plan import Plan
from autoshard.planner import PlanReport
from autoshard.runtime import tp as tp_ops
from autoshard.runtime.comm import CommCounter
from autoshard.runtime.grad_sync import BucketedGradSync, DataParallelTrainer
from autoshard.runtime.optim import clip_by_global_norm, make_optimizer
from autoshard.runtime.pipeline import (
    PipelineChannel,
    PipelineRunner,
    PipelineStats,
    PipelineTrainer,
    TiedGroup,
    ZeroPipelineTrainer,
)
from autoshard.runtime.tp import TensorParallel
from autoshard.runtime.zero import (
    FlatLayout,
    TensorParallelShards,
    Zero3Runtime,
    Zero3Trainer,
    ZeroDataParallel,
    layouts_from_slots,
)
from autoshard.schedules import Schedule

__all__ = ["Program", "RankProgram"]

MODEL_PREFIX = "model."


@dataclass(frozen=True)
class RankProgram:
    """One rank's view of the program: its coordinates, graphs and parameter placements."""

    rank: int
    coords: dict[str, int]
    graph_modules: tuple[fx.GraphModule, ...]
    placements: dict[str, dict[str, Placement]]

    def graph_code(self) -> str:
        return "\n".join(gm.code for gm in self.graph_modules)

    def __str__(self) -> str:
        coords = ", ".join(f"{d}={self.coords[d]}" for d in MESH_DIMS)
        lines = [f"rank {self.rank} ({coords}): {len(self.graph_modules)} graph(s)"]
        for name, per_dim in self.placements.items():
            lines.append(f"  {name:<48} " + " ".join(f"{d}:{per_dim[d]}" for d in MESH_DIMS))
        return "\n".join(lines)


def _fmt_count(value: int) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return str(value)


def _forward_only(gm: fx.GraphModule, n_inputs: int) -> fx.GraphModule:
    """The training graph minus the loss: inputs -> model outputs (target inputs dropped when unused)."""
    graph = fx.Graph()
    outputs = graph.graph_copy(gm.graph, {})
    graph.output(tuple(outputs[1:]))
    graph.eliminate_dead_code()
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node in placeholders[n_inputs:]:
        if node.users:
            raise InputError("the model's outputs depend on the target; forward-only calls are not possible")
        graph.erase_node(node)
    graph.lint()
    return fx.GraphModule(gm, graph, class_name="ForwardGraph")


class Program:
    """This rank's compiled training program. Build one with ``autoshard.compile``."""

    def __init__(
        self,
        *,
        captured: Captured,
        model: torch.nn.Module,
        plan: Plan,
        report: PlanReport,
        cost: ModelCost,
        optimizer_factory: Callable[[Iterator[torch.nn.Parameter]], torch.optim.Optimizer] | None,
        analysis_log: list[str],
        master_values: dict[int, torch.Tensor] | None = None,
        schedule: Schedule | None = None,
        stages: list[pipeline_stages.StageGraph] | None = None,
        tp_report: tp_placement.TpReport | None = None,
    ) -> None:
        self.plan = plan
        self.mesh = plan.mesh
        self.report = report
        self.cost = cost
        self.analysis_log = analysis_log
        self._captured = captured
        self._call = captured.call
        self._train_gm = captured.gm
        self._forward_gm: fx.GraphModule | None = None
        self._optimizer_factory = optimizer_factory
        self._trainer: Any = None
        self._master_values = master_values  # fp32 starting values under mixed precision, until the trainer has them
        self._zero3: Zero3Runtime | None = None
        self._dp_group: dist.ProcessGroup | None = None
        # Pipeline: the schedule, every stage's graph, and (under a process group) what this rank holds.
        self.schedule = schedule
        self._stages = stages or []
        self._held: set[int] | None = None  # ids of the state tensors this rank keeps; None: all
        self._full_shapes: dict[str, torch.Size] = {}
        self._pp_ranks_of: dict[int, set[int]] = {}  # id(tensor) -> pipeline ranks whose stages read it
        self._tied: list[TiedGroup] = []
        self._pp_group: dist.ProcessGroup | None = None
        self._p2p_group: dist.ProcessGroup | None = None
        self._channel: PipelineChannel | None = None
        # Tensor parallel: what the search decided, and (under a process group) this rank's group.
        self.tp_report = tp_report
        self._tp: TensorParallel | None = None
        self._tp_placement_of: dict[int, Shard] = {}  # id(tensor) -> its shard along tp
        self._distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._distributed else 0
        self.comm = CommCounter()
        self.last_step_memory: dict[str, int] = {}
        self._loss_sum: torch.Tensor | None = None
        # Keys and tensors of the original model's state dict; the graph shares these tensors.
        self._state = dict(model.state_dict(keep_vars=True))
        self._params = self._unique_parameters()
        self._key_of: dict[int, str] = {}
        for key, tensor in self._state.items():
            self._key_of.setdefault(id(tensor), key)
        if plan.tp > 1:
            for node in self._train_gm.graph.nodes:
                if node.op == "get_attr" and TP in node.meta and isinstance(get_tp(node).out, Shard):
                    tensor = reduce(getattr, node.target.split("."), self._train_gm)
                    self._tp_placement_of[id(tensor)] = get_tp(node).out
        if self.is_meta or (not self._distributed and self.mesh.size > 1):
            return  # planning and inspection only
        if self._distributed:
            self._dp_group = self._make_group("dp")
            self.comm.group = self._dp_group
            if plan.tp > 1:
                self._setup_tensor_parallel()
            if plan.pp > 1:
                self._setup_pipeline()
            self._broadcast_from_first_dp_rank()
        if plan.zero == 3:
            self._zero3 = Zero3Runtime(self._flat_layouts(ZERO3), self.comm)
            self._train_gm.add_submodule(zero3_gather_free.RUNTIME_ATTR, self._zero3)
        if optimizer_factory is not None:
            self._ensure_trainer()  # now, so that a bad optimizer fails before any rank trains

    # ---- inspection -------------------------------------------------------------------------
    @property
    def graph_modules(self) -> list[fx.GraphModule]:
        """This rank's rewritten graph(s): with pp > 1 the graphs of its pipeline stages."""
        return self._graphs_of(self.rank)

    @property
    def captured_graph(self) -> fx.GraphModule:
        """The whole model and loss as captured and analysed, before any per-rank rewrite splits it."""
        return self._train_gm

    def _graphs_of(self, rank: int) -> list[fx.GraphModule]:
        if self.schedule is None:
            return [self._train_gm]
        return [s.gm for s in self._stages_of(rank)]

    def _stages_of(self, rank: int) -> list[pipeline_stages.StageGraph]:
        pp_rank = self.mesh.coords(rank)["pp"]
        return [s for s in self._stages if self.schedule.rank_of(s.stage) == pp_rank]

    @property
    def pipeline_stats(self) -> PipelineStats | None:
        """The last step's pipeline measurements on this rank (wall time, busy time, activations held)."""
        return None if self._trainer is None or self.schedule is None else self._trainer.runner.stats

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last step before clipping (None unless max_grad_norm is set)."""
        trainer = self._trainer
        source = getattr(trainer, "shard_opt", trainer)
        norm = getattr(source, "last_grad_norm", None)
        return None if norm is None else float(norm)

    @property
    def is_meta(self) -> bool:
        return any(p.is_meta for p in self._params.values())

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return None if self._trainer is None else self._trainer.optimizer

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """This rank's trainable tensors: the model's parameters, or with ZeRO-3 its flat shards."""
        if self._zero3 is not None:
            yield from ((f"zero3.shards.{g}", s) for g, s in enumerate(self._zero3.shards))
        else:
            yield from ((n, p) for n, p in self._params.items() if self._held is None or id(p) in self._held)

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        yield from (p for _, p in self.named_parameters())

    def for_rank(self, rank: int) -> RankProgram:
        """Rank ``rank``'s graphs and placements; works offline for any mesh size."""
        coords = self.mesh.coords(rank)
        if self.schedule is not None:  # its stages' parameters only
            targets = dict.fromkeys(t for s in self._stages_of(rank) for t in s.parameter_targets)
            names = [t.removeprefix(MODEL_PREFIX) for t in targets]
        else:
            names = [
                n.removeprefix(MODEL_PREFIX)
                for n, _ in self._train_gm.named_parameters(remove_duplicate=False)
                if n.startswith(MODEL_PREFIX)  # not the ZeRO-3 runtime's shards
            ]
        # ZeRO-3 shards each parameter's flat group along the dp dimension.
        dp_placement = Shard(0) if self.plan.zero == 3 else Replicate()
        tp_of = {
            n.removeprefix(MODEL_PREFIX): self._tp_placement_of.get(id(p), Replicate())
            for n, p in self._train_gm.named_parameters(remove_duplicate=False)
        }
        placements = {
            name: {"pp": Replicate(), "dp": dp_placement, "tp": tp_of.get(name, Replicate())} for name in names
        }
        graphs = tuple(self._graphs_of(rank))
        return RankProgram(rank=rank, coords=coords, graph_modules=graphs, placements=placements)

    def explain(self) -> str:
        sizes = self.report.sizes
        size_str = ", ".join(f"{k}={v}" for k, v in sizes.items())
        chosen = self.report.chosen
        ev = self.cost.evaluate(**sizes)
        lines = [
            f"autoshard program for {self._captured.model_name} on {self.mesh}",
            f"plan: {self.plan}",
            f"why:  {self.report.reason}",
            f"predicted per rank at the example global batch ({size_str}) on a {self.report.device.name}: "
            f"{chosen.memory_bytes / 2**30:.3f} GiB, {chosen.step_seconds * 1e3:.3f} ms per step",
            "",
            "candidates:",
            self.report.table(),
            "",
            f"whole model: forward {self.cost.flops_fwd} FLOPs = {_fmt_count(int(ev.flops_fwd))}, "
            f"backward {self.cost.flops_bwd} = {_fmt_count(int(ev.flops_bwd))}",
            f"             parameters {_fmt_count(self.cost.param_bytes)}B, "
            f"activations {self.cost.activation_bytes} B = {_fmt_count(int(ev.activation_bytes))}B",
            "",
            f"{'layer':<28} {'forward FLOPs':<34} {'at ' + size_str:>14} {'params':>9} {'activations':>12}",
        ]
        for lc, lv in zip(self.cost.layers, ev.layers):
            expr = str(lc.flops_fwd)
            expr = expr if len(expr) <= 34 else expr[:31] + "..."
            lines.append(
                f"{lc.name:<28} {expr:<34} {_fmt_count(int(lv.flops_fwd)):>14} "
                f"{_fmt_count(lc.param_bytes) + 'B':>9} {_fmt_count(int(lv.activation_bytes)) + 'B':>12}"
            )
        if self.mesh.size <= 16:
            lines += ["", "mesh:", self.mesh.table()]
        if self.schedule is not None:
            lines += ["", "pipeline stages:"]
            for stage in self._stages:
                layers = [get_layer(n) for n in stage.gm.graph.nodes if n.op == "get_attr" and LAYER in n.meta]
                blocks = list(dict.fromkeys(x for x in layers if x.rsplit(".", 1)[-1].isdigit()))
                span = f"{blocks[0]} .. {blocks[-1]}" if blocks else "no blocks"
                lines.append(
                    f"  stage {stage.stage} on pp rank {self.schedule.rank_of(stage.stage)}: {span}, "
                    f"{len(stage.parameter_targets)} parameters; receives {len(stage.recv)}, "
                    f"sends {len(stage.send)} tensor(s)"
                )
            if self.schedule.microbatches * self.schedule.virtual_stages <= 16:
                lines += ["", self.schedule.table()]
        if self.tp_report is not None:
            lines += ["", *self._explain_tp()]
        lines += ["", "passes:"] + [f"  {line}" for line in self.analysis_log]
        return "\n".join(lines)

    def _explain_tp(self) -> list[str]:
        report = self.tp_report
        params = dict(self._train_gm.named_parameters(remove_duplicate=False))
        lines = [f"tensor parallel (tp={report.degree}):"]
        for target, placement in report.weights.items():
            if isinstance(placement, Shard):
                key = target.removeprefix(MODEL_PREFIX)
                shape = tuple(self._full_shapes.get(key, params[target].shape)) if target in params else "?"
                lines.append(f"  {target.removeprefix(MODEL_PREFIX):<52} {str(placement):<8} full {shape}")
        for target, why in report.replicated.items():
            lines.append(f"  {target.removeprefix(MODEL_PREFIX):<52} {'R':<8} replicated: {why}")
        per_layer = tp_rewrite.collectives_by_layer(self._train_gm)
        lines.append("  collectives per layer:")
        for layer, counts in per_layer.items():
            lines.append(f"    {layer:<30} " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
        losses = [n for n in self._train_gm.graph.nodes if n.target is tp_ops.vocab_parallel_cross_entropy]
        if losses:
            lines.append(
                f"  vocab-parallel cross-entropy ({len(losses)}): per row, an all-reduce of the max logit and one of "
                f"the sum of exponentials with the target's logit; the logits stay sharded"
            )
        if report.partial_grad_params:
            lines.append(
                f"  {len(report.partial_grad_params)} replicated weights used on shards (norms, split biases): "
                f"gradients summed over tp in one all-reduce after backward"
            )
        if report.unruled:
            ops = ", ".join(f"{op} x{n}" for op, n in sorted(report.unruled.items()))
            lines.append(f"  ops without a sharding rule (inputs replicated): {ops}")
        return lines

    def __repr__(self) -> str:
        return f"<autoshard.Program {self.plan} rank={self.rank} of {self.mesh}>"

    # ---- running ------------------------------------------------------------------------------
    def local_batch(self, global_tensor: torch.Tensor) -> torch.Tensor:
        """This data-parallel rank's rows of a global batch (contiguous slices in dp-rank order)."""
        if not isinstance(global_tensor, torch.Tensor) or global_tensor.dim() == 0:
            raise InputError(f"local_batch takes a tensor with a batch dimension, got {type(global_tensor).__name__}")
        rows, dp = global_tensor.shape[0], self.plan.dp
        if rows % dp:
            raise InputError(
                f"a batch of {rows} rows is not divisible by dp={dp}; use a global batch that is a multiple of {dp}"
            )
        index = self.mesh.coords(self.rank)["dp"]
        per = rows // dp
        return global_tensor[index * per : (index + 1) * per]

    def step(self, *inputs: torch.Tensor, target: Any = None, **kwargs: torch.Tensor) -> float:
        """Forward, backward, gradient sync and optimizer step on this rank's local batch.

        Returns the global mean loss (the mean of the dp ranks' local mean losses), equal on every rank.
        """
        self._check_runnable("step()")
        trainer = self._ensure_trainer()
        flat = self._call.flatten_inputs(inputs, kwargs) + self._call.flatten_target(target)
        if self.schedule is not None:
            return self._pipeline_step(trainer, flat)
        trainer.prepare()
        loss = self._train_gm(*flat)[0]
        # One buffer kept across steps for the loss being summed over dp while backward runs.
        if self._loss_sum is None or self._loss_sum.device != loss.device:
            self._loss_sum = torch.zeros((), dtype=torch.float32, device=loss.device)
        loss_sum = self._loss_sum
        loss_sum.copy_(loss.detach())
        work = None
        if self.plan.dp > 1:
            # Launched before the gradient buckets, so every rank issues collectives in one order.
            work = dist.all_reduce(loss_sum, group=self._dp_group, async_op=True)
        loss.backward()
        trainer.finish()
        if self._tp is not None and self.plan.zero == 0:  # (under ZeRO the reduced shards are summed)
            self._sum_partial_grads()
        self.last_step_memory = trainer.memory()
        trainer.step(self.plan.max_grad_norm)
        if work is not None:
            work.wait()
        return loss_sum.item() / self.plan.dp

    def _pipeline_step(self, trainer: PipelineTrainer, flat: list[torch.Tensor]) -> float:
        loss_sum = trainer.run(flat)
        if self._tp is not None and self.plan.zero == 0:  # (under ZeRO the reduced shards are summed)
            self._sum_partial_grads()
        self.last_step_memory = trainer.memory()
        # The last stage's ranks hold the loss (summed over microbatches); one sum over all ranks shares
        # it, while the optimizer steps.
        coords = self.mesh.coords(self.rank)
        shared = torch.zeros((), dtype=torch.float64)
        if loss_sum is not None and coords["tp"] == 0:
            shared += loss_sum.double() / self.plan.microbatches
        work = dist.all_reduce(shared, async_op=True)
        trainer.update(self.plan.max_grad_norm)
        work.wait()
        return shared.item() / self.plan.dp

    def __call__(self, *inputs: torch.Tensor, **kwargs: torch.Tensor) -> Any:
        """Forward only: the model's outputs for this rank's local inputs (non-tensor outputs are None)."""
        self._check_runnable("a forward call")
        if self.schedule is not None:
            raise DistributedError(
                "forward-only calls are not implemented for pipeline programs (pp > 1): the model's outputs "
                "live on the last stage; load program.full_state_dict() into the model to run it whole"
            )
        if self._forward_gm is None:
            self._forward_gm = _forward_only(self._train_gm, self._call.n_inputs)
        outputs = list(self._forward_gm(*self._call.flatten_inputs(inputs, kwargs)))
        if self._tp is not None:  # sharded outputs (logits over a sharded vocabulary) are joined here
            output = next(n for n in self._train_gm.graph.nodes if n.op == "output")
            for i, placement in enumerate(get_tp(output).out[1:]):
                with torch.no_grad():
                    if isinstance(placement, Shard):
                        outputs[i] = self._tp.gather(outputs[i], placement)
                    elif isinstance(placement, Partial):
                        outputs[i] = self._tp.sum_(outputs[i].clone())
        return self._call.unflatten_outputs(outputs)

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's tensors: the model's keys (with ZeRO-3: its flat shards, then the buffers)."""
        if self._zero3 is not None:
            shards = {f"zero3.shards.{g}": s.detach() for g, s in enumerate(self._zero3.shards)}
            buffers = {k: t.detach() for k, t in self._state_tensors().items() if not isinstance(t, torch.nn.Parameter)}
            return shards | buffers
        return {key: tensor.detach() for key, tensor in self._state_tensors().items() if self._holds(tensor)}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """On rank 0 (or offline): the original model's keys and full shapes; elsewhere an empty dict.

        With ZeRO-3 this gathers the shards: call it on every rank.
        """
        if self._held is not None:
            return self._gather_pipeline_state()
        gathered: dict[int, torch.Tensor] = {}
        if self._tp is not None:
            for tensor in self._state_tensors().values():
                placement = self._tp_placement_of.get(id(tensor))
                if placement is not None and id(tensor) not in gathered:
                    gathered[id(tensor)] = self._tp.gather(tensor.detach(), placement)
        if self._zero3 is not None:
            for layout, tensors in zip(self._zero3.layouts, self._zero3.full_parameters()):
                gathered.update({id(p): t for p, t in zip(layout.params, tensors)})
        if self._distributed and self.rank != 0:
            return {}
        return {
            key: gathered[id(tensor)] if id(tensor) in gathered else tensor.detach().clone()
            for key, tensor in self._state_tensors().items()
        }

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a full state dict (the original model's keys); every rank keeps its share."""
        tensors = self._state_tensors()
        missing = sorted(set(tensors) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(tensors))
        if missing or unexpected:
            raise InputError(f"state dict keys do not match the model: missing {missing}, unexpected {unexpected}")
        sharded = {id(p) for layout in self._zero3.layouts for p in layout.params} if self._zero3 else set()
        for key, tensor in tensors.items():
            value = state_dict[key]
            shape = self._zero3_shape(tensor) if id(tensor) in sharded else self._full_shapes.get(key, tensor.shape)
            if tuple(value.shape) != tuple(shape):
                raise InputError(f"{key}: shape {tuple(value.shape)} in the state dict, {tuple(shape)} here")
        with torch.no_grad():
            for key, tensor in tensors.items():
                if id(tensor) not in sharded and self._holds(tensor):
                    value = state_dict[key]
                    if id(tensor) in self._tp_placement_of and self._tp is not None:
                        value = self._tp_placement_of[id(tensor)].local(value, self._tp.rank, self._tp.degree)
                    tensor.copy_(value)
            if self._zero3 is not None:
                for layout, shard in zip(self._zero3.layouts, self._zero3.shards):
                    full = torch.zeros(layout.padded, dtype=shard.dtype, device=shard.device)
                    for param, offset in zip(layout.params, layout.offsets):
                        value = state_dict[self._key_of[id(param)]]
                        full[offset : offset + value.numel()].copy_(value.reshape(-1))
                    shard.copy_(layout.own(full))
        if self._trainer is not None and self.plan.zero > 0:
            syncs = self._trainer.syncs.values() if self.schedule is not None else [self._trainer]
            for sync in syncs:
                sync.shard_opt.reload_masters()

    # ---- internals ----------------------------------------------------------------------------
    def _holds(self, tensor: torch.Tensor) -> bool:
        return self._held is None or id(tensor) in self._held

    def _setup_tensor_parallel(self) -> None:
        """This rank's tp group, bound into the graph; every sharded tensor cut down to this rank's slice."""
        group = self._make_group("tp")
        # Replicated activations must see the same dropout masks on every tp rank: share tp rank 0's
        # random state (and seed, from which each rank's own stream for sharded activations derives).
        first = self.mesh.group("tp", self.rank)[0]
        nccl = dist.get_backend(group) == "nccl"
        wire = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

        def shared(tensor: torch.Tensor) -> torch.Tensor:
            on_wire = tensor.to(wire)
            dist.broadcast(on_wire, src=first, group=group)
            return on_wire.cpu()

        torch.set_rng_state(shared(torch.get_rng_state()))
        if nccl:
            torch.cuda.set_rng_state(shared(torch.cuda.get_rng_state()))
        seed = shared(torch.tensor([torch.initial_seed() % 2**62]))
        self._tp = TensorParallel(group, self.comm, int(seed))
        self._train_gm.add_submodule(tp_rewrite.RUNTIME_ATTR, self._tp)
        tensors = self._state_tensors()
        self._full_shapes = {key: t.shape for key, t in tensors.items()}
        done: set[int] = set()
        for tensor in tensors.values():
            placement = self._tp_placement_of.get(id(tensor))
            if placement is not None and id(tensor) not in done:
                done.add(id(tensor))
                tensor.data = placement.local(tensor.data, self._tp.rank, self._tp.degree).clone()

    def _sum_partial_grads(self) -> None:
        """Replicated weights used on sequence shards (norms, split biases): sum their gradients over tp, at once."""
        params = (self._train_gm.get_parameter(t) for t in self.tp_report.partial_grad_params)
        self._tp.sum_each_([p.grad for p in params if p.grad is not None])

    def _tp_shards(self, layouts: list[FlatLayout]) -> TensorParallelShards | None:
        """Where, in this rank's ZeRO shards, the gradients to sum over tp and the weights replicated over tp lie."""
        if self._tp is None:
            return None
        partial = {id(self._train_gm.get_parameter(t)) for t in self.tp_report.partial_grad_params}
        return TensorParallelShards(
            self._tp,
            [lay.own_ranges(lambda p: id(p) in partial) for lay in layouts],
            [lay.own_ranges(lambda p: id(p) not in self._tp_placement_of) for lay in layouts],
        )

    def _tp_clip(self, max_norm: float) -> torch.Tensor:
        """Global-norm clipping over tp shards: a sharded gradient counts on every tp rank, a replicated one once."""
        params = [p for p in self._params.values() if p.grad is not None]
        counted = [p.grad for p in params if id(p) in self._tp_placement_of or self._tp.rank == 0]
        group = self._tp.group
        return clip_by_global_norm(
            counted, [p.grad for p in params], max_norm, lambda t: dist.all_reduce(t, group=group)
        )

    def _setup_pipeline(self) -> None:
        """Groups, the channel, and this rank's share: its stages' tensors stay, the rest are released."""
        mesh, schedule = self.mesh, self.schedule
        # Every rank creates every group, in the same order.
        self._pp_group = self._make_group("pp")
        self._p2p_group = dist.new_group(list(range(mesh.size)))  # point to point only, apart from collectives
        tensors = self._state_tensors()
        for stage in self._stages:
            for node in stage.gm.graph.nodes:
                if node.op == "get_attr" and node.target != pipeline_stages.CHANNEL_ATTR:
                    tensor = reduce(getattr, node.target.split("."), stage.gm)
                    self._pp_ranks_of.setdefault(id(tensor), set()).add(schedule.rank_of(stage.stage))
        tied: dict[tuple[int, ...], list[torch.nn.Parameter]] = {}
        for param in self._params.values():
            pp_ranks = self._pp_ranks_of.get(id(param), set())
            if param.requires_grad and len(pp_ranks) > 1:
                tied.setdefault(tuple(sorted(pp_ranks)), []).append(param)
        for pp_ranks, params in sorted(tied.items()):
            for dp in range(mesh.dp):
                for tp in range(mesh.tp):
                    ranks = [mesh.rank_of(pp=r, dp=dp, tp=tp) for r in pp_ranks]
                    group = dist.new_group(ranks)
                    if self.rank in ranks:
                        self._tied.append(TiedGroup(group, params))
                        with torch.no_grad():  # the copies start equal, whatever each rank was given
                            for param in params:
                                dist.broadcast(param, src=ranks[0], group=group)
        mine = mesh.coords(self.rank)["pp"]
        self._held = {id(t) for t in tensors.values() if mine in self._pp_ranks_of.get(id(t), {mine})}
        self._full_shapes = self._full_shapes or {key: t.shape for key, t in tensors.items()}  # tp set them first
        for tensor in tensors.values():
            if id(tensor) not in self._held:
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)  # another stage's
        self._channel = PipelineChannel()
        for stage in self._stages_of(self.rank):
            stage.gm.add_submodule(pipeline_stages.CHANNEL_ATTR, self._channel)
            if self._tp is not None:
                stage.gm.add_submodule(tp_rewrite.RUNTIME_ATTR, self._tp)

    def _pipeline_trainer(self) -> PipelineTrainer:
        coords = self.mesh.coords(self.rank)
        mine = self._stages_of(self.rank)
        syncs: dict[int, Any] = {}
        params = list(self.parameters())
        if self.plan.zero in (1, 2):
            for s in mine:
                layouts = layouts_from_slots(self._flat_slots(GRAD_BUCKET, s.gm), self.plan.dp, coords["dp"])
                syncs[s.stage] = ZeroDataParallel(
                    layouts, self.plan.zero, self.plan.offload, self._optimizer_factory, self.comm, self._master_values
                )
        elif self.plan.dp > 1:
            for s in mine:
                syncs[s.stage] = BucketedGradSync(self._flat_slots(GRAD_BUCKET, s.gm), self.comm, self.plan.dp)
        inputs = [n for n in self._train_gm.graph.nodes if n.op == "placeholder"]
        input_shapes = [next(iter(get_shape(n).tensors), None) for n in inputs]
        runner = PipelineRunner(
            stages={s.stage: s for s in mine},
            schedule=self.schedule,
            pp_rank=coords["pp"],
            peer=lambda stage: self.mesh.rank_of(pp=self.schedule.rank_of(stage), dp=coords["dp"], tp=coords["tp"]),
            channel=self._channel,
            input_shapes=input_shapes,
            group=self._p2p_group,
            max_slots=max(len(s.send) for s in self._stages),
            comm=self.comm,
        )
        if self.plan.zero in (1, 2):
            return ZeroPipelineTrainer(runner, syncs, params)
        optimizer = make_optimizer(self._optimizer_factory, params)
        # A tied parameter counts once in the global norm: on the first pipeline rank that reads it; a
        # weight replicated over tp on tp rank 0 only, a sharded one on every tp rank.
        norm_params = [
            p
            for p in params
            if min(self._pp_ranks_of.get(id(p), {coords["pp"]})) == coords["pp"]
            and (coords["tp"] == 0 or id(p) in self._tp_placement_of)
        ]
        groups = [self._pp_group] + ([self._tp.group] if self._tp is not None else [])

        def sum_over_model(tensor: torch.Tensor) -> None:
            for group in groups:
                dist.all_reduce(tensor, group=group)

        return PipelineTrainer(runner, syncs, optimizer, params, self._tied, norm_params, sum_over_model, self.comm)

    def _gather_pipeline_state(self) -> dict[str, torch.Tensor]:
        """Rank 0 receives every tensor from the first rank of the pipeline stage holding it."""
        tensors = self._state_tensors()
        if self._tp is not None:  # join each held tp shard first (every rank of a tp group holds the same keys)
            joined: dict[int, torch.Tensor] = {}
            for key in sorted(tensors):
                tensor = tensors[key]
                placement = self._tp_placement_of.get(id(tensor))
                if placement is not None and self._holds(tensor) and id(tensor) not in joined:
                    joined[id(tensor)] = self._tp.gather(tensor.detach(), placement)
            tensors = {key: joined.get(id(t), t) for key, t in tensors.items()}
        owner = {}
        for key, tensor in self._state_tensors().items():
            pp_ranks = self._pp_ranks_of.get(id(tensor))
            owner[key] = self.mesh.rank_of(pp=min(pp_ranks)) if pp_ranks else 0
        out = {key: tensors[key].detach().clone() for key in tensors if owner[key] == 0} if self.rank == 0 else {}
        for src in sorted(set(owner.values()) - {0}):
            keys = [k for k in tensors if owner[k] == src]
            by_dtype: dict[torch.dtype, list[str]] = {}
            for key in keys:
                by_dtype.setdefault(tensors[key].dtype, []).append(key)
            for dtype, group_keys in by_dtype.items():
                if self.rank == src:
                    flat = torch.cat([tensors[k].detach().reshape(-1) for k in group_keys])
                    dist.send(flat, dst=0, group=self._p2p_group)
                elif self.rank == 0:
                    numels = [self._full_shapes[k].numel() for k in group_keys]
                    flat = torch.empty(sum(numels), dtype=dtype)
                    dist.recv(flat, src=src, group=self._p2p_group)
                    for key, piece in zip(group_keys, flat.split(numels)):
                        out[key] = piece.view(self._full_shapes[key]).clone()
        return {key: out[key] for key in tensors} if self.rank == 0 else {}

    def _zero3_shape(self, param: torch.Tensor) -> torch.Size:
        for layout in self._zero3.layouts:
            for p, shape in zip(layout.params, layout.shapes):
                if p is param:
                    return shape
        raise KeyError(self._key_of[id(param)])

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for key, original in self._state.items():
            try:
                out[key] = reduce(getattr, (MODEL_PREFIX + key).split("."), self._train_gm)
            except AttributeError:
                out[key] = original  # not used by the graph: it never changes
        return out

    def _unique_parameters(self) -> dict[str, torch.nn.Parameter]:
        params: dict[str, torch.nn.Parameter] = {}
        seen: set[int] = set()
        for name, param in self._train_gm.named_parameters(remove_duplicate=False):
            if id(param) in seen or name.startswith(zero3_gather_free.RUNTIME_ATTR + "."):
                continue
            seen.add(id(param))
            params[name.removeprefix(MODEL_PREFIX)] = param
        return params

    def _check_runnable(self, what: str) -> None:
        if self.is_meta:
            raise DistributedError(
                f"{what} needs real parameters, but the model is on the meta device: this program is for "
                f"planning and inspection; build the model on a real device and compile again to train"
            )
        if not self._distributed and self.mesh.size > 1:
            raise DistributedError(
                f"{what} needs a process group of {self.mesh.size} ranks, but none is initialized: this program "
                f"was compiled offline for inspection; call torch.distributed.init_process_group() before "
                f"autoshard.compile (e.g. under torchrun --nproc-per-node {self.mesh.size})"
            )

    def _flat_slots(self, key: str, gm: fx.GraphModule | None = None) -> list[tuple[torch.nn.Parameter, int, int, int]]:
        """(parameter, group, offset, numel) as passes assigned them: GRAD_BUCKET or ZeRO-3's ZERO3."""
        gm = gm if gm is not None else self._train_gm
        slots, seen = [], set()
        for node in gm.graph.nodes:
            if key not in node.meta:
                continue
            if key == ZERO3:
                record = get_zero3_gather(node)
                for target, offset, numel in zip(record.targets, record.offsets, record.numels):
                    slots.append((gm.get_parameter(target), record.group, offset, numel))
                continue
            param = gm.get_parameter(node.target)
            if id(param) in seen:
                continue
            seen.add(id(param))
            slot = node.meta[key]
            slots.append((param, slot.group, slot.offset, slot.numel))
        return slots

    def _flat_layouts(self, key: str) -> list[FlatLayout]:
        return layouts_from_slots(self._flat_slots(key), self.plan.dp, self.mesh.coords(self.rank)["dp"])

    def _ensure_trainer(self) -> Any:
        if self._trainer is not None:
            return self._trainer
        factory = self._optimizer_factory
        if factory is None:
            raise InputError(
                "step() needs an optimizer: compile(..., optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))"
            )
        zero = self.plan.zero
        if self.schedule is not None:
            self._trainer = self._pipeline_trainer()
        elif zero == 0:
            sync = BucketedGradSync(self._flat_slots(GRAD_BUCKET), self.comm, self.plan.dp)
            optimizer = make_optimizer(factory, self.parameters())
            clip = self._tp_clip if self._tp is not None else None
            self._trainer = DataParallelTrainer(sync, optimizer, list(self._params.values()), clip)
        elif zero in (1, 2):
            layouts = self._flat_layouts(GRAD_BUCKET)
            self._trainer = ZeroDataParallel(
                layouts, zero, self.plan.offload, factory, self.comm, self._master_values, self._tp_shards(layouts)
            )
        else:
            self._trainer = Zero3Trainer(self._zero3, self.plan.offload, factory, self.comm, self._master_values)
        self._master_values = None  # the master shards hold them now
        return self._trainer

    def _make_group(self, dim: str) -> dist.ProcessGroup | None:
        """This rank's process group along mesh dimension ``dim``."""
        if self.mesh.degree(dim) == dist.get_world_size():
            return None  # the default group
        mine = None
        for ranks in self.mesh.groups(dim):  # every rank creates every group, in the same order
            group = dist.new_group(ranks)
            if self.rank in ranks:
                mine = group
        return mine

    def _broadcast_from_first_dp_rank(self) -> None:
        """Start every dp replica from identical parameters and buffers, as DDP does."""
        if self.plan.dp == 1:
            return
        src = self.mesh.group("dp", self.rank)[0]
        tensors, seen = [], set()
        for tensor in [*self._state_tensors().values(), *(self._master_values or {}).values()]:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                tensors.append(tensor)
        with torch.no_grad():
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for t in tensors:
                by_dtype.setdefault(t.dtype, []).append(t)
            for group in by_dtype.values():
                flat = torch.cat([t.reshape(-1) for t in group])
                dist.broadcast(flat, src=src, group=self._dp_group)
                offset = 0
                for t in group:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()
