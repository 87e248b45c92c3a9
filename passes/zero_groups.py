"""ZeRO-3 gather groups: the parameters of one layer form one flat group, gathered and freed together.

Reads:  autoshard.layer (of get_attr nodes), autoshard.shape
Writes: autoshard.zero_group (meta.FlatSlot) on the get_attr nodes of trainable parameters

Groups are numbered in order of first use in forward, so "the next group" is the one to prefetch
in forward and "the previous group" the one to prefetch in backward. A parameter reached through
several get_attr nodes (tied weights) belongs to the group of its first use. A group holds one dtype
and one ``partition`` key (the compiler's: the pipeline stages that read a parameter and the user's
optimizer group), so a layer whose parameters differ there becomes several groups.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

from torch import fx

from autoshard.ir.meta import LAYER, SHAPE, ZERO_GROUP, get_layer, get_shape

from .grad_buckets import assign_slots, trainable_uses
from .infra import PARAMETERS, Need, Pass, PassResult

__all__ = ["PASS", "run"]


def run(gm: fx.GraphModule, partition: Mapping[str, Hashable] | None = None) -> PassResult:
    """``partition``: get_attr target -> a key that no group mixes (None: one key for all)."""
    groups: dict[tuple, list[int]] = {}  # (layer, partition key, dtype) -> params in order of first use
    uses = trainable_uses(gm)
    for key, nodes in uses.items():
        first = nodes[0]
        kind = (get_layer(first), (partition or {}).get(first.target), get_shape(first).tensor.dtype)
        groups.setdefault(kind, []).append(key)
    assign_slots(uses, list(groups.values()), ZERO_GROUP)  # dicts keep insertion order: first use
    return PassResult("zero_groups", False, f"{len(uses)} parameters in {len(groups)} gather groups")


PASS = Pass(
    "zero_groups",
    reads=(Need(SHAPE, PARAMETERS), Need(LAYER, PARAMETERS)),
    writes=(Need(ZERO_GROUP, PARAMETERS),),
    run=run,
)
