"""Pass records and the one manager that runs them, checking what each pass reads and writes.

A pass is a record: its name, the node.meta keys it reads and writes (each on a scope of nodes), and
its function. ``run_pass`` checks the reads before the pass runs (a missing key names the pass that
writes it) and, after it, lints every graph the pass produced and checks that each promised key is
on every node of its scope, so a pass that forgets a key fails by name (torch.fx's PassBase
requires/ensures, made declarative).

A pipeline is a tuple of ``Step`` records, each a pass with the condition under which it runs (read
off the state the pipeline carries: the plan, the graphs so far) and how it is applied; ``run_steps``
runs the steps in order, each through ``run_pass``, once or once per graph, and logs every result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from torch import fx

from autoshard.errors import MissingMetaError
from autoshard.ir.meta import COST, LAYER, NO_COST, PRODUCERS, SHAPE, NodeShape

__all__ = [
    "CALLS",
    "EVERY_NODE",
    "PARAMETERS",
    "Need",
    "Pass",
    "PassResult",
    "Scope",
    "Step",
    "all_nodes",
    "mark_inserted",
    "runtime_attr",
    "check_graph",
    "is_trainable_parameter",
    "run_pass",
    "run_steps",
]


@dataclass(frozen=True)
class Scope:
    """Which nodes of a graph a key must be on."""

    name: str
    test: Callable[[fx.GraphModule, fx.Node], bool]


def is_trainable_parameter(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A used get_attr node of a parameter that trains."""
    return node.op == "get_attr" and bool(node.users) and SHAPE in node.meta and node.meta[SHAPE].requires_grad


EVERY_NODE = Scope("every node but the output", lambda gm, node: node.op != "output")
CALLS = Scope("every call_function node", lambda gm, node: node.op == "call_function")
PARAMETERS = Scope("every used trainable parameter (get_attr)", is_trainable_parameter)


def calls_to(name: str, *functions: Any) -> Scope:
    """The call_function nodes of ``functions`` (what a transformation inserts)."""
    targets = set(functions)
    return Scope(name, lambda gm, node: node.op == "call_function" and node.target in targets)


@dataclass(frozen=True)
class Need:
    """A node.meta key on a scope of nodes."""

    key: str
    scope: Scope = EVERY_NODE


@dataclass(frozen=True)
class PassResult:
    """The outcome of one pass: whether it changed the graph, one line for the log, and what it returns.

    ``value``: the pass's product beyond node.meta (a report, a list of stage graphs);
    ``graphs``: graphs the pass made, checked for its writes instead of the graph it ran on.
    """

    name: str
    modified: bool
    summary: str
    value: Any = None
    graphs: tuple[fx.GraphModule, ...] = ()

    def __str__(self) -> str:
        return f"{self.name}: {self.summary}{' (graph changed)' if self.modified else ''}"


@dataclass(frozen=True)
class Pass:
    """One pass: ``run(gm, *args)`` returns a PassResult; ``reads`` and ``writes`` are checked around it."""

    name: str
    reads: tuple[Need, ...]
    writes: tuple[Need, ...]
    run: Callable[..., PassResult]


def mark_inserted(node: fx.Node, shape: NodeShape, layer: str) -> fx.Node:
    """The analysis keys on a node a transformation inserts: its shape, its layer, no cost."""
    node.meta.update({SHAPE: shape, LAYER: layer, COST: NO_COST})
    return node


def runtime_attr(gm: fx.GraphModule, name: str, module: Any) -> fx.Node:
    """``module`` under ``name`` (a rank binds its own there) and its get_attr, first in the graph."""
    gm.add_submodule(name, module)
    with gm.graph.inserting_before(next(iter(gm.graph.nodes))):
        return mark_inserted(gm.graph.get_attr(name), NodeShape(), "(top)")


def all_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes of ``gm`` and, in their place, those of the graphs it calls (recompute regions)."""
    out = []
    for node in gm.graph.nodes:
        sub = getattr(gm, node.target, None) if node.op == "get_attr" else None
        out += all_nodes(sub) if isinstance(sub, fx.GraphModule) else [node]
    return out


def _missing(gm: fx.GraphModule, need: Need) -> fx.Node | None:
    return next((n for n in gm.graph.nodes if need.scope.test(gm, n) and need.key not in n.meta), None)


def run_pass(p: Pass, gm: fx.GraphModule, *args: Any, **kwargs: Any) -> PassResult:
    """Run ``p`` on ``gm`` through its contract."""
    for need in p.reads:
        node = _missing(gm, need)
        if node is not None:
            producer = PRODUCERS.get(need.key, "the pass that writes it")
            raise MissingMetaError(
                f"pass {p.name} reads {need.key!r} on {need.scope.name}, but node {node.format_node()} has none; "
                f"run {producer} on this graph first"
            )
    result = p.run(gm, *args, **kwargs)
    for graph in result.graphs or (gm,):
        check_graph(graph, p.writes, p.name)
    return result


def check_graph(gm: fx.GraphModule, writes: tuple[Need, ...] = (), pass_name: str = "the last pass") -> None:
    """Lint the graph and check that every node in each promised scope carries its key."""
    gm.graph.lint()
    for need in writes:
        node = _missing(gm, need)
        if node is not None:
            raise MissingMetaError(
                f"{pass_name} promised {need.key!r} on {need.scope.name}, but node {node.format_node()} lacks it"
            )


class PipelineState(Protocol):
    """What a pipeline carries from step to step: the whole graph, the graphs its per-graph steps run on
    (pipeline stages once they are cut), and the log of results."""

    gm: fx.GraphModule
    log: list[PassResult]

    def graphs(self) -> list[fx.GraphModule]: ...


S = TypeVar("S", bound=PipelineState)


@dataclass(frozen=True)
class Step(Generic[S]):
    """One step of a pipeline: ``apply(state, gm)`` runs ``pass_`` (through ``run_pass``) on ``gm`` when
    ``when(state)`` holds; ``per_graph``: on each of ``state.graphs()`` in turn (pipeline stages), else on
    the whole graph. ``apply`` keeps what the pass returns in the state for the steps after it."""

    pass_: Pass
    when: Callable[[S], bool]
    apply: Callable[[S, fx.GraphModule], PassResult]
    per_graph: bool = False

    @property
    def name(self) -> str:
        return self.pass_.name


def run_steps(steps: tuple[Step[S], ...], state: S) -> S:
    """Run the pipeline: every step whose condition holds, in order; each result into ``state.log``."""
    for step in steps:
        if not step.when(state):
            continue
        for gm in state.graphs() if step.per_graph else [state.gm]:
            state.log.append(step.apply(state, gm))
    return state
