"""Sharding rules and placements without ranks: the registry's coverage, view grouping, strided shards."""

from __future__ import annotations

import pytest
import sympy
import torch
from cases import build_case, compile_case
from hypothesis import given
from hypothesis import strategies as st

import autoshard
from autoshard.ir.placements import Shard
from autoshard.sharding.views import view_groups

B, S = sympy.Symbol("B", integer=True, positive=True), sympy.Symbol("S", integer=True, positive=True)

# Ops that only ever build masks and positions from the inputs (or embed image patches): replicated.
INPUT_ONLY = {
    "aten.cumsum.default", "aten.diff.default", "aten.index.Tensor", "aten.new_ones.default",
    "aten.gather.default", "aten.conv2d.default",
}  # fmt: skip


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert", "vit"])
def test_every_op_that_sees_a_shard_has_a_rule(family: str) -> None:
    program = compile_case(build_case(family), autoshard.Mesh(tp=2))
    assert set(program.tp_report.unruled) <= INPUT_ONLY


def test_view_groups_follow_products_of_sizes() -> None:
    assert view_groups((B, S, 96), (B * S, 96)) == [((0, 1), (0,)), ((2,), (1,))]
    assert view_groups((B, S, 32), (B, S, 4, 8)) == [((0,), (0,)), ((1,), (1,)), ((2,), (2, 3))]
    assert view_groups((B, 4, 2, S, 4), (B, 8, S, 4)) == [((0,), (0,)), ((1, 2), (1,)), ((3,), (2,)), ((4,), (3,))]
    assert view_groups((B, S), (B, 1, S)) == [((0,), (0,)), ((), (1,)), ((1,), (2,))]


@given(
    blocks=st.integers(1, 3),
    degree=st.sampled_from([1, 2, 4]),
    per=st.integers(1, 3),
    dim=st.integers(0, 1),
)
def test_strided_shards_join_back(blocks: int, degree: int, per: int, dim: int) -> None:
    shape = [5, 5]
    shape[dim] = blocks * degree * per
    full = torch.arange(shape[0] * shape[1]).view(shape)
    placement = Shard(dim, blocks)
    pieces = [placement.local(full, r, degree) for r in range(degree)]
    assert all(p.shape[dim] == blocks * per for p in pieces)
    assert torch.equal(placement.join(pieces), full)
    if blocks > 1:  # each rank's slice of every block: splitting the blocks apart gives its own parts
        part = full.narrow(dim, 0, shape[dim] // blocks)
        assert torch.equal(pieces[0].narrow(dim, 0, per), part.narrow(dim, 0, per))
