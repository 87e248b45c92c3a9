"""Sharding propagation rules: per ATen overload, how its inputs' placements along ``tp`` decide its output's.

A rule reads the node and the placements its tensor inputs arrive in and returns a ``Decision``:
the output placement (a tuple for ops with several outputs) and, where the inputs as they arrive
cannot give a sharded result, the placements it wants them in instead. The TP passes insert those
redistributions (Partial->Replicate: all-reduce; Shard->Replicate: all-gather; Replicate->Shard: a
local slice) and weigh their cost.

The registry is ``RULES`` below, one op family a module (as DTensor's ``_ops``): pointwise ops
(broadcasting from the right), views and other dimension moves, matrix multiplies, the vocabulary's
embedding and loss, reductions and attention. An op with no rule gets every input replicated:
always correct, and passes.tp_placement lists it.
"""

from __future__ import annotations

from typing import Any

from autoshard.sharding import matmul, pointwise, reductions, views, vocabulary
from autoshard.sharding.rule import Decision, P, R, Rule, RuleInput, fits_ranks, replicate_all, sequence_dim

__all__ = [
    "P",
    "R",
    "RULES",
    "Decision",
    "Rule",
    "RuleInput",
    "fits_ranks",
    "replicate_all",
    "rule_for",
    "rule_of",
    "sequence_dim",
]

RULES: dict[Any, Rule] = {}
for _family in (pointwise, views, matmul, vocabulary, reductions):
    overlap = RULES.keys() & _family.RULES.keys()
    assert not overlap, f"{_family.__name__} decides {sorted(map(str, overlap))} again"
    RULES.update(_family.RULES)


_NAMED: dict[str, Rule] = {**matmul.NAMED_RULES, **reductions.NAMED_RULES}


def rule_of(op: Any) -> Rule | None:
    """The rule that decides ``op``: by the op, or by its qualified name for another library's op (or a graph op
    of autoshard's, by module and name); None: none."""
    rule = RULES.get(op)
    if rule is None:
        packet = getattr(op, "overloadpacket", None)
        name = (
            getattr(packet, "_qualified_op_name", "")
            or f"{getattr(op, '__module__', '')}.{getattr(op, '__name__', '')}"
        )
        rule = _NAMED.get(name)
    return rule


def rule_for(op: Any) -> Rule:
    """The rule that decides ``op`` (every input replicated where none does)."""
    return rule_of(op) or replicate_all
