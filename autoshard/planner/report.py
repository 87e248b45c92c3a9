"""What the planner answers: per candidate plan its memory by category, its step time by part, its
throughput and bottleneck; the candidates best first, and why the winner won."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import sympy

from autoshard.spec.plan import Plan

if TYPE_CHECKING:
    from autoshard.planner.hardware import Hardware

__all__ = ["BOTTLENECKS", "Candidate", "Memory", "PlanReport", "StepTime", "bottleneck", "fmt_bytes"]

BOTTLENECKS = ("compute", "exposed communication", "bubble", "memory")


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class Memory:
    """Bytes one rank holds at its peak, by category (the most loaded rank of the plan)."""

    weights: int = 0  # parameters as the graphs read them (ZeRO-3: this rank's shard)
    gradients: int = 0
    optimizer: int = 0  # optimizer state (Adam: two moments per master element)
    masters: int = 0  # fp32 master copies kept apart from lower-precision parameters
    activations: int = 0  # what autograd keeps, for every microbatch in flight, plus a recomputed region's
    gathered: int = 0  # ZeRO-3 parameters gathered at once (a layer and the prefetched next one)
    buffers: int = 0  # communication buffers (a bucket converted to reduce_dtype for its reduction)

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def items(self) -> list[tuple[str, int]]:
        return [(f.name, getattr(self, f.name)) for f in fields(self)]

    def __str__(self) -> str:
        parts = ", ".join(f"{name} {fmt_bytes(n)}" for name, n in self.items() if n)
        return f"{fmt_bytes(self.total)} ({parts or 'nothing'})"


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step by part, on the rank that finishes last."""

    compute: float = 0.0  # forward and backward kernels (recomputation included)
    recompute: float = 0.0  # of which: forward work repeated in backward
    tp_comm: float = 0.0  # tensor-parallel collectives (on the critical path: they sit between kernels)
    ep_comm: float = 0.0  # expert parallelism's all-to-alls (on the critical path: the experts wait for their rows)
    cp_comm: float = 0.0  # context parallelism's ring not hidden behind the attention it feeds
    pp_comm: float = 0.0  # pipeline sends and receives on the critical path
    bubble: float = 0.0  # pipeline idle time
    dp_comm: float = 0.0  # gradient reduction (and ZeRO's parameter all-gather) not hidden behind backward
    zero3: float = 0.0  # ZeRO-3 parameter gathers not hidden behind compute
    optimizer: float = 0.0  # the optimizer step
    offload: float = 0.0  # host link traffic of offload

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "recompute")

    @property
    def exposed_communication(self) -> float:
        return self.tp_comm + self.ep_comm + self.cp_comm + self.pp_comm + self.dp_comm + self.zero3 + self.offload

    def __str__(self) -> str:
        parts = ", ".join(
            f"{f.name} {getattr(self, f.name) * 1e3:.3g}" for f in fields(self) if getattr(self, f.name) > 0
        )
        return f"{self.total * 1e3:.4g} ms ({parts} ms)"


@dataclass(frozen=True)
class Candidate:
    """One plan and what the cost model predicts for it."""

    plan: Plan
    step_time: float  # seconds
    memory: Memory  # per rank, at its peak
    time: StepTime
    tflops_per_device: float  # FLOPs executed (recomputation included) per second per device, in 1e12
    mfu: float  # model FLOPs (forward + backward, no recomputation) / (step time x peak x devices)
    fits: bool
    why: str  # the bottleneck (one of BOTTLENECKS) and the numbers behind it
    capacity: int = 0  # the device memory it was checked against
    # Per pipeline rank, what it runs: (action, start s, end s); empty without a pipeline.
    timeline: tuple[tuple[tuple[str, float, float], ...], ...] = ()
    memory_expr: sympy.Expr = field(default=sympy.Integer(0), compare=False, repr=False)  # bytes, in B (global)
    batch_multiple: int = 1  # a global batch must be a multiple of this (dp x microbatches)

    @property
    def bottleneck(self) -> str:
        return self.why.split(":", 1)[0]

    def max_batch(self) -> int:
        """The largest global batch (a multiple of dp x microbatches) whose per-rank memory fits the device;
        0 when none does. Other sizes (the sequence) stay as planned."""
        symbol = sympy.Symbol("B", integer=True, positive=True)
        expr = sympy.sympify(self.memory_expr)
        if symbol not in expr.free_symbols:
            return 0 if int(expr) > self.capacity else 2**62
        fn = sympy.lambdify(symbol, expr, "math")
        step = self.batch_multiple

        def fits(k: int) -> bool:
            return fn(k * step) <= self.capacity

        if not fits(1):
            return 0
        hi = 1
        while fits(hi * 2) and hi < 2**50:
            hi *= 2
        lo, hi = hi, hi * 2  # fits(lo), not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo * step

    def row(self, chosen: bool = False) -> str:
        note = "chosen" if chosen else ""
        if not self.fits:
            note = (note + "; " if note else "") + "does not fit"
        return (
            f"{str(self.plan):<64} {fmt_bytes(self.memory.total):>10} {self.step_time * 1e3:>10.4g}ms "
            f"{self.tflops_per_device:>7.3g} {self.mfu:>6.1%}  {self.bottleneck:<21} {note}"
        )


