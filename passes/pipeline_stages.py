"""Pipeline stage graphs: one GraphModule per stage, its boundaries explicit recv / send nodes.

Reads:  autoshard.stage, autoshard.shape, autoshard.ir.cost
Writes: autoshard.pipe (meta.PipeSlot) on every recv and send node of the stage graphs

Stage ``s`` of ``n`` gets the nodes that pipeline_split assigned to it. A value made on an earlier
stage and used here or later crosses the cut before this stage and arrives through a ``recv``
node; a value made here (or received) and used on a later stage leaves through a ``send`` node.
Only activations cross: what can be recomputed for free is recomputed where it is used instead of
being sent, namely

- sizes (SymInts such as ``B`` and ``S``): a ``size`` node evaluates their expression in the
  microbatch's symbol values, which every rank knows from the inputs it is given;
- tensors computed from the inputs alone, without gradient, matrix FLOPs or randomness (attention
  masks, position ids): their computation is copied into the stage that reads them.

A stage graph for stage 1 of GPT-2 reads::

    pipe = get_attr[pipe]                   # the rank's PipelineChannel
    add_7 = pipeline.recv(pipe, 1, 0)       # hidden state from stage 0
    sym_size_int_14 = pipeline.size(pipe, 'B')
    ...                                     # the stage's blocks
    pipeline.send(pipe, 1, 0, add_12)       # hidden state to stage 2
    return None                             # (the last stage returns the microbatch loss)

Graph inputs (token ids, labels) are the graph's placeholders on every stage that reads them.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from autoshard.errors import PlanError
from autoshard.graph_ops import pipeline
from autoshard.ir.meta import (
    COST,
    LAYER,
    PIPE,
    SHAPE,
    STAGE,
    NodeShape,
    PipeSlot,
    TensorShape,
    get_cost,
    get_shape,
    get_stage,
)

from .infra import Need, Pass, PassResult, calls_to

__all__ = ["CHANNEL_ATTR", "PASS", "StageGraph", "run"]

CHANNEL_ATTR = "pipe"


@dataclass(frozen=True)
class StageGraph:
    """One stage (built by passes.pipeline_stages): its graph, which graph inputs it reads, what it
    receives and sends."""

    stage: int
    gm: fx.GraphModule
    input_indices: tuple[int, ...]  # positions in the captured graph's flat inputs
    recv: tuple[TensorShape, ...]  # from stage - 1, in slot order
    send: tuple[TensorShape, ...]  # to stage + 1, in slot order
    parameter_targets: tuple[str, ...]  # get_attr targets of trainable parameters


def _mutates(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


def _written_in_place(node: fx.Node) -> bool:
    """Whether an in-place op writes into ``node`` or a view of it: a copy of its ancestors misses the write."""
    stack, seen = [node], {node}
    while stack:
        for user in stack.pop().users:
            if _mutates(user):
                return True
            if isinstance(user.target, torch._ops.OpOverload) and user.target.is_view and user not in seen:
                seen.add(user)
                stack.append(user)
    return False


def _free_to_recompute(node: fx.Node, memo: dict[fx.Node, bool]) -> bool:
    """Whether ``node`` depends on the graph inputs alone, through ops with no gradient, FLOPs, randomness
    or writes in place (``shifted[:, 1:] = labels[:, :-1]`` leaves no data edge to the value it changes)."""
    if node in memo:
        return memo[node]
    if node.op == "placeholder":
        result = True
    elif node.op == "get_attr":
        result = not get_shape(node).requires_grad
    elif node.op != "call_function":
        result = False
    else:
        tags = getattr(node.target, "tags", ())
        result = (
            not get_shape(node).requires_grad
            and get_cost(node).flops_fwd == 0
            and torch.Tag.nondeterministic_seeded not in tags
            and not _mutates(node)
            and not _written_in_place(node)
            and all(_free_to_recompute(arg, memo) for arg in node.all_input_nodes)
        )
    memo[node] = result
    return result


def _crossing_kind(node: fx.Node, memo: dict[fx.Node, bool]) -> str:
    """How a value made on an earlier stage reaches a later one: 'size', 'recompute' or 'send'."""
    shape = get_shape(node)
    if shape.scalar is not None:
        return "size"
    if len(shape.tensors) != 1 or shape.tensors[0] is None:
        raise PlanError(
            f"{node.format_node()} crosses a pipeline cut but is not one tensor ({shape}); "
            f"fix the cuts with plan={{'pp_cuts': [...]}} so that it stays within a stage"
        )
    return "recompute" if _free_to_recompute(node, memo) else "send"


def run(gm: fx.GraphModule, n_stages: int, channel: torch.nn.Module | None = None, returns: str = "loss") -> PassResult:
    """Build the stage graphs (the value: a list of StageGraph). ``channel`` becomes each graph's ``pipe``
    attribute (the runtime binds its own). ``returns``: what the last stage returns, "loss" (the training
    graph's first output) or "outputs" (every output of a forward graph; made earlier, they are sent on)."""
    if returns not in ("loss", "outputs"):
        raise ValueError(f"returns={returns!r} must be 'loss' or 'outputs'")
    channel = channel if channel is not None else pipeline.UnboundChannel()
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    stage_of = {n: get_stage(n) for n in nodes if n.op == "call_function"}
    memo: dict[fx.Node, bool] = {}

    # Values sent across each cut: made on a stage <= s (or received there), used on a stage > s.
    last_use: dict[fx.Node, int] = {}
    for node in nodes:
        if node.op != "call_function":
            continue
        for arg in node.all_input_nodes:
            if arg in stage_of and stage_of[arg] < stage_of[node]:
                last_use[arg] = max(last_use.get(arg, -1), stage_of[node])
    if returns == "outputs":  # the outputs are read on the last stage
        for arg in output.all_input_nodes:
            if arg in stage_of and stage_of[arg] < n_stages - 1:
                last_use[arg] = n_stages - 1
    kinds = {node: _crossing_kind(node, memo) for node in last_use}
    position = {n: i for i, n in enumerate(nodes)}
    sent = sorted((n for n, k in kinds.items() if k == "send"), key=position.__getitem__)
    crossing = [[n for n in sent if stage_of[n] <= s < last_use[n]] for s in range(n_stages)]

    counts = {"send": 0, "size": 0, "recompute": 0}
    stages = []
    for s in range(n_stages):
        builder = _StageBuilder(gm, s, stage_of, kinds, channel, counts)
        for slot, node in enumerate(crossing[s - 1] if s > 0 else []):
            builder.recv(node, slot)
        for node in nodes:
            if stage_of.get(node) == s:
                builder.copy(node)
        for slot, node in enumerate(crossing[s] if s < n_stages - 1 else []):
            builder.send(node, slot)
        result = output.args[0][0] if returns == "loss" else output.args[0]
        received, sent = crossing[s - 1] if s > 0 else [], crossing[s] if s < n_stages - 1 else []
        stages.append(builder.finish(result if s == n_stages - 1 else None, received, sent))
    summary = (
        f"{n_stages} stage graphs; {counts['send']} tensor(s) sent across cuts, "
        f"{counts['size']} size(s) and {counts['recompute']} input-only value(s) recomputed instead"
    )
    return PassResult("pipeline_stages", True, summary, value=stages, graphs=tuple(s.gm for s in stages))


class _StageBuilder:
    """Builds one stage's graph, copying nodes (and their free-to-recompute inputs) on first need."""

    def __init__(self, gm, stage, stage_of, kinds, channel, counts) -> None:  # noqa: ANN001 - private helper
        self.gm, self.stage, self.stage_of, self.kinds, self.counts = gm, stage, stage_of, kinds, counts
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.attrs: dict[str, object] = {CHANNEL_ATTR: channel}
        self.used_inputs: list[int] = []
        self.pipe = self.graph.get_attr(CHANNEL_ATTR)
        self.pipe.meta.update({SHAPE: NodeShape(), LAYER: "(top)"})

    def recv(self, node: fx.Node, slot: int) -> None:
        received = self.env[node] = self.graph.call_function(pipeline.recv, (self.pipe, self.stage, slot))
        received.meta.update(node.meta)
        received.meta[PIPE] = PipeSlot(stage=self.stage, peer=self.stage - 1, slot=slot, direction="recv")

    def send(self, node: fx.Node, slot: int) -> None:
        sent = self.graph.call_function(pipeline.send, (self.pipe, self.stage, slot, self.env[node]))
        sent.meta.update({SHAPE: NodeShape(), LAYER: self.env[node].meta.get(LAYER, "(top)")})
        sent.meta[PIPE] = PipeSlot(stage=self.stage, peer=self.stage + 1, slot=slot, direction="send")
        self.counts["send"] += 1

    def copy(self, node: fx.Node) -> fx.Node:
        env, graph = self.env, self.graph
        if node in env:
            return env[node]
        if node.op == "placeholder":
            self.used_inputs.append(self.placeholders.index(node))
            with graph.inserting_before(self.pipe):
                env[node] = graph.placeholder(node.name)
            env[node].meta.update(node.meta)
            return env[node]
        if node.op == "get_attr":
            self.attrs[node.target] = operator.attrgetter(node.target)(self.gm)
        elif node in self.stage_of and self.stage_of[node] < self.stage:
            if self.kinds.get(node) == "size":
                env[node] = graph.call_function(pipeline.size, (self.pipe, str(get_shape(node).scalar)))
                env[node].meta.update(node.meta)
                self.counts["size"] += 1
                return env[node]
            self.counts["recompute"] += node in self.kinds
        for arg in node.all_input_nodes:
            self.copy(arg)
        env[node] = graph.node_copy(node, lambda arg: env[arg])
        return env[node]

    def finish(self, result: Any, received: list[fx.Node], sent: list[fx.Node]) -> StageGraph:
        """``result``: what the graph returns (a node, a tuple of them, or None)."""
        self.graph.output(fx.map_arg(result, self.copy))
        self.graph.lint()
        stage_gm = fx.GraphModule(self.attrs, self.graph, class_name=f"Stage{self.stage}")
        targets = tuple(
            n.target for n in self.graph.nodes
            if n.op == "get_attr" and n.target != CHANNEL_ATTR and get_shape(n).requires_grad
        )  # fmt: skip
        return StageGraph(
            stage=self.stage,
            gm=stage_gm,
            input_indices=tuple(self.used_inputs),
            recv=tuple(get_shape(n).tensor for n in received),
            send=tuple(get_shape(n).tensor for n in sent),
            parameter_targets=targets,
        )


PASS = Pass(
    "pipeline_stages",
    reads=(Need(STAGE), Need(SHAPE), Need(COST)),
    writes=(Need(PIPE, calls_to("pipeline recv and send nodes", pipeline.recv, pipeline.send)), Need(SHAPE)),
    run=run,
)
