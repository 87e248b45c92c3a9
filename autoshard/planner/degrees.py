"""The numbers the search tries: the mesh's factorizations, divisors, and microbatch counts."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autoshard.spec.schedules import Schedule

__all__ = ["default_microbatches", "divisors", "factorizations", "geometric"]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n else []


def geometric(n: int) -> list[int]:
    """Divisors of n that are powers of two, and n itself: microbatch counts worth trying."""
    out, d = [], 1
    while d <= n:
        if n % d == 0:
            out.append(d)
        d *= 2
    return [*out, n] if n else []


def default_microbatches(local_rows: int, pp: int, schedule: str | Schedule) -> int:
    """The most microbatches up to 4 x pp that divide a dp rank's rows (bubble (pp-1)/(m+pp-1) shrinks with m).

    Interleaved 1F1B needs a multiple of pp; when none divides the rows, pp itself (compile then says why).
    """
    step = pp if schedule == "interleaved_1f1b" else 1
    options = [m for m in range(step, 4 * pp + 1, step) if local_rows % m == 0]
    return max(options) if options else step


def factorizations(world: int) -> list[tuple[int, int, int]]:
    out = []
    for tp in range(1, world + 1):
        if world % tp:
            continue
        for pp in range(1, world // tp + 1):
            if (world // tp) % pp:
                continue
            out.append((world // (tp * pp), tp, pp))
    return out
