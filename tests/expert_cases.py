"""What the expert-parallel tests run on each rank (importable by the rank processes)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from cases import build_case, compile_case, train_local_batches
from torch import nn
from transformers.modeling_outputs import CausalLMOutput

import autoshard

EP_OPS = ("ep_counts", "ep_dispatch", "ep_combine", "ep_dispatch_grad", "ep_combine_grad")


def exchanges_per_step(rank: int, world_size: int, family: str, mesh: dict[str, int], plan: dict[str, Any]) -> dict:
    """The expert-parallel collectives of one training step, by op, and what this rank holds of the experts."""
    case = build_case(family, steps=1)
    program = compile_case(case, autoshard.Mesh(**mesh), plan=plan)
    program.comm.reset()
    train_local_batches(program, case, [], None)
    experts = {k: tuple(t.shape) for k, t in program.state_dict().items() if "experts" in k}
    return {"calls": {op: program.comm.calls[op] for op in EP_OPS}, "experts": experts}


class GroupedMoE(nn.Module):
    """A mixture of experts as hand-written models do it with ``torch._grouped_mm``: top-k routing, the
    (token, expert) pairs sorted by expert, two grouped matmuls, the weighted sum back per token.
    ``mix_rows``: the activation is centred over all rows between the matmuls (not per row: ep must refuse)."""

    def __init__(self, hidden: int, inter: int, experts: int, top_k: int, mix_rows: bool = False) -> None:
        super().__init__()
        self.experts, self.top_k, self.mix_rows = experts, top_k, mix_rows
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, hidden, 2 * inter) / hidden**0.5)
        self.w_out = nn.Parameter(torch.randn(experts, inter, hidden) / inter**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.router(flat).softmax(-1).topk(self.top_k)
        weights = weights / weights.sum(-1, keepdim=True)
        ids = ids.reshape(-1)
        order = ids.argsort(stable=True)
        rows = flat[order // self.top_k]
        offs = ids.float().histc(self.experts, 0, self.experts - 1).cumsum(0).to(torch.int32)
        gate, up = torch._grouped_mm(rows, self.w_in, offs).chunk(2, dim=-1)
        hidden = F.silu(gate) * up
        if self.mix_rows:
            hidden = hidden - hidden.mean(0, keepdim=True)
        out = torch._grouped_mm(hidden, self.w_out, offs) * weights.reshape(-1)[order].unsqueeze(-1)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return out[back].view(-1, self.top_k, x.shape[-1]).sum(1).view_as(x)


class GroupedMoELM(nn.Module):
    """A small language model whose blocks are a norm and a GroupedMoE (``loop``: a LoopMoE) with a residual."""

    def __init__(
        self, vocab: int, layers: int = 2, mix_rows: bool = False, loop: bool = False, mixed: bool = False
    ) -> None:
        hidden = 32
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(layers))
        moe = (
            (lambda: LoopMoE(hidden, 2 * hidden, 4, 2, mixed))
            if loop
            else (lambda: GroupedMoE(hidden, 2 * hidden, 4, 2, mix_rows))
        )
        self.moes = nn.ModuleList(moe() for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> CausalLMOutput:
        h = self.embed(ids)
        for norm, moe in zip(self.norms, self.moes):
            h = h + moe(norm(h))
        logits = self.head(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return CausalLMOutput(loss=loss, logits=logits)


def explained_load(rank: int, world_size: int, family: str, mesh: dict[str, int], plan: dict[str, Any]) -> dict:
    """explain() after a step, the step's metrics line and expert load, and the report's Experts section."""
    case = build_case(family, steps=1)
    program = compile_case(case, autoshard.Mesh(**mesh), plan=plan)
    train_local_batches(program, case, [], None)
    return {"explain": program.explain(), "load": program.metrics.expert_load, "line": program.metrics.line()}


class LoopMoE(nn.Module):
    """Experts as older and hand-written models run them: a Python loop over the experts, each taking the
    tokens routed to it (``where(ids == e)``) and adding its weighted output back with ``index_add``.
    ``mixed``: expert 1 runs GELU where the others run SiLU (ep, which runs experts in each other's places, must
    refuse)."""

    def __init__(self, hidden: int, inter: int, experts: int, top_k: int, mixed: bool = False) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(
                nn.Linear(hidden, inter), nn.GELU() if mixed and e == 1 else nn.SiLU(), nn.Linear(inter, hidden)
            )
            for e in range(experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.router(flat).softmax(-1).topk(self.top_k)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(ids == e)
            out = out.index_add(0, token, expert(flat[token]) * weights[token, slot, None])
        return out.view_as(x)
