"""Two small GPT training steps, timed and predicted by the cost model: the first mostly per-op overhead,
the second mostly matmuls, so together they fit the scale of the kernels' work and of the overhead apart."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from autoshard import passes
from autoshard.capture import capture
from autoshard.models import TinyGPT, next_token_loss
from autoshard.planner.profile import profile_graph
from autoshard.planner.timing import compute_seconds

if TYPE_CHECKING:
    from autoshard.planner.hardware import Hardware

__all__ = ["GPU_WORKLOADS", "WORKLOADS", "scales", "workload"]


# The two GPTs (vocab, dim, heads, layers, sequence, rows): the first's step is mostly per-op overhead, the
# second's mostly matmuls, so their two timings fit the scale of the kernels' work and of the per-op overhead
# apart, and noise in the single-op timings cannot tilt one against the other.
WORKLOADS = ((512, 128, 4, 2, 64, 4), (2048, 256, 8, 2, 128, 4))
# On a GPU the second is still overhead-bound: one whose matmuls take milliseconds (bf16 autocast).
GPU_WORKLOADS = ((512, 128, 4, 2, 64, 4), (8192, 2048, 16, 2, 1024, 8))


def workload(device: torch.device, hardware: Hardware, shared: bool, size: tuple[int, ...]) -> tuple[float, ...]:
    """A small GPT's training step (forward, loss, backward): (the seconds ``hardware`` predicts for its kernels'
    work, for their per-op overhead, measured as training runs it; ``shared``: ranks share processors, every
    rank at once)."""
    vocab, dim, heads, layers, seq, rows = size
    torch.manual_seed(0)
    model = TinyGPT(vocab=vocab, dim=dim, heads=heads, layers=layers, max_seq=seq).to(device)
    ids = torch.randint(0, vocab, (rows, seq), device=device)
    target = torch.randint(0, vocab, (rows, seq), device=device)

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # as the peak was measured

    def step() -> None:
        with torch.autocast(device.type, dtype, enabled=device.type == "cuda"):
            loss = next_token_loss(model(ids), target)
        loss.backward()

    measured = compute_seconds(step, device, 0.3, shared)
    captured = capture(model, (ids,), None, next_token_loss, target)
    passes.analyze(captured.gm, captured.rename)
    profile = profile_graph(captured.gm, captured.example_sizes, hardware.kernels, 0.0)

    def predicted(hw: Hardware) -> float:
        total = 0.0
        for name in ("pre", *profile.blocks, "post"):
            if name in profile.parts:
                times = profile.part(name, 1, False).times(captured.example_sizes, hw, dtype)
                total += times.forward + times.backward
        return total

    work = predicted(hardware.with_(op_overhead=0.0))
    return work, predicted(hardware) - work, measured


def scales(workloads: list[tuple[float, ...]]) -> tuple[float, float]:
    """(work, overhead): the factors by which the measured steps exceed the predicted kernels' work and per-op
    overhead (what single ops miss: autograd's engine, caches, processors shared). Two workloads give both;
    where they do not tell them apart (or disagree past belief), one factor for both."""
    (w1, o1, m1), (w2, o2, m2) = workloads
    det = w1 * o2 - w2 * o1
    if abs(det) > 1e-12:
        work, overhead = (m1 * o2 - m2 * o1) / det, (w1 * m2 - w2 * m1) / det
        if 0.25 <= work <= 8.0 and 0.25 <= overhead <= 8.0:
            return work, overhead
    both = min(8.0, max(0.25, (m1 + m2) / (w1 + o1 + w2 + o2)))
    return both, both
