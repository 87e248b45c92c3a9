"""Node values for autoshard.verify: record them per graph call, find the reference node a rank's node
holds, join a value over the tp group by its placement, and measure the error.

A rank's node holds the value of a reference node when it is an original node (same name, same op,
or an op the tensor-parallel rewrite re-targeted, such as a vocab-parallel embedding); a collective
the rewrite inserted (``autoshard.tp_comm``) holds the value it redistributes; a ZeRO-3 gather's
item holds its parameter; a pipeline receive holds what the previous stage sent.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from autoshard.graph_ops import context as cp_ops
from autoshard.graph_ops import zero
from autoshard.ir.meta import PIPE, TP_COMM, ZERO3
from autoshard.ir.placements import Partial, Placement, Shard

__all__ = ["Recorder", "join_over_tp", "max_error", "module_path", "op_name", "origin", "placement_str", "send_of"]


class Recorder(fx.Interpreter):
    """Runs a graph node by node, keeping a detached copy of every node's value."""

    def __init__(self, gm: fx.GraphModule, sink: dict[str, list[Any]]) -> None:
        super().__init__(gm)
        self.sink = sink

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.op != "output":
            self.sink.setdefault(n.name, []).append(_detached(out))
        return out


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    return None  # runtime modules and other handles


_PASS_THROUGH = {zero.mark}


def _first_tensor_input(node: fx.Node) -> fx.Node | None:
    return next(
        (a for a in node.all_input_nodes if a.op != "get_attr" or a.target not in ("tp", "pipe", "zero3")), None
    )


def origin(node: fx.Node, ref: Any, stages: dict[int, fx.GraphModule]) -> tuple[str | None, str]:
    """(reference node name, kind) of a rank node's value; None where nothing in the reference holds it."""
    if TP_COMM in node.meta:  # a collective the tp rewrite inserted: the value it redistributes
        source = _first_tensor_input(node)
        return (origin(source, ref, stages)[0] if source is not None else None), "collective"
    if PIPE in node.meta and node.meta[PIPE].direction == "recv":
        slot = node.meta[PIPE]
        send = send_of(stages.get(slot.peer), slot)
        value = send.args[-1] if send is not None else None
        return (origin(value, ref, stages)[0] if isinstance(value, fx.Node) else None), "boundary"
    if node.target in _PASS_THROUGH:
        return origin(node.args[0], ref, stages)[0], "activation"
    if node.target is operator.getitem and ZERO3 in node.args[0].meta:
        record = node.args[0].meta[ZERO3]
        return ref.by_target.get(record.targets[node.args[1]]), "gather"
    theirs = ref.nodes.get(node.name)
    if theirs is None or node.op != theirs.op:
        return None, "activation"
    if node.op == "call_function" and node.target != theirs.target and not _is_runtime(node.target):
        return None, "activation"  # a node the rewrite made anew under a name the reference also uses
    return node.name, "activation"


def _is_runtime(target: Any) -> bool:
    """A runtime op, or one a rewrite put in a node's place that computes the same value (its rank's share)."""
    return getattr(target, "__module__", "").startswith("autoshard.runtime") or target in _SAME_VALUE


# Context parallelism's attentions: the node's own value, this rank's tokens of it.
_SAME_VALUE = (cp_ops.ring_attention, cp_ops.all_to_all_attention)


def send_of(gm: fx.GraphModule | None, recv: Any) -> fx.Node | None:
    if gm is None:
        return None
    for n in gm.graph.nodes:
        slot = n.meta.get(PIPE)
        if slot is not None and slot.direction == "send" and slot.peer == recv.stage and slot.slot == recv.slot:
            return n
    return None


def module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if stack:
        return str(list(stack.values())[-1][0])
    return str(node.meta.get("autoshard.layer", ""))


def op_name(node: fx.Node) -> str:
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target)) if _is_runtime(node.target) else str(node.target)
    return f"{node.op} {node.target}"


# ---- joining a node's values over the tp group ---------------------------------------------------------
def join_over_tp(values: list[Any], placement: Placement) -> list[Any]:
    """Full values from the tp group's local ones: each rank's own where replicated, else one join."""
    if isinstance(placement, tuple):
        parts = [join_over_tp([v[i] for v in values], p) for i, p in enumerate(placement)]
        return [tuple(p[0] for p in parts)]
    if isinstance(placement, Shard):
        return [placement.join(list(values))]
    if isinstance(placement, Partial):
        return [torch.stack(list(values)).sum(0)]
    return list(values)


def max_error(mine: Any, theirs: Any, atol: float, rtol: float) -> tuple[float, float]:
    """(max abs error, tolerance); a shape or type mismatch is an infinite error."""
    if isinstance(theirs, (tuple, list)):
        if not isinstance(mine, (tuple, list)) or len(mine) != len(theirs):
            return float("inf"), atol
        pairs = [max_error(a, b, atol, rtol) for a, b in zip(mine, theirs)]
        return max((e - t for e, t in pairs), default=0.0) + atol, atol
    if isinstance(theirs, torch.Tensor):
        if not isinstance(mine, torch.Tensor) or mine.shape != theirs.shape:
            return float("inf"), atol
        if not theirs.is_floating_point():
            return (float("inf") if bool((mine != theirs).any()) else 0.0), atol
        diff = (mine.double() - theirs.double()).abs()
        scale = theirs.double().abs().max().item() if theirs.numel() else 0.0
        return (diff.max().item() if diff.numel() else 0.0), atol + rtol * scale
    return (0.0 if mine == theirs else float("inf")), atol


def placement_str(placement: Placement | tuple[Placement, ...] | None) -> str:
    if placement is None:
        return "R"
    if isinstance(placement, tuple):
        return "(" + ", ".join(str(p) for p in placement) + ")"
    return str(placement)
