"""Shared fixtures: one pool of real gloo ranks per world size, started once per test session."""

from __future__ import annotations

import pytest
from hypothesis import settings

from autoshard.launch import LocalRanks


class RankPools:
    def __init__(self) -> None:
        self._pools: dict[int, LocalRanks] = {}

    def __call__(self, world_size: int) -> LocalRanks:
        pool = self._pools.get(world_size)
        if pool is None:
            pool = self._pools[world_size] = LocalRanks(world_size)
        return pool.start()

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()


@pytest.fixture(scope="session")
def ranks():
    """``ranks(n)``: a started LocalRanks pool of n gloo ranks, shared by every test that asks."""
    pools = RankPools()
    yield pools
    pools.close()


# Reproducible property tests in CI: the same examples every run, no per-example deadline.
settings.register_profile("autoshard", derandomize=True, deadline=None, max_examples=25)
settings.load_profile("autoshard")
