"""Memory and step time of one plan, from the model's profile (autoshard/planner/profile.py).

Per pipeline stage: the parts it runs (whole blocks, the embeddings on the first stage, head and loss on
the last), each at the plan's tp degree and microbatch size: forward and backward kernel time (each
node's FLOPs at the efficiency its shape reaches, memory-bound nodes at the memory bandwidth, a kernel's
overhead), the tp collectives the rewrite put there, and the forward work recomputation repeats. The
schedule's action table is simulated with those costs and the sends between stages, which gives the
bubble. Data-parallel traffic is the gradient reduction (ZeRO 1-2: reduce-scatter, then the all-gather
of the updated parameters; ZeRO-3: a gather of each block's parameters in forward and again in backward
per microbatch), hidden behind backward as far as the hardware overlaps it. Memory per rank: its
parameters, gradients, Adam's two moments and fp32 masters, divided as the ZeRO stage divides them,
the activations autograd keeps for every microbatch the schedule holds in flight, ZeRO-3's gathered
layers, and the buckets being reduced.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sympy

from autoshard.planner.exchanges import context_exchanges, expert_exchanges, ring_kept_block
from autoshard.planner.memory import itemsize, rank_memory
from autoshard.planner.part_times import value
from autoshard.planner.profile import ModelProfile, PartAtDegree
from autoshard.planner.report import Candidate, Memory, StepTime, bottleneck
from autoshard.planner.simulate import built, in_flight, simulate, simulate_shared
from autoshard.planner.stages import RankSums, Stage, balanced_starts, rank_sums
from autoshard.spec.plan import Plan
from autoshard.spec.schedules import Schedule

if TYPE_CHECKING:
    from autoshard.planner.hardware import Hardware

__all__ = ["Costing", "Unfit"]

HOST_OP_OVERHEAD = 10e-6  # an eager kernel on the host (offload's optimizer step)
# torch.optim.AdamW's step per element, as its eager and foreach forms run it: param.mul_ (weight decay),
# exp_avg.lerp_, exp_avg_sq.mul_ and .addcmul_, sqrt, div, add_ (the denominator), param.addcdiv_: eight
# kernels that read and write 20 fp32 values an element in all (a fused kernel would move 7; the
# planner costs the optimizer torch gives by default).
ADAM_PASSES, ADAM_KERNELS = 20, 8
B = sympy.Symbol("B", integer=True, positive=True)


@dataclass(frozen=True)
class Unfit:
    """A plan over the device's memory as the search ranks it: by its memory alone (its time not costed)."""

    plan: Plan
    memory: Memory
    fits: bool = False


