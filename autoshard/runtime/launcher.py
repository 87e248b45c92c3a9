"""Gradient groups launched in one order on every rank, as their gradients arrive during backward.

A holder (runtime/holders.py) hands its flat groups to an InOrderLauncher; the launcher counts each
group's gradients as autograd accumulates them and calls ``launch(group)`` for complete groups, never
out of order, so that every dp rank issues the same collectives in the same order (gloo and NCCL
match collectives by order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from autoshard.graph_ops.weight_grad import WEIGHT_GRADS
from autoshard.runtime.optim import weak_grad_hook

__all__ = ["InOrderLauncher"]


class InOrderLauncher:
    """Counts gradient arrivals per armed group and launches complete groups, strictly in ``order``. Arrivals
    come from post-accumulate-grad hooks; a group not armed yet (an earlier microbatch) ignores them. Every dp
    rank runs the same schedule, so every rank launches the same collectives in the same order."""

    def __init__(
        self,
        order: list[int],
        params_of: dict[int, list[nn.Parameter]],
        launch: Callable[[int], None],
        on_arrival: Callable[[torch.Tensor], None] | None = None,  # first, on every arrival (one hook, not two)
    ):
        self.order, self.on_arrival = order, on_arrival
        self.sizes = {g: len(params_of[g]) for g in order}
        self.group_of = {id(p): g for g in order for p in params_of[g]}
        self.launch = launch
        self.arrived: set[int] = set()
        self.armed: set[int] = set()
        self._pending = dict(self.sizes)
        self._next = 0
        for g in order:
            for p in params_of[g]:
                p.register_post_accumulate_grad_hook(weak_grad_hook(self._on_grad))

    def reset(self, armed: Iterable[int]) -> None:
        self.arrived.clear()
        self._pending = dict(self.sizes)
        self._next = 0
        self.armed = set(armed)

    def arm(self, groups: Iterable[int]) -> None:
        self.armed.update(groups)

    def _on_grad(self, param: torch.Tensor) -> None:
        if self.on_arrival is not None:
            self.on_arrival(param)
        group = self.group_of.get(id(param))
        if WEIGHT_GRADS.holds_back(param):
            return  # a zero-bubble B held this weight's gradient back, or an earlier microbatch's W runs
        if group not in self.armed or id(param) in self.arrived:
            return  # an earlier microbatch, a backward outside step(), or a second arrival
        self.arrived.add(id(param))
        self._pending[group] -= 1
        self._launch_ready(force=False)

    def _launch_ready(self, force: bool) -> None:
        while self._next < len(self.order):
            group = self.order[self._next]
            if not force and (group not in self.armed or self._pending[group] > 0):
                return
            self.launch(group)
            self._next += 1

    def flush(self) -> None:
        """After backward: launch the groups still waiting (parameters that got no gradient)."""
        self._launch_ready(force=True)
        self.armed = set()
