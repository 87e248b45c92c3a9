"""The pipeline's graph ops: a stage graph's boundaries, read from and written to the rank's channel.

passes/pipeline_stages cuts the graph into stage graphs whose inputs from the previous stage are
``recv`` nodes and whose outputs to the next are ``send`` nodes, and whose sizes made on an earlier
stage are ``size`` nodes; each takes the rank's ``PipelineChannel`` (a get_attr node named ``pipe``),
which the runtime (runtime/pipeline.py) fills before a stage runs and empties after.
"""

from __future__ import annotations

import re
from typing import Any

import sympy
import torch
from torch import nn

from autoshard.errors import DistributedError
from autoshard.graph_ops.graph_break import stays_eager
from autoshard.ir.meta import evaluate_expr

__all__ = ["PipelineChannel", "UnboundChannel", "recv", "send", "size"]


@stays_eager
def recv(pipe: PipelineChannel, stage: int, slot: int) -> torch.Tensor:
    """A boundary tensor from the previous stage (received by the runtime before the stage runs)."""
    return pipe.received(stage, slot)


@stays_eager
def send(pipe: PipelineChannel, stage: int, slot: int, value: torch.Tensor) -> None:
    """Hand a boundary tensor to the runtime, which sends it to the next stage after the stage ran."""
    pipe.sending(stage, slot, value)


@stays_eager
def size(pipe: PipelineChannel, expr: str) -> int:
    """A size made on an earlier stage, evaluated in this microbatch's symbol values instead of sent."""
    return pipe.size(expr)


class UnboundChannel(nn.Module):
    """The channel of a stage graph built for inspection; running it needs a Program's PipelineChannel."""

    def _unbound(self, *_: Any) -> Any:
        raise DistributedError(
            "this stage graph was built for inspection; run it through a Program compiled under a process group"
        )

    received = sending = size = _unbound


class PipelineChannel(nn.Module):
    """What the current action's stage graph reads (received tensors, sizes) and writes (tensors to send)."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: list[torch.Tensor] = []
        self.outputs: dict[int, torch.Tensor] = {}
        self.sizes: dict[str, int] = {}
        self._exprs: dict[str, sympy.Expr] = {}
        self._values: dict[tuple, int] = {}  # evaluating with sympy costs ~0.1 ms; sizes repeat every step

    def received(self, stage: int, slot: int) -> torch.Tensor:
        return self.inputs[slot]

    def sending(self, stage: int, slot: int, value: torch.Tensor) -> None:
        self.outputs[slot] = value

    def size(self, expr: str) -> int:
        key = (expr, tuple(sorted(self.sizes.items())))
        if key not in self._values:
            self._values[key] = self._evaluate(expr)
        return self._values[key]

    def _evaluate(self, expr: str) -> int:
        parsed = self._exprs.get(expr)
        if parsed is None:
            # Every name is a size symbol (plain sympify would read S as sympy's singleton registry).
            names = {name: sympy.Symbol(name) for name in re.findall(r"[A-Za-z_]\w*", expr)}
            parsed = self._exprs[expr] = sympy.sympify(expr, locals=names)
        return evaluate_expr(parsed, self.sizes)