@dataclass(frozen=True)
class PlanReport(Sequence):
    """The planner's answer: the candidates best first (fastest that fits, then the rest by memory),
    the winner and why. Indexing and iterating go over the candidates."""

    candidates: tuple[Candidate, ...]
    reason: str
    sizes: dict[str, int] = field(hash=False)
    hardware: Hardware
    searched: int = 0  # plans the search costed (the candidates are the best of each mesh shape and ZeRO stage)
    model: str = ""  # the model planned for, and its size
    parameters: int = 0

    def assumed(self) -> str:
        """One line: the model and its size, and the hardware the plan assumed (a preset or measured)."""
        size = f"{self.parameters / 1e9:.2f}B" if self.parameters >= 1e8 else f"{self.parameters / 1e6:.2f}M"
        origin = "measured" if self.hardware.source.startswith("Hardware.measure") else "preset"
        return f"{self.model or 'the model'}: {size} parameters; assuming {self.hardware.name} ({origin})"

    def __getitem__(self, index: Any) -> Any:
        return self.candidates[index]

    def __len__(self) -> int:
        return len(self.candidates)

    def __iter__(self) -> Iterator[Candidate]:
        return iter(self.candidates)

    @property
    def chosen(self) -> Candidate:
        return self.candidates[0]

    @property
    def winner(self) -> Plan:
        return self.chosen.plan

    def table(self, top: int = 8, shapes: int = 8) -> str:
        """The ``top`` candidates, then the best of up to ``shapes`` other mesh shapes (why they lost)."""
        lines = [f"{'plan':<64} {'memory':>10} {'step':>12} {'TFLOP/s':>7} {'MFU':>6}  {'bottleneck':<21} note"]
        lines += [c.row(chosen=i == 0) for i, c in enumerate(self.candidates[:top])]
        shown = {(c.plan.dp, c.plan.tp, c.plan.pp, c.plan.cp) for c in self.candidates[:top]}
        others = []
        for c in self.candidates[top:]:
            shape = (c.plan.dp, c.plan.tp, c.plan.pp, c.plan.cp)
            if shape not in shown and len(others) < shapes:
                shown.add(shape)
                others.append(c.row())
        if others:
            lines += ["best of the other mesh shapes:", *others]
        if len(self.candidates) > top + len(others):
            lines.append(f"... {len(self.candidates)} candidates in all ({self.searched} plans costed)")
        return "\n".join(lines)

    def breakdown(self, top: int = 3) -> str:
        """The top candidates' memory and time, part by part."""
        lines = []
        for i, c in enumerate(self.candidates[:top]):
            lines += [
                f"{i + 1}. {c.plan}",
                f"   memory per rank {c.memory}",
                f"   step {c.time}",
                f"   why: {c.why}",
            ]
        return "\n".join(lines)


def bottleneck(time: StepTime, memory: Memory, fits: bool, hw: Hardware) -> str:
    """The bottleneck of a plan, in words: memory where it does not fit, else the largest share of its step."""
    if not fits:
        return f"memory: {memory.total / 2**30:.2f} GiB per rank needed, {hw.memory_bytes / 2**30:.2f} GiB available"
    step = time.total
    parts = {
        "compute": time.compute + time.optimizer,
        "exposed communication": time.exposed_communication,
        "bubble": time.bubble,
    }
    name = max(parts, key=parts.__getitem__)
    detail = ", ".join(f"{k} {v / step:.0%}" for k, v in parts.items())
    return f"{name}: {detail} of the step"
