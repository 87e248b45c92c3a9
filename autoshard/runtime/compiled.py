"""torch.compile of one rank's graphs: autoshard's backend, every compiled graph's collectives, compile time.

Each rank graph (each pipeline stage's graph) runs through ``torch.compile``. Dynamo hands the
backend a graph whose inputs are the parameters and the batch; AOTAutograd splits it into a forward
and a backward graph, and before inductor (or aot_eager) compiles them autoshard rewrites both:

  backward  passes/graph_buckets: data-parallel buckets reduced in the graph (plain dp, one graph
            call per step): a bucket's gradients are concatenated, divided by dp and all-reduced as
            soon as the last of them is computed, and waited for just before the graph returns;
            the holder then leaves those buckets alone
  both      passes/overlap_comm: every collective issued as early, and its wait_tensor as late, as
            the graph allows (tensor parallelism's collectives, forward and backward, are
            functional collectives already: distributed/funcol.py)

What stays eager, by a graph break around it: ZeRO-3's gather and free ops and the pipeline's
receive, send and size ops (stateful runtime calls whose collectives overlap on their own), the
dropout of sharded activations (it switches random streams), and recompute regions. ZeRO-1/2's
reduce-scatters and every bucket under gradient accumulation or a pipeline still run from the
holders' gradient hooks, as in an eager step.

Counting: a compiled graph's collectives are recorded when it is compiled and counted in the
CommCounter each time it runs (forward after the call, backward when autograd reaches it).
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import fx, nn

from autoshard import passes
from autoshard.distributed.comm import CommCounter
from autoshard.errors import CompileError
from autoshard.graph_ops import graph_break
from autoshard.passes.graph_buckets import GraphBucket
from autoshard.passes.overlap_comm import COLLECTIVES
from autoshard.runtime.flat import FlatLayout
from autoshard.spec.torch_compile import TorchCompile

if TYPE_CHECKING:
    from autoshard.runtime.rank import RankRuntime

__all__ = ["CompiledGraph", "InGraphBuckets", "RankCompiler", "rank_compiler"]

_SHORT = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}


@dataclass(frozen=True)
class CompiledGraph:
    """One graph as the compiler got it after autoshard's passes: forward or backward, and its collectives."""

    kind: str  # "forward" or "backward"
    gm: fx.GraphModule
    collectives: tuple[tuple[str, int], ...]  # (counted name, bytes by CommCounter's accounting), in order

    def __str__(self) -> str:
        names = [name for name, _ in self.collectives]
        counts = ", ".join(f"{names.count(n)} {n}" for n in dict.fromkeys(names)) or "no collectives"
        return f"{self.kind}: {len(self.gm.graph.nodes)} nodes, {counts}"


@dataclass
class InGraphBuckets:
    """The data-parallel buckets compiled backward graphs reduce: the holder skips the ids in ``reduced``."""

    layouts: dict[int, FlatLayout]
    dp: int
    group_name: str
    dtype: torch.dtype | None  # the reduction dtype (None: the gradients' own)
    reduced: set[int] = field(default_factory=set)
    seen: set[int] = field(default_factory=set)  # ids of parameters some compiled graph read

    def plan(self, inputs: Sequence[Any]) -> list[GraphBucket]:
        """The buckets a graph with these inputs reduces: those reduced already, and new ones wholly inside it
        (a parameter another graph read first keeps its bucket with the holder)."""
        index = {id(t): i for i, t in enumerate(inputs) if isinstance(t, nn.Parameter)}
        out = []
        for g, layout in self.layouts.items():
            ids = [id(p) for p in layout.params]
            if g not in self.reduced and (not all(i in index for i in ids) or any(i in self.seen for i in ids)):
                continue
            members = [(index[id(p)], tuple(s)) for p, s in zip(layout.params, layout.shapes) if id(p) in index]
            if members:
                self.reduced.add(g)
                out.append(GraphBucket(g, tuple(i for i, _ in members), tuple(s for _, s in members)))
        self.seen.update(index)
        return out


def _collectives(gm: fx.GraphModule, prefixes: dict[str, str]) -> tuple[tuple[str, int], ...]:
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in COLLECTIVES:
            continue
        op = node.target._overloadpacket.__name__
        value, first = node.meta["val"], node.args[0].meta["val"]
        nbytes = {"all_reduce": 2 * _nbytes(value), "all_gather_into_tensor": _nbytes(value)}.get(op, _nbytes(first))
        out.append((prefixes.get(node.args[-1], "") + _SHORT.get(op, op), nbytes))
    return tuple(out)


