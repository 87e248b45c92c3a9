"""``autoshard.verify``: the compiled program against single-device training, node by node.

The reference is the unrewritten captured graph on one device (captured from a copy of the model
before compile rewrites and shards it; node names are shared with the rewritten graphs). Every rank
runs one training step with its graphs under a recording ``fx.Interpreter``; the reference runs on
exactly the rows each graph call saw (the rank's dp rows, then its microbatch). Rank 0 joins each
node's values across the tp group by the node's recorded placement (``autoshard.tp``: replicated,
shard, partial sum), compares them in graph order, stage by stage, and then compares the global loss
and every parameter after the step (with the default optimizer, SGD at lr 1, a parameter's change is
minus its gradient, so that check is the check of every gradient).

What is compared: every original node (activations, the loss, parameters as read), the output of
every collective the tensor-parallel rewrite inserted (its value is the node it redistributes),
every ZeRO-3 gather (the parameter it gathers), every pipeline receive (the value the previous
stage computed). Not an expert region under ep (its rows are those routed to the rank's experts from
every ep rank, on the rank's experts): the values before dispatch and after combine are compared, and
every expert weight after the step. Under cp each rank's value of a node is compared with its tokens of the
device's (``autoshard.cp``: the shard's dimension, flattened [rows x tokens] included); a partial sum over
each rank's tokens is not (the loss after its reduction is). Before anything runs, every stage's receives
are matched with the previous stage's sends: a missing send would hang the pipeline, so it is reported
instead.

Only the graph's structure and the recorded placements are read, never how a collective is
implemented. Random ops (dropout) draw differently on ranks and on one device: verify models
without them (or with p=0).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import fx, nn

from autoshard.capture import capture
from autoshard.capture.call import CallSpec
from autoshard.graph_ops.context import chunk_positions
from autoshard.inspection.node_values import (
    Recorder,
    join_over_tp,
    max_error,
    module_path,
    op_name,
    origin,
    placement_str,
    send_of,
)
from autoshard.ir.meta import CP, EXPERT, MODEL_PREFIX, PIPE, TP
from autoshard.ir.ops import packet
from autoshard.ir.placements import Replicate, Shard
from autoshard.runtime.pipeline import split_microbatches

if TYPE_CHECKING:
    from autoshard.program import Program
    from autoshard.spec.mesh import Mesh
    from autoshard.spec.plan import Plan

__all__ = ["NodeCheck", "Reference", "VerifyReport", "check", "verify"]

aten = torch.ops.aten
UNINITIALISED = {aten.empty_like, aten.empty, aten.new_empty, aten.empty_strided}


@dataclass(frozen=True)
class NodeCheck:
    """One compared value: a node of a rank's graph (or the loss, or a parameter after the step)."""

    node: str  # the rank graph's node name (for a parameter: the reference's get_attr node)
    module: str  # the original module path
    op: str
    kind: str  # activation, collective, gather, boundary, loss, parameter, structure
    stage: int
    max_error: float
    tolerance: float
    ranks: tuple[int, ...] = ()
    microbatch: int = 0
    placement: str = "R"
    reference: str = ""  # the reference node it is compared with
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.max_error <= self.tolerance

    def __str__(self) -> str:
        where = f"stage {self.stage}, ranks {list(self.ranks)}, microbatch {self.microbatch}"
        than = f" vs {self.reference}" if self.reference and self.reference != self.node else ""
        text = f"{self.kind} node {self.node}{than} ({self.op}, module {self.module or '(top)'}; {where})"
        if self.kind == "structure":
            return f"{text}: {self.detail}"
        return f"{text}: max error {self.max_error:.3g} > tolerance {self.tolerance:.3g} [{self.placement}]"


@dataclass(frozen=True)
class VerifyReport:
    """Every check in order (graph order, stage by stage; then the loss and the parameters)."""

    checks: tuple[NodeCheck, ...]
    loss: float
    reference_loss: float
    skipped: int = 0  # nodes with no counterpart in the reference (sizes, tuples, runtime handles)

    @property
    def first(self) -> NodeCheck | None:
        """The first check that failed, or None when every value matches."""
        return next((c for c in self.checks if not c.ok), None)

    @property
    def ok(self) -> bool:
        return self.first is None

    def to_dict(self) -> dict[str, Any]:
        first = self.first
        return {
            "ok": self.ok,
            "checked": len(self.checks),
            "skipped": self.skipped,
            "loss": self.loss,
            "reference_loss": self.reference_loss,
            "first_divergence": None if first is None else {**first.__dict__, "ok": False},
            "failed": sum(not c.ok for c in self.checks),
        }

    def __str__(self) -> str:
        counts: dict[str, int] = {}
        for c in self.checks:
            counts[c.kind] = counts.get(c.kind, 0) + 1
        summary = ", ".join(f"{n} {kind}" for kind, n in counts.items())
        head = f"verify: loss {self.loss:.6f} vs single-device {self.reference_loss:.6f}; checked {summary}"
        if self.ok:
            worst = max((c.max_error for c in self.checks), default=0.0)
            return f"{head}\nall match (largest error {worst:.3g})"
        bad = sum(not c.ok for c in self.checks)
        return f"{head}\n{bad} diverge; the first: {self.first}"


