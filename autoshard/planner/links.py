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
    """A measured alpha-beta fit of one collective over ``group_size`` ranks on one kind of link."""

    op: str
    scope: str  # "intra" (inside a node) or "inter"
    group_size: int
    bandwidth: float  # bus bytes/s
    latency: float  # s per step of the ring
