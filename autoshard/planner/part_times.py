"""What one microbatch of a model part costs on one rank: the work of its nodes (a matmul's FLOPs at the
efficiency its shape reaches and its operands' pass over memory, an elementwise kernel's bytes at the memory
bandwidth, each kernel's overhead), its gradients added into their buffers, and its tp collectives, each
waiting for the last rank of its group. The part's works and collectives are what autoshard/planner/profile.py
reads off its rewritten graph, symbolic in B and S; here they are evaluated at a microbatch's sizes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sympy
import torch

from autoshard.ir.meta import evaluate_expr

if TYPE_CHECKING:
    from autoshard.planner.hardware import Hardware

if TYPE_CHECKING:
    from autoshard.planner.profile import PartAtDegree

__all__ = ["Comm", "PartTimes", "Work", "part_times", "value"]


@dataclass(frozen=True)
class Work:
    """One node's work, symbolic: FLOPs forward and backward, matmul dimensions, bytes it moves."""

    name: str
    flops_fwd: sympy.Expr
    flops_bwd: sympy.Expr
    dims: tuple[sympy.Expr, ...]  # (m, n, k) of a matmul; () otherwise
    nbytes: sympy.Expr  # read and written in forward
    grad: bool  # backward runs for it
    kernel: bool  # launches a kernel (views and bookkeeping do not)
    # A matmul of a trainable weight (the weight's target): its weight gradient is a split backward's W
    deferred: str | None = None
    kernel_name: str = ""  # the kernel it runs where the hardware has its own rate for it (planner/kernels.py)


@dataclass(frozen=True)
class Comm:
    """A tp collective of a part (inserted by the rewrite, issued by an op it put in, or reducing a partial sum the
    part hands on): its forward and backward operation and the local bytes."""

    forward: str | None
    backward: str | None
    nbytes_in: sympy.Expr  # the larger of the two is the full size a collective is timed by
    nbytes_out: sympy.Expr


@dataclass(frozen=True)
class PartTimes:
    """Seconds one microbatch of a part takes on one rank."""

    forward: float
    backward: float
    tp_forward: float
    tp_backward: float
    by_node: dict[str, float]  # forward seconds per node (what recomputing it repeats)
    weight_grad: float = 0.0  # of backward: the deferred matmuls' weight gradients, accumulated (a split's W)
    fused_saving: float = 0.0  # of backward: what a pipeline's fused accumulation of those saves (see part_times)
    # of weight_grad: that of each tied weight another part owns (a tied head's), by target: it stays in B where
    # the owner's stage runs on the same rank (passes/weight_grad_split: a gradient arrives whole in one place)
    tied_weight_grad: tuple[tuple[str, float], ...] = ()

    def recompute(self, part: PartAtDegree, choice: str) -> float:
        """Forward work ``choice`` repeats in backward (full: the whole part, its collectives included)."""
        if choice == "none":
            return 0.0
        if choice == "full":
            return self.forward + self.tp_forward
        return sum(self.by_node.get(n, 0.0) for n in part.recomputed(choice))


def value(expr: Any, sizes: dict[str, int]) -> float:
    """``expr`` (a sympy expression in B and S, or a number) at ``sizes``."""
    if not isinstance(expr, sympy.Basic):
        return float(expr)
    return _evaluated(expr, tuple(sorted(sizes.items())))


@functools.lru_cache(maxsize=1 << 16)
def _evaluated(expr: sympy.Basic, sizes: tuple[tuple[str, int], ...]) -> float:
    # The same few expressions (B*S*h, ...) at the same sizes recur across parts, degrees and plans; sympy's
    # substitution was a fifth of a 1024-rank search.
    return float(evaluate_expr(expr, dict(sizes)))


def part_times(part: PartAtDegree, sizes: dict[str, int], hw: Hardware, dtype: torch.dtype) -> PartTimes:
    """One microbatch of ``part`` at ``sizes`` (B: its rows) on one rank of ``hw``, its tensors ``dtype``."""
    every_kernel = hw.kernels == "cpu"  # eager dispatch on a CPU costs every op, views included
    forward = backward = weight_grad = deferred_bytes = 0.0
    tied = {target: 0.0 for target, *_ in part.tied}
    grad_bytes = part.param_bytes / max(1, part.param_elements)  # a gradient's element: its parameter's
    by_name: dict[str, float] = {}
    for w in part.works:
        if not (w.kernel or every_kernel):
            continue
        flops_fwd, nbytes = value(w.flops_fwd, sizes), value(w.nbytes, sizes)
        if w.dims:
            dims = tuple(max(1.0, value(d, sizes)) for d in w.dims)
            f = hw.matmul_seconds(flops_fwd, dims, nbytes, dtype)
            flops_bwd = value(w.flops_bwd, sizes)
            b = hw.matmul_seconds(flops_bwd, dims, 2 * nbytes, dtype) if flops_bwd else 0.0
            if w.deferred:  # the weight's gradient: a matmul of the forward's size, added into .grad (n x k) by
                # a fused multiply-add (graph_ops/weight_grad.py: addmm_, which reads the gradient it adds to)
                w_seconds = hw.matmul_seconds(flops_fwd, dims, nbytes, dtype)
                w_seconds += hw.memory_seconds(dims[1] * dims[2] * grad_bytes, kernels=0)
                weight_grad += w_seconds
                if w.deferred in tied:
                    tied[w.deferred] += w_seconds
                deferred_bytes += dims[1] * dims[2] * grad_bytes
        elif w.kernel_name and hw.kernel_rates:  # a kernel timed on its own (a CPU's GELU, softmax, ...)
            f = hw.kernel_seconds(w.kernel_name, nbytes)
            b = hw.kernel_seconds(w.kernel_name, nbytes, backward=True) if w.grad else 0.0
        else:
            f = hw.memory_seconds(nbytes if w.kernel else 0.0)
            b = hw.memory_seconds(2 * nbytes) if w.grad and w.kernel else 0.0
        forward += f
        backward += b
        by_name[w.name] = f
    # Every backward adds its parameters' gradients into the buffers they accumulate in (autograd's
    # AccumulateGrad, one per microbatch): the buffer and the new gradient read, the sum written. A pipeline
    # (eager) adds its matmuls' weight gradients with the product fused into the add (addmm_): the buffer read
    # and written, no product of its own; ``fused_saving`` is the difference, which costing takes off there.
    backward += hw.memory_seconds(3 * part.param_bytes, kernels=0)
    fused_saving = hw.memory_seconds(2 * min(deferred_bytes, part.param_bytes), kernels=0)
    tp_fwd = tp_bwd = 0.0
    for c in part.comms:
        full = max(value(c.nbytes_in, sizes), value(c.nbytes_out, sizes))
        if c.forward:  # synchronous: each waits for the last rank to arrive
            tp_fwd += hw.collective_seconds(c.forward, full, part.degree) + hw.sync(part.degree)
        if c.backward:
            tp_bwd += hw.collective_seconds(c.backward, full, part.degree) + hw.sync(part.degree)
    weight_grad = min(weight_grad, backward)
    tied_grads = tuple((target, min(seconds, weight_grad)) for target, seconds in tied.items() if seconds)
    return PartTimes(forward, backward, tp_fwd, tp_bwd, by_name, weight_grad, fused_saving, tied_grads)