def _nbytes(value: Any) -> int:
    tensors = value if isinstance(value, (list, tuple)) else [value]
    return sum(t.numel() * t.element_size() for t in tensors)


class RankCompiler:
    """torch.compile for every graph of one rank, with autoshard's backend where it rewrites the graphs."""

    def __init__(
        self, request: TorchCompile, comm: CommCounter, prefixes: dict[str, str], buckets: InGraphBuckets | None
    ) -> None:
        """``prefixes``: process group name -> the prefix its collectives are counted under ("tp_", "")."""
        self.request = request
        self.comm = comm
        self.prefixes = prefixes
        self.buckets = buckets
        self.graphs: list[CompiledGraph] = []
        self.seconds = 0.0  # spent in AOTAutograd and the backend (dynamo's tracing excluded)

    def compile(self, gm: nn.Module, outputs_need_grad: bool = True) -> Callable[..., Any]:
        """``outputs_need_grad``: False for a graph whose outputs after the loss are only read (the model's
        outputs of a whole training graph): they leave the compiled graph detached, so its backward graph
        takes no gradient for them (autograd would hand it zeros the size of the logits)."""
        graph_break.enable()
        request = self.request
        backend = self._backend if request.rewrites_graphs else request.backend
        options = dict(request.options) if not request.rewrites_graphs else None
        module = gm if outputs_need_grad else _LossKeepsGrad(gm)
        return torch.compile(
            module, backend=backend, dynamic=request.dynamic, fullgraph=request.fullgraph, options=options or None
        )

    def check_compiled(self) -> None:
        """After the first step: dynamo handed autoshard's backend a graph. Dynamo runs a frame eagerly, with
        only a warning, past its recompile limit or where its errors are suppressed: the request would be dropped."""
        if self.request.rewrites_graphs and not self.graphs:
            raise CompileError(
                f"{self.request} compiled no graph of this rank in its first step: dynamo ran them eagerly (its "
                f"recompile limit reached, torch._dynamo.config.recompile_limit, or its errors suppressed); "
                f"TORCH_LOGS=recompiles says why, or pass torch_compile=False to train eagerly"
            )

    # ---- the backend --------------------------------------------------------------------------------
    def _backend(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        start = time.perf_counter()
        buckets = self.buckets.plan(example_inputs) if self.buckets is not None else []
        n_inputs = len(example_inputs)

        def rewrite(graph: fx.GraphModule, backward: bool) -> fx.GraphModule:
            began = time.perf_counter()
            if backward and buckets:
                outputs = graph.graph.output_node().args[0]
                if len(outputs) != n_inputs:  # the buckets were promised to the graph: fail rather than skip them
                    raise RuntimeError(f"backward graph returns {len(outputs)} values for {n_inputs} inputs")
                live = [_live(b, outputs) for b in buckets]
                b = self.buckets
                passes.run_pass(passes.graph_buckets.PASS, graph, [x for x in live if x], b.dp, b.group_name, b.dtype)
            passes.run_pass(passes.overlap_comm.PASS, graph)
            record = CompiledGraph("backward" if backward else "forward", graph, _collectives(graph, self.prefixes))
            self.graphs.append(record)
            if backward and not compiling[0]:
                self.seconds += time.perf_counter() - began  # compiled lazily, at the first backward
            return graph

        def counted(compiled: Any, record: CompiledGraph) -> Any:
            return _Counted(compiled, record, self.comm)

        compiling = [True]
        if self.request.backend == "inductor":
            from torch._inductor.compile_fx import compile_fx, compile_fx_inner

            def inner(graph: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
                graph = rewrite(graph, bool(kwargs.get("is_backward")))
                return counted(compile_fx_inner(graph, inputs, **kwargs), self.graphs[-1])

            patches = {"fallback_random": True, **dict(self.request.options)}  # dropout masks as eager draws them
            fn = compile_fx(
                gm, example_inputs, inner_compile=inner, config_patches=patches, decompositions=_decompositions(patches)
            )
        else:
            from functorch.compile import make_boxed_func
            from torch._dynamo.backends.common import aot_autograd

            def boxed(graph: fx.GraphModule, backward: bool) -> Any:
                graph = rewrite(graph, backward)
                return counted(make_boxed_func(graph.forward), self.graphs[-1])

            fn = aot_autograd(
                fw_compiler=lambda graph, _: boxed(graph, False), bw_compiler=lambda graph, _: boxed(graph, True)
            )(gm, example_inputs)
        compiling[0] = False
        self.seconds += time.perf_counter() - start
        return fn


# Left to their ATen kernels: inductor's decomposition of nll_loss_backward scatters -1 into zeros, which it
# fuses into a comparison of every class index with the target over the whole (rows x classes) grid, one more
# pass over the logits' size; the kernel writes one value per row.
_KEPT_WHOLE = (torch.ops.aten.nll_loss_backward.default, torch.ops.aten.nll_loss2d_backward.default)


def _decompositions(patches: dict[str, Any]) -> dict[Any, Any]:
    """Inductor's decomposition table under ``patches``, less the ops in _KEPT_WHOLE (lowered to their kernels)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.lowering import lowerings, make_fallback, require_contiguous

    with inductor_config.patch(patches):
        table = dict(select_decomp_table())
    for op in _KEPT_WHOLE:
        table.pop(op, None)
        # Registered as a fallback up front: inductor's implicit fallback for an op that has a decomposition is an
        # error where the CI environment variable is set. Other compiles still decompose the op before lowering.
        if op not in lowerings:
            make_fallback(op, layout_constraint=require_contiguous, warn=False, override_decomp=True)
    return table


class _LossKeepsGrad(nn.Module):
    """A training graph whose outputs after the first (the loss) come out detached."""

    def __init__(self, gm: nn.Module) -> None:
        super().__init__()
        self.gm = gm
        # A forward with a code object of its own: dynamo keeps its compiled code per code object, and one
        # shared by every program would reach its recompile limit at a process's ninth compiled program
        # (the graph's type differs each time), which would then run eagerly, the request dropped.
        forward = type(self).forward
        own = types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__)
        self.forward = types.MethodType(own, self)

    def forward(self, *args: Any) -> tuple[Any, ...]:
        loss, *outputs = self.gm(*args)
        return (loss, *(o.detach() if isinstance(o, torch.Tensor) else o for o in outputs))


class _Counted:
    """A compiled forward or backward graph that counts its collectives in the CommCounter each time it runs
    (everything else, such as inductor's calling convention, is the compiled graph's own)."""

    def __init__(self, compiled: Any, record: CompiledGraph, comm: CommCounter) -> None:
        self._compiled, self._record, self._comm = compiled, record, comm
        # AOTAutograd passes the arguments as one list, which the graph empties as it goes (a saved activation
        # is freed after its last use). An attribute of the instance: AOTAutograd's wrappers copy __dict__.
        self._boxed_call = True

    def __call__(self, *args: Any) -> Any:
        flat = args[0] if len(args) == 1 and isinstance(args[0], list) else list(args)
        out = self._compiled(flat) if getattr(self._compiled, "_boxed_call", False) else self._compiled(*flat)
        for name, nbytes in self._record.collectives:
            self._comm.count(name, nbytes)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._compiled, name)


def _live(bucket: GraphBucket, outputs: Sequence[Any]) -> GraphBucket | None:
    """The bucket without members whose gradient the graph does not produce (None)."""
    keep = [(i, s) for i, s in zip(bucket.outputs, bucket.shapes) if outputs[i] is not None]
    return GraphBucket(bucket.gid, tuple(i for i, _ in keep), tuple(s for _, s in keep)) if keep else None


def rank_compiler(rt: RankRuntime) -> RankCompiler:
    """The compiler of a RankRuntime's graphs: buckets reduced in the backward graph where one graph call
    completes every gradient (plain dp, no pipeline, no accumulation) and the backend rewrites graphs."""
    plan, request = rt.plan, rt.compiled.torch_compile
    prefixes = {rt.tp.group_name: "tp_"} if rt.tp is not None else {}
    buckets = None
    whole = plan.zero == 0 and plan.pp == 1 and plan.microbatches == 1 and plan.dp * plan.cp > 1
    if whole and request.rewrites_graphs and rt.dp_group is not None:
        # Expert groups reduce over the ranks holding the same experts, outside the graph.
        dense = {g: layout for g, layout in rt.holder.layouts.items() if g not in rt.holder.comms}
        buckets = InGraphBuckets(dense, plan.dp * plan.cp, rt.dp_group.group_name, plan.reduce_dtype)
        rt.holder.in_graph = buckets.reduced
    return RankCompiler(request, rt.comm, prefixes, buckets)
