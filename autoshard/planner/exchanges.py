"""Seconds of the exchanges a part's layers add under expert and context parallelism, one microbatch: what
autoshard/planner/costing.py adds to a stage's forward and backward."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autoshard.planner.part_times import value

if TYPE_CHECKING:
    from autoshard.planner.hardware import Hardware
    from autoshard.planner.profile import PartAtDegree
    from autoshard.spec.plan import Plan

__all__ = ["context_exchanges", "expert_exchanges", "ring_kept_block"]


def expert_exchanges(part: PartAtDegree, plan: Plan, sizes: dict[str, Any], hw: Hardware) -> float:
    """Seconds of one microbatch's all-to-alls in a part's MoE layers, forward and backward: per layer the
    counts (latency only), then each way a dispatch and a combine of its rows, over ep consecutive dp ranks."""
    span = plan.ep * plan.tp
    rows = value(part.dispatch_bytes, sizes) / part.moe_layers
    move = hw.collective_seconds("all_to_all", rows, plan.ep, span)
    counts = hw.collective_seconds("all_gather", 8 * part.experts * plan.ep, plan.ep, span) + hw.sync(plan.ep)
    return part.moe_layers * (counts + 4 * move)


def context_exchanges(
    part: PartAtDegree, plan: Plan, sizes: dict[str, Any], times: Any, hw: Hardware, itemsize: int
) -> tuple[float, float]:
    """Seconds cp adds to a part, forward and backward, one microbatch (graph_ops/context.py).

    Ring: K/V blocks go round cp - 1 times forward and cp - 2 backward (which starts on the block forward
    ended on), each hidden behind the attention of the block in hand (1/cp of the part's attention time);
    the gradients of each block follow it home, cp - 1 hops, each hidden behind the next block's backward;
    and each step merges its block into the running output (a few passes over it) and launches its kernels
    apart. All-to-all: q, k, v and the output each traded
    once each way, on the critical path."""
    span = plan.cp * plan.tp  # ring neighbours sit tp ranks apart
    kv = value(part.attention_kv_bytes, sizes)  # this rank's blocks (its share of the tokens)
    q = value(part.attention_q_bytes, sizes)
    if plan.cp_attention == "all_to_all":
        exchanges = hw.collective_seconds("all_to_all", 2 * q + kv, plan.cp, span) + hw.sync(plan.cp)
        return exchanges, exchanges
    attention = sum(t for name, t in times.by_node.items() if "scaled_dot_product" in name)
    send = hw.collective_seconds("send_recv", kv, 2, span)
    grads = hw.collective_seconds("send_recv", kv * max(4, itemsize) / itemsize, 2, span)  # fp32 at least
    laps, per_block = plan.cp - 1, attention / plan.cp
    merges = plan.cp * hw.memory_seconds(6 * q * max(4, itemsize) / itemsize, kernels=8)  # out, lse: a few passes
    forward = laps * max(0.0, send - hw.overlap * per_block) + merges
    backward = (laps - 1) * max(0.0, send - hw.overlap * 2 * per_block)
    backward += laps * max(0.0, grads - hw.overlap * 2 * per_block) + merges
    return forward, backward


def ring_kept_block(part: PartAtDegree, plan: Plan, sizes: dict[str, Any], choice: str) -> float:
    """Bytes ring attention keeps besides what SDPA keeps: the K/V block its forward ended on, where its backward
    starts (graph_ops/ring_attention.py); none where the attention is recomputed, or traded for heads."""
    if plan.cp_attention == "all_to_all" or choice == "full":
        return 0.0
    if any("scaled_dot_product" in name for name in part.recomputed(choice)):
        return 0.0
    return value(part.attention_kv_bytes, sizes)
