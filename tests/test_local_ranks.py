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


PARENT = """
import os, sys, time
from autoshard.launch import LocalRanks


def pid(rank, world_size):
    return os.getpid()


if __name__ == "__main__":
    pool = LocalRanks(2).start()
    print(" ".join(str(p) for p in pool.run(pid)), flush=True)
    time.sleep(600)
"""


def test_ranks_end_when_their_parent_is_killed(tmp_path) -> None:
    """A pool whose parent is killed (no close, no atexit: SIGKILL, or a benchmark's pkill) leaves no ranks
    holding memory and cores: each rank ends within seconds of its parent."""
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        ranks = [int(p) for p in parent.stdout.readline().split()]
        assert len(ranks) == 2 and all(_alive(r) for r in ranks)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 20
        while any(_alive(r) for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(r) for r in ranks), ranks
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped by its new parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
