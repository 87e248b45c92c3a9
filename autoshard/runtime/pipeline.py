"""Pipeline runtime: this rank's stage graphs run in the schedule's order, boundaries over send/recv.

A forward action ``F(s, m)`` receives stage ``s``'s boundary tensors for microbatch ``m`` from the
rank of stage ``s - 1``, runs the stage graph (its ``recv`` nodes read them, its ``send`` nodes
hand over what goes on) and sends those to the rank of stage ``s + 1``. The backward action
``B(s, m)`` receives the gradients of what was sent, runs autograd from the stage's sent tensors
(the last stage: from its loss, scaled by 1/microbatches so that gradients are the mean over
microbatches) and sends back the gradients of what was received. In a zero-bubble schedule B holds
the weight gradients of the stage's matmuls back (graph_ops/weight_grad.py) and ``W(s, m)`` computes
them. The stage's gradient reduction is armed at its last B (only its last W's weight gradients then
count as arrivals), or under ZeRO-3 at its last W. Two stages of one rank (the V placement's turn)
hand over through a mailbox instead of send and receive.

Sends are asynchronous and receives are posted one action ahead, so a rank waits only for data it
needs now; the schedule's validator has shown that no rank waits forever. Every boundary tensor
has its own tag, and its shape is known before it arrives: the stage graphs carry symbolic shapes,
evaluated in the microbatch's sizes (``B``, ``S``), which every rank reads off its inputs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import sympy
import torch
import torch.distributed as dist

from autoshard.distributed.tracing import span
from autoshard.errors import InputError
from autoshard.graph_ops.pipeline import PipelineChannel
from autoshard.graph_ops.recompute import callable_name, input_recomputed
from autoshard.graph_ops.weight_grad import (
    WEIGHT_GRADS,
    DeferredWeightGrad,
    GradSlot,
    matmul_deferring_weight_grad,
)
from autoshard.ir.meta import TensorShape, evaluate_expr
from autoshard.passes.pipeline_stages import StageGraph
from autoshard.spec.schedules import Action, Schedule

if TYPE_CHECKING:
    from autoshard.distributed.comm import CommCounter

__all__ = ["PipelineRunner", "PipelineStats", "split_microbatches"]


def split_microbatches(
    flat: list[torch.Tensor], input_shapes: list[TensorShape | None], m: int
) -> tuple[list[list[torch.Tensor]], dict[str, int]]:
    """Cut every batch-major input into ``m`` microbatches; bind the size symbols of one microbatch."""
    per_mb: list[list[torch.Tensor]] = [[] for _ in range(m)]
    sizes: dict[str, int] = {}
    split_any = False
    for index, (tensor, shape) in enumerate(zip(flat, input_shapes)):
        first = shape.sizes[0] if shape is not None and shape.sizes else None
        batch_major = isinstance(first, sympy.Symbol) and first.name == "B"
        if batch_major:
            rows = tensor.shape[0]
            if rows % m:
                raise InputError(
                    f"input {index} has {rows} rows on this rank, not divisible into {m} microbatches; "
                    f"use a local batch that is a multiple of {m} (or plan microbatches dividing it)"
                )
            chunks = tensor.split(rows // m)
        else:
            chunks = [tensor] * m
        split_any = split_any or batch_major
        for mb, chunk in enumerate(chunks):
            per_mb[mb].append(chunk)
        if shape is not None:
            for dim, expr in enumerate(shape.sizes):
                if isinstance(expr, sympy.Symbol):
                    sizes[expr.name] = chunks[0].shape[dim]
    if m > 1 and not split_any:
        raise InputError(f"no input has the batch dimension B first, so the batch cannot be cut into {m} microbatches")
    return per_mb, sizes


# ---- the schedule runner ------------------------------------------------------------------------
@dataclass
class PipelineStats:
    """One step of this rank, measured: wall time of the schedule, time spent computing, activations held."""

    step_seconds: float = 0.0
    busy_seconds: float = 0.0
    peak_in_flight: int = 0
    microbatch_sizes: dict[str, int] = field(default_factory=dict)  # symbol values of one microbatch
    events: list[tuple[str, float, float]] = field(default_factory=list)  # (action, start s, end s) of the step
    started_at: float = 0.0  # time.perf_counter() at the step's start: one clock for every rank of a host

    @property
    def idle_fraction(self) -> float:
        return 1.0 - self.busy_seconds / self.step_seconds if self.step_seconds > 0 else 0.0


@dataclass
class _Held:
    """A forward's boundary tensors, kept until its backward."""

    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    loss: torch.Tensor | None = None


