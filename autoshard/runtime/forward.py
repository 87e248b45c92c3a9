"""Forward-only calls of a compiled program: the model's outputs, in training or eval mode, for every plan.

The forward graph is the training graph minus its loss. In eval mode it computes as the model does
after ``model.eval()``: dropout off (``train=False``), batch norm on its running statistics (and not
updating them), attention without dropout. With pp > 1 the forward graph is cut at the same places
as the training graph and run in the schedule's order of forwards; the last stage's outputs are
joined over microbatches and broadcast to every pipeline rank. Sharded outputs (logits over a
vocabulary split by tp) are gathered whole.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import sympy
import torch
import torch.distributed as dist
from torch import fx

from autoshard import passes
from autoshard.errors import InputError
from autoshard.ir.meta import evaluate_expr, get_shape, get_tp
from autoshard.ir.ops import TRAINING_ARGS, runs
from autoshard.ir.placements import Partial, Shard

if TYPE_CHECKING:
    from autoshard.runtime.rank import RankRuntime

__all__ = ["ForwardRunner", "eval_graph", "forward_graph"]


def forward_graph(gm: fx.GraphModule, n_inputs: int) -> fx.GraphModule:
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


def eval_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` that computes as the model does in eval mode."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        target, args = runs(node)  # through tp.sharded_random and masks.dropout: the op and its own args
        offset = len(node.args) - len(args)
        if target in TRAINING_ARGS:
            index, name, value = TRAINING_ARGS[target]
            if name in node.kwargs:
                node.update_kwarg(name, value)
            elif len(node.args) > index + offset:
                node.update_arg(index + offset, value)
            elif isinstance(value, bool):  # a flag left at its default (training) is set explicitly
                node.update_kwarg(name, value)
        elif _updates_a_buffer(node):  # num_batches_tracked += 1 and the like: eval changes no state
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    graph.lint()
    evaluated = fx.GraphModule(gm, graph, class_name=f"Eval{type(gm).__name__}")
    for node in graph.nodes:  # the graphs it calls (recompute regions) compute in eval mode too
        sub = getattr(evaluated, node.target, None) if node.op == "get_attr" else None
        if isinstance(sub, fx.GraphModule):
            setattr(evaluated, node.target, eval_graph(sub))
    return evaluated


def _updates_a_buffer(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    first = node.args[0] if node.args else None
    return (
        schema is not None
        and schema.is_mutable
        and schema.arguments
        and schema.arguments[0].alias_info is not None
        and schema.arguments[0].alias_info.is_write
        and isinstance(first, fx.Node)
        and first.op == "get_attr"
    )


class ForwardRunner:
    """Forward calls of one rank: builds the forward (and eval) graphs on first use."""

    def __init__(self, runtime: RankRuntime) -> None:
        self.rt = runtime
        self._graphs: dict[bool, Any] = {}

    def _build(self, training: bool) -> Any:
        rt = self.rt
        compiled = rt.compiled
        fwd = forward_graph(compiled.captured.gm, compiled.captured.call.n_inputs)
        if rt.schedule is None:
            return fwd if training else eval_graph(fwd)
        n_stages = rt.schedule.n_stages
        stages = passes.run_pass(passes.pipeline_stages.PASS, fwd, n_stages, rt.channel, "outputs").value
        mine = {}
        for stage in stages:
            if rt.schedule.rank_of(stage.stage) != rt.coords["pp"]:
                continue
            if compiled.plan.zero == 3:
                passes.run_pass(passes.zero3_gather_free.PASS, stage.gm)
            rt.bind(stage.gm)
            mine[stage.stage] = dataclasses.replace(stage, gm=stage.gm if training else eval_graph(stage.gm))
        return fwd, mine

    def __call__(self, flat: list[torch.Tensor], training: bool) -> list[torch.Tensor]:
        rt = self.rt
        if training not in self._graphs:
            self._graphs[training] = self._build(training)
        built = self._graphs[training]
        if training:
            rt.begin_masks(flat)  # a forward in training mode draws dropout masks as one device would
        with torch.no_grad(), rt.autocast():
            if rt.schedule is None:
                outputs = list(built(*flat))
            else:
                outputs = self._pipeline(flat, *built)
            if training and rt.masks is not None:
                rt.masks.end()
            return self._join_tp(outputs)

    def _pipeline(self, flat: list[torch.Tensor], fwd: fx.GraphModule, stages: dict[int, Any]) -> list[torch.Tensor]:
        rt = self.rt
        per_microbatch = rt.runner.run_forward(flat, stages)
        out_nodes = next(n for n in fwd.graph.nodes if n.op == "output").args[0]
        sizes = dict(rt.channel.sizes)
        sizes["B"] = sizes.get("B", 1) * rt.schedule.microbatches
        last = rt.mesh.rank_of(pp=rt.schedule.last_rank, dp=rt.coords["dp"], cp=rt.coords["cp"], tp=rt.coords["tp"])
        outputs = []
        for i, node in enumerate(out_nodes):
            shape = get_shape(node).tensor
            batch_major = bool(shape.sizes) and isinstance(shape.sizes[0], sympy.Symbol) and shape.sizes[0].name == "B"
            if per_microbatch is not None:
                parts = [mb[i] for mb in per_microbatch]
                value = torch.cat(parts) if batch_major else parts[0]
            else:
                dims = [evaluate_expr(s, sizes) for s in shape.sizes]
                value = torch.empty(dims, dtype=shape.dtype, device=rt.device)
            dist.broadcast(value, src=last, group=rt.pp_group)
            outputs.append(value)
        return outputs

    def _join_tp(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        rt = self.rt
        if rt.tp is None:
            return outputs
        output = next(n for n in rt.compiled.captured.gm.graph.nodes if n.op == "output")
        for i, placement in enumerate(get_tp(output).out[1:]):
            if isinstance(placement, Shard):
                outputs[i] = rt.tp.gather(outputs[i], placement)
            elif isinstance(placement, Partial):
                outputs[i] = rt.tp.sum_(outputs[i].clone())
        return outputs
