"""Matrix multiplies whose weight gradient can be held back: the B / W split of zero-bubble pipelines.

passes/weight_grad_split rewrites ``linear``, ``addmm`` and ``mm`` nodes whose weight is a trainable
parameter into ``matmul_deferring_weight_grad``. Its backward computes the input's (and the bias's)
gradient at once, as the op's own backward would; the weight's gradient too, unless a pipeline's B
is collecting (``WEIGHT_GRADS.collect()``): then it keeps the two factors of that gradient (the
matmul's input and its output's gradient) and returns none, and the schedule's W for that stage and
microbatch computes them later (``apply``) and adds them into ``.grad`` in place (one fused multiply-add a
weight); the stage's last W then runs each weight's post-accumulate-grad hooks, as autograd's accumulation
would, so that the gradient hooks (dp buckets, ZeRO-1/2 reduce-scatter) see the completed gradients arrive
as they see any other. A pipeline
whose schedule has no W (GPipe, 1F1B, run eagerly) collects too and applies them at the end of each B, for
that in-place add. Under ZeRO-3 the weight is a view of its layer's gather; W needs no gathered value (the
gradient is the product of the two factors) and adds into the layer's flat gradient as the gather's backward
does.

Under autocast the op runs as autocast runs a matmul (its inputs cast to the autocast dtype) and its
gradients come back in the dtypes of its inputs, as the casts' own backward returns them. Under
torch.compile the op stays eager (dynamo breaks the graph around it): the work between the matmuls is
compiled, forward and backward, and the matmuls, whose kernels compiling would not change, keep their
weight gradients for W as they do eagerly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from autoshard.graph_ops.graph_break import stays_eager
from autoshard.ir.ops import WRAPPERS

__all__ = ["WEIGHT_GRADS", "DeferredWeightGrad", "GradSlot", "WeightGradStore", "matmul_deferring_weight_grad"]

aten = torch.ops.aten
GradSlot = Callable[[torch.Tensor], "torch.Tensor | None"]  # where a holder keeps a weight's gradient, if it does


@dataclass
class DeferredWeightGrad:
    """One matmul's held-back weight gradient: its two factors and the parameter it belongs to."""

    kind: str
    weight: torch.Tensor
    inputs: torch.Tensor  # the matmul's input as the op read it (cast, under autocast)
    grad_output: torch.Tensor
    gathered: tuple[Any, int, int] | None = None  # ZeRO-3: (runtime, group, index) of the gathered parameter

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, b) with the weight's gradient a @ b, recording no graph (the gradient is a value)."""
        x = self.inputs.reshape(-1, self.inputs.shape[-1])
        g = self.grad_output.reshape(-1, self.grad_output.shape[-1])
        a, b = (g.t(), x) if self.kind == "linear" else (x.t(), g)
        return a.detach(), b.detach()

    def add_into(self, grad: torch.Tensor) -> bool:
        """Add the weight's gradient to ``grad`` in one fused multiply-add (addmm_: no product of its own, which
        would cost a write and a read of the weight's size: a 4096x1024 weight's update from 32-row factors
        takes 1.4 ms fused against 2.4 ms as a product then an add, one CPU thread); False where the factors'
        dtype is not the gradient's (under autocast), which the caller then computes and casts."""
        a, b = self.factors()
        if a.dtype != grad.dtype:
            return False
        grad.addmm_(a, b)
        return True

    def compute(
        self, scratch: dict[tuple, torch.Tensor] | None = None, into: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The weight's gradient, in its dtype. With ``scratch`` (one flat buffer by dtype and device, as large
        as the largest weight, reused while the stage's W's run), the product is written into it: a fresh
        allocation a matmul costs page faults that can take longer than the matmul itself (a 4096x1024
        weight's product of 32-row factors: 3.4 ms fresh against 1.8 ms reused, one CPU thread). With
        ``into`` (the weight's gradient slot), it is written there."""
        a, b = self.factors()
        if into is not None:
            return torch.mm(a, b, out=into) if a.dtype == into.dtype else into.copy_(a.mm(b))
        if scratch is None or a.dtype != self.weight.dtype:
            return a.mm(b).to(self.weight.dtype)
        key = (self.weight.dtype, self.weight.device)
        flat = scratch.get(key)
        if flat is None or flat.numel() < self.weight.numel():
            flat = scratch[key] = torch.empty(self.weight.numel(), dtype=self.weight.dtype, device=self.weight.device)
        return torch.mm(a, b, out=flat[: self.weight.numel()].view(self.weight.shape))


@dataclass
class WeightGradStore:
    """Where B keeps what W will compute; None while nobody collects (weight gradients at once).

    Autograd still runs a held-back weight's accumulation step in B, with no gradient, and that fires its
    post-accumulate hook; ``holds_back`` tells the gradient hooks to count no arrival then. A W that does
    not complete its stage's gradients adds outside autograd, so no hook fires for it.
    """

    pending: list[DeferredWeightGrad] | None = None
    deferred_total: int = 0  # how many weight gradients were held back, ever (tests, the report)
    _held: set[int] = field(default_factory=set)  # ids of the weights whose gradient this B held back
    _scratch: dict[tuple, torch.Tensor] = field(default_factory=dict)  # W's products, by dtype and device

    def holds_back(self, param: torch.Tensor) -> bool:
        """Whether a gradient hook firing for ``param`` now is not its gradient's arrival."""
        return id(param) in self._held

    @contextlib.contextmanager
    def collect(self) -> Iterator[list[DeferredWeightGrad]]:
        """Inside, deferring matmuls keep their weight gradients in the list handed out."""
        outer, self.pending = self.pending, []
        try:
            yield self.pending
        finally:
            self.pending = outer
            self._held.clear()

    def hold(self, deferred: DeferredWeightGrad) -> None:
        assert self.pending is not None
        self.pending.append(deferred)
        self._held.add(id(deferred.weight))
        self.deferred_total += 1

    def apply(self, deferred: list[DeferredWeightGrad], completes: bool = True, slot: GradSlot | None = None) -> None:
        """W: compute the held-back weight gradients and accumulate them into ``.grad``, one contribution a
        weight (a weight read twice is summed first, as autograd sums before it accumulates), in place (a fused
        multiply-add, ``add_into``). ``completes``: whether this is the stage's last W; then each weight's
        post-accumulate-grad hooks run once, with every contribution in: they are the gradients' arrivals. An
        earlier W's are no arrival and fire no hook. A weight's first gradient of the step goes where
        ``slot(weight)`` says its holder keeps it (a gradient bucket's view), else it is the fresh product, which
        the hooks hand to the holder: kept until the stage's last W, a weight's worth of bytes a weight."""
        if not deferred:
            return
        uses: dict[int, int] = {}
        for item in deferred:
            uses[id(item.weight)] = uses.get(id(item.weight), 0) + 1
        summed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        groups: dict[tuple[int, int], tuple[Any, list[torch.Tensor | None]]] = {}
        for item in deferred:
            if item.gathered is not None:  # ZeRO-3: into the group's flat gradient, as the gather's backward adds
                grad = item.compute()
                runtime, group, index = item.gathered
                _, grads = groups.setdefault(
                    (id(runtime), group), (runtime, [None] * len(runtime.layouts[group].shapes))
                )
                grads[index] = grad if grads[index] is None else grads[index] + grad
                continue
            if uses[id(item.weight)] == 1:  # added at once: the scratch buffer is free again for the next
                into = _first_slot(item.weight, slot)
                if into is not None:
                    item.weight.grad = item.compute(into=into)
                    _arrived(item.weight, completes)
                    continue
                if item.weight.grad is not None and item.add_into(item.weight.grad):
                    _arrived(item.weight, completes)  # into .grad in place, as autograd's accumulation would add it
                    continue
                reuse = item.weight.grad is not None  # a first gradient is kept, so it is a fresh tensor
                self._accumulate(item.weight, item.compute(self._scratch if reuse else None), completes, slot)
                continue
            weight, total = summed.get(id(item.weight), (item.weight, None))
            grad = item.compute()
            summed[id(item.weight)] = (weight, grad if total is None else total + grad)
        for (_, group), (runtime, grads) in groups.items():
            runtime.add_grads(group, tuple(grads))  # accumulated; reduce-scattered at the stage's last W (armed)
        for weight, total in summed.values():
            self._accumulate(weight, total, completes, slot)
        if completes:
            self._scratch.clear()  # the stage's gradients are complete: no buffer outlives its W's
        deferred.clear()

    @staticmethod
    def _accumulate(weight: torch.Tensor, grad: torch.Tensor, completes: bool, slot: GradSlot | None) -> None:
        if weight.grad is not None:
            weight.grad.add_(grad)
        else:
            into = _first_slot(weight, slot)
            # a fresh product, owned, as autograd's first accumulation keeps it; or copied into the holder's slot
            weight.grad = grad if into is None else into.copy_(grad)
        _arrived(weight, completes)


def _first_slot(weight: torch.Tensor, slot: GradSlot | None) -> torch.Tensor | None:
    """Where W writes ``weight``'s first gradient of the step: its holder's slot (None: none, or not the first)."""
    if weight.grad is not None or slot is None:
        return None
    return slot(weight)


def _arrived(weight: torch.Tensor, completes: bool) -> None:
    """The stage's last W completed ``weight``'s gradient: its post-accumulate-grad hooks run, in their order and
    without autograd, as autograd's accumulation would run them (the holders' arrivals). An earlier W's add is no
    arrival."""
    hooks = getattr(weight, "_post_accumulate_grad_hooks", None) if completes else None
    if hooks:
        with torch.no_grad():
            for hook in list(hooks.values()):
                hook(weight)


WEIGHT_GRADS = WeightGradStore()


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


class _DeferringMatmul(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        kind: str,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        gathered: tuple[Any, int, int] | None,
    ) -> torch.Tensor:
        device_type = x.device.type
        ctx.gathered = gathered
        cast = _autocast_dtype(device_type)
        ctx.kind, ctx.weight, ctx.dtypes = kind, weight, (x.dtype, None if bias is None else bias.dtype)
        ctx.bias_shape = None if bias is None else bias.shape
        if cast is not None:  # as autocast runs the matmul: every input in its dtype
            x, weight = x.to(cast), weight.to(cast)
            bias = None if bias is None else bias.to(cast)
        with torch.autocast(device_type, enabled=False):
            if kind == "linear":
                out = aten.linear.default(x, weight, bias)
            elif kind == "addmm":
                out = aten.addmm.default(bias, x, weight)
            else:
                out = aten.mm.default(x, weight)
        ctx.save_for_backward(x, weight)
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        x_dtype, bias_dtype = ctx.dtypes
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_x = grad_output.matmul(weight) if ctx.kind == "linear" else grad_output.mm(weight.t())
            grad_x = grad_x.to(x_dtype)
        if ctx.needs_input_grad[3]:
            grad_bias = grad_output.sum_to_size(ctx.bias_shape).to(bias_dtype)  # the bias broadcast over rows
        if ctx.needs_input_grad[2]:
            deferred = DeferredWeightGrad(ctx.kind, ctx.weight, x, grad_output, ctx.gathered)
            if WEIGHT_GRADS.pending is not None:
                WEIGHT_GRADS.hold(deferred)
            else:
                grad_weight = deferred.compute()  # in the weight's dtype
        return None, grad_x, grad_weight, grad_bias, None


@stays_eager  # its backward reads and writes the store, outside any graph: under torch.compile it runs eagerly
def matmul_deferring_weight_grad(
    kind: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    gathered: tuple[Any, int, int] | None = None,
) -> torch.Tensor:
    """``kind`` is the op rewritten: ``linear`` (x, W[n,k], b), ``addmm`` (x, W[k,n], b), ``mm`` (x, W[k,n]).
    ``gathered``: under ZeRO-3, (the rank's Zero3Runtime, the group, the parameter's index in it): W adds the
    weight's gradient to the group's flat gradient, as the gather's backward does."""
    return _DeferringMatmul.apply(kind, x, weight, bias, gathered)


def _as_aten(args: tuple) -> tuple[object, tuple]:
    kind, x, weight, bias = args[:4]
    if kind == "linear":
        return aten.linear.default, (x, weight) if bias is None else (x, weight, bias)
    if kind == "addmm":
        return aten.addmm.default, (bias, x, weight)
    return aten.mm.default, (x, weight)


# The analyses (what autograd keeps, what selective recomputation keeps) see the matmul it runs.
WRAPPERS[matmul_deferring_weight_grad] = _as_aten
