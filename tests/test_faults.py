"""A rank that dies or stalls mid-step: every other rank's step fails within the compile-time timeout,
naming the step and the operation it waited in; nothing hangs."""

from __future__ import annotations

import re
import time

import pytest
from checkpoint_cases import fail_at_second_step
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoshard.launch import LocalRanks, RankFailure

TIMEOUT = 5.0
PLANS = {
    "dp4": ({"dp": 4}, {}, {}),
    "tp4": ({"tp": 4}, {}, {}),
    "pp4": ({"pp": 4}, {"microbatches": 4}, {"layers": 4}),
    "dp4-zero3": ({"dp": 4}, {"zero": 3}, {}),
}
CASES = [(plan, fault) for plan in PLANS for fault in ("kill", "stall")]
LINE = re.compile(r"rank (\d): step 2 failed in (\w+) \(timeout 5s; another rank died or stalled\)")


def check_fault(plan: str, fault: str) -> None:
    mesh, extra, shape = PLANS[plan]
    family = "llama" if plan == "pp4" else "gpt2"
    start = time.perf_counter()
    with LocalRanks(4, timeout=120) as pool:
        if fault == "kill":
            with pytest.raises(RankFailure, match="rank 1 died") as failure:
                pool.run(fail_at_second_step, family, mesh, extra, fault, **shape)
            reports = re.findall(r"REPORT ([\d.]+)s (.*)", str(failure.value))
            seconds, messages = [float(s) for s, _ in reports], [m for _, m in reports]
        else:
            results = pool.run(fail_at_second_step, family, mesh, extra, fault, **shape)
            survivors = [r for i, r in enumerate(results) if i != 1]
            seconds, messages = [r["seconds"] for r in survivors], [r["message"] for r in survivors]
    assert len(messages) == 3, messages
    for message, took in zip(messages, seconds):
        assert LINE.search(message), message
        assert took < TIMEOUT + 10, (message, took)
    assert time.perf_counter() - start < 120  # the pool, its ranks included, is gone


@pytest.mark.slow
@pytest.mark.parametrize(("plan", "fault"), CASES)
def test_other_ranks_fail_within_the_timeout(plan: str, fault: str) -> None:
    check_fault(plan, fault)


# All eight with -m slow; every run draws one.
@settings(max_examples=1, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(CASES))
def test_other_ranks_fail_within_the_timeout_sample(case: tuple[str, str]) -> None:
    check_fault(*case)
