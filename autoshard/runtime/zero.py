"""ZeRO-3 at run time: parameters sharded at rest over dp, gathered per layer just before use.

The rewritten graph (passes/zero3_gather_free) calls graph_ops/zero.py's ``gather`` before a group's first use (which
also prefetches the group after it), ``mark`` on the output of each op that uses the group (the last
one frees the gathered buffer; in backward each gathers it again, and prefetches the group before,
ahead of that op's backward), and the gather's backward adds the group's gradient into a flat
buffer. Once the group is armed (the last microbatch's backward of the stage that owns it) the buffer
is reduce-scattered into this rank's gradient shard, overlapped with the rest of backward.

With tensor parallelism the gathered values are this tp rank's slices: ZeRO-3 shards over dp what
tp already split (torchtitan's FSDP inside a TP mesh).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from autoshard.distributed.comm import CommCounter
from autoshard.runtime.flat import FlatLayout
from autoshard.runtime.holders import Groups, ShardedGrads, _nbytes
from autoshard.runtime.masters import Masters

__all__ = ["Zero3Holder", "Zero3Runtime"]


class Zero3Runtime(nn.Module):
    """ZeRO-3 state of one rank, shared by all its stage graphs: shards at rest, gathered buffers, gradients."""

    def __init__(
        self, layouts: dict[int, FlatLayout], comm: CommCounter, reduce_dtype: torch.dtype | None = None,
        comms: dict[int, CommCounter] | None = None, dp: int | None = None,
    ) -> None:  # fmt: skip
        """``comms``: the groups sharded over other ranks than ``comm``'s (experts: the ranks holding them);
        ``dp``: what every gradient is divided by (the plan's dp; default: the layouts' shard count)."""
        super().__init__()
        self.layouts = layouts
        self.comm = comm
        self.comms = comms or {}
        self.reduce_dtype = reduce_dtype  # gradients are reduce-scattered in it (None: their own dtype)
        self.dp = dp or (next(iter(layouts.values())).dp if layouts else 1)
        forward = sorted(layouts)  # group ids follow first use in forward
        self.next_of = dict(zip(forward, forward[1:]))
        self.prev_of = dict(zip(forward[1:], forward))
        self.shards: dict[int, nn.Parameter] = {}
        self.fulls: dict[int, torch.Tensor] = {}
        for g, layout in layouts.items():
            self.shards[g] = nn.Parameter(layout.own(layout.flatten()).clone())
            full = torch.empty(layout.padded, dtype=layout.dtype, device=layout.device)
            full.untyped_storage().resize_(0)
            self.fulls[g] = full
            for param in layout.params:  # the unsharded parameters are released: the shards hold them now
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self._gathered = dict.fromkeys(layouts, False)
        self._pending: dict[int, Any] = {}
        self._versions = dict.fromkeys(layouts, 0)
        self.grad_flats: dict[int, torch.Tensor | None] = dict.fromkeys(layouts)
        self.armed: set[int] = set()
        self.reductions: list[tuple[int, Any, torch.Tensor, torch.Tensor]] = []  # launched, not waited for
        self.done_shards: dict[int, torch.Tensor] = {}  # waited for: this rank's gradient shard per group
        self.peak_gathered_bytes = 0
        # Inside a recompute region's replay in backward (graph_ops.recompute): forward's frees and
        # prefetches are not repeated; the gather's backward frees the group once its gradients are in.
        self.replaying = 0
        # Native collectives run asynchronously: prefetch and keep a reduction in flight. On gloo the
        # in-place path (no full-size temporaries) completes when called, so neither would overlap.
        self.overlap = not comm.reduces_in_place()

    def comm_of(self, group: int) -> CommCounter:
        return self.comms.get(group, self.comm)

    def groups_viewed_by(self, values: tuple[object, ...]) -> list[int]:
        """The groups whose gathered buffer one of ``values`` views (a buffer keeps its storage when freed)."""
        storages = {self.fulls[g].untyped_storage()._cdata: g for g in self.fulls}
        tensors = (v for v in values if isinstance(v, torch.Tensor))
        return sorted({storages[t.untyped_storage()._cdata] for t in tensors if t.untyped_storage()._cdata in storages})

    def gathered_bytes(self) -> int:
        return sum(f.untyped_storage().nbytes() for f in self.fulls.values())

    def _launch(self, group: int) -> None:
        full = self.fulls[group]
        full.untyped_storage().resize_(self.layouts[group].padded * full.element_size())
        # Refilling a buffer that autograd saved is safe here: nothing read it since it was freed.
        # The backend may copy into it at any time until wait(), so _wait restores this version.
        self._versions[group] = full._version
        own = self.layouts[group].own(full)
        own.copy_(self.shards[group].detach())
        self._pending[group] = self.comm_of(group).all_gather(full, own, async_op=True, in_place=True)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes())

    def _wait(self, group: int) -> None:
        work = self._pending.pop(group, None)
        if work is not None:
            work.wait()
            torch._C._autograd._unsafe_set_version_counter((self.fulls[group],), (self._versions[group],))

    def ensure_gathered(self, group: int) -> None:
        if not self._gathered[group] and group not in self._pending:
            self._launch(group)
        self._wait(group)
        self._gathered[group] = True

    def prefetch(self, group: int | None) -> None:
        if not self.overlap:
            return  # collectives that complete when called (gloo, in place): gathering early only costs memory
        if group is not None and not self._gathered[group] and group not in self._pending:
            self._launch(group)

    def free(self, group: int) -> None:
        self._wait(group)
        self.fulls[group].untyped_storage().resize_(0)
        self._gathered[group] = False

    def add_grads(self, group: int, grads: tuple[torch.Tensor | None, ...]) -> None:
        """Add a backward's gradients of ``group`` to its flat buffer; reduce-scatter it once armed."""
        layout = self.layouts[group]
        flat = self.grad_flats[group]
        if flat is None:
            flat = self.grad_flats[group] = torch.zeros(layout.padded, dtype=layout.dtype, device=layout.device)
        for offset, shape, grad in zip(layout.offsets, layout.shapes, grads):
            if grad is not None:
                flat[offset : offset + math.prod(shape)].add_(grad.reshape(-1))
        if group in self.armed:
            if self.reduce_dtype not in (None, flat.dtype):
                flat = flat.to(self.reduce_dtype)
            flat.div_(self.dp)
            out = flat.new_empty(layout.shard_numel)
            # At most two reductions in flight: waiting for the older one frees its full-size input
            # while backward goes on (FSDP's bound on unsharded gradients).
            self._retire(keep=1)
            work = self.comm_of(group).reduce_scatter(out, flat, async_op=True, in_place=True)
            self.reductions.append((group, work, out, flat))
            if not self.overlap:
                self._retire(keep=0)
            self.grad_flats[group] = None
        self.free(group)

    def _retire(self, keep: int) -> None:
        while len(self.reductions) > keep:
            group, work, out, _flat = self.reductions.pop(0)
            work.wait()
            done = self.done_shards.get(group)
            self.done_shards[group] = out if done is None else done.add_(out)

    def wait_reductions(self) -> dict[int, torch.Tensor]:
        """Every launched reduce-scatter, waited for: group -> this rank's gradient shard."""
        self._retire(keep=0)
        shards, self.done_shards = self.done_shards, {}
        for group in self.layouts:  # prefetched in backward but not needed any more
            if self._gathered[group] or group in self._pending:
                self.free(group)
        return shards

    def full_parameters(self) -> dict[int, list[torch.Tensor]]:
        """Every group's parameters, gathered (a collective: call on every rank)."""
        out = {}
        for g in sorted(self.layouts):
            layout = self.layouts[g]
            full = self.fulls[g].new_empty(layout.padded)
            self.comm_of(g).all_gather(full, self.shards[g].detach())
            out[g] = [v.clone() for v in layout.views(full)]
        return out