@dataclass
class Reference:
    """The unrewritten graph of a copy of the model, captured before compile shards the original."""

    gm: fx.GraphModule
    model: nn.Module
    call: CallSpec
    optimizer: Any  # the optimizer factory both sides step with
    nodes: dict[str, fx.Node] = field(default_factory=dict)
    by_target: dict[str, str] = field(default_factory=dict)  # get_attr target -> node name

    @classmethod
    def capture(cls, model: nn.Module, example_inputs: Any, example_kwargs: dict | None = None,
                loss_fn: Any = None, example_target: Any = None, optimizer: Any = None) -> Reference:  # fmt: skip
        """Call before ``compile(model, ...)``, which shards the model's tensors in place; compile with
        ``optimizer=reference.optimizer``."""
        twin = copy.deepcopy(model)
        captured = capture(twin, example_inputs, example_kwargs, loss_fn, example_target)
        ref = cls(captured.gm, twin, captured.call, optimizer or sgd_lr1)
        ref.nodes = {n.name: n for n in captured.gm.graph.nodes}
        ref.by_target = {n.target: n.name for n in captured.gm.graph.nodes if n.op == "get_attr"}
        return ref

    def make_optimizer(self) -> torch.optim.Optimizer:
        return self.optimizer(self.model.parameters())


def structure_problems(program: Program) -> list[NodeCheck]:
    """Receives with no matching send on the previous stage (a pipeline that would wait forever)."""
    problems = []
    stages = {s.stage: s.gm for s in program.compiled.stages}
    for stage, gm in stages.items():
        for n in gm.graph.nodes:
            slot = n.meta.get(PIPE)
            if slot is not None and slot.direction == "recv" and send_of(stages.get(slot.peer), slot) is None:
                problems.append(
                    NodeCheck(
                        n.name, module_path(n), op_name(n), "structure", stage, float("inf"), 0.0,
                        detail=f"stage {slot.peer} has no send for slot {slot.slot}, which this receive waits for",
                    )
                )  # fmt: skip
    return problems


# ---- the check, on every rank ------------------------------------------------------------------------------
def _slices(flat: list[torch.Tensor], shapes: list[Any], parts: int) -> list[list[torch.Tensor]]:
    return split_microbatches(flat, shapes, parts)[0] if parts > 1 else [flat]


def check(program: Program, reference: Reference, inputs: tuple = (), kwargs: dict | None = None, target: Any = None,
          atol: float = 1e-5, rtol: float = 1e-4) -> VerifyReport:  # fmt: skip
    """One training step of ``program`` on the global batch against ``reference``; call on every rank
    (the reference's model must be the model as it was before compile, with the same optimizer)."""
    kwargs = kwargs or {}
    runtime = program._runtime("verify")
    problems = structure_problems(program)
    if problems:  # before any rank communicates: a missing send would hang every rank
        return VerifyReport(tuple(problems), float("nan"), float("nan"))
    call = program.compiled.captured.call
    flat = call.flatten_inputs(inputs, kwargs) + call.flatten_target(target)
    shapes = runtime.input_shapes
    local = _slices(flat, shapes, program.plan.dp)[program.mesh.coords(program.rank)["dp"]]
    sinks: dict[int, dict[str, list[Any]]] = {}
    saved = {}
    for stage, gm in runtime.graphs.items():
        sink = sinks[stage] = {}
        saved[stage] = gm.__dict__.get("forward")
        gm.forward = (lambda g, s: lambda *args: Recorder(g, s).run(*args))(gm, sink)
    try:
        loss = program.step(*local[: call.n_args], target=_target(call, local), **_kwargs(call, local))
    finally:
        for stage, gm in runtime.graphs.items():
            del gm.forward
            if saved[stage] is not None:
                gm.forward = saved[stage]
    state = program.full_state_dict()
    group = runtime.world_group
    gathered: list[Any] = [None] * program.mesh.size if program.rank == 0 else None
    dist.gather_object(sinks, gathered, dst=0, group=group)
    report = None
    if program.rank == 0:
        report = _compare(program, reference, flat, shapes, gathered, loss, state, atol, rtol)
    box = [report]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _target(call: Any, local: list[torch.Tensor]) -> Any:
    if call.target_spec is None:
        return None
    from torch.utils import _pytree as pytree

    return pytree.tree_unflatten(local[call.n_inputs :], call.target_spec)


