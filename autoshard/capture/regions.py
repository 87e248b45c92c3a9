"""Regions of the forward that a trace records specially: grad-mode regions and the model's own checkpoints.

torch.export wraps ``torch.no_grad()`` / ``torch.enable_grad()`` blocks in a higher-order op over a
submodule the passes cannot see into; they are inlined here. ``torch.utils.checkpoint`` would be
traced through and lost; while capture traces, it tags the nodes it makes instead, and
passes.recompute turns each tagged region back into recomputation.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch.utils.checkpoint
from torch import fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils import _pytree as pytree

from autoshard.errors import CaptureError
from autoshard.ir.meta import USER_RECOMPUTE

__all__ = ["inline_grad_regions", "recording_checkpoints"]


def _subgraph_calls(gm: fx.GraphModule) -> list[fx.Node]:
    """Calls that take a submodule's graph as an argument (torch.export's higher-order ops)."""

    def is_subgraph(a: fx.Node) -> bool:
        return a.op == "get_attr" and isinstance(getattr(gm, a.target, None), fx.GraphModule)

    return [n for n in gm.graph.nodes if n.op == "call_function" and any(map(is_subgraph, n.all_input_nodes))]


def _inline_region(gm: fx.GraphModule, node: fx.Node, name: str) -> None:
    """Replace ``wrap_with_set_grad_enabled(enabled, submodule, *args)`` by the submodule's nodes."""
    graph = gm.graph
    enabled, sub_node, *args = node.args
    sub = getattr(gm, sub_node.target)
    env: dict[fx.Node, Any] = dict(zip([n for n in sub.graph.nodes if n.op == "placeholder"], args))

    def lookup(x: Any) -> Any:
        return env[x] if isinstance(x, fx.Node) else x

    outputs: Any = ()
    with graph.inserting_before(node):
        for inner in sub.graph.nodes:
            if inner.op == "placeholder":
                continue
            if inner.op == "output":
                outputs = tuple(pytree.tree_map(lookup, inner.args[0]))
                break
            if inner.op == "get_attr":  # a nested region's submodule or a constant: lift it into gm
                target = f"{sub_node.target}_{inner.target}".replace(".", "_")
                setattr(gm, target, getattr(sub, inner.target))
                env[inner] = graph.get_attr(target)
                env[inner].meta.update(inner.meta)
            else:
                env[inner] = graph.node_copy(inner, lookup)
        if not enabled:  # no gradient flows back out of a no-grad region
            detached = []
            for out in outputs:
                val = out.meta.get("val") if isinstance(out, fx.Node) else None
                if isinstance(val, torch.Tensor) and (val.is_floating_point() or val.is_complex()):
                    kept = {k: v for k, v in out.meta.items() if k in ("val", "nn_module_stack")}
                    out = graph.call_function(torch.ops.aten.detach.default, (out,))
                    out.meta.update(kept)
                detached.append(out)
            outputs = tuple(detached)
    for user in list(node.users):
        if user.op != "call_function" or user.target is not operator.getitem:
            raise CaptureError(f"autoshard could not capture {name}: {node.name} is read whole by {user.name}")
        user.replace_all_uses_with(outputs[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(node)
    if not sub_node.users:
        graph.erase_node(sub_node)
        delattr(gm, sub_node.target)


def inline_grad_regions(gm: fx.GraphModule, name: str) -> None:
    """Inline ``torch.no_grad()`` / ``torch.enable_grad()`` regions of the forward into the graph.

    torch.export records them as ``wrap_with_set_grad_enabled(enabled, submodule, *args)``, whose
    submodule the passes cannot see into. Inlined, a no-grad region's outputs are detached: the same
    values, and no gradient flows back through them, as in eager. Other calls of subgraphs (control
    flow) are refused.
    """
    set_grad = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
    for _ in range(64):  # regions nested in regions surface as the outer ones are inlined
        calls = _subgraph_calls(gm)
        if not calls:
            return
        for node in calls:
            if node.target is not set_grad:
                raise CaptureError(
                    f"autoshard could not capture {name}: its graph calls {node.target} on a subgraph (control "
                    f"flow or a wrapped region), which this version does not partition; make that part of the "
                    f"forward plain tensor code"
                )
            _inline_region(gm, node, name)
    raise CaptureError(f"autoshard could not capture {name}: grad-mode regions nested more than 64 deep")


@contextlib.contextmanager
def recording_checkpoints() -> Iterator[None]:
    """While torch.export traces: the model's own torch.utils.checkpoint calls tag the nodes they make
    (meta.USER_RECOMPUTE) instead of checkpointing, which a trace has no use for; passes.recompute then
    makes each tagged region recompute in backward again, so capture drops nothing."""
    regions = itertools.count()

    def tracing_graph() -> fx.Graph | None:
        mode = get_proxy_mode()
        return mode.tracer.graph if mode is not None else None

    @contextlib.contextmanager
    def tagging() -> Iterator[None]:
        graph = tracing_graph()
        before = set(graph.nodes) if graph is not None else set()
        region = next(regions)
        yield
        for node in graph.nodes if graph is not None else ():
            if node not in before:
                node.meta[USER_RECOMPUTE] = region  # an enclosing region, finishing later, overwrites: it wins

    def non_reentrant(*_: Any, **__: Any) -> Iterator[None]:
        with tagging():
            yield

    class Reentrant:
        @staticmethod
        def apply(function: Callable[..., Any], _preserve: bool, *args: Any) -> Any:
            with tagging():
                return function(*args)

    with (
        mock.patch.object(torch.utils.checkpoint, "_checkpoint_without_reentrant_generator", non_reentrant),
        mock.patch.object(torch.utils.checkpoint, "CheckpointFunction", Reentrant),
    ):
        yield