class Costing:
    """Costs plans of one model at the planning sizes on one kind of hardware."""

    def __init__(self, profile: ModelProfile, sizes: dict[str, int], hardware: Hardware) -> None:
        self.profile = profile
        self.sizes = dict(sizes)
        self.hardware = hardware
        self.blocks = len(profile.blocks)
        self.heads = profile.heads
        scale = sizes.get("B", 1) / max(1, profile.sizes.get("B", 1))
        self.model_flops = profile.model_flops * scale  # at the planning batch
        # The search costs thousands of plans that differ only in ZeRO stage, offload, bucket or schedule:
        # none of those changes a stage's kernels, so each stage layout is costed once (and summed per rank once).
        self._stage_memo: dict[tuple, tuple[Stage, ...]] = {}
        self._sums_memo: dict[tuple, tuple[RankSums, ...]] = {}
        self._recompute_memo: dict[tuple, float] = {}

    def allows(self, tp: int = 1, pp: int = 1) -> bool:
        """pp at most the blocks; tp dividing the heads and sharding every kind of block."""
        return self.refusal(tp, pp) is None

    def refusal(self, tp: int = 1, pp: int = 1) -> str | None:
        """The constraint a tp and pp degree break, in words (None: they are allowed)."""
        if pp > max(1, self.blocks):
            return f"pp={pp} is more stages than the model's {self.blocks} blocks"
        if tp > 1 and (self.heads and self.heads % tp):
            return f"tp={tp} does not divide the {self.heads} attention heads"
        if tp > 1 and not self.profile.shards(tp):
            return f"tp={tp} leaves a kind of block unsharded"
        return None

    # ---- one plan ------------------------------------------------------------------------------
    def candidate(self, plan: Plan, with_timeline: bool = True, unfit_memory_only: bool = False) -> Candidate | Unfit:
        """What the cost model predicts for ``plan`` (``with_timeline``: each pipeline rank's actions too;
        ``unfit_memory_only``: a plan that does not fit comes back as an Unfit, its schedule not simulated: most
        plans of a large search do not fit, and the search ranks those by memory alone)."""
        hw = self.hardware
        rows = self.sizes.get("B", 1)
        local = max(1, rows // plan.dp)
        micro = max(1, local // plan.microbatches)
        schedule = self._schedule(plan)
        node = min(plan.mesh.size, hw.devices_per_node)  # ranks of one node
        shared = schedule is not None and hw.shared_cores > 0  # ranks compute faster while others wait
        # A cp rank computes 1/cp of each row's tokens, and of its attention (balanced chunks): every per-token
        # cost and the attention's, as 1/cp of the rows over the whole sequence.
        tokens = micro / plan.cp
        layout, stages = self._layout(plan, tokens, 1.0 if shared else hw.sharing(node))
        sums = self._rank_sums(layout, stages, plan)
        memory, per_row = rank_memory(plan, sums, (((1, 0, 0),),) if schedule is None else in_flight(schedule), micro)
        fits = memory.total <= hw.memory_bytes
        if unfit_memory_only and not fits:
            return Unfit(plan, memory)

        def run(stages: list[Stage], timeline: bool = False) -> tuple[float, list[float], tuple]:
            if shared:
                return simulate_shared(
                    schedule, tuple(stages), hw.shared_cores, node // plan.pp, timeline, hw.action_gap
                )
            return simulate(schedule, tuple(stages), timeline, hw.action_gap)

        if schedule is None:
            stage = stages[0]
            compute = plan.microbatches * (
                stage.forward + stage.backward - stage.tp_comm - stage.ep_comm - stage.cp_comm
            )
            tp_comm, pp_comm, bubble, window = plan.microbatches * stage.tp_comm, 0.0, 0.0, stage.backward
            ep_comm, cp_comm = plan.microbatches * stage.ep_comm, plan.microbatches * stage.cp_comm
            timeline: tuple = ()
        else:
            makespan, busy, timeline = run(stages, timeline=with_timeline)
            # The sends' share of the idle time (a second simulation without them) only for the plans kept:
            # the search ranks by the step, which it does not change.
            no_send = makespan
            if with_timeline:
                no_send = run([dataclasses.replace(s, send=0.0) for s in stages])[0]
            per_rank_tp, per_rank_ep, per_rank_cp = [0.0] * plan.pp, [0.0] * plan.pp, [0.0] * plan.pp
            for index, s in enumerate(stages):
                per_rank_tp[schedule.rank_of(index)] += plan.microbatches * s.tp_comm
                per_rank_ep[schedule.rank_of(index)] += plan.microbatches * s.ep_comm
                per_rank_cp[schedule.rank_of(index)] += plan.microbatches * s.cp_comm
            slowest = max(range(plan.pp), key=busy.__getitem__)
            tp_comm, ep_comm, cp_comm = per_rank_tp[slowest], per_rank_ep[slowest], per_rank_cp[slowest]
            compute = busy[slowest] - tp_comm - ep_comm - cp_comm
            pp_comm = max(0.0, makespan - no_send)
            bubble = max(0.0, makespan - busy[slowest] - pp_comm)
            window = max(s.backward for s in stages)
        recompute = plan.microbatches * max(s.recompute for s in stages)
        partial = max(r.partial_grads for r in sums)
        if partial:  # summed over tp in one synchronous all-reduce a step, after backward (runtime/rank.py)
            tp_comm += hw.collective_seconds("all_reduce", partial, plan.tp) + hw.sync(plan.tp)
        dp_comm, zero3, optimizer, offload = self._data_parallel(plan, sums, window, compute, node)
        time = StepTime(
            compute=compute, recompute=recompute, tp_comm=tp_comm, ep_comm=ep_comm, cp_comm=cp_comm, pp_comm=pp_comm,
            bubble=bubble,
            dp_comm=dp_comm, zero3=zero3, optimizer=optimizer, offload=offload,
        )  # fmt: skip
        step = time.total
        executed = self.model_flops + self._recompute_flops(plan, tokens)
        per_device = executed / plan.mesh.size / step
        mfu = self.model_flops / plan.mesh.size / step / hw.peak(self._dtype(plan))
        expr = sympy.Integer(memory.total - memory.activations) + sympy.Rational(per_row).limit_denominator(10**6) * B
        return Candidate(
            plan=plan, step_time=step, memory=memory, time=time, tflops_per_device=per_device / 1e12, mfu=mfu,
            fits=fits, why=bottleneck(time, memory, fits, hw), capacity=hw.memory_bytes, timeline=timeline,
            memory_expr=expr, batch_multiple=plan.dp * plan.microbatches,
        )  # fmt: skip

    def _dtype(self, plan: Plan) -> Any:
        return plan.autocast or plan.param_dtype or self.profile.model_dtype

    def _schedule(self, plan: Plan) -> Schedule | None:
        if plan.pp == 1:
            return None
        if isinstance(plan.schedule, Schedule):
            return plan.schedule.check_for(plan.pp)
        return built(plan.schedule, plan.pp, plan.microbatches, plan.virtual_stages)

    def _parts_per_stage(self, plan: Plan, micro: int) -> list[list[str]]:
        n = plan.pp * plan.virtual_stages
        blocks = list(self.profile.blocks)
        if n == 1:
            return [self._with_ends(blocks, 0, 1)]
        names = self.profile.block_names
        if plan.pp_cuts is not None and len(plan.pp_cuts) == n - 1 and all(c in names for c in plan.pp_cuts):
            starts = [0, *(names.index(c) for c in plan.pp_cuts), len(blocks)]
        else:
            starts = balanced_starts(tuple(self._block_seconds(plan, micro)), n)
        return [self._with_ends(blocks[starts[i] : starts[i + 1]], i, n) for i in range(n)]

    def _with_ends(self, blocks: list[str], index: int, n: int) -> list[str]:
        parts = list(blocks)
        if index == 0 and "pre" in self.profile.parts:
            parts.insert(0, "pre")
        if index == n - 1 and "post" in self.profile.parts:
            parts.append("post")
        return parts

    def _block_seconds(self, plan: Plan, micro: int) -> list[float]:
        """Each block's forward and backward, the embedding's added to the first and the head's and loss's to
        the last: the end stages take fewer blocks, as passes/pipeline_split balances the whole graph."""
        sizes, dtype = {**self.sizes, "B": micro}, self._dtype(plan)
        times = {n: self._part(n, plan).times(sizes, self.hardware, dtype) for n in self.profile.parts}
        out = [times[kind].forward + times[kind].backward for kind in self.profile.blocks]
        for end, index in (("pre", 0), ("post", -1)):
            if out and end in times:
                out[index] += times[end].forward + times[end].backward
        return out

    def _part(self, name: str, plan: Plan) -> PartAtDegree:
        return self.profile.part(name, plan.tp, plan.sequence_parallel)

    def _stages(self, plan: Plan, micro: int, slowdown: float = 1.0) -> tuple[Stage, ...]:
        """Each stage's costs per microbatch; its kernels ``slowdown`` times slower (cores shared)."""
        return self._layout(plan, micro, slowdown)[1]

    def _layout(self, plan: Plan, micro: int, slowdown: float) -> tuple[tuple, tuple[Stage, ...]]:
        """``_stages``, and the key of that stage layout (what the memos of its per-rank sums go by)."""
        # Everything _costed_stages reads of the plan.
        key = (plan.tp, plan.sequence_parallel, plan.recompute, plan.pp, plan.virtual_stages, plan.v_placement,
               plan.pp_cuts, plan.dp, plan.ep, plan.cp, plan.cp_attention, self._dtype(plan), micro,
               slowdown)  # fmt: skip
        stages = self._stage_memo.get(key)
        if stages is None:
            stages = self._stage_memo[key] = tuple(self._costed_stages(plan, micro, slowdown))
        return key, stages

    def _rank_sums(self, layout: tuple, stages: tuple[Stage, ...], plan: Plan) -> tuple[RankSums, ...]:
        key = (layout, plan.v_placement)
        sums = self._sums_memo.get(key)
        if sums is None:
            sums = self._sums_memo[key] = rank_sums(stages, plan.pp, plan.v_placement)
        return sums

    def _costed_stages(self, plan: Plan, micro: int, slowdown: float) -> list[Stage]:
        hw, sizes, dtype = self.hardware, {**self.sizes, "B": micro}, self._dtype(plan)
        out = []
        cut_names = self._parts_per_stage(plan, micro)
        block_iter = iter(self.profile.block_names)
        schedule = self._schedule(plan)
        ranks = [schedule.rank_of(i) if schedule is not None else 0 for i in range(len(cut_names))]
        rank_of_part = {name: ranks[i] for i, names in enumerate(cut_names) for name in names}
        for stage, names in enumerate(cut_names):
            f = b = r = tp = ep = ring = 0.0
            params = elements = largest = groups = partial = expert_params = expert_elements = 0
            kept = transient = boundary = grads_in_flight = held_for_w = w_inputs = weight_grad = 0.0
            runs: dict[tuple[str, str], int] = {}  # (part, recompute choice) -> how many: repeated blocks once
            for name in names:
                layer = next(block_iter) if name.startswith("block") else name
                key = (name, _choice(plan.recompute, layer))
                runs[key] = runs.get(key, 0) + 1
            for (name, choice), count in runs.items():
                part = self._part(name, plan)
                times = part.times(sizes, hw, dtype)
                again = slowdown * times.recompute(part, choice) if choice != "none" else 0.0
                f += count * (slowdown * times.forward + times.tp_forward)
                # A pipeline's matmuls accumulate their weight gradients fused (runtime/pipeline.py: each B, or W)
                backward = times.backward - (times.fused_saving if plan.pp > 1 else 0.0)
                b += count * (slowdown * backward + times.tp_backward + again)
                r += count * again
                # A tied weight whose owner runs on this rank too keeps its gradient in B (one place, whole).
                in_b = {target for target, owner, *_ in part.tied if rank_of_part.get(owner) == ranks[stage]}
                kept_in_b = sum(t for target, t in times.tied_weight_grad if target in in_b)
                weight_grad += count * slowdown * (times.weight_grad - kept_in_b)
                tp += count * (times.tp_forward + times.tp_backward)
                params += count * part.param_bytes
                elements += count * part.param_elements
                largest = max(largest, part.largest_param_bytes)
                groups += count * part.gather_groups
                partial += count * part.partial_grad_bytes
                if plan.ep > 1 and part.moe_layers:  # this rank keeps E / ep of each layer's experts
                    kept_share = part.expert_param_bytes // plan.ep, part.expert_elements // plan.ep
                    params -= count * (part.expert_param_bytes - kept_share[0])
                    elements -= count * (part.expert_elements - kept_share[1])
                    expert_params += count * kept_share[0]
                    expert_elements += count * kept_share[1]
                    exchanges = count * expert_exchanges(part, plan, sizes, hw)
                    f, b, ep = f + exchanges / 2, b + exchanges / 2, ep + exchanges
                k, tr, _, fl, w, saved = part.at(choice, sizes, plan.autocast)
                if plan.cp > 1 and part.attention_kv_bytes != 0:
                    forward, backward = context_exchanges(part, plan, sizes, times, hw, itemsize(dtype))
                    f, b, ring = f + count * forward, b + count * backward, ring + count * (forward + backward)
                    k += ring_kept_block(part, plan, sizes, choice)
                for target, held, inputs in part.tied_held_for_w:
                    if target in in_b:
                        w, saved = w - value(held, sizes), saved - (value(inputs, sizes) if saved else 0.0)
                kept, held_for_w, w_inputs = kept + count * k, held_for_w + count * w, w_inputs + count * saved
                transient, grads_in_flight = max(transient, tr), max(grads_in_flight, fl)
            # A tied parameter whose owner runs on another stage (the head of a pipeline's last stage): a copy.
            copies = {t: (owner, nbytes, n) for name in {name for name, _ in runs}
                      for t, owner, nbytes, n in self._part(name, plan).tied if owner not in names}  # fmt: skip
            params += sum(nbytes for _, nbytes, _ in copies.values())
            elements += sum(n for _, _, n in copies.values())
            if names:  # what the stage's last part hands on
                last = names[-1]
                layer = self.profile.block_names[-1] if last.startswith("block") else last
                boundary = self._part(last, plan).at(_choice(plan.recompute, layer), sizes)[2]
            send = 0.0
            if plan.pp > 1 and names:
                span = plan.dp * plan.tp + 1  # neighbouring stages sit dp x tp ranks apart
                send = hw.collective_seconds("send_recv", boundary, 2, span)
            out.append(Stage(f, b, r, tp, send, params, elements, largest, groups, kept, transient, partial,
                             expert_params, expert_elements, ep, ring, grads_in_flight, held_for_w, frozenset(names),
                             tuple((t, *c) for t, c in copies.items()), weight_grad, w_inputs))  # fmt: skip
        return out

    def _data_parallel(
        self, plan: Plan, sums: tuple[RankSums, ...], window: float, compute: float, node: int
    ) -> tuple[float, float, float, float]:
        """Exposed gradient reduction, exposed ZeRO-3 gathers, the optimizer step, offload traffic (``sums``: each
        pipeline rank's stages; ``node``: the plan's ranks on one node)."""
        hw = self.hardware
        params = max(r.params for r in sums)
        elements = max(r.elements for r in sums)
        per_element = params / max(1, elements)
        grad_bytes = elements * (itemsize(plan.reduce_dtype) if plan.reduce_dtype else per_element)
        replicas = plan.dp * plan.cp  # the ranks holding the same parameters
        span = replicas * plan.tp
        # One collective per flat group, each paying its latency: ZeRO-3's groups are layers, the others' buckets.
        groups = max(r.groups for r in sums)
        later = max(0.0, grad_bytes - plan.first_bucket_bytes)  # the buckets after the smaller first one
        calls = max(1, groups if plan.zero == 3 else 1 + math.ceil(later / plan.bucket_bytes))

        # Experts are data parallel over the dp / ep ranks holding them: their share of the bytes goes there.
        experts = max(r.expert_elements for r in sums) / max(1, elements)

        def collectives(op: str, nbytes: float) -> float:
            seconds = 0.0
            for n, share in ((replicas, 1 - experts), (plan.dp // plan.ep, experts)):
                if share > 0 and n > 1:
                    arrival = hw.sync(n) if op in hw.blocking else 0.0  # a synchronous call waits for the last rank
                    seconds += calls * share * (hw.collective_seconds(op, nbytes / calls, n, span) + arrival)
            return seconds

        dp_comm = zero3 = 0.0
        if replicas > 1:
            if plan.zero == 0:
                reduce = collectives("all_reduce", grad_bytes)
                dp_comm = _exposed(hw, "all_reduce", reduce, window, grad_bytes, plan.bucket_bytes)
            else:
                reduce = collectives("reduce_scatter", grad_bytes)
                dp_comm = _exposed(hw, "reduce_scatter", reduce, window, grad_bytes, grad_bytes / calls)
                if plan.zero < 3:  # the updated shards gathered back after the step: nothing to hide behind
                    dp_comm += collectives("all_gather", params)
            if plan.zero == 3:
                largest = max(r.largest for r in sums)
                gathers = 2 * plan.microbatches * collectives("all_gather", params)
                first = hw.collective_seconds("all_gather", largest, replicas, span)
                zero3 = _exposed(hw, "all_gather", gathers, compute, gathers, 0) + first
        shard = replicas if plan.zero >= 1 else 1
        master = elements * 4
        touched = ADAM_PASSES * master / shard
        optimizer = offload = 0.0
        if plan.offload:
            # The host steps after the gradients are down and before the parameters go back up: in series,
            # each a copy per flat group, the step a few eager CPU kernels per group.
            optimizer = touched / hw.host_memory_bandwidth + ADAM_KERNELS * HOST_OP_OVERHEAD
            offload = 2 * (master / shard / hw.host_bandwidth + hw.op_overhead)
        elif hw.kernels == "cpu":  # the host's step, at what Hardware.measure() times an AdamW step at
            optimizer = hw.sharing(node) * (touched / hw.host_memory_bandwidth + ADAM_KERNELS * hw.op_overhead)
        else:
            # Every rank of a node steps at once: on processors they share, as slowly as their kernels do.
            optimizer = hw.sharing(node) * hw.memory_seconds(touched, kernels=ADAM_KERNELS)
        return dp_comm, zero3, optimizer, offload

    def _recompute_flops(self, plan: Plan, micro: int) -> float:
        """FLOPs recomputation repeats in one step, over every rank."""
        if plan.recompute == "none":
            return 0.0
        key = (plan.tp, plan.sequence_parallel, plan.recompute, micro, plan.cp)
        flops = self._recompute_memo.get(key)
        if flops is None:
            sizes = {**self.sizes, "B": micro}
            flops = 0.0
            for kind, name in zip(self.profile.blocks, self.profile.block_names):
                choice = _choice(plan.recompute, name)
                if choice != "none":
                    flops += self._part(kind, plan).recompute_flops(choice, sizes)
            self._recompute_memo[key] = flops
        return flops * plan.tp * plan.dp * plan.cp * plan.microbatches


def _choice(recompute: Any, layer: str) -> Any:
    if isinstance(recompute, (str, float)):  # a budget: each block its share (the budget of its own bytes)
        return recompute if layer not in ("pre", "post") else "none"
    return "full" if layer in recompute else "none"


def _exposed(hw: Hardware, op: str, seconds: float, window: float, nbytes: float, bucket: float) -> float:
    """What of an asynchronous collective stays on the critical path behind ``window`` seconds of compute:
    all of it where the runtime issues it synchronously, else what overlap cannot hide, at least the last
    bucket's share."""
    if op in hw.blocking:
        return seconds
    last = seconds * min(1.0, bucket / nbytes) if nbytes else 0.0
    return max(seconds - hw.overlap * window, last)
