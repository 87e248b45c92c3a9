"""Gradients in flight: the most bytes one op's backward (or the loss's forward) holds at once beside what
autograd keeps, in B and S.

Reads:  autoshard.shape
Writes: nothing (the value: a sympy expression)

Saved tensors are not the whole of an activation peak. While an op's backward runs, the gradient of its
output and the gradients it makes for its inputs (a weight's gradient too, before it joins its bucket)
are live beside everything still kept, and the first ops of backward run with all of it kept. The loss
is the usual maximum: ``cross_entropy_loss``'s backward holds the gradient of its log-softmax and of the
logits, twice the logits, the largest tensors of a language model (at a 128k vocabulary they outweigh a
block's activations); the vocabulary-parallel loss holds its logits shard and their shifted copy while its
forward computes the exponentials it keeps. Measured on the planner bench's GPT at dp=4, the peak of a
step sat in the log-softmax's backward at what is kept plus twice the logits, to the byte.
"""

from __future__ import annotations

from typing import Any

import sympy
import torch
from torch import fx

from autoshard.graph_ops import context as cp_ops
from autoshard.graph_ops import recompute
from autoshard.graph_ops import tp as tp_ops
from autoshard.ir.meta import SHAPE
from autoshard.ir.ops import ALIASING, packet

from .infra import Need, Pass, PassResult

__all__ = ["PASS", "run"]

aten = torch.ops.aten

# Losses whose work holds two tensors of their logits' size at once (the logits are the argument given).
_TWICE_THE_LOGITS = {aten.cross_entropy_loss: 0, tp_ops.vocab_parallel_cross_entropy: 1, cp_ops.cross_entropy: 1}


def _grad_bytes(value: Any) -> sympy.Expr:
    """Bytes of a value's gradient: its tensors that require one."""
    shape = value.meta.get(SHAPE) if isinstance(value, fx.Node) else None
    if shape is None:
        return sympy.Integer(0)
    return sympy.Add(*(t.nbytes for t in shape.tensors if t is not None and t.requires_grad))


def op_bytes(node: fx.Node) -> sympy.Expr:
    """What ``node``'s backward holds at once: its output's gradient and its inputs' (a loss: twice its logits)."""
    target = packet(node.target)
    if target in _TWICE_THE_LOGITS:
        logits = node.args[_TWICE_THE_LOGITS[target]]
        return 2 * (logits.meta[SHAPE].nbytes if isinstance(logits, fx.Node) and SHAPE in logits.meta else 0)
    if target in ALIASING or _grad_bytes(node) == 0:
        return sympy.Integer(0)
    return sympy.expand(_grad_bytes(node) + sympy.Add(*(_grad_bytes(arg) for arg in node.all_input_nodes)))


def in_flight(gm: fx.GraphModule) -> sympy.Expr:
    """The most of any op of ``gm`` and of the recompute regions it calls."""
    terms: set[sympy.Expr] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is recompute.region:
            terms.add(in_flight(getattr(gm, node.args[0].target)))
        else:
            terms.add(op_bytes(node))
    terms.discard(sympy.Integer(0))
    kept = _undominated({t for term in terms for t in (term.args if isinstance(term, sympy.Max) else (term,))})
    return sympy.Max(*kept, evaluate=False) if len(kept) > 1 else (kept[0] if kept else sympy.Integer(0))


def _undominated(terms: set[sympy.Expr]) -> list[sympy.Expr]:
    """The terms no other term is at least everywhere: sizes are sums of monomials in B and S with positive
    coefficients, so one with at least each of another's coefficients is at least it (sympy's Max compares
    every pair symbolically: seconds on a large model's parts, where this takes milliseconds; the Max is then
    built unevaluated, and evaluated a term at a time)."""
    coefficients = {term: term.as_coefficients_dict() for term in terms}

    def covers(a: sympy.Expr, b: sympy.Expr) -> bool:
        return all(coefficients[a].get(m, 0) >= c for m, c in coefficients[b].items())

    kept: list[sympy.Expr] = []
    for term in sorted(terms, key=sympy.default_sort_key):
        if not any(covers(other, term) for other in kept):
            kept = [other for other in kept if not covers(term, other)] + [term]
    return kept


def run(gm: fx.GraphModule) -> PassResult:
    most = in_flight(gm)
    return PassResult("gradients_in_flight", False, f"gradients in flight: at most {most} bytes", value=most)


PASS = Pass("gradients_in_flight", reads=(Need(SHAPE),), writes=(), run=run)
