"""How a tensor is laid out along one mesh dimension: Shard(dim), Replicate(), Partial() or OnStages(ranks).

A ``ParamPlacement`` is one state tensor's record: its full shape and one placement per mesh
dimension (DTensor's tuple of placements, with the pipeline dimension's own kind). The runtime, the
state dict, ``for_rank`` and the global gradient norm all read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["OnRank", "OnStages", "ParamPlacement", "Partial", "Placement", "Replicate", "Shard"]


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


@dataclass(frozen=True)
class OnStages:
    """Along pp: the tensor lives on these pipeline ranks only (several: a weight tied across stages)."""

    ranks: tuple[int, ...]

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def __str__(self) -> str:
        return "@" + ",".join(str(r) for r in self.ranks)


@dataclass(frozen=True)
class OnRank:
    """Along ep: one expert's tensor of a loop over experts, held whole by the ep rank that runs the expert."""

    rank: int

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def __str__(self) -> str:
        return f"@ep{self.rank}"


Placement = Shard | Replicate | Partial | OnStages | OnRank


@dataclass(frozen=True)
class ParamPlacement:
    """Where one tensor of the model's state lives on the mesh.

    pp    OnStages(ranks) for a tensor the stages of those pipeline ranks read; Replicate() when every
          pipeline rank holds it (no pipeline, or a tensor no stage reads)
    dp    Shard(0): ZeRO-3 keeps a flat 1/dp shard of it at rest; Replicate() otherwise
    tp    Shard(dim) (strided: Shard(dim, blocks)) when tensor parallelism splits it; Replicate() otherwise
    partial_over_tp: its gradient is a partial sum on each tp rank (a replicated weight used on
          sequence shards, or a bias split over the ranks), summed over tp after backward
    ep    Shard(0): an expert weight split over the ep ranks (each holds E / ep experts), data parallel over
          the dp / ep ranks that hold the same experts; OnRank(k): the weight of one expert of a loop over
          experts, held whole by ep rank k (data parallel likewise); Replicate() otherwise
    """

    key: str
    shape: tuple[int, ...]
    trainable: bool
    pp: OnStages | Replicate
    dp: Shard | Replicate
    tp: Shard | Replicate
    partial_over_tp: bool = False
    ep: Shard | Replicate | OnRank = Replicate()

    @property
    def tied(self) -> bool:
        """A trainable tensor that several pipeline ranks hold a copy of (its gradients are summed there)."""
        return self.trainable and isinstance(self.pp, OnStages) and len(self.pp.ranks) > 1

    @property
    def expert(self) -> bool:
        """A weight that ep splits: data parallel over the dp / ep ranks holding the same experts."""
        return isinstance(self.ep, (Shard, OnRank))

    def held_on(self, coords: dict[str, int], ep: int) -> bool:
        """Whether the rank at these mesh coordinates holds the tensor (under ``ep``: its ep rank is dp % ep)."""
        if isinstance(self.ep, OnRank) and coords["dp"] % ep != self.ep.rank:
            return False
        return not isinstance(self.pp, OnStages) or coords["pp"] in self.pp.ranks

    def counts_in_norm(self, coords: dict[str, int], grad_sharded_over_dp: bool, ep: int = 1) -> bool:
        """Whether this rank's copy of the gradient counts in the global norm: every element exactly once.

        A dimension that shards the gradient counts every rank's part; one that replicates it counts
        its first rank's copy (a tied weight: the first pipeline rank that holds it).
        """
        if isinstance(self.tp, Replicate) and coords["tp"] != 0:
            return False
        if isinstance(self.pp, OnStages) and coords["pp"] != self.pp.ranks[0]:
            return False
        if isinstance(self.pp, Replicate) and coords["pp"] != 0:
            return False
        if grad_sharded_over_dp:
            return True
        if self.expert:  # each ep rank's experts, once: on the first ranks holding them
            return coords["dp"] < ep
        return coords["dp"] == 0 and coords.get("cp", 0) == 0

    def by_dim(self) -> dict[str, Placement]:
        # cp ranks hold other tokens of the same rows: every parameter is whole on each of them
        return {"pp": self.pp, "dp": self.dp, "cp": Replicate(), "tp": self.tp, "ep": self.ep}

    def __str__(self) -> str:
        extra = " (gradient partial over tp)" if self.partial_over_tp else ""
        return f"{self.key} {tuple(self.shape)}: pp {self.pp}, dp {self.dp}, tp {self.tp}{extra}"
