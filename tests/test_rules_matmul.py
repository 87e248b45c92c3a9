"""The sharding rules of the matrix-multiply family (and embedding, attention), one placement table each.

Tier 1, no ranks: each case exports a single op, gives its inputs placements along tp=2 and checks
what the rule decides: the output placement, the inputs it wants redistributed, and the bias
handling of a row-parallel product. Column- and row-parallel are told apart by which dimension of
the weight is sharded, which differs between linear (W[out, in]) and addmm/mm (W[in, out]).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from autoshard import passes
from autoshard.ir.meta import BIAS_AFTER_REDUCE, BIAS_SPLIT
from autoshard.ir.placements import Partial, Replicate, Shard
from autoshard.sharding import RULES, Decision, RuleInput
from autoshard.sharding.matmul import matmul_dims

R, P, S = Replicate(), Partial(), Shard


class _Call(nn.Module):
    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.fn(*args)


def exported(fn: Any, *shapes: tuple[int, ...], ints: int = 0) -> tuple[fx.Node, list[fx.Node]]:
    """The single op ``fn`` makes on inputs of ``shapes`` (the first ``ints`` are int64 ids), and its inputs."""
    args = tuple(
        torch.randint(0, 4, s) if i < ints else torch.randn(s, generator=torch.Generator().manual_seed(i))
        for i, s in enumerate(shapes)
    )
    gm = torch.export.export(_Call(fn), args).graph_module
    passes.shape_prop.run(gm)
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    return node, [n for n in gm.graph.nodes if n.op == "placeholder"]


def decide(node: fx.Node, inputs: list[fx.Node], placements: list[Any], sequence_parallel: bool = False) -> Decision:
    ctx = RuleInput(node, dict(zip(inputs, placements)), degree=2, sequence_parallel=sequence_parallel)
    return RULES[node.target](ctx)


def check(fn: Any, shapes: list[tuple[int, ...]], given: list[Any], out: Any, want: list[Any], **kw: Any) -> Decision:
    """``want[i]``: the placement the rule wants input i in, or None where it takes the input as it is."""
    node, inputs = exported(fn, *shapes, ints=kw.pop("ints", 0))
    decision = decide(node, inputs, given, **kw)
    assert decision.out == out
    assert decision.want == {inputs[i]: w for i, w in enumerate(want) if w is not None}
    return decision


# linear(x [4, 3, 8], W [out 6, in 8], b [6]): column-parallel shards W's dim 0, row-parallel its dim 1.
LINEAR = [(4, 3, 8), (6, 8), (6,)]
LINEAR_CASES = {
    "column": ([R, S(0), R], S(2), [None, None, S(0)], ""),
    "column, bias already split": ([R, S(0), S(0)], S(2), [None, None, None], ""),
    "column, rows of x sharded": ([S(0), S(0), S(0)], S(2), [R, None, None], ""),
    "column, x partial": ([P, S(0), R], S(2), [R, None, S(0)], ""),
    "row": ([S(2), S(1), R], R, [None, None, None], BIAS_AFTER_REDUCE),
    "row, x whole": ([R, S(1), R], R, [S(2), None, None], BIAS_AFTER_REDUCE),
    "row, bias sharded": ([S(2), S(1), S(0)], R, [None, None, R], BIAS_AFTER_REDUCE),
    "row, strided weight": ([R, S(1, 2), R], R, [None, R, None], ""),
    "weight whole, rows of x sharded": ([S(0), R, R], S(0), [None, None, None], ""),
    "weight whole, rows sharded, bias sharded": ([S(1), R, S(0)], S(1), [None, None, R], ""),
    "weight whole, features of x sharded": ([S(2), R, R], R, [R, None, None], ""),
    "weight partial": ([R, P, R], R, [None, R, None], ""),
}


@pytest.mark.parametrize("case", LINEAR_CASES)
def test_linear(case: str) -> None:
    given, out, want, bias = LINEAR_CASES[case]
    assert check(F.linear, LINEAR, given, out, want).bias == bias


def test_linear_row_parallel_under_sequence_parallel_splits_the_bias() -> None:
    decision = check(F.linear, LINEAR, [S(2), S(1), R], P, [None, None, None], sequence_parallel=True)
    assert decision.bias == BIAS_SPLIT


def test_linear_row_parallel_without_bias_is_partial() -> None:
    assert check(F.linear, LINEAR[:2], [S(2), S(1)], P, [None, None]).bias == ""


def test_linear_column_parallel_with_a_fused_weight_keeps_its_blocks() -> None:
    check(F.linear, [(4, 3, 8), (12, 8), (12,)], [R, S(0, 3), R], S(2, 3), [None, None, S(0, 3)])


# addmm(b [6], x [5, 8], W [in 8, out 6]) (HF GPT-2's Conv1D): column-parallel shards W's dim 1.
ADDMM = [(6,), (5, 8), (8, 6)]
ADDMM_CASES = {
    "column": ([R, R, S(1)], S(1), [S(0), None, None], ""),
    "column, x sharded on features": ([S(0), S(1), S(1)], S(1), [None, R, None], ""),
    "row": ([R, S(1), S(0)], R, [None, None, None], BIAS_AFTER_REDUCE),
    "row, x whole": ([R, R, S(0)], R, [None, S(1), None], BIAS_AFTER_REDUCE),
    "weight whole, rows of x sharded": ([R, S(0), R], S(0), [None, None, None], ""),
}


@pytest.mark.parametrize("case", ADDMM_CASES)
def test_addmm(case: str) -> None:
    given, out, want, bias = ADDMM_CASES[case]
    assert check(torch.addmm, ADDMM, given, out, want).bias == bias


def test_addmm_row_parallel_under_sequence_parallel_splits_the_bias() -> None:
    assert check(torch.addmm, ADDMM, [R, S(1), S(0)], P, [None, None, None], sequence_parallel=True).bias == BIAS_SPLIT


# mm(x [5, 8], W [in 8, out 6]).
MM_CASES = {
    "column": ([R, S(1)], S(1), [None, None]),
    "column, x sharded on features": ([S(1), S(1)], S(1), [R, None]),
    "row": ([S(1), S(0)], P, [None, None]),
    "row, x whole": ([R, S(0)], P, [S(1), None]),
    "weight whole, rows of x sharded": ([S(0), R], S(0), [None, None]),
    "weight whole, features of x sharded": ([S(1), R], R, [R, None]),
}


@pytest.mark.parametrize("case", MM_CASES)
def test_mm(case: str) -> None:
    given, out, want = MM_CASES[case]
    check(torch.mm, [(5, 8), (8, 6)], given, out, want)


def test_matmul_dims_name_the_weight_and_its_output_features() -> None:
    aten = torch.ops.aten
    assert matmul_dims(aten.linear.default) == (0, 1, 0)  # W[out, in]
    assert matmul_dims(aten.addmm.default) == (1, 2, 1)  # W[in, out]
    assert matmul_dims(aten.mm.default) == (0, 1, 1)
    assert matmul_dims(aten.bmm.default) is None  # two activations: the _bmm rule


# bmm(a [4, 5, 8], b [4, 8, 6]): batch dims sharded alike, or a contraction split (partial).
BMM_CASES = {
    "batch sharded on both": ([S(0), S(0)], S(0), [None, None]),
    "batch sharded on a": ([S(0), R], S(0), [None, S(0)]),
    "batch sharded on b": ([R, S(0)], S(0), [S(0), None]),
    "contraction split": ([S(2), S(1)], P, [None, None]),
    "rows of a": ([S(1), R], S(1), [None, None]),
    "columns of b": ([R, S(2)], S(2), [None, None]),
    "a partial": ([P, R], R, [R, None]),
    "contraction of a only": ([S(2), R], R, [R, None]),
    "rows of a and columns of b": ([S(1), S(2)], R, [R, R]),
}


@pytest.mark.parametrize("case", BMM_CASES)
def test_bmm(case: str) -> None:
    given, out, want = BMM_CASES[case]
    check(torch.bmm, [(4, 5, 8), (4, 8, 6)], given, out, want)


MATMUL_CASES = {
    "heads sharded on both": ([(2, 4, 5, 8), (2, 4, 8, 6)], [S(1), S(1)], S(1), [None, None]),
    "heads sharded on a": ([(2, 4, 5, 8), (2, 4, 8, 6)], [S(1), R], S(1), [None, S(1)]),
    "contraction split": ([(2, 4, 5, 8), (2, 4, 8, 6)], [S(3), S(2)], P, [None, None]),
    "ranks differ": ([(4, 5, 8), (8, 6)], [S(0), R], R, [R, None]),
}


@pytest.mark.parametrize("case", MATMUL_CASES)
def test_matmul_of_two_activations(case: str) -> None:
    shapes, given, out, want = MATMUL_CASES[case]
    check(torch.matmul, shapes, given, out, want)


# embedding(ids [4, 3], table [10 rows, 6]) (exported as aten.embedding(table, ids)).
EMBEDDING_CASES = {
    "vocab-parallel": ([R, S(0)], P, [None, None]),
    "vocab-parallel, ids sharded": ([S(0), S(0)], P, [R, None]),
    "features sharded": ([R, S(1)], S(2), [None, None]),
    "rows of ids sharded": ([S(0), R], S(0), [None, None]),
    "whole": ([R, R], R, [None, None]),
}


@pytest.mark.parametrize("case", EMBEDDING_CASES)
def test_embedding(case: str) -> None:
    given, out, want = EMBEDDING_CASES[case]
    check(F.embedding, [(4, 3), (10, 6)], given, out, want, ints=1)


# scaled_dot_product_attention(q, k, v [2, heads, 5, 8], mask): sharded by heads when they divide.
SDPA_CASES = {
    "q by heads": ([(2, 4, 5, 8)] * 3, [S(1), R, R], S(1), [None, S(1), S(1)]),
    "all by heads": ([(2, 4, 5, 8)] * 3, [S(1), S(1), S(1)], S(1), [None, None, None]),
    "whole": ([(2, 4, 5, 8)] * 3, [R, R, R], R, [None, None, None]),
    "heads do not divide": ([(2, 3, 5, 8)] * 3, [S(1), R, R], R, [R, None, None]),
    "mask per head": ([(2, 4, 5, 8)] * 3 + [(2, 4, 5, 5)], [S(1)] * 3 + [R], S(1), [None] * 3 + [S(1)]),
    "mask shared by heads": ([(2, 4, 5, 8)] * 3 + [(2, 1, 5, 5)], [S(1)] * 3 + [S(0)], S(1), [None] * 3 + [R]),
}


@pytest.mark.parametrize("case", SDPA_CASES)
def test_attention(case: str) -> None:
    shapes, given, out, want = SDPA_CASES[case]
    check(F.scaled_dot_product_attention, shapes, given, out, want)
