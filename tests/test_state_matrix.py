"""State round trips between plans, on two gloo ranks: saved under one plan (a checkpoint, or a full state
dict with masters), loaded under another. The plan that loads must hold exactly what the saving plan held
(fp32 master weights kept apart by bf16 parameters or offload included), then train a step as one device
does from that state (tests/state_matrix_cases.py). A representative slice runs by default; every pair
and both ways of handing the state over with ``-m slow``."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from state_matrix_cases import PLANS, VIAS, hand_over, reference, take_over

LR = 1e-3  # the cases' AdamW: no element moves more than this in a step


def check_round_trip(ranks, tmp_path: Path, first: str, then: str, via: str) -> None:
    path = str(tmp_path / f"{first}-to-{then}-{via}")
    pool = ranks(2)
    held = pool.run(hand_over, first, via, path)[0]
    taken = pool.run(take_over, then, via, path)
    after = taken[0]
    # What the loading plan holds is what the saving plan held: fp32 values to the bit (a bf16 plan's
    # masters included); buffers in the loading plan's dtype.
    assert after["held"].keys() == held.keys()
    for key, value in held.items():
        mine = after["held"][key]
        assert torch.equal(mine, value.to(mine.dtype)), f"{key}: not what {first} held after {via} into {then}"
    # One step from there, as one device takes it.
    ref_loss, ref_state = reference(first, then, via == "state_dict")
    # The reference replays both plans' steps: a bf16 step there matches the program's to the rounding of
    # gradients that are noise (tests/test_zero.py), so after one the comparison is bf16's.
    bf16 = PLANS[first][2] == torch.bfloat16 or PLANS[then][2] == torch.bfloat16
    loss_rtol = 1e-2 if PLANS[then][2] == torch.bfloat16 else 1e-4 if bf16 else 1e-5
    for result in taken:
        assert result["loss"] == pytest.approx(ref_loss, rel=loss_rtol)
    state = after["state"]
    assert state.keys() == ref_state.keys()
    close = total = 0
    for key, expected in ref_state.items():
        actual = state[key].to(expected.dtype)
        if not expected.is_floating_point():
            assert torch.equal(actual, expected), key
            continue
        if not bf16:
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
            continue
        # bf16 gradients: an element whose gradient is rounding noise may take another Adam step (at most
        # lr); nearly all match the reference's masters closely.
        close += int(torch.isclose(actual, expected, rtol=1e-4, atol=1e-6).sum())
        total += expected.numel()
        assert (actual - expected).abs().max() <= LR * 1.01, key
    if total:
        assert close / total >= 0.99, f"{total - close} of {total} elements differ"


SLICE = [
    ("plain", "bf16", "checkpoint"),  # masters kept apart by the loading plan only
    ("bf16", "plain", "checkpoint"),  # ... by the saving plan only
    ("offload", "zero3", "checkpoint"),
    ("bf16-zero3-offload", "tp", "state_dict"),
    ("pp", "bf16-zero3-offload", "state_dict"),
    ("zero3", "bf16", "state_dict"),  # fp32 values into ZeRO-1's masters
]


@pytest.mark.parametrize(("first", "then", "via"), SLICE, ids=["-".join(s) for s in SLICE])
def test_state_round_trip(ranks, tmp_path: Path, first: str, then: str, via: str) -> None:
    check_round_trip(ranks, tmp_path, first, then, via)


@settings(max_examples=1, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=st.sampled_from(list(PLANS)), then=st.sampled_from(list(PLANS)), via=st.sampled_from(VIAS))
def test_state_round_trip_drawn(ranks, tmp_path: Path, first: str, then: str, via: str) -> None:
    check_round_trip(ranks, tmp_path, first, then, via)


MATRIX = list(itertools.product(PLANS, PLANS, VIAS))


@pytest.mark.slow
@pytest.mark.parametrize(("first", "then", "via"), MATRIX, ids=["-".join(m) for m in MATRIX])
def test_state_round_trip_matrix(ranks, tmp_path: Path, first: str, then: str, via: str) -> None:
    check_round_trip(ranks, tmp_path, first, then, via)