def _kwargs(call: Any, local: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return dict(zip(call.tensor_kwargs, local[call.n_args : call.n_inputs]))


def _reference_values(reference: Reference, rows: list[torch.Tensor]) -> dict[str, Any]:
    sink: dict[str, list[Any]] = {}
    with torch.no_grad():
        Recorder(reference.gm, sink).run(*rows)
    return {name: values[0] for name, values in sink.items()}


def _compare(program: Program, reference: Reference, flat: list[torch.Tensor], shapes: list[Any], gathered: list[Any],
             loss: float, state: dict[str, torch.Tensor], atol: float, rtol: float) -> VerifyReport:  # fmt: skip
    plan, mesh, schedule = program.plan, program.mesh, program.schedule
    stages = {s.stage: s.gm for s in program.compiled.stages} or {0: program.compiled.captured.gm}
    per_dp = _slices(flat, shapes, plan.dp)
    memo: dict[tuple[int, int], dict[str, Any]] = {}
    seq = program.plan_report.sizes.get("S", 0)

    def ref_values(dp: int, mb: int) -> dict[str, Any]:
        if (dp, mb) not in memo:
            memo[(dp, mb)] = _reference_values(reference, _slices(per_dp[dp], shapes, plan.microbatches)[mb])
        return memo[(dp, mb)]

    checks: list[NodeCheck] = []
    skipped = 0
    for stage in sorted(stages):
        gm = stages[stage]
        pp = schedule.rank_of(stage) if schedule is not None else 0
        if schedule is not None:
            mbs = [a.microbatch for a in schedule.ranks[pp] if a.kind == "F" and a.stage == stage]
        else:
            mbs = list(range(plan.microbatches))
        for node in gm.graph.nodes:
            if node.op == "output":
                continue
            source, kind = origin(node, reference, stages)
            # An expert region's values are this rank's experts' (on rows from every ep rank): no device has them.
            # An empty tensor's values are whatever memory held (a permutation's inverse, filled in place next).
            uninitialised = node.op == "call_function" and packet(node.target) in UNINITIALISED
            if source is None or not node.users or (mesh.tp > 1 and TP not in node.meta) or EXPERT in node.meta:
                skipped += 1
                continue
            if uninitialised:
                continue
            tp_meta = node.meta.get(TP)
            placement = tp_meta.out if tp_meta is not None else None
            tokens = node.meta[CP].out if mesh.cp > 1 and CP in node.meta else None
            if mesh.cp > 1 and not (isinstance(tokens, Shard) or tokens == _WHOLE):
                skipped += 1  # a partial sum over each rank's tokens (a loss before its all-reduce)
                continue
            for dp, cp in ((d, c) for d in range(mesh.dp) for c in range(mesh.cp)):
                ranks = [mesh.rank_of(pp=pp, dp=dp, cp=cp, tp=t) for t in range(mesh.tp)]
                for call, mb in enumerate(mbs):
                    values = [gathered[r][stage].get(node.name, [None] * (call + 1))[call] for r in ranks]
                    theirs = _tokens_of(ref_values(dp, mb).get(source), tokens, cp, mesh.cp, seq)
                    if theirs is None or any(v is None for v in values):
                        continue
                    errors = [max_error(v, theirs, atol, rtol) for v in join_over_tp(values, placement)]
                    error, tol = max(errors, key=lambda et: et[0] - et[1])
                    checks.append(
                        NodeCheck(node.name, module_path(node), op_name(node), kind, stage, error, tol,
                                  tuple(ranks), mb, placement_str(placement), source)
                    )  # fmt: skip
                    if not checks[-1].ok:  # the first divergence decides; later ones only follow from it
                        return _finish(program, reference, checks, flat, loss, state, atol, rtol, skipped)
    return _finish(program, reference, checks, flat, loss, state, atol, rtol, skipped)


_WHOLE = Replicate()


def _tokens_of(value: Any, placement: Any, rank: int, degree: int, seq: int) -> Any:
    """A cp rank's tokens of a reference value along its shard (every token where the rank holds them all)."""
    if not isinstance(placement, Shard) or not isinstance(value, torch.Tensor):
        return value
    index = chunk_positions(seq, rank, degree, value.device)
    if value.shape[placement.dim] == seq:
        return value.index_select(placement.dim, index)
    rows = value.unflatten(placement.dim, (-1, seq))  # [rows x tokens], the tokens innermost
    return rows.index_select(placement.dim + 1, index).flatten(placement.dim, placement.dim + 1)


def _finish(program: Program, reference: Reference, checks: list[NodeCheck], flat: list[torch.Tensor], loss: float,
            state: dict[str, torch.Tensor], atol: float, rtol: float, skipped: int) -> VerifyReport:  # fmt: skip
    """The reference's own step on the global batch: the loss, then every parameter after the step."""
    ref_loss = reference.gm(*flat)[0]
    ref_loss.backward()
    reference.make_optimizer().step()
    error, tol = max_error(torch.tensor(loss, dtype=torch.float64), ref_loss.detach().double(), atol, rtol)
    checks.append(NodeCheck("loss", "", "mean over dp of the local mean losses", "loss", -1, error, tol))
    for key, value in reference.model.state_dict().items():
        mine = state.get(key)
        name = reference.by_target.get(MODEL_PREFIX + key, key)
        error, tol = max_error(mine.to(value.dtype) if mine is not None else None, value, atol, rtol)
        checks.append(NodeCheck(name, key, "parameter after the step", "parameter", -1, error, tol))
    return VerifyReport(tuple(checks), float(loss), float(ref_loss.detach()), skipped)


def sgd_lr1(params: Any) -> torch.optim.Optimizer:
    """verify's default optimizer: a parameter's change in the step is minus its gradient."""
    return torch.optim.SGD(params, lr=1.0)


def verify(model: nn.Module, mesh: Mesh | int, example_inputs: Any, example_kwargs: dict | None = None, *,
           loss_fn: Any = None, example_target: Any = None, optimizer: Any = None,
           plan: str | Plan | dict[str, Any] = "auto", atol: float = 1e-5, rtol: float = 1e-4,
           ranks: Any = None) -> VerifyReport:  # fmt: skip
    """Compile ``model`` for ``mesh`` and compare one training step, node by node, with single-device training
    on the same global batch (``example_inputs``, ``example_kwargs``, ``example_target``).

    Under a process group (torchrun) every rank calls it; otherwise it starts ``mesh``'s ranks as local gloo
    processes (or uses the ``LocalRanks`` pool ``ranks``); then the model, loss_fn and optimizer must pickle.
    ``optimizer`` defaults to SGD at lr 1, so that the parameters after the step check every gradient.
    Returns the report (the same on every rank): ``report.ok``, ``report.first`` (the first divergence).
    """
    args = (model, mesh, example_inputs, example_kwargs, loss_fn, example_target, optimizer, plan, atol, rtol)
    if dist.is_available() and dist.is_initialized():
        return _verify_rank(dist.get_rank(), dist.get_world_size(), *args)
    from autoshard.launch import LocalRanks
    from autoshard.spec.mesh import Mesh

    world = mesh.size if isinstance(mesh, Mesh) else int(mesh)
    if ranks is not None:
        if ranks.world_size != world:
            raise ValueError(f"ranks has {ranks.world_size} processes but the mesh has {world} ranks")
        return ranks.run(_verify_rank, *args)[0]
    with LocalRanks(world) as pool:
        return pool.run(_verify_rank, *args)[0]


def _verify_rank(rank: int, world: int, model: nn.Module, mesh: Mesh | int, example_inputs: Any, example_kwargs: Any,
                 loss_fn: Any, example_target: Any, optimizer: Any, plan: str | Plan | dict[str, Any], atol: float,
                 rtol: float) -> VerifyReport:  # fmt: skip
    from autoshard.compiler import compile

    # Tensors sent to LocalRanks' processes arrive in shared memory, one storage for every rank: each
    # rank's step would write into the others' parameters.
    model = copy.deepcopy(model)
    reference = Reference.capture(model, example_inputs, example_kwargs, loss_fn, example_target, optimizer)
    program = compile(
        model, mesh, example_inputs, example_kwargs, loss_fn, reference.optimizer, plan,
        example_target=example_target, timeout=120.0,
    )  # fmt: skip
    inputs = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    tensor_kwargs = {k: v for k, v in (example_kwargs or {}).items() if isinstance(v, torch.Tensor)}
    return check(program, reference, tuple(inputs), tensor_kwargs, example_target, atol, rtol)
