"""The collectives' cost model that Hardware and its calibration share: how much of a tensor each rank
moves and in how many ring steps (NCCL-tests' bus factors), and a measured fit of one collective."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["COLLECTIVES", "CollectiveFit", "ring_factors"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


def ring_factors(op: str, n: int) -> tuple[float, int]:
    """(share of the tensor each rank moves, ring steps) of ``op`` over ``n`` ranks (NCCL-tests' bus factors)."""
    return {
        "all_reduce": (2 * (n - 1) / n, 2 * (n - 1)),
        "all_gather": ((n - 1) / n, n - 1),
        "reduce_scatter": ((n - 1) / n, n - 1),
        "send_recv": (1.0, 1),
        "all_to_all": ((n - 1) / n, n - 1),  # each rank's buffer: all but its own share leaves it
    }[op]


@dataclass(frozen=True)
class CollectiveFit:
    """A measured alpha-beta fit of one collective over ``group_size`` ranks on one kind of link, and the
    timings it was measured at."""

    op: str
    scope: str  # "intra" (inside a node) or "inter"
    group_size: int
    bandwidth: float  # bus bytes/s
    latency: float  # s per step of the ring
    # (full bytes, seconds) as timed, smallest first. The line runs through the smallest and the largest; in
    # between a collective's cost does not follow it (gloo's 2 MiB all-reduce over 2 ranks here took 1.6x the
    # line's time: its algorithm changes with the size), so sizes between are read off these.
    points: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "points", tuple(sorted((float(n), float(t)) for n, t in self.points)))

    def seconds_at(self, nbytes: float) -> float | None:
        """Seconds for ``nbytes`` between the sizes timed (linear between the two nearest, each no faster than a
        smaller one: noise cannot make a larger message cheaper), None outside them."""
        if len(self.points) < 2 or not self.points[0][0] <= nbytes <= self.points[-1][0]:
            return None
        envelope, most = [], 0.0
        for size, seconds in self.points:
            most = max(most, seconds)
            envelope.append((size, most))
        for (lo, t_lo), (hi, t_hi) in zip(envelope, envelope[1:]):
            if nbytes <= hi:
                return t_lo + (t_hi - t_lo) * (nbytes - lo) / max(hi - lo, 1e-9)
        return envelope[-1][1]
