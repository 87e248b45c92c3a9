"""Graph ops that stay eager under torch.compile: dynamo breaks the graph around each call of a ``stays_eager`` op.

ZeRO-3's gather and free, the pipeline's receive, send and size, dropout on tensor-parallel shards
and recompute regions keep state outside the graph (gathered buffers, the channel, random streams).
Marking them with ``torch._dynamo.disable`` when they are defined would import dynamo with autoshard;
instead each call goes through ``_run``, which ``enable()`` (called before the first torch.compile)
replaces by a disabled caller, and dynamo breaks the graph where it meets it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["enable", "stays_eager"]


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


_run = _call


def enable() -> None:
    """From now on, dynamo breaks the graph at every ``stays_eager`` op."""
    global _run
    import torch._dynamo

    if _run is _call:
        _run = torch._dynamo.disable(_call, reason="autoshard runtime op that keeps state outside the graph")


def stays_eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator of a graph op that torch.compile leaves to run eagerly."""

    @functools.wraps(fn)
    def op(*args: Any, **kwargs: Any) -> Any:
        return _run(fn, *args, **kwargs)

    return op
