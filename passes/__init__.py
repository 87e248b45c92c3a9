"""autoshard's graph passes, one a file, and the order the compiler runs them in.

Analysis passes only write node.meta (keys in autoshard.meta); each module declares READS and WRITES.
"""

from __future__ import annotations

from collections.abc import Mapping

import sympy
from torch import fx

from . import (
    cost_model,
    grad_buckets,
    layer_assign,
    pipeline_split,
    pipeline_stages,
    shape_prop,
    tp_placement,
    tp_rewrite,
    zero3_gather_free,
    zero_groups,
)
from .infra import PassResult, check_graph

__all__ = ["ANALYSES", "PassResult", "analyze", "check_graph"]

ANALYSES = (shape_prop, layer_assign, cost_model)


def analyze(gm: fx.GraphModule, rename: Mapping[sympy.Symbol, sympy.Symbol] | None = None) -> list[PassResult]:
    """Run the analysis passes in order, checking the graph and the promised keys after each."""
    results = [shape_prop.run(gm, rename)]
    check_graph(gm, shape_prop.WRITES)
    results.append(layer_assign.run(gm))
    check_graph(gm, layer_assign.WRITES)
    results.append(cost_model.run(gm))
    check_graph(gm, cost_model.WRITES)
    return results


__all__ += [
    "grad_buckets",
    "pipeline_split",
    "pipeline_stages",
    "tp_placement",
    "tp_rewrite",
    "zero3_gather_free",
    "zero_groups",
]
