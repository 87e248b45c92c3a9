"""Training metrics after every step (``program.metrics``), a progress line every N steps, and
``program.profile``: a Chrome trace of the next steps with autoshard's own ranges on every rank.

The step time is split three ways on each rank: exposed communication is the time the rank was
blocked in a collective (a synchronous call, or waiting for an asynchronous one: what backward did
not hide), the bubble is the time a pipeline rank waited for its neighbours between actions, and
compute is the rest. MFU is the model's FLOPs (forward and backward at the step's global batch,
``program.cost``; recomputation not counted) over the step time, the world size and the device's
peak for the compute dtype (``program.plan_report.hardware``).
"""

from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sympy
import torch

from autoshard.distributed import tracing
from autoshard.errors import InputError
from autoshard.ir.meta import evaluate_expr

if TYPE_CHECKING:
    from autoshard.program import Program

__all__ = ["Monitor", "StepMetrics", "trace_path"]

log = logging.getLogger("autoshard")


@dataclass(frozen=True)
class StepMetrics:
    """One step on this rank, measured."""

    step: int
    loss: float
    step_seconds: float
    compute_seconds: float
    comm_seconds: float  # exposed: blocked in collectives
    bubble_seconds: float  # pipeline ranks waiting for their neighbours
    tokens: int  # global tokens (rows x sequence) per step; samples when the inputs have no sequence
    unit: str  # "tokens" or "samples"
    flops: float  # model FLOPs of the step, all ranks together
    peak_flops: float  # the device's peak FLOP/s for the compute dtype
    world_size: int
    peak_memory_bytes: int
    memory_source: str  # "cuda allocator" or "process RSS"
    # With ep: each MoE layer's expert load in this rank's ep group, the most rows an expert got over the
    # mean per expert (1.0: balanced; E / top_k at worst), by layer.
    expert_load: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.step_seconds if self.step_seconds > 0 else 0.0

    @property
    def tflops_per_rank(self) -> float:
        return self.flops / self.world_size / self.step_seconds / 1e12 if self.step_seconds > 0 else 0.0

    @property
    def mfu(self) -> float:
        if self.step_seconds <= 0 or self.peak_flops <= 0:
            return 0.0
        return self.flops / (self.world_size * self.step_seconds * self.peak_flops)

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out.update(tokens_per_second=self.tokens_per_second, tflops_per_rank=self.tflops_per_rank, mfu=self.mfu)
        return out

    def line(self) -> str:
        ms = 1e3
        return (
            f"step {self.step}: loss {self.loss:.4f}, {self.tokens_per_second:,.0f} {self.unit}/s, "
            f"{self.tflops_per_rank:.3g} TFLOP/s per rank, MFU {self.mfu:.2%}, step {self.step_seconds * ms:.1f} ms "
            f"(compute {self.compute_seconds * ms:.1f}, communication {self.comm_seconds * ms:.1f}, "
            f"bubble {self.bubble_seconds * ms:.1f}), peak memory {self.peak_memory_bytes / 2**20:.1f} MiB"
            + (f", expert load max/mean {max(self.expert_load.values()):.2f}" if self.expert_load else "")
        )


def _expert_load(runtime: Any) -> dict[str, float]:
    loads = runtime.ep.take_loads() if runtime.ep is not None else {}
    return {layer: float(rows.max() / rows.float().mean()) for layer, rows in loads.items() if rows.sum() > 0}


def trace_path(path: str | os.PathLike, rank: int, world: int) -> Path:
    """Where ``rank`` writes its trace: ``path`` with ``{rank}`` filled in, or ``.rank<r>`` before the suffix."""
    text = str(path)
    if "{rank}" in text:
        return Path(text.format(rank=rank))
    p = Path(text)
    return p if world == 1 else p.with_name(f"{p.stem}.rank{rank}{p.suffix or '.json'}")


