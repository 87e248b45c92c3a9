"""RankProgram: one rank's view of a compiled program (``program.for_rank(r)``), offline for any mesh."""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from autoshard.ir.placements import Placement
from autoshard.spec.mesh import MESH_DIMS

__all__ = ["RankProgram"]


@dataclass(frozen=True)
class RankProgram:
    """One rank's view of the program: its coordinates, graphs and parameter placements."""

    rank: int
    coords: dict[str, int]
    graph_modules: tuple[fx.GraphModule, ...]
    placements: dict[str, dict[str, Placement]]

    def graph_code(self) -> str:
        return "\n".join(gm.code for gm in self.graph_modules)

    def __str__(self) -> str:
        coords = ", ".join(f"{d}={self.coords[d]}" for d in MESH_DIMS)
        lines = [f"rank {self.rank} ({coords}): {len(self.graph_modules)} graph(s)"]
        for name, per_dim in self.placements.items():
            lines.append(f"  {name:<48} " + " ".join(f"{d}:{per_dim[d]}" for d in MESH_DIMS))
        return "\n".join(lines)