@dataclass
class _Posted:
    buffers: list[torch.Tensor]
    works: list[Any] = field(default_factory=list)
    local: list[int] = field(default_factory=list)  # tags handed over inside this rank (the V's turn)
    mailbox: dict[int, torch.Tensor] = field(default_factory=dict)

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        self.works.clear()
        if self.local:  # sent by an earlier action of this rank, which has run by now
            self.buffers = [self.mailbox.pop(tag) for tag in self.local]
            self.local = []
        return self.buffers


class PipelineRunner:
    """Runs this rank's actions of a schedule for one step."""

    def __init__(
        self,
        stages: dict[int, StageGraph],
        schedule: Schedule,
        pp_rank: int,
        peer: Callable[[int], int],
        channel: PipelineChannel,
        input_shapes: list[TensorShape | None],
        group: dist.ProcessGroup | None,
        max_slots: int,
        comm: CommCounter | None = None,
        device: torch.device | None = None,
        before_action: Callable[[Action], None] | None = None,
        calls: dict[int, Callable[..., Any]] | None = None,
        arm_at_last_w: bool = False,
        grad_slot: GradSlot | None = None,
    ) -> None:
        """``peer(stage)``: the global rank running ``stage`` in this rank's pipeline.

        ``max_slots``: the most tensors crossing any one cut (the same on every rank: tags derive from it).
        ``comm``: a CommCounter that records the bytes sent; ``device``: where received tensors live;
        ``before_action``: called before each action runs (the runtime tells single-device dropout masks
        the microbatch); ``calls``: what runs each stage's graph (torch.compile's wrapper of it; default
        the graph itself); ``arm_at_last_w``: where backward is split, arm a stage's reduction before its last
        W rather than its last B (ZeRO-3, whose reduce-scatter sums what was added until then: once a step);
        ``grad_slot``: the holder's place for a weight's first gradient of a step (``Holder.grad_slot``).
        """
        self.grad_slot = grad_slot
        self.splits = schedule.splits_backward  # B holds weight gradients back for W
        # Stage graphs with deferring matmuls under a schedule with no W (an eager pipeline): each B adds its
        # weight gradients itself, into .grad in place (WEIGHT_GRADS.apply: one fused multiply-add a weight,
        # no product of the weight's size allocated, written and added), before it sends: moving them after the
        # send would be another schedule (1F1B with a W after each B, which a custom schedule can ask for).
        deferring = callable_name(matmul_deferring_weight_grad)  # (as an input_recomputed call names it)
        self.fused = not self.splits and any(
            node.target is matmul_deferring_weight_grad
            or (node.target is input_recomputed and node.args[0] == deferring)
            for io in stages.values()
            for node in io.gm.graph.nodes
        )
        self.arm_at_last_w = arm_at_last_w and (self.splits or self.fused)
        self.before_action = before_action or (lambda action: None)
        self.calls = calls or {}
        self.comm = comm
        self.device = device or torch.device("cpu")
        self.stages = stages
        self.schedule = schedule
        self.actions = schedule.ranks[pp_rank]
        self.peer = peer
        self.channel = channel
        self.input_shapes = input_shapes
        self.group = group
        self.n_stages = schedule.n_stages
        self.microbatches = schedule.microbatches
        self.max_slots = max_slots
        self.stats = PipelineStats()
        self._shape_cache: dict[tuple, list[int]] = {}  # (symbolic sizes, symbol values) -> sizes
        self._sends: list[Any] = []  # this step's isend handles, waited for at its end
        # Consecutive stages on one rank (the V placement's turn) hand over through a mailbox, not send/recv.
        self.own = peer(self.actions[0].stage) if self.actions else -1
        self._mailbox: dict[int, torch.Tensor] = {}
        last_backward, last_w = {}, {}
        for i, action in enumerate(self.actions):
            if action.kind == "B":
                last_backward[action.stage] = i
            elif action.kind == "W":
                last_w[action.stage] = i
        self.final_backward = set(last_backward.values())  # positions of each stage's last backward
        self.final_w = set(last_w.values())  # and of its last W, where backward is split

    # -- inputs ---------------------------------------------------------------------------------
    def split(self, flat: list[torch.Tensor]) -> tuple[list[list[torch.Tensor]], dict[str, int]]:
        return split_microbatches(flat, self.input_shapes, self.microbatches)

    # -- point to point ---------------------------------------------------------------------------
    def _tag(self, boundary: int, backward: bool, microbatch: int, slot: int) -> int:
        return ((boundary * 2 + backward) * self.microbatches + microbatch) * self.max_slots + slot

    def _post(
        self, action: Action, sizes: dict[str, int], stages: dict[int, StageGraph] | None = None
    ) -> _Posted | None:
        """Post the receives an action needs: activations for F, gradients of sent tensors for B."""
        io = (stages or self.stages)[action.stage]
        if action.kind == "W":
            return None  # local: what its B held back
        if action.kind == "F":
            if action.stage == 0:
                return None
            shapes, src, boundary = io.recv, self.peer(action.stage - 1), action.stage - 1
        else:
            if action.stage == self.n_stages - 1:
                return None
            shapes = tuple(s for s in io.send if s.requires_grad)
            src, boundary = self.peer(action.stage + 1), action.stage
        if src == self.own:
            tags = [self._tag(boundary, action.kind == "B", action.microbatch, slot) for slot in range(len(shapes))]
            return _Posted([], local=tags, mailbox=self._mailbox)
        posted = _Posted([torch.empty(self._concrete(s, sizes), dtype=s.dtype, device=self.device) for s in shapes])
        for slot, buffer in enumerate(posted.buffers):
            tag = self._tag(boundary, action.kind == "B", action.microbatch, slot)
            posted.works.append(dist.irecv(buffer, src=src, group=self.group, tag=tag))
        return posted

    def _concrete(self, shape: TensorShape, sizes: dict[str, int]) -> list[int]:
        key = (shape.sizes, tuple(sorted(sizes.items())))
        if key not in self._shape_cache:
            self._shape_cache[key] = [evaluate_expr(d, sizes) for d in shape.sizes]
        return self._shape_cache[key]

    def _send(self, tensors: list[torch.Tensor], dst_stage: int, boundary: int, backward: bool, mb: int) -> None:
        dst = self.peer(dst_stage)
        for slot, tensor in enumerate(tensors):
            tag = self._tag(boundary, backward, mb, slot)
            if dst == self.own:
                self._mailbox[tag] = tensor.detach()
                continue
            if self.comm is not None:
                self.comm.count("send", tensor.numel() * tensor.element_size())
            self._sends.append(dist.isend(tensor.detach().contiguous(), dst=dst, group=self.group, tag=tag))

    def _run_stage(self, io: StageGraph, received: list[torch.Tensor], inputs: list[torch.Tensor]) -> tuple[Any, list]:
        """Run a stage graph on received boundary tensors; returns its output and the tensors it sends."""
        self.channel.inputs, self.channel.outputs = received, {}
        run = self.calls.get(io.stage, io.gm) if self.stages.get(io.stage) is io else io.gm  # not forward-only
        out = run(*(inputs[j] for j in io.input_indices))
        sent = [self.channel.outputs[slot] for slot in range(len(io.send))]
        self.channel.inputs, self.channel.outputs = [], {}
        return out, sent

    def _wait_sends(self) -> None:
        for work in self._sends:
            work.wait()
        self._sends = []

    # -- one step -----------------------------------------------------------------------------
    def run(self, flat: list[torch.Tensor], before_final_backward: Callable[[int], None]) -> torch.Tensor | None:
        """Run this rank's actions; returns the sum of the microbatch losses on the last stage's rank."""
        per_mb, sizes = self.split(flat)
        self.channel.sizes = sizes
        held: dict[tuple[int, int], _Held] = {}
        held_back: dict[tuple[int, int], list[DeferredWeightGrad]] = {}  # B ran, W has not
        loss_sum: torch.Tensor | None = None
        stats = PipelineStats(microbatch_sizes=dict(sizes))
        start = stats.started_at = time.perf_counter()
        posted = {0: self._post(self.actions[0], sizes)} if self.actions else {}
        for i, action in enumerate(self.actions):
            mine = posted.pop(i, None)
            received = mine.wait() if mine is not None else []
            if i + 1 < len(self.actions):
                posted[i + 1] = self._post(self.actions[i + 1], sizes)  # overlap the next receive with this action
            began = time.perf_counter()
            self.before_action(action)
            io = self.stages[action.stage]
            with span(f"stage{action.stage}.{action.kind}.mb{action.microbatch}"):
                if action.kind == "F":
                    for tensor, shape in zip(received, io.recv):
                        tensor.requires_grad_(shape.requires_grad)
                    loss, outputs = self._run_stage(io, received, per_mb[action.microbatch])
                    if action.stage < self.n_stages - 1:
                        self._send(outputs, action.stage + 1, action.stage, False, action.microbatch)
                    else:
                        detached = loss.detach()
                        loss_sum = detached.clone() if loss_sum is None else loss_sum + detached
                    held[(action.stage, action.microbatch)] = _Held(received, outputs, loss)
                    stats.peak_in_flight = max(stats.peak_in_flight, len(held) + len(held_back))
                elif action.kind == "W":
                    deferred = held_back.pop((action.stage, action.microbatch))
                    if i in self.final_w and self.arm_at_last_w:
                        before_final_backward(action.stage)
                    WEIGHT_GRADS.apply(deferred, completes=i in self.final_w, slot=self.grad_slot)
                else:
                    if i in self.final_backward and not self.arm_at_last_w:
                        before_final_backward(action.stage)
                    h = held.pop((action.stage, action.microbatch))
                    collect = self.splits or self.fused
                    with WEIGHT_GRADS.collect() if collect else contextlib.nullcontext() as deferred:
                        if action.stage == self.n_stages - 1:
                            h.loss.backward(torch.full_like(h.loss, 1.0 / self.microbatches))
                        else:
                            sent = (o for o, s in zip(h.outputs, io.send) if s.requires_grad)
                            pairs = [(out, grad) for out, grad in zip(sent, received) if out.requires_grad]
                            if pairs:
                                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                    if deferred is not None and self.splits:
                        held_back[(action.stage, action.microbatch)] = deferred
                    elif deferred is not None:  # fused, before the send: B is whole, as the schedule's name says
                        if i in self.final_backward and self.arm_at_last_w:
                            before_final_backward(action.stage)
                        completes = i in self.final_backward
                        WEIGHT_GRADS.apply(deferred, completes=completes, slot=self.grad_slot)
                    if action.stage > 0:
                        grads = [
                            t.grad if t.grad is not None else torch.zeros_like(t)
                            for t, s in zip(h.inputs, io.recv)
                            if s.requires_grad
                        ]
                        self._send(grads, action.stage - 1, action.stage - 1, True, action.microbatch)
            ended = time.perf_counter()
            stats.busy_seconds += ended - began
            stats.events.append((str(action), began - start, ended - start))
        self._wait_sends()
        stats.step_seconds = time.perf_counter() - start
        self.stats = stats
        return loss_sum

    def run_forward(self, flat: list[torch.Tensor], stages: dict[int, StageGraph]) -> list[Any] | None:
        """Forward only, over ``stages`` (this rank's stages of the forward graph), in the schedule's order of
        forwards; returns every microbatch's outputs on the rank of the last stage, None elsewhere."""
        per_mb, sizes = self.split(flat)
        self.channel.sizes = sizes
        outputs: list[Any] = [None] * self.microbatches
        for action in (a for a in self.actions if a.kind == "F"):
            posted = self._post(action, sizes, stages)
            self.before_action(action)
            io = stages[action.stage]
            out, sent = self._run_stage(io, posted.wait() if posted else [], per_mb[action.microbatch])
            if action.stage < self.n_stages - 1:
                self._send(sent, action.stage + 1, action.stage, False, action.microbatch)
            else:
                outputs[action.microbatch] = out
        self._wait_sends()
        return outputs if any(a.stage == self.n_stages - 1 for a in self.actions) else None
