"""Expert parallelism measured: a Hugging Face Mixtral on 4 gloo ranks, dp=4 with its experts split ep=4.

Memory: the expert parameters, gradients and AdamW state a rank holds at ep=4 against ep=1 (plain dp=4,
every rank holds every expert), read from the rank's own tensors; the dense parts are shown unchanged.

Step time: autoshard's ep=4 against a hand-written PyTorch expert parallelism on the same ranks, model and
batch, as torchtitan's ``ExpertParallel`` does it: each rank holds its E/4 experts (slices of the model's
``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``), sends every (token, expert) row to its
expert's rank with ``all_to_all_single`` (an autograd function: the backward is the reverse exchange),
runs its experts as grouped matmuls and sends the rows back; dense gradients are all-reduced over the 4
ranks by DDP (expert weights left out of it), expert gradients divided by 4 with no exchange (ep = dp:
no other rank holds the same experts). And autoshard's ep=4 against its own ep=1, reported.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import autoshard
from autoshard.ir.placements import Shard
from autoshard.launch import LocalRanks

MOE = {
    "hidden": 256, "intermediate": 512, "experts": 8, "top_k": 2, "layers": 2, "heads": 4, "vocab": 1024,
    "seq": 128, "batch": 8,
}  # fmt: skip


def mixtral(cfg: dict[str, int]) -> nn.Module:
    """A Mixtral of ``cfg``'s sizes (also bench/planner.py's MoE workload), seeded."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.MixtralConfig(
        hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"], num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"], num_key_value_heads=cfg.get("kv_heads", cfg["heads"]),
        num_local_experts=cfg["experts"], num_experts_per_tok=cfg["top_k"], vocab_size=cfg["vocab"],
        max_position_embeddings=cfg["seq"],
        router_jitter_noise=0.0, output_router_logits=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


