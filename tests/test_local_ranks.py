"""LocalRanks keeps each rank on cores of its own where there are enough: every thread of a rank's process
(its compute and gloo's), so that no rank's gloo thread waits behind another rank's compute."""

from __future__ import annotations

import os

import pytest

from autoshard.launch import LocalRanks, _cores_of_ranks


def thread_affinities(rank: int, world_size: int) -> list[set[int]]:
    return [os.sched_getaffinity(int(tid)) for tid in os.listdir("/proc/self/task")]


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="two ranks, a core each (Linux)"
)
def test_each_rank_and_every_thread_of_it_stays_on_a_core_of_its_own(ranks) -> None:
    cores = sorted(os.sched_getaffinity(0))
    per_rank = ranks(2).run(thread_affinities)
    for rank, threads in enumerate(per_rank):
        assert len(threads) > 1  # the process group's threads are there too
        assert all(affinity == {cores[rank]} for affinity in threads), (rank, threads)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="affinity is Linux's")
def test_too_few_cores_or_pin_off_leaves_the_scheduler_free() -> None:
    cores = os.sched_getaffinity(0)
    assert _cores_of_ranks(len(cores) + 1, 1) is None
    assert _cores_of_ranks(1, len(cores) + 1) is None
    assert _cores_of_ranks(1, len(cores)) == [cores]
    with LocalRanks(1, pin=False) as pool:
        assert all(affinity == cores for affinity in pool.run(thread_affinities)[0])
