"""`autoshard demo`: train a small GPT on local gloo ranks next to single-device training."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

import autoshard
from autoshard.launch import LocalRanks
from autoshard.models import TinyGPT, next_token_loss, successor_batch

__all__ = ["TinyGPT", "main", "next_token_loss", "successor_batch"]  # the model and task live in models.py


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
