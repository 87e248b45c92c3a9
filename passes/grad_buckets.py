"""Data-parallel gradient buckets: which bucket, and where in it, each trainable parameter's gradient goes.

Reads:  autoshard.shape (of get_attr nodes: numel and dtype)
Writes: autoshard.grad_bucket (meta.FlatSlot) on the get_attr nodes of trainable parameters

Backward produces a parameter's gradient once it has passed the parameter's first use in forward,
so gradients become ready in reverse order of first use. Bucket 0 holds the parameters used last;
buckets fill up to ``bucket_bytes`` and never mix dtypes. The runtime all-reduces a bucket as soon
as all its gradients are ready, in bucket order on every rank, while backward goes on (DDP's overlap).
A parameter reached through several get_attr nodes (tied weights) has one slot.
"""

from __future__ import annotations

from collections.abc import Container

from torch import fx

from autoshard.meta import GRAD_BUCKET, FlatSlot, get_shape

from .infra import PassResult

__all__ = ["READS", "WRITES", "run"]

READS = ("autoshard.shape",)
WRITES = (GRAD_BUCKET,)


def run(gm: fx.GraphModule, bucket_bytes: int, targets: Container[str] | None = None) -> PassResult:
    """``targets``: bucket only these parameters (by get_attr target); None: every trainable parameter."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    first_use: dict[int, int] = {}
    nodes_of: dict[int, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        try:
            param = gm.get_parameter(node.target)
        except AttributeError:
            continue
        if not param.requires_grad or not node.users or (targets is not None and node.target not in targets):
            continue
        key = id(param)
        use = min(position[user] for user in node.users)
        first_use[key] = min(first_use.get(key, use), use)
        nodes_of.setdefault(key, []).append(node)

    order = sorted(first_use, key=lambda k: -first_use[k])
    bucket, offset, used_bytes, dtype = 0, 0, 0, None
    for key in order:
        tensor = get_shape(nodes_of[key][0]).tensor
        numel = int(tensor.numel)
        nbytes = int(tensor.nbytes)
        if dtype is not None and (tensor.dtype != dtype or used_bytes + nbytes > bucket_bytes) and used_bytes > 0:
            bucket, offset, used_bytes = bucket + 1, 0, 0
        dtype = tensor.dtype
        slot = FlatSlot(group=bucket, offset=offset, numel=numel)
        for node in nodes_of[key]:
            node.meta[GRAD_BUCKET] = slot
        offset += numel
        used_bytes += nbytes
    buckets = bucket + 1 if order else 0
    return PassResult("grad_buckets", False, f"{len(order)} parameters in {buckets} buckets")
