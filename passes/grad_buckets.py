"""Data-parallel gradient buckets: which bucket, and where in it, each trainable parameter's gradient goes.

Reads:  autoshard.shape (of get_attr nodes: numel and dtype)
Writes: autoshard.grad_bucket (meta.FlatSlot) on the get_attr nodes of trainable parameters

Backward produces a parameter's gradient once it has passed the parameter's first use in forward,
so gradients become ready in reverse order of first use. Buckets fill in that order up to
``bucket_bytes``; a bucket holds one dtype and one ``partition`` key (the compiler's: the pipeline
stages that read a parameter and the user's optimizer group, so that a bucket's flat shard belongs
to one group and one set of ranks). The first bucket of each key to fill may be smaller (``first_bucket_bytes``;
the plan's is DDP's 1 MiB): its all-reduce starts early in backward instead of waiting for a whole bucket's
worth of gradients, which on a small model is all of them. Buckets are numbered in the order they complete, which is the
order the runtime launches them in on every rank (DDP's overlap). A parameter reached through
several get_attr nodes (tied weights) has one slot.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

from torch import fx

from autoshard.ir.meta import GRAD_BUCKET, SHAPE, FlatSlot, get_shape

from .infra import PARAMETERS, Need, Pass, PassResult

__all__ = ["PASS", "assign_slots", "run", "trainable_uses"]


def trainable_uses(gm: fx.GraphModule) -> dict[int, list[fx.Node]]:
    """Every used trainable parameter (by id) -> its get_attr nodes, in order of first use."""
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    nodes_of: dict[int, list[fx.Node]] = {}
    first: dict[int, int] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr" or not node.users or not get_shape(node).requires_grad:
            continue
        key = id(gm.get_parameter(node.target))
        nodes_of.setdefault(key, []).append(node)
        first[key] = min(first.get(key, len(position)), min(position[u] for u in node.users))
    return {key: nodes_of[key] for key in sorted(first, key=first.__getitem__)}


def assign_slots(uses: dict[int, list[fx.Node]], groups: list[list[int]], key: str) -> None:
    """Write ``key``: group ``i`` holds ``groups[i]``'s parameters one after another, in that order."""
    for index, members in enumerate(groups):
        offset = 0
        for param in members:
            numel = int(get_shape(uses[param][0]).tensor.numel)
            for node in uses[param]:
                node.meta[key] = FlatSlot(group=index, offset=offset, numel=numel)
            offset += numel


def run(
    gm: fx.GraphModule,
    bucket_bytes: int,
    partition: Mapping[str, Hashable] | None = None,
    first_bucket_bytes: int | None = None,
) -> PassResult:
    """``partition``: get_attr target -> a key that no bucket mixes (None: one key for all); ``first_bucket_bytes``:
    the cap of each key's first bucket (None: ``bucket_bytes``)."""
    first_bucket_bytes = bucket_bytes if first_bucket_bytes is None else first_bucket_bytes
    if bucket_bytes <= 0 or first_bucket_bytes <= 0:
        raise ValueError(f"bucket sizes must be positive, got {bucket_bytes} and first {first_bucket_bytes}")
    uses = trainable_uses(gm)
    open_buckets: dict[tuple, list[int]] = {}  # (partition key, dtype) -> params of the bucket being filled
    started: set[tuple] = set()  # the keys whose first bucket has closed
    closed: list[list[int]] = []
    sizes: dict[int, int] = {}
    for key in reversed(list(uses)):  # the order gradients become ready in
        tensor = get_shape(uses[key][0]).tensor
        sizes[key] = int(tensor.nbytes)
        kind = ((partition or {}).get(uses[key][0].target), tensor.dtype)
        bucket = open_buckets.setdefault(kind, [])
        cap = bucket_bytes if kind in started else min(bucket_bytes, first_bucket_bytes)
        if bucket and sum(sizes[k] for k in bucket) + sizes[key] > cap:
            closed.append(bucket)
            started.add(kind)
            bucket = open_buckets[kind] = []
        bucket.append(key)
    closed += [b for b in open_buckets.values() if b]
    ready = {key: i for i, key in enumerate(reversed(list(uses)))}
    closed.sort(key=lambda b: ready[b[-1]])  # launched in the order they complete
    assign_slots(uses, closed, GRAD_BUCKET)
    return PassResult("grad_buckets", False, f"{len(uses)} parameters in {len(closed)} buckets")


PASS = Pass("grad_buckets", reads=(Need(SHAPE, PARAMETERS),), writes=(Need(GRAD_BUCKET, PARAMETERS),), run=run)
