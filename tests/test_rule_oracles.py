"""Every sharding rule against the oracle of tests/rule_oracle.py: random shapes, arguments and input
placements; the ranks' outputs joined as the rule says must equal the op on the full tensors."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rule_oracle import DEGREES, SAMPLES, check, placements_for

from autoshard.sharding import RULES


def test_every_rule_has_an_oracle_case() -> None:
    missing = sorted(str(op) for op in RULES.keys() - SAMPLES.keys())
    assert not missing, f"rules with no oracle samples (add them to tests/rule_oracle.py SAMPLES): {missing}"


def _holds(op, data) -> None:
    sample = data.draw(SAMPLES[op](), label="sample")
    degree = data.draw(st.sampled_from(DEGREES), label="degree")
    placements = data.draw(placements_for(sample.tensors(), degree), label="placements")
    check(op, sample, placements, degree)


@pytest.mark.parametrize("op", list(SAMPLES), ids=str)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_rule_holds(op, data) -> None:
    _holds(op, data)


@pytest.mark.slow
@pytest.mark.parametrize("op", list(SAMPLES), ids=str)
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_rule_holds_over_many_draws(op, data) -> None:
    _holds(op, data)


def test_the_oracle_catches_a_rule_right_only_for_the_usual_permutations(monkeypatch) -> None:
    """Inverting the permutation is right for the swaps attention makes (0, 2, 1, 3), wrong for a cycle."""
    import torch
    from rule_oracle import Oracle, Sample, _tensor

    from autoshard.ir.placements import Shard
    from autoshard.sharding.rule import Decision

    aten = torch.ops.aten

    def inverted(ctx):
        p = ctx.p(ctx.node.args[0])
        return Decision(Shard(ctx.node.args[1][p.dim], p.blocks)) if isinstance(p, Shard) else Decision(p)

    monkeypatch.setitem(RULES, aten.permute.default, inverted)
    swap = Sample((_tensor((2, 4, 6, 3)), [0, 2, 1, 3]))
    assert check(aten.permute.default, swap, [Shard(1)], 2) == Shard(2)  # a swap is its own inverse
    cycle = Sample((_tensor((2, 4, 6, 3)), [1, 2, 0, 3]))
    with pytest.raises(Oracle, match="joined as S"):
        check(aten.permute.default, cycle, [Shard(1)], 2)


def test_the_oracle_catches_a_partial_claim_through_a_nonlinear_op(monkeypatch) -> None:
    import torch
    from rule_oracle import Oracle, Sample, _tensor

    from autoshard.ir.placements import Partial
    from autoshard.sharding.rule import Decision

    aten = torch.ops.aten
    monkeypatch.setitem(RULES, aten.gelu.default, lambda ctx: Decision(Partial()))
    with pytest.raises(Oracle, match="summed as P"):
        check(aten.gelu.default, Sample((_tensor((4, 6)),)), [Partial()], 2)