class Monitor:
    """Measures each step of a Program's runtime; records a profile while asked to."""

    def __init__(self, program: Program) -> None:
        self.program = program
        self.last: StepMetrics | None = None
        self.history: list[StepMetrics] = []  # the last few steps (the report's measured timeline reads them)
        self.timelines: list[list[tuple[str, float, float]]] = []
        self._comm_before = 0.0
        self._profiler: Any = None
        self._profile_left = 0
        self._profile_path: Path | None = None
        self._flops: dict[tuple, float] = {}  # FLOPs of one step per sizes (sympy is slow to evaluate each step)

    # ---- metrics -------------------------------------------------------------------------------
    def _sizes(self, flat: list[torch.Tensor]) -> dict[str, int]:
        sizes = {}
        for tensor, shape in zip(flat, self.program.runtime.input_shapes):
            for dim, expr in enumerate(shape.sizes if shape is not None else ()):
                if isinstance(expr, sympy.Symbol):
                    sizes[expr.name] = tensor.shape[dim]
        sizes["B"] = sizes.get("B", 1) * self.program.plan.dp  # the global batch
        return sizes

    def after_step(self, loss: float, flat: list[torch.Tensor]) -> StepMetrics:
        program, runtime = self.program, self.program.runtime
        sizes = self._sizes(flat)
        key = tuple(sorted(sizes.items()))
        if key not in self._flops:
            cost = program.cost
            self._flops[key] = float(evaluate_expr(cost.flops_fwd + cost.flops_bwd, sizes))
        flops = self._flops[key]
        step = runtime.step_seconds
        blocked = sum(program.comm.seconds.values())
        comm, self._comm_before = blocked - self._comm_before, blocked
        stats = program.pipeline_stats
        bubble = max(0.0, stats.step_seconds - stats.busy_seconds) if stats is not None else 0.0
        if stats is not None:
            self.timelines = (self.timelines + [list(stats.events)])[-3:]
        metrics = StepMetrics(
            step=runtime.steps, loss=float(loss), step_seconds=step, compute_seconds=max(0.0, step - comm - bubble),
            comm_seconds=comm, bubble_seconds=bubble, tokens=sizes["B"] * sizes.get("S", 1),
            unit="tokens" if "S" in sizes else "samples", flops=flops, peak_flops=self.peak_flops(),
            world_size=program.mesh.size, **_peak_memory(runtime.device), expert_load=_expert_load(runtime),
        )  # fmt: skip
        self.last = metrics
        self.history = (self.history + [metrics])[-3:]
        every = program.compiled.log_every
        if every and metrics.step % every == 0 and program.rank == 0:
            if log.hasHandlers() and log.isEnabledFor(logging.INFO):
                log.info("%s", metrics.line())
            else:  # logging not configured for it: the line the user asked for, on stdout
                print(metrics.line(), flush=True)
        self._profile_step()
        return metrics

    def peak_flops(self) -> float:
        hardware = self.program.plan_report.hardware
        plan = self.program.plan  # what the matmuls run in: autocast's dtype, the cast parameters', the model's
        dtype = plan.autocast or plan.param_dtype or next(self.program.compiled.model.parameters()).dtype
        return float(hardware.peak(dtype))

    # ---- profile -------------------------------------------------------------------------------
    def profile(self, path: str | os.PathLike, steps: int) -> Path:
        """Record the next ``steps`` steps; the trace is written when the last of them ends."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise InputError(f"profile(steps={steps!r}) takes a positive number of steps to record")
        if self._profiler is not None:
            raise InputError("a profile is already recording; wait for its steps to finish")
        program = self.program
        self._profile_path = trace_path(path, program.rank, program.mesh.size)
        self._profile_path.parent.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if program.runtime.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities)
        self._profiler.start()
        tracing.set_recording(True)
        self._profile_left = steps
        return self._profile_path

    def _profile_step(self) -> None:
        if self._profiler is None:
            return
        self._profile_left -= 1
        if self._profile_left > 0:
            return
        tracing.set_recording(False)
        self._profiler.stop()
        self._profiler.export_chrome_trace(str(self._profile_path))
        self._profiler = None


def _peak_memory(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return {"peak_memory_bytes": int(peak), "memory_source": "cuda allocator"}
    return {
        "peak_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "memory_source": "process RSS",
    }
