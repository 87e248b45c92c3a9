"""The device mesh: how ranks are arranged along the pp, dp, cp and tp dimensions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autoshard.errors import InputError, MeshError

__all__ = ["MESH_DIMS", "REPLICAS", "Mesh", "resolve_mesh"]

# Outer to inner: tp ranks are neighbours (they talk most, so they share the fastest links), then cp
# (a ring of K/V blocks every layer), then dp, then pp (Megatron's ordering).
MESH_DIMS = ("pp", "dp", "cp", "tp")
# The ranks that hold the same parameters (before ZeRO shards them) and reduce their gradients together:
# data parallel ranks hold different rows, context parallel ranks different tokens of the same rows.
REPLICAS = ("dp", "cp")

Dims = str | tuple[str, ...]


def _check_degree(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MeshError(
            f"mesh degree {name}={value!r} is not a positive integer; "
            f"give every degree as an int >= 1, e.g. Mesh(dp=2, tp=1, pp=1)"
        )


@dataclass(frozen=True)
class Mesh:
    """A 4-D arrangement of ranks: ``size == dp * cp * tp * pp``.

    Rank numbering puts tp innermost, then cp: ``rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp +
    tp_index``. ``cp`` (context parallel) splits every sequence over its ranks.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in MESH_DIMS:
            _check_degree(name, getattr(self, name))

    @property
    def size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def degree(self, dim: Dims) -> int:
        """The ranks along ``dim``, or along several dimensions at once (``REPLICAS``: dp x cp)."""
        if isinstance(dim, tuple):
            out = 1
            for d in dim:
                out *= self.degree(d)
            return out
        if dim not in MESH_DIMS:
            raise MeshError(f"unknown mesh dimension {dim!r}; the dimensions are {MESH_DIMS}")
        return getattr(self, dim)

    def product_str(self) -> str:
        cp = f" x cp({self.cp})" if self.cp > 1 else ""
        return f"dp({self.dp}){cp} x tp({self.tp}) x pp({self.pp}) = {self.size}"

    def check_world_size(self, world_size: int) -> None:
        if self.size != world_size:
            raise MeshError(
                f"mesh {self.product_str()} != world size {world_size}; "
                f"choose degrees whose product is {world_size}, or launch {self.size} ranks "
                f"(torchrun --nproc-per-node {self.size})"
            )

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each mesh dimension."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.size:
            raise MeshError(f"rank {rank!r} is outside this mesh of {self.size} ranks (0..{self.size - 1})")
        tp_index = rank % self.tp
        cp_index = (rank // self.tp) % self.cp
        dp_index = (rank // (self.tp * self.cp)) % self.dp
        pp_index = rank // (self.tp * self.cp * self.dp)
        return {"pp": pp_index, "dp": dp_index, "cp": cp_index, "tp": tp_index}

    def rank_of(self, *, pp: int = 0, dp: int = 0, tp: int = 0, cp: int = 0) -> int:
        for name, index in (("pp", pp), ("dp", dp), ("cp", cp), ("tp", tp)):
            if not 0 <= index < self.degree(name):
                raise MeshError(f"{name} index {index} is outside 0..{self.degree(name) - 1}")
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def replica_index(self, rank: int) -> int:
        """``rank``'s place among the ranks holding the same parameters (dp x cp, cp inner)."""
        here = self.coords(rank)
        return here["dp"] * self.cp + here["cp"]

    def group(self, dim: Dims, rank: int) -> list[int]:
        """The ranks that share every coordinate with ``rank`` except ``dim`` (or each of several dims), in order."""
        here = self.coords(rank)
        dims = dim if isinstance(dim, tuple) else (dim,)
        out = [here]
        for d in dims:
            out = [{**c, d: i} for c in out for i in range(self.degree(d))]
        return sorted(self.rank_of(**c) for c in out)

    def groups(self, dim: Dims) -> list[list[int]]:
        """Every group along ``dim``: one list of ranks per combination of the other coordinates."""
        seen: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.size):
            group = self.group(dim, rank)
            seen.setdefault(tuple(group), group)
        return list(seen.values())

    def expert_groups(self, rank: int, ep: int) -> tuple[list[int], list[int]]:
        """``rank``'s expert-parallel group (the ep consecutive dp ranks that split the experts among them)
        and its expert-data-parallel group (the dp / ep ranks holding the same experts), as Megatron-core
        and torchtitan carve them out of dp."""
        if ep < 1 or self.dp % ep:
            raise MeshError(f"ep={ep} does not divide dp={self.dp}: expert-parallel groups are carved out of dp")
        here = self.coords(rank)
        first = here["dp"] - here["dp"] % ep
        ep_group = [self.rank_of(**{**here, "dp": first + i}) for i in range(ep)]
        replicas = [self.rank_of(**{**here, "dp": here["dp"] % ep + j * ep}) for j in range(self.dp // ep)]
        return ep_group, replicas

    def table(self) -> str:
        """A rank-by-rank table of coordinates, for people."""
        dims = [d for d in ("pp", "dp", "cp", "tp") if d != "cp" or self.cp > 1]
        lines = ["rank  " + "  ".join(dims)]
        for rank in range(self.size):
            c = self.coords(rank)
            lines.append(f"{rank:>4}  " + "  ".join(f"{c[d]:>2}" for d in dims))
        return "\n".join(lines)

    def __str__(self) -> str:
        cp = f", cp={self.cp}" if self.cp > 1 else ""
        return f"Mesh(dp={self.dp}{cp}, tp={self.tp}, pp={self.pp}; {self.size} ranks)"

    @classmethod
    def from_device_mesh(cls, device_mesh: Any) -> Mesh:
        """Build a Mesh from a ``torch.distributed.device_mesh.DeviceMesh``.

        Dimension names must be among ``dp``, ``cp``, ``tp`` and ``pp``; an unnamed 1-D mesh is data parallel.
        """
        names = getattr(device_mesh, "mesh_dim_names", None)
        ndim = device_mesh.ndim
        if names is None:
            if ndim != 1:
                raise MeshError(
                    f"a {ndim}-D DeviceMesh needs mesh_dim_names from {MESH_DIMS} so autoshard knows "
                    f"which dimension is which; pass mesh_dim_names=(...) to init_device_mesh"
                )
            names = ("dp",)
        degrees: dict[str, int] = {}
        for i, name in enumerate(names):
            if name not in MESH_DIMS:
                raise MeshError(
                    f"DeviceMesh dimension {name!r} is not one of {MESH_DIMS}; rename it when creating the mesh"
                )
            if name in degrees:
                raise MeshError(f"DeviceMesh names dimension {name!r} twice")
            degrees[name] = int(device_mesh.size(i))
        return cls(**degrees)


def resolve_mesh(mesh: Any) -> int | Mesh:
    """What ``compile`` and ``plan`` take as a mesh: a Mesh, a torch DeviceMesh, or a world size."""
    if isinstance(mesh, Mesh):
        return mesh
    if isinstance(mesh, int) and not isinstance(mesh, bool):
        if mesh < 1:
            raise MeshError(f"mesh={mesh} is not a positive world size; pass the number of ranks or a Mesh")
        return mesh
    if type(mesh).__name__ == "DeviceMesh":
        return Mesh.from_device_mesh(mesh)
    raise InputError(
        f"mesh must be an autoshard.Mesh, a torch DeviceMesh, or an int world size, got {type(mesh).__name__}"
    )