class Zero3Holder(ShardedGrads):
    """ZeRO-3: the runtime the rewritten graphs call, the armed reduce-scatters, and fp32 master shards."""

    name = "ZeRO-3 (gather per layer, reduce-scatter, sharded step)"

    def __init__(
        self,
        groups: Groups,
        comm: CommCounter,
        offload: bool,
        initial: dict[int, torch.Tensor] | None,
        reduce_dtype: torch.dtype | None = None,
    ):
        super().__init__(groups, comm, reduce_dtype)
        self.runtime = Zero3Runtime(self.layouts, comm, reduce_dtype, self.comms, self.dp)
        self.masters = Masters({g: s.data for g, s in self.runtime.shards.items()}, offload, initial)

    def params(self) -> list[nn.Parameter]:
        return [p for g in sorted(self.layouts) for p in self.layouts[g].params]

    def begin(self, armed: bool) -> None:
        self.grad_shards = dict.fromkeys(self.order)
        self.runtime.grad_flats = dict.fromkeys(self.layouts)
        self.runtime.armed = set(self.order) if armed else set()

    def arm(self, stage: int) -> None:
        self.runtime.armed.update(self.groups_of(stage))

    def end(self) -> None:
        rt = self.runtime
        for g in self.order:  # gradients added but never armed (should not happen): reduce them now
            if rt.grad_flats[g] is not None:
                rt.armed.add(g)
                rt.add_grads(g, ())
        self.grad_shards.update(rt.wait_reductions())
        for g in self.order:
            rt.grad_flats[g] = None

    def after_step(self) -> None:
        self.masters.write_back()

    def full_values(self) -> dict[int, torch.Tensor]:
        gathered = self.runtime.full_parameters()
        return {id(p): v for g, values in gathered.items() for p, v in zip(self.layouts[g].params, values)}

    def load_values(self, values: dict[int, torch.Tensor]) -> None:
        with torch.no_grad():
            for g, layout in self.layouts.items():
                self.runtime.shards[g].copy_(layout.own(layout.flatten(values=values)))
        self.reload_masters(values)

    def memory(self) -> dict[str, int]:
        rt = self.runtime
        return {
            "parameters": _nbytes(rt.shards.values()) + rt.gathered_bytes(),
            "gradients": _nbytes(self.grad_shards.values()),
        }
