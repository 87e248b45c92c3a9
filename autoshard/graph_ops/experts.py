"""Expert parallelism at run time: tokens sent to the rank of their expert and back, in forward and backward.

The expert-parallel rewrite (passes/expert_parallel.py) puts two calls round each mixture-of-experts
layer's expert computation, whose rows arrive sorted by expert (``offs``: where each expert's rows end):

    dispatch(ep, rows, offs, layer) -> (local rows, local offs, routing)
        every ep rank's row counts per expert are gathered (E integers a rank, and one host sync: the
        split sizes of the next all-to-all are host integers; the gathered counts are also the layer's
        expert load, ``ExpertParallel.take_loads``); then every row goes to
        its expert's rank (all-to-all), where the rows are reordered expert-major (rank r holds experts
        r * E/ep .. (r+1) * E/ep - 1), so the local grouped matmuls see their experts' rows contiguous;
    combine(ep, local rows, routing) -> rows
        the converse: rows back to the ranks that sent them, in the order they were sent.

Each one's backward is the other's forward: one all-to-all each way (Megatron-core's all-to-all token
dispatcher, torchtitan's ``ExpertParallel``). ``routing`` is a small CPU tensor: [0] the rows this rank
sends to each ep rank's each local expert, [1] the rows it receives from each ep rank for each of its own.
A plain ``dist.all_to_all_single`` would not carry gradients back; the autograd functions below do.
Both ops stay eager under torch.compile (their split sizes are data, different each step).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autoshard.errors import DistributedError
from autoshard.graph_ops.graph_break import stays_eager

__all__ = ["UnboundExpertParallel", "combine", "combine_rows", "dispatch", "dispatch_rows", "on_native_kernel"]


class UnboundExpertParallel(nn.Module):
    """The ``ep`` of a graph built for inspection: its degree; running it needs a Program under a process group
    (runtime/expert_parallel.py's ``ExpertParallel``)."""

    rank = 0

    def __init__(self, degree: int) -> None:
        super().__init__()
        self.degree = degree
        self.loads: dict[str, torch.Tensor] = {}  # layer -> rows per expert routed in this ep group, this step

    def take_loads(self) -> dict[str, torch.Tensor]:
        """Each layer's rows per expert since the last call (every ep rank's, summed), and start counting anew."""
        loads, self.loads = self.loads, {}
        return loads

    def _unbound(self, *_: Any) -> Any:
        raise DistributedError(
            "this expert-parallel graph was built for inspection; run it through a Program compiled under a "
            "process group"
        )

    # route(counts, layer): the routing; exchange(rows, send, receive, op): an all-to-all; gather(local): every
    # ep rank's experts of one weight joined along dim 0. A rank's ExpertParallel implements them.
    route = exchange = gather = _unbound


def _regroup(rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows in blocks counts[i, j] (i-major) reordered j-major; counts (I, J) on the host."""
    blocks = rows.split(counts.reshape(-1).tolist())
    width = counts.shape[1]
    return torch.cat([blocks[i * width + j] for j in range(width) for i in range(counts.shape[0])])


def _to_experts(ep: UnboundExpertParallel, rows: torch.Tensor, routing: torch.Tensor, op: str) -> torch.Tensor:
    send, receive = routing[0], routing[1]
    arrived = ep.exchange(rows, send.sum(1).tolist(), receive.sum(1).tolist(), op)
    return _regroup(arrived, receive)  # [source rank][expert] -> [expert][source rank]


def _from_experts(ep: UnboundExpertParallel, rows: torch.Tensor, routing: torch.Tensor, op: str) -> torch.Tensor:
    send, receive = routing[0], routing[1]
    by_source = _regroup(rows, receive.t().contiguous())  # [expert][source rank] -> [source rank][expert]
    return ep.exchange(by_source, receive.sum(1).tolist(), send.sum(1).tolist(), op)


class _Exchange(torch.autograd.Function):
    """Rows to their experts' ranks (``to_experts``) or back to where they came from; its backward is the
    other direction, counted under ``op`` + ``_grad``."""

    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, ep: UnboundExpertParallel, routing: torch.Tensor, to_experts: bool, op: str
    ) -> torch.Tensor:
        ctx.ep, ctx.routing, ctx.to_experts, ctx.op = ep, routing, to_experts, op
        return (_to_experts if to_experts else _from_experts)(ep, rows, routing, op)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        back = _from_experts if ctx.to_experts else _to_experts
        return back(ctx.ep, grad, ctx.routing, ctx.op + "_grad"), None, None, None, None


@stays_eager
def dispatch(
    ep: UnboundExpertParallel, rows: torch.Tensor, offs: torch.Tensor, layer: str = ""
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's experts' rows from every ep rank, expert-major; their ``offs``; and the routing."""
    ends = offs.to(torch.int64)
    counts = torch.cat([ends[:1], ends[1:] - ends[:-1]])
    routing = ep.route(counts, layer)
    local_offs = routing[1].sum(0).cumsum(0).to(device=offs.device, dtype=offs.dtype)
    return _Exchange.apply(rows, ep, routing, True, "ep_dispatch"), local_offs, routing


@stays_eager
def combine(ep: UnboundExpertParallel, rows: torch.Tensor, routing: torch.Tensor) -> torch.Tensor:
    """The local experts' output rows back where ``dispatch`` took them from, in their order."""
    return _Exchange.apply(rows, ep, routing, False, "ep_combine")


@stays_eager
def dispatch_rows(ep: UnboundExpertParallel, rows: list[torch.Tensor], layer: str = "") -> tuple[torch.Tensor, ...]:
    """A loop over experts' form of ``dispatch``: ``rows[e]`` are this rank's rows of expert e; the rows of each
    of this rank's experts from every ep rank, one tensor an expert, then the routing."""
    counts = torch.tensor([r.shape[0] for r in rows], dtype=torch.int64, device=rows[0].device)
    routing = ep.route(counts, layer)
    arrived = _Exchange.apply(torch.cat(rows), ep, routing, True, "ep_dispatch")
    return (*arrived.split(routing[1].sum(0).tolist()), routing)


@stays_eager
def combine_rows(
    ep: UnboundExpertParallel, outs: list[torch.Tensor], routing: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The converse of ``dispatch_rows``: each local expert's output rows back to where they came from; this
    rank's rows of every expert, one tensor an expert, in the order of ``dispatch_rows``' input."""
    back = _Exchange.apply(torch.cat(outs), ep, routing, False, "ep_combine")
    return back.split(routing[0].reshape(-1).tolist())


EXCHANGES = (dispatch, combine, dispatch_rows, combine_rows)  # the graph ops the expert-parallel rewrite inserts


def _native_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """transformers' fallback grouped matmul on torch's own kernel where that takes the operands (on the CPU:
    float32 or bfloat16, rows and strides in whole 16-byte lines); the fallback (a matmul an expert, and a
    backward that writes each weight's gradient in the weight's transposed layout) elsewhere."""
    aligned = all(
        t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s, n in zip(t.stride(), t.shape) if s != 1)
        for t in (x, w)
    )
    if x.device.type == "cpu" and x.dtype == w.dtype and x.dtype in (torch.float32, torch.bfloat16) and aligned:
        return torch._grouped_mm(x, w, offs)
    return torch.ops.transformers.grouped_mm_fallback(x, w, offs)


def on_native_kernel(gm: torch.fx.GraphModule) -> int:
    """An eager rank graph's calls of transformers' fallback grouped matmul, where torch's kernel can take
    them (torch.export traced the fallback: torch's meta kernel takes only bfloat16); how many."""
    swapped = 0
    for node in gm.graph.nodes:
        op = getattr(node.target, "overloadpacket", None)
        if node.op == "call_function" and getattr(op, "_qualified_op_name", "") == "transformers::grouped_mm_fallback":
            node.target = _native_grouped_mm
            swapped += 1
    if swapped:
        gm.recompile()
    return swapped
