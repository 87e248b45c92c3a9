"""`autoshard demo`: train a small GPT on local gloo ranks next to single-device training."""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import autoshard
from autoshard.launch import LocalRanks

__all__ = ["TinyGPT", "main", "next_token_loss", "successor_batch"]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(dim)
        # No attention biases (as in Llama): a key bias has a true gradient of zero (softmax ignores a
        # shift shared by all keys), so Adam would amplify rounding noise in it and blur the comparison.
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.ln_2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.fc_out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    """A GPT-2-shaped language model: token and position embeddings, pre-LN blocks, tied LM head."""

    def __init__(self, vocab: int = 256, dim: int = 64, heads: int = 4, layers: int = 2, max_seq: int = 64) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(max_seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, param in self.named_parameters():
            if name.endswith("weight") and param.dim() == 2:
                nn.init.normal_(param, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def successor_batch(step: int, batch: int, seq: int, vocab: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch ``step`` of a task a small model learns in seconds, so the loss visibly falls: every
    token is followed by its successor in one fixed permutation of the vocabulary, from a random first
    token per row. The same on every rank (seeded by ``step``), so a resumed run continues the stream."""
    successor = torch.randperm(vocab, generator=torch.Generator().manual_seed(7))
    tokens = [torch.randint(0, vocab, (batch,), generator=torch.Generator().manual_seed(1000 + step))]
    for _ in range(seq):
        tokens.append(successor[tokens[-1]])
    rows = torch.stack(tokens, dim=1)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def _batches(steps: int, batch: int, seq: int, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [successor_batch(step, batch, seq, vocab) for step in range(steps)]


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3)


def _single_device(steps: int, batch: int, seq: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = TinyGPT()
    opt = _optimizer(model.parameters())
    losses = []
    for ids, target in _batches(steps, batch, seq, 256):
        opt.zero_grad()
        loss = next_token_loss(model(ids), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _rank(rank: int, world_size: int, steps: int, batch: int, seq: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyGPT()
    batches = _batches(steps, batch, seq, 256)
    start = time.perf_counter()
    program = autoshard.compile(
        model,
        world_size,  # an int: the planner picks the degrees
        example_inputs=(batches[0][0],),
        loss_fn=next_token_loss,
        example_target=batches[0][1],
        optimizer=_optimizer,
    )
    compile_seconds = time.perf_counter() - start
    losses = [program.step(program.local_batch(ids), target=program.local_batch(t)) for ids, t in batches]
    return {
        "explain": program.explain() if rank == 0 else "",
        "losses": losses,
        "state": program.full_state_dict(),
        "compile_seconds": compile_seconds,
    }


def main(ranks: int = 4, steps: int = 20, batch: int = 16, seq: int = 32) -> int:
    print(f"autoshard demo: TinyGPT on {ranks} local gloo ranks, global batch {batch} x {seq} tokens, {steps} steps")
    with LocalRanks(ranks) as pool:
        results = pool.run(_rank, steps, batch, seq)
    ref_losses, ref_state = _single_device(steps, batch, seq)
    first = results[0]
    print()
    print(first["explain"])
    print()
    print(f"compiled in {first['compile_seconds']:.2f} s on rank 0")
    print(f"{'step':>4}  {'autoshard loss':>15}  {'single-device loss':>19}  {'relative difference':>20}")
    for i, (mine, ref) in enumerate(zip(first["losses"], ref_losses)):
        print(f"{i:>4}  {mine:>15.6f}  {ref:>19.6f}  {abs(mine - ref) / abs(ref):>20.2e}")
    diffs = {k: ((first["state"][k] - v).norm() / v.norm().clamp_min(1e-12)).item() for k, v in ref_state.items()}
    worst_name = max(diffs, key=diffs.get)
    same_on_all = all(r["losses"] == first["losses"] for r in results)
    print(f"largest relative parameter difference after {steps} steps: {diffs[worst_name]:.2e} ({worst_name})")
    print(f"every rank returned the same losses: {same_on_all}")
    close = all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(first["losses"], ref_losses))
    ok = same_on_all and close and diffs[worst_name] < 1e-4  # float sums in another order, through Adam
    print("OK: distributed training matches single-device training" if ok else "MISMATCH")
    return 0 if ok else 1
