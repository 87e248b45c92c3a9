"""How a tensor is laid out along one mesh dimension: Shard(dim), Replicate() or Partial()."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Partial", "Placement", "Replicate", "Shard"]


@dataclass(frozen=True)
class Shard:
    """Each rank holds one slice along tensor dimension ``dim``.

    ``blocks > 1``: the dimension is ``blocks`` equal parts laid end to end (a fused QKV projection's
    q, k and v), and each rank holds its slice of every part, so that splitting the parts apart
    leaves each rank with its own q, k and v heads.
    """

    dim: int
    blocks: int = 1

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def local(self, full: torch.Tensor, rank: int, degree: int) -> torch.Tensor:
        """This rank's slice of ``full`` (a view)."""
        size = full.shape[self.dim]
        if size % (self.blocks * degree):
            raise ValueError(f"{self}: dimension of size {size} does not split into {self.blocks} x {degree} parts")
        parts = full.unflatten(self.dim, (self.blocks, size // self.blocks))
        step = size // self.blocks // degree
        return parts.narrow(self.dim + 1, rank * step, step).flatten(self.dim, self.dim + 1)

    def join(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's slice, in rank order (the inverse of ``local``)."""
        parts = [p.unflatten(self.dim, (self.blocks, p.shape[self.dim] // self.blocks)) for p in pieces]
        return torch.cat(parts, dim=self.dim + 1).flatten(self.dim, self.dim + 1)

    def __str__(self) -> str:
        return f"S({self.dim})" if self.blocks == 1 else f"S({self.dim})x{self.blocks}"


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
