"""How a tensor is laid out along one mesh dimension: Shard(dim), Replicate() or Partial()."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Partial", "Placement", "Replicate", "Shard"]


@dataclass(frozen=True)
class Shard:
    """Each rank holds one contiguous slice along tensor dimension ``dim``."""

    dim: int

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Replicate:
    """Each rank holds the whole tensor."""

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    """Each rank holds a partial value; the full tensor is their reduction (``sum``)."""

    reduce_op: str = "sum"

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def __str__(self) -> str:
        return "P" if self.reduce_op == "sum" else f"P({self.reduce_op})"


Placement = Shard | Replicate | Partial
