"""Context parallelism: autoshard's cp against torch's ring attention, and what a rank keeps for backward.

torch's ``context_parallel`` dispatches only the CUDA attention kernels to its ring; on the CPU its own ring
functions (``_templated_ring_attention`` and its backward, with the head-tail load balancer) run here on the
CPU's flash kernel, the same kernel autoshard's ring calls, under DDP over the cp ranks: the hand-written
form of torch's context parallelism a user would run on this machine.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from allocations import allocation_trace, malloc_net
from torch import nn

import autoshard
from autoshard.graph_ops import context
from autoshard.launch import LocalRanks
from autoshard.models import TinyGPT, next_token_loss

aten = torch.ops.aten
GPT = {"vocab": 256, "dim": 128, "heads": 4, "layers": 2}


def _model(seq: int) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(GPT["vocab"], GPT["dim"], GPT["heads"], GPT["layers"], max_seq=seq)


def _batch(seq: int, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    rows = torch.randint(0, GPT["vocab"], (batch, seq + 1), generator=gen)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


class _TorchRing(torch.autograd.Function):
    """torch's ring attention (its templated forward and backward, head-tail balanced) on the CPU flash kernel."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale):  # noqa: ANN001, ANN205
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp

        out, lse = cp._templated_ring_attention(
            group, 2, aten._scaled_dot_product_flash_attention_for_cpu, q, k, v, is_causal=True, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp

        q, k, v, out, lse = ctx.saved_tensors
        grads = cp._templated_ring_attention_backward(
            ctx.group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward, grad_out.contiguous(), "grad_out",
            q, k, v, out, lse, True, dropout_p=0.0, scale=ctx.scale,
        )  # fmt: skip
        return grads[0], grads[1], grads[2], None, None


class _TorchCPGPT(nn.Module):
    """TinyGPT as torch's context parallelism runs it: this rank's positions passed in (the user shards them as
    a buffer), attention through torch's ring."""

    def __init__(self, model: TinyGPT, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.model, self.group = model, group

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        m = self.model
        x = m.wte(ids) + m.wpe(positions)
        for block in m.blocks:
            b, s, d = x.shape
            q, k, v = block.qkv(block.ln_1(x)).split(d, dim=-1)
            q, k, v = (t.view(b, s, block.heads, d // block.heads).transpose(1, 2) for t in (q, k, v))
            attn = _TorchRing.apply(q, k, v, self.group, (d // block.heads) ** -0.5)
            x = x + block.proj(attn.transpose(1, 2).reshape(b, s, d))
            x = x + block.fc_out(F.gelu(block.fc(block.ln_2(x))))
        return m.lm_head(m.ln_f(x))


def _rank_step_time(rank: int, world_size: int, seq: int, steps: int, rounds: int) -> dict[str, Any]:
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention

    cp_attention._cp_options.enable_load_balance = True
    ids, target = _batch(seq)
    hardware = autoshard.Hardware.measure()  # the planner's predictions, calibrated on these ranks
    programs = {
        attention: autoshard.compile(
            _model(seq),
            autoshard.Mesh(cp=world_size),
            (ids,),
            loss_fn=next_token_loss,
            optimizer=_adamw,
            example_target=target,
            plan={"cp_attention": attention},
            hardware=hardware,
        )  # fmt: skip
        for attention in ("ring", "all_to_all")
    }
    program = programs["ring"]
    group = dist.group.WORLD
    theirs_model = nn.parallel.DistributedDataParallel(_TorchCPGPT(_model(seq), group))
    theirs_opt = _adamw(theirs_model.parameters())
    positions = context.chunk_positions(seq, rank, world_size)  # torch's head-tail order is the same split
    mine_ids, mine_target = ids.index_select(1, positions), target.index_select(1, positions)

    def ours() -> float:
        return program.step(ids, target=target)

    def all_to_all() -> float:
        return programs["all_to_all"].step(ids, target=target)

    def torch_ring() -> float:
        theirs_opt.zero_grad()
        loss = next_token_loss(theirs_model(mine_ids, positions.unsqueeze(0)), mine_target)
        loss.backward()
        theirs_opt.step()
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        return reported.item() / world_size

    systems = {"autoshard": ours, "torch": torch_ring, "autoshard all-to-all": all_to_all}
    losses = {name: [fn() for _ in range(2)] for name, fn in systems.items()}
    for name, seen in losses.items():
        if any(abs(a - b) > 1e-4 * abs(b) for a, b in zip(seen, losses["autoshard"])):
            raise AssertionError(f"losses differ: autoshard {losses['autoshard']}, {name} {seen}")
    timings: dict[str, list[float]] = {name: [] for name in systems}
    exposed, total, sent = [], [], (0, 0)
    names = list(systems)
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            program.comm.reset()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                systems[name]()
            dist.barrier()
            timings[name].append((time.perf_counter() - start) / steps)
            if name == "autoshard":
                exposed.append(program.comm.seconds["cp_ring"] / steps)
                sent = (program.comm.volume_bytes["cp_ring"] // steps, program.comm.calls["cp_ring"] // steps)
    # The ring's own time: the same sends with nothing to overlap them (each step's K/V laps, forward and
    # backward, and the gradients' lap), as the step's ring sent them.
    cp = program.runtime.cp
    volume, sends = sent
    block = torch.empty(max(1, volume // max(1, sends) // 4))
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(sends):
            cp.wait(cp.exchange([block]))
        total.append(time.perf_counter() - start)
    predicted = {name: p.plan_report.chosen.step_time for name, p in programs.items()}
    return {"timings": timings, "exposed": exposed, "ring": total, "predicted": predicted}


def _rank_memory(rank: int, world_size: int, seq: int, attention: str) -> dict[str, Any]:
    """Bytes one forward of a rank keeps for backward: the allocator's, and the compiler's accounting."""
    ids, target = _batch(seq)
    program = autoshard.compile(
        _model(seq), autoshard.Mesh(cp=world_size), (ids,), loss_fn=next_token_loss, optimizer=_adamw,
        example_target=target, plan={"cp_attention": attention},
    )  # fmt: skip
    program.step(ids, target=target)  # warm: the rank's positions and the optimizer's state are made
    gm = program.runtime.graphs[0]

    outputs, net = malloc_net(lambda: gm(ids, target))
    kept = net - sum(o.untyped_storage().nbytes() for o in outputs if isinstance(o, torch.Tensor))
    outputs[0].backward()
    accounted = sum(memory.evaluate(B=1, S=seq)["kept"] for _, memory in program.compiled.cost.saved_for_backward)
    return {"allocator": kept, "accounting": accounted}


def _single_device_kept(seq: int) -> int:
    model = _model(seq)
    ids, target = _batch(seq)

    def forward() -> torch.Tensor:
        return next_token_loss(model(ids), target)

    loss, net, _ = allocation_trace(forward)
    kept = net - loss.untyped_storage().nbytes()
    loss.backward()
    return kept


def bench_context(report: Callable[..., None], ranks: int = 4, seq: int = 2048, memory_seq: int = 4096) -> None:
    described = f"TinyGPT {GPT['layers']} blocks, width {GPT['dim']}, {GPT['heads']} heads, causal SDPA, one sequence"
    mib = 2**20
    whole = _single_device_kept(memory_seq)
    for attention in ("ring", "all_to_all"):  # ring keeps a K/V block a layer more: where its backward starts
        with LocalRanks(ranks) as pool:
            memory = pool.run(_rank_memory, memory_seq, attention)
        kept = max(r["allocator"] for r in memory)  # the rank that keeps the most
        accounted = max(r["accounting"] for r in memory)
        spread = min(r["allocator"] for r in memory)
        report(
            f"{described} of {memory_seq} tokens: activation bytes a rank keeps for backward at cp={ranks}, "
            f"{attention.replace('_', '-')} attention, vs one device (allocator, the rank keeping most; the least "
            f"{spread / mib:.1f} MiB; the compiler's accounting says {accounted / mib:.1f} MiB, "
            f"{accounted / kept:.3f} of the most)",
            f"{kept / mib:.1f} MiB",
            f"cp=1 {whole / mib:.1f} MiB",
            kept / whole,
            "<= 0.3 (accounting within 10%)",
        )
    with LocalRanks(ranks) as pool:
        results = pool.run(_rank_step_time, seq, 2, 4)
    step = {name: statistics.median(t for r in results for t in r["timings"][name]) for name in results[0]["timings"]}
    report(
        f"{described} of {seq} tokens: cp={ranks} step (gloo, CPU flash kernel on both sides)",
        f"{step['autoshard'] * 1e3:.1f} ms",
        f"torch's ring attention + DDP {step['torch'] * 1e3:.1f} ms",
        step["autoshard"] / step["torch"],
        "<= 1.0",
    )
    report(
        f"{described} of {seq} tokens: cp={ranks} step, all-to-all attention (sequence traded for heads) vs ring",
        f"{step['autoshard all-to-all'] * 1e3:.1f} ms",
        f"ring {step['autoshard'] * 1e3:.1f} ms",
        step["autoshard all-to-all"] / step["autoshard"],
        "reported",
    )
    for name, measured in (("ring", step["autoshard"]), ("all_to_all", step["autoshard all-to-all"])):
        predicted = results[0]["predicted"][name]
        report(
            f"{described} of {seq} tokens: the planner's cp={ranks} {name} step (Hardware.measure() on these ranks) "
            f"vs measured",
            f"{predicted * 1e3:.1f} ms",
            f"measured {measured * 1e3:.1f} ms",
            predicted / measured,
            "0.75 - 1.25",
        )
    exposed = statistics.median(t for r in results for t in r["exposed"])
    ring = statistics.median(t for r in results for t in r["ring"])
    report(
        f"{described} of {seq} tokens: cp={ranks} ring time a step leaves exposed (waits) vs the ring's sends alone",
        f"{exposed * 1e3:.1f} ms",
        f"{ring * 1e3:.1f} ms",
        exposed / ring,
        "<= 0.5",
    )
    # 4 ranks on this machine's 2 cores take turns on them: a rank waits for a block its neighbour has not
    # sent because the neighbour is off its core, whatever the sends cost. 2 ranks with a core each show what
    # the ring's overlap hides where no rank waits for a core.
    with LocalRanks(2) as pool:
        pair = pool.run(_rank_step_time, seq, 2, 4)
    exposed = statistics.median(t for r in pair for t in r["exposed"])
    ring = statistics.median(t for r in pair for t in r["ring"])
    report(
        f"{described} of {seq} tokens: cp=2 (2 ranks, a core each) ring time a step leaves exposed (waits) vs the "
        f"ring's sends alone",
        f"{exposed * 1e3:.1f} ms",
        f"{ring * 1e3:.1f} ms",
        exposed / ring,
        "reported",
    )


if __name__ == "__main__":
    bench_context(lambda *a: print(*a))