class _AllToAll(torch.autograd.Function):
    """Rows ``send[i]`` to rank i, ``receive[i]`` from it; the backward sends the gradients the reverse way."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, send: list[int], receive: list[int], group: Any) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, group
        out = rows.new_empty((sum(receive), rows.shape[1]))
        dist.all_to_all_single(out, rows.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out = grad.new_empty((sum(ctx.send), grad.shape[1]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.receive, group=ctx.group)
        return out, None, None, None


class _LocalExperts(nn.Module):
    """This rank's E/ep experts of one Mixtral MoE layer, called as ``mlp.experts(rows, top_k_index, top_k_weights)``
    on the rank's own tokens: torchtitan's token dispatch (sort by expert, all-to-all the counts, then the rows),
    grouped matmuls over the local experts, and the rows back (all-to-all) to be weighted and summed per token."""

    def __init__(self, experts: nn.Module, group: Any) -> None:
        super().__init__()
        self.group, self.ep = group, dist.get_world_size(group)
        self.num_experts = experts.num_experts
        local = self.num_experts // self.ep
        mine = slice(dist.get_rank(group) * local, (dist.get_rank(group) + 1) * local)
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[mine].clone())  # (E/ep, 2I, H)
        self.down_proj = nn.Parameter(experts.down_proj.detach()[mine].clone())  # (E/ep, H, I)
        self.act_fn = experts.act_fn

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        from transformers.integrations.moe import _grouped_mm  # the kernel transformers picks for its own experts

        tokens, top_k = top_k_index.shape
        expert_ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)
        rows = hidden[perm // top_k]  # (tokens * top_k, H), sorted by expert
        counts = torch.bincount(expert_ids, minlength=self.num_experts)
        arriving = torch.empty_like(counts)
        dist.all_to_all_single(arriving, counts, group=self.group)  # rows of each local expert from each rank
        send, receive = counts.view(self.ep, -1), arriving.view(self.ep, -1)  # [rank][local expert]
        send_split, receive_split = send.sum(1).tolist(), receive.sum(1).tolist()
        arrived = _AllToAll.apply(rows, send_split, receive_split, self.group)  # [source rank][local expert]
        # source-major -> expert-major, so each local expert's rows are contiguous for the grouped matmuls
        blocks = torch.arange(arrived.shape[0]).split(receive.reshape(-1).tolist())
        local = receive.shape[1]
        order = torch.cat([blocks[r * local + e] for e in range(local) for r in range(self.ep)])
        offs = torch.cumsum(receive.sum(0), 0, dtype=torch.int32)
        x = arrived[order]
        gate, up = _grouped_mm(x, self.gate_up_proj.transpose(-2, -1), offs).chunk(2, dim=-1)
        y = _grouped_mm(self.act_fn(gate) * up, self.down_proj.transpose(-2, -1), offs)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.shape[0])
        returned = _AllToAll.apply(y[back], receive_split, send_split, self.group)  # in the order sent
        weighted = returned * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
        unsorted = torch.empty_like(weighted)
        unsorted[perm] = weighted
        return unsorted.view(tokens, top_k, -1).sum(dim=1).to(hidden.dtype)


def _hand_written(model: nn.Module, world_size: int) -> tuple[nn.Module, torch.optim.Optimizer, Callable[..., Any]]:
    """The baseline: every MoE layer's experts replaced by this rank's; DDP over the dense parameters only."""
    from torch.nn.parallel import DistributedDataParallel

    group = dist.new_group(list(range(world_size)))  # the all-to-alls apart from DDP's asynchronous all-reduces
    for layer in model.model.layers:
        layer.mlp.experts = _LocalExperts(layer.mlp.experts, group)
    experts = [n for n, _ in model.named_parameters() if ".mlp.experts." in n]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, experts)
    ddp = DistributedDataParallel(model, forward_sync_buffers=False, gradient_as_bucket_view=True)
    expert_params = [p for n, p in model.named_parameters() if n in experts]
    opt = _adamw(model.parameters())

    def step(ids: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        loss = ddp(ids, labels=ids, use_cache=False).loss
        loss.backward()
        for p in expert_params:  # every rank's tokens' gradient arrived through the all-to-all: mean over dp
            p.grad.div_(world_size)
        opt.step()
        return loss.detach()

    return model, opt, step


def _expert_bytes(program: autoshard.Program, keys: set[str]) -> dict[str, int]:
    """Bytes of this rank's expert weights (``keys``), their gradients and their AdamW state (exp_avg, exp_avg_sq)."""
    params = [p for n, p in program.named_parameters() if n in keys]
    state = [program.optimizer.state.get(p, {}) for p in params]
    return {
        "parameters": sum(p.numel() * p.element_size() for p in params),
        "gradients": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
        "optimizer": sum(t.numel() * t.element_size() for s in state for t in s.values() if t.dim() > 0),
    }


