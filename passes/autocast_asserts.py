"""Under autocast, drop export's checks that a value keeps the dtype it had when captured.

Reads:  nothing
Writes: nothing (erases unused ``aten._assert_tensor_metadata`` nodes)

A model's ``.float()`` of logits it computed in fp32 was captured with a check that they are fp32;
under the plan's autocast the matmuls return bf16, so the check no longer holds. The checks compute
nothing the graph uses.
"""

from __future__ import annotations

import torch
from torch import fx

from .infra import Pass, PassResult

__all__ = ["PASS", "run"]


def run(gm: fx.GraphModule) -> PassResult:
    dropped = 0
    for node in list(gm.graph.nodes):
        if node.target is torch.ops.aten._assert_tensor_metadata.default and not node.users:
            gm.graph.erase_node(node)
            dropped += 1
    gm.recompile()
    return PassResult("autocast_asserts", dropped > 0, f"{dropped} dtype checks dropped")


PASS = Pass("autocast_asserts", reads=(), writes=(), run=run)
