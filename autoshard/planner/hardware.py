"""What the planner knows about the machines: compute, memory, links; from vendor figures or measured.

``Hardware.preset("a100-80gb")`` gives a device from its data sheet; ``Hardware.measure()`` (under a
process group) calibrates the ranks it runs on (autoshard/planner/calibrate.py); ``to_json`` and
``from_json`` keep either. Times follow three small models:

- a matmul of m x k by k x n takes ``2mnk / (peak * efficiency)``, where the efficiency grows with
  each dimension as ``d / (d + half_dim)`` up to ``matmul_efficiency`` (small matrices do not fill
  the device), and never less than the time to move its operands through memory (on a CPU, that
  move is added: its GEMMs pack their operands into cache-sized panels, a pass the multiply does not
  hide: part of why many small microbatches cost more than a few large ones there);
- an elementwise or reduction kernel is memory bound: bytes read and written over ``memory_bandwidth``;
  every kernel costs ``op_overhead`` (launch, or on a CPU the eager dispatch);
- a collective over ``n`` ranks is ``steps * latency + factor * bytes / bandwidth`` (NCCL-tests'
  bus bandwidth: an all-reduce moves 2(n-1)/n of the tensor, an all-gather or reduce-scatter (n-1)/n,
  a send all of it), over the intra-node link while the group fits in one node, else inter-node;
  an all-reduce of a small tensor takes NCCL's tree instead when that is faster (2 log2 n steps).
  A measured fit for an operation and group size replaces the default link figures.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from autoshard.errors import InputError
from autoshard.planner.links import COLLECTIVES, CollectiveFit, ring_factors

__all__ = ["COLLECTIVES", "CollectiveFit", "Hardware", "ring_factors"]


def dtype_name(dtype: torch.dtype | str | None) -> str:
    if dtype is None:
        return "float32"
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Hardware:
    """One kind of device and the links between them, as the cost model sees it (every field in SI units)."""

    name: str
    devices_per_node: int
    memory_bytes: int
    peak_flops: tuple[tuple[str, float], ...]  # dtype name -> FLOP/s (a dict is accepted)
    matmul_efficiency: float  # the largest fraction of peak a large matmul reaches
    matmul_half_dim: float  # the size of a dimension at which it reaches half of that
    memory_bandwidth: float  # bytes/s an elementwise kernel reaches in device memory
    op_overhead: float  # seconds every kernel costs besides its work
    intra_bandwidth: float  # bus bytes/s of a collective inside a node
    intra_latency: float
    inter_bandwidth: float  # per device, between nodes
    inter_latency: float
    host_bandwidth: float  # device <-> host memory (offload)
    host_memory_bandwidth: float  # bytes/s of the host's optimizer step (offload; on CPU ranks, every step's)
    overlap: float = 1.0  # share of an asynchronous collective that hides behind concurrent compute
    blocking: tuple[str, ...] = ()  # collectives the runtime issues synchronously here (they never overlap)
    kernels: str = "cuda"  # whose kernels run, "cuda" or "cpu" (what autograd keeps differs: passes.saved_tensors)
    # Ranks of a node that share processors (CPU ranks): as many ranks as this compute at full speed at
    # once, more share it; 0 when each rank has its own device.
    shared_cores: float = 0.0
    # Seconds a synchronous collective waits beyond its own time when it follows compute: ranks that share
    # cores reach it apart (by about a scheduler's time slice). 0 when each rank has its own device.
    sync_wait: float = 0.0
    # (group size, seconds) where groups of several sizes were timed: fewer ranks arrive less far apart.
    group_sync_waits: tuple[tuple[int, float], ...] = ()
    # Seconds a pipeline rank spends before each action outside any, once what it needs has arrived: the next
    # receive made and posted, the arrived one's wait. An eager CPU runtime pays it in line (between the
    # actions of two pipeline ranks with a core each here: medians of 19-46 us); a GPU's host runs ahead of
    # its kernels and hides it (0).
    action_gap: float = 0.0
    # (kernel, forward bytes/s, backward bytes/s) of the kernels a CPU runs slower than its memory moves
    # (planner/kernels.py: GELU, softmax, a dropout mask's draw, ...), in the cost model's bytes (read and
    # written; backward twice forward's); every other kernel, and every kernel of a GPU, at memory_bandwidth
    kernel_rates: tuple[tuple[str, float, float], ...] = ()
    collectives: tuple[CollectiveFit, ...] = field(default=())
    source: str = ""  # where the figures come from

    def __post_init__(self) -> None:
        if isinstance(self.peak_flops, dict):
            object.__setattr__(self, "peak_flops", tuple(sorted(self.peak_flops.items())))
        if self.kernels not in ("cuda", "cpu"):
            raise InputError(f"Hardware.kernels={self.kernels!r} must be 'cuda' or 'cpu'")
        fits = tuple(CollectiveFit(**f) if isinstance(f, dict) else f for f in self.collectives)
        object.__setattr__(self, "collectives", fits)
        object.__setattr__(self, "blocking", tuple(self.blocking))
        object.__setattr__(self, "group_sync_waits", tuple((int(n), float(w)) for n, w in self.group_sync_waits))
        object.__setattr__(self, "kernel_rates", tuple((str(k), float(f), float(b)) for k, f, b in self.kernel_rates))
        for name in ("devices_per_node", "memory_bytes"):
            if getattr(self, name) < 1:
                raise InputError(f"Hardware.{name}={getattr(self, name)} must be positive")

    # ---- what things cost ---------------------------------------------------------------------
    def peak(self, dtype: torch.dtype | str | None = None) -> float:
        """Peak FLOP/s for ``dtype`` (float32 when None); a dtype without a figure falls back to float32."""
        table = dict(self.peak_flops)
        name = dtype_name(dtype)
        if name not in table and "float32" not in table:
            raise InputError(f"{self.name} has no peak FLOP/s for {name}; give peak_flops={{'{name}': ...}}")
        return table.get(name, table.get("float32"))

    def efficiency(self, *dims: float) -> float:
        """The fraction of peak a matmul with these dimensions (m, n, k) reaches."""
        out = self.matmul_efficiency
        for d in dims:
            out *= d / (d + self.matmul_half_dim)
        return out

    def matmul_seconds(
        self, flops: float, dims: tuple[float, ...], nbytes: float, dtype: torch.dtype | str | None = None
    ) -> float:
        compute = flops / (self.peak(dtype) * self.efficiency(*dims)) if flops else 0.0
        moved = nbytes / self.memory_bandwidth
        if self.packs_operands:
            return self.op_overhead + compute + moved
        return self.op_overhead + max(compute, moved)

    @property
    def packs_operands(self) -> bool:
        """Whether a matmul first packs its operands into panels, a pass over memory its multiply does not hide
        (a CPU's GEMMs); a GPU's kernel overlaps moving its operands with the multiply."""
        return self.kernels == "cpu"

    def sharing(self, computing: float) -> float:
        """How much slower a rank computes while ``computing`` ranks of its node compute at once."""
        return max(1.0, computing / self.shared_cores) if self.shared_cores else 1.0

    def sync(self, group_size: int) -> float:
        """What a synchronous collective over ``group_size`` ranks waits for the last of them to arrive: the
        nearest group size timed, else ``sync_wait``."""
        if group_size <= 1:
            return 0.0
        if not self.group_sync_waits:
            return self.sync_wait
        return min(self.group_sync_waits, key=lambda w: (abs(math.log(w[0] / group_size)), w[0]))[1]

    def memory_seconds(self, nbytes: float, kernels: int = 1) -> float:
        return kernels * self.op_overhead + nbytes / self.memory_bandwidth

    def kernel_seconds(self, kernel: str, nbytes: float, backward: bool = False) -> float:
        """One elementwise or reduction kernel moving ``nbytes`` in forward (its backward: twice them), at the rate
        measured for ``kernel`` where there is one (``kernel_rates``), else at the memory bandwidth."""
        moved = 2 * nbytes if backward else nbytes
        for name, forward_rate, backward_rate in self.kernel_rates:
            if name == kernel:
                return self.op_overhead + moved / (backward_rate if backward else forward_rate)
        return self.memory_seconds(moved)

    def scope(self, span: int) -> str:
        """ "intra" when a group whose ranks lie within ``span`` consecutive ranks fits one node."""
        return "intra" if span <= self.devices_per_node else "inter"

    def link(self, op: str, group_size: int, scope: str) -> tuple[float, float]:
        """(bus bandwidth, latency per step) of ``op`` over ``group_size`` ranks: the nearest measured fit,
        else the link's figures."""
        best = self._nearest(op, group_size, scope)
        if best is not None:
            return best.bandwidth, best.latency
        if scope == "intra":
            return self.intra_bandwidth, self.intra_latency
        return self.inter_bandwidth, self.inter_latency

    def collective_seconds(self, op: str, nbytes: float, group_size: int, span: int | None = None) -> float:
        """Seconds for ``op`` on a tensor of ``nbytes`` (the full, unsharded size) over ``group_size`` ranks
        spread over ``span`` consecutive ranks (default: adjacent)."""
        n = group_size
        if n <= 1 and op != "send_recv":
            return 0.0
        scope = self.scope(span or n)
        fit = self._nearest(op, n, scope)
        timed = fit.seconds_at(nbytes) if fit is not None and fit.group_size == n else None
        if timed is not None:
            return timed
        bandwidth, latency = (fit.bandwidth, fit.latency) if fit is not None else self.link(op, n, scope)
        factor, steps = ring_factors(op, n)
        ring = steps * latency + factor * nbytes / bandwidth
        if op == "all_reduce" and not self._measured(op, scope):
            # NCCL takes a tree when it is faster (small messages): 2 log2(n) hops at half the bus bandwidth.
            tree = 2 * math.ceil(math.log2(n)) * latency + 2 * nbytes / bandwidth
            return min(ring, tree)
        return ring

    def _nearest(self, op: str, group_size: int, scope: str) -> CollectiveFit | None:
        fits = [f for f in self.collectives if f.op == op and f.scope == scope]
        if not fits:
            return None
        return min(fits, key=lambda f: (abs(math.log(f.group_size / group_size)), f.group_size))

    def _measured(self, op: str, scope: str) -> bool:
        return any(f.op == op and f.scope == scope for f in self.collectives)

    # ---- making and keeping one ---------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> Hardware:
        """A device from its vendor's figures: "a100-80gb", "h100-80gb", "h200" or "cpu"."""
        if name not in PRESETS:
            raise InputError(f"no hardware preset {name!r}; the presets are {sorted(PRESETS)}")
        return PRESETS[name]

    @classmethod
    def measure(
        cls,
        group: torch.distributed.ProcessGroup | None = None,
        *,
        name: str | None = None,
        memory_bytes: int | None = None,
    ) -> Hardware:
        """Calibrate the ranks of the current process group (call on every rank; every rank gets the same
        result): matmul throughput over a few shapes, memory bandwidth, kernel overhead, and the bandwidth
        and latency of every collective per group size. See autoshard/planner/calibrate.py."""
        from autoshard.planner.calibrate import measure

        base = PRESETS["h100-80gb" if torch.cuda.is_available() else "cpu"]
        return measure(base, group, name=name, memory_bytes=memory_bytes)

    def to_json(self, path: str | Path | None = None) -> str:
        """The figures as JSON (written to ``path`` too when given)."""
        data = dataclasses.asdict(self)
        data["peak_flops"] = dict(self.peak_flops)
        text = json.dumps(data, indent=1, sort_keys=True)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> Hardware:
        """Read what ``to_json`` wrote (a JSON string or a file)."""
        text = str(text_or_path)
        if not text.lstrip().startswith("{"):
            text = Path(text_or_path).read_text()
        data = json.loads(text)
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise InputError(f"hardware JSON has unknown field(s) {unknown}; write it with Hardware.to_json")
        data["blocking"] = tuple(data.get("blocking", ()))
        return cls(**data)

    def with_(self, **changes: Any) -> Hardware:
        """A copy with some figures changed (``hw.with_(memory_bytes=40 * 2**30)``)."""
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        peaks = ", ".join(f"{k} {v / 1e12:g} TFLOP/s" for k, v in self.peak_flops)
        return (
            f"{self.name}: {self.memory_bytes / 2**30:.0f} GiB, {peaks}, {self.devices_per_node} per node, "
            f"links {self.intra_bandwidth / 1e9:g} / {self.inter_bandwidth / 1e9:g} GB/s intra / inter node"
        )


GB = 1e9
# Vendor figures. A100: NVIDIA A100 Tensor Core GPU data sheet (80 GB SXM: 312 TFLOP/s dense BF16/FP16,
# 19.5 TFLOP/s FP32, 2,039 GB/s HBM2e, NVLink 600 GB/s, PCIe Gen4 64 GB/s); a DGX A100 node has 8 GPUs and
# 8 HDR InfiniBand HCAs of 200 Gb/s, one per GPU (25 GB/s). H100: NVIDIA H100 Tensor Core GPU data sheet
# (SXM: 989 TFLOP/s dense BF16, 67 TFLOP/s FP32, 3.35 TB/s HBM3, NVLink 900 GB/s, PCIe Gen5 128 GB/s); DGX
# H100: 8 ConnectX-7 400 Gb/s per node (50 GB/s per GPU). H200: NVIDIA H200 data sheet (141 GB HBM3e at
# 4.8 TB/s, otherwise the H100 SXM's compute and links). What kernels reach of those peaks is not on a
# data sheet: a large cuBLAS GEMM reaches about 80% of dense peak, elementwise kernels about 80% of the
# memory bandwidth, NCCL's bus bandwidth about 80% of NVLink's one-way rate; the host optimizer step of
# offload is a memory-bound pass over the state at a server's ~100 GB/s. "cpu" is one core of an AVX-512
# server (two 16-lane FMA units at 2.5 GHz: 160 GFLOP/s FP32) with loopback links; measure() replaces it.


def _dgx_gpu(
    name: str,
    memory_bytes: int,
    peak_flops: dict[str, float],
    matmul_efficiency: float,
    matmul_half_dim: float,
    hbm: float,
    nvlink: float,
    nic: float,
    pcie: float,
    source: str,
) -> Hardware:
    """One GPU of an 8-GPU DGX node from data-sheet figures in GB/s (HBM; NVLink and PCIe one way; the
    node's InfiniBand per GPU) and the shares of them that kernels reach (above)."""
    return Hardware(
        name=name, devices_per_node=8, memory_bytes=memory_bytes, peak_flops=peak_flops,
        matmul_efficiency=matmul_efficiency, matmul_half_dim=matmul_half_dim, memory_bandwidth=0.8 * hbm * GB,
        op_overhead=4e-6, intra_bandwidth=0.8 * nvlink * GB, intra_latency=5e-6, inter_bandwidth=0.9 * nic * GB,
        inter_latency=10e-6, host_bandwidth=0.8 * pcie * GB, host_memory_bandwidth=100 * GB, overlap=0.9,
        kernels="cuda", source=source,
    )  # fmt: skip


_H100 = _dgx_gpu(
    "H100 80GB SXM", 80 * 2**30, {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12}, 0.75, 64.0,
    hbm=3350, nvlink=450, nic=50, pcie=64, source="NVIDIA H100 data sheet; DGX H100 (8 x NDR 400 Gb/s per node)",
)  # fmt: skip
PRESETS = {
    "a100-80gb": _dgx_gpu(
        "A100 80GB SXM", 80 * 2**30, {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12}, 0.80, 48.0,
        hbm=2039, nvlink=300, nic=25, pcie=32, source="NVIDIA A100 data sheet; DGX A100 (8 x HDR 200 Gb/s per node)",
    ),
    "h100-80gb": _H100,
    "h200": dataclasses.replace(
        _H100, name="H200 SXM", memory_bytes=141 * 10**9, memory_bandwidth=0.8 * 4800 * GB,
        source="NVIDIA H200 data sheet; DGX H200 (8 x NDR 400 Gb/s per node)",
    ),
    "cpu": Hardware(
        name="CPU core", devices_per_node=8, memory_bytes=16 * 2**30,
        peak_flops={"float32": 160e9, "bfloat16": 320e9},
        matmul_efficiency=0.6, matmul_half_dim=32.0, memory_bandwidth=10 * GB, op_overhead=10e-6, action_gap=30e-6,
        intra_bandwidth=2 * GB, intra_latency=30e-6, inter_bandwidth=1 * GB, inter_latency=100e-6,
        host_bandwidth=10 * GB, host_memory_bandwidth=10 * GB, overlap=0.5, blocking=("all_gather", "reduce_scatter"),
        kernels="cpu", source="one AVX-512 core at 2.5 GHz (2 x 16-lane FMA); gloo over loopback",
    ),
}  # fmt: skip