def _rank(rank: int, world_size: int, cfg: dict[str, int], steps: int, rounds: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1 + rank)
    local = cfg["batch"] // world_size
    data = [torch.randint(1, cfg["vocab"], (local, cfg["seq"]), generator=gen) for _ in range(steps)]
    example = torch.cat([data[0]] * world_size)
    programs = {}
    for ep in (4, 1):
        programs[ep] = autoshard.compile(
            mixtral(cfg), autoshard.Mesh(dp=world_size), example_inputs=(example,),
            example_kwargs={"labels": example, "use_cache": False}, loss_fn=None, optimizer=_adamw, plan={"ep": ep},
        )  # fmt: skip
    _, _, their_step = _hand_written(mixtral(cfg), world_size)

    def ours(ep: int) -> Callable[[torch.Tensor], float]:
        return lambda ids: programs[ep].step(ids, labels=ids)

    def theirs(ids: torch.Tensor) -> float:
        loss = their_step(ids)
        dist.all_reduce(loss)
        return loss.item() / world_size

    systems = {"autoshard ep4": ours(4), "torch ep4": theirs, "autoshard ep1": ours(1)}
    # The same computation on every side: equal losses over two steps (the second after an optimizer step
    # on gradients that came back through the all-to-alls), else the timing comparison means nothing.
    losses = {name: [fn(ids) for ids in data[:2]] for name, fn in systems.items()}
    first = losses["autoshard ep4"]
    for name, seen in losses.items():
        if any(abs(a - b) > 1e-4 * abs(b) for a, b in zip(seen, first)):
            raise AssertionError(f"losses differ: autoshard ep4 {first}, {name} {seen}")
    for fn in systems.values():  # warm on every batch of the rounds (each routes its own row counts)
        for ids in data:
            fn(ids)
    timings: dict[str, list[float]] = {name: [] for name in systems}
    # Every order of the systems in turn, so that drift hits all alike and each system follows each other one
    # equally often (a system run right after ep=1's larger working set starts on colder caches).
    orders = list(itertools.permutations(systems))
    for round_ in range(rounds):
        for name in orders[round_ % len(orders)]:
            dist.barrier()
            start = time.perf_counter()
            for ids in data:
                systems[name](ids)
            dist.barrier()
            timings[name].append((time.perf_counter() - start) / len(data))
    # The expert weights: those ep=4 splits along dim 0 (at ep=1 the same keys, replicated).
    keys = {k for k, p in programs[4].placements.items() if isinstance(p.ep, Shard)}
    memory = {ep: (programs[ep].last_step_memory, _expert_bytes(programs[ep], keys)) for ep in programs}
    return {"timings": timings, "memory": memory, "losses": losses}


def bench_experts(report: Callable[..., None], ranks: int = 4, steps: int = 3, rounds: int = 12) -> None:
    cfg = MOE
    with LocalRanks(ranks) as pool:
        results = pool.run(_rank, cfg, steps, rounds)
    model = mixtral(cfg)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    described = (
        f"Mixtral {cfg['layers']} layers, hidden {cfg['hidden']}, {cfg['experts']} experts top-{cfg['top_k']}, "
        f"intermediate {cfg['intermediate']} ({total / 1e6:.1f}M params, {experts / 1e6:.1f}M in experts), "
        f"batch {cfg['batch']}x{cfg['seq']}, dp={ranks}"
    )
    mib = 2**20
    held = {}
    for ep in (4, 1):
        whole = {k: max(r["memory"][ep][0][k] for r in results) for k in ("parameters", "gradients", "optimizer")}
        expert = {k: max(r["memory"][ep][1][k] for r in results) for k in whole}
        held[ep] = (sum(expert.values()), sum(whole.values()) - sum(expert.values()), expert)
    detail = {ep: "/".join(f"{v / mib:.1f}" for v in held[ep][2].values()) for ep in held}
    report(
        f"{described}: expert parameters + gradients + AdamW state per rank, ep=4 vs ep=1 (params/grads/optimizer "
        f"MiB {detail[4]} vs {detail[1]}); dense parts {held[4][1] / mib:.1f} MiB vs {held[1][1] / mib:.1f} MiB",
        f"{held[4][0] / mib:.1f} MiB",
        f"ep=1 {held[1][0] / mib:.1f} MiB",
        held[4][0] / held[1][0],
        "<= 0.3",
    )
    step = {name: statistics.median(t for r in results for t in r["timings"][name]) for name in results[0]["timings"]}
    report(
        f"{described}: ep=4 step (gloo, CPU)",
        f"{step['autoshard ep4'] * 1e3:.1f} ms",
        f"hand-written all-to-all EP + DDP {step['torch ep4'] * 1e3:.1f} ms",
        step["autoshard ep4"] / step["torch ep4"],
        "<= 1.0",
    )
    report(
        f"{described}: ep=4 step vs autoshard's ep=1 (replicated experts)",
        f"{step['autoshard ep4'] * 1e3:.1f} ms",
        f"ep=1 {step['autoshard ep1'] * 1e3:.1f} ms",
        step["autoshard ep4"] / step["autoshard ep1"],
        "reported",
    )
