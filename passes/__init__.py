"""autoshard's graph passes, one a file, each a ``Pass`` record run through ``run_pass`` (infra.py is the
pass machinery; expert_loops.py is expert_parallel's second form, loops over experts; recompute_budget.py is recompute's
budget solver).

Analysis passes only write node.meta (keys in autoshard.ir.meta); transformation passes rewrite the
graph. Every pass declares the keys it reads and writes, and ``run_pass`` checks both.
"""

from __future__ import annotations

from collections.abc import Mapping

import sympy
from torch import fx

from . import (
    autocast_asserts,
    batch_statistics,
    context_parallel,
    cost_model,
    dropout_masks,
    expert_parallel,
    grad_buckets,
    gradients_in_flight,
    graph_buckets,
    layer_assign,
    overlap_comm,
    pipeline_split,
    pipeline_stages,
    recompute,
    saved_tensors,
    shape_prop,
    tp_placement,
    tp_rewrite,
    weight_grad_split,
    zero3_gather_free,
    zero_groups,
)
from .infra import Need, Pass, PassResult, check_graph, run_pass

__all__ = [
    "ALL",
    "ANALYSES",
    "COMPILED",
    "Need",
    "Pass",
    "PassResult",
    "analyze",
    "autocast_asserts",
    "batch_statistics",
    "check_graph",
    "context_parallel",
    "cost_model",
    "dropout_masks",
    "expert_parallel",
    "grad_buckets",
    "gradients_in_flight",
    "graph_buckets",
    "layer_assign",
    "overlap_comm",
    "pipeline_split",
    "pipeline_stages",
    "recompute",
    "run_pass",
    "saved_tensors",
    "shape_prop",
    "tp_placement",
    "tp_rewrite",
    "weight_grad_split",
    "zero3_gather_free",
    "zero_groups",
]

ANALYSES = (shape_prop.PASS, layer_assign.PASS, cost_model.PASS)
ALL = (
    *ANALYSES,
    autocast_asserts.PASS,
    context_parallel.PASS,
    expert_parallel.PASS,
    batch_statistics.PASS,
    tp_placement.PASS,
    tp_rewrite.PASS,
    dropout_masks.PASS,
    pipeline_split.PASS,
    grad_buckets.PASS,
    zero_groups.PASS,
    pipeline_stages.PASS,
    zero3_gather_free.PASS,
    weight_grad_split.PASS,
    recompute.PASS,
    saved_tensors.PASS,
    gradients_in_flight.PASS,
)
# Passes over the forward and backward graphs torch.compile compiles (no autoshard keys there).
COMPILED = (graph_buckets.PASS, overlap_comm.PASS)


def analyze(gm: fx.GraphModule, rename: Mapping[sympy.Symbol, sympy.Symbol] | None = None) -> list[PassResult]:
    """Run the analysis passes in order: shapes, layers, costs."""
    return [
        run_pass(shape_prop.PASS, gm, rename),
        run_pass(layer_assign.PASS, gm),
        run_pass(cost_model.PASS, gm),
    ]
