"""The training loop the examples share: resume, train, save every few steps, report.

    parser = argparse.ArgumentParser(); add_loop_args(parser); args = parser.parse_args()
    global_batch = batches(args, device)
    ids, target = global_batch(0)  # compile with the first global batch
    ...
    train(program, global_batch, args)

The data is autoshard.demo.successor_batch: every token followed by its successor in a fixed
permutation, a task a small GPT learns in seconds, so the printed loss falls from ln(256) = 5.55.

With --checkpoint-dir it saves every --every steps and, started again (by torchrun --max-restarts after
a rank failed, or by hand), resumes from the latest complete checkpoint there by itself. Launch
torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 when it may restart: its shared store keeps the
failed attempt's addresses otherwise (autoshard.launch.init_from_torchrun refuses such a restart).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

import autoshard
from autoshard.demo import successor_batch


def add_loop_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16, help="global batch (rows)")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--checkpoint-dir", help="save here every --every steps; resume from the latest")
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--fail-at-step", type=int, help="(testing) rank 1 exits there on the first attempt")


def batches(args: argparse.Namespace, device: torch.device) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """``global_batch(step)``: the step's (ids, target), the same on every rank, on ``device``."""

    def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, target = successor_batch(step, args.batch, args.seq)
        return ids.to(device), target.to(device)

    return global_batch


def train(
    program: autoshard.Program,
    global_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    args: argparse.Namespace,
) -> dict[str, torch.Tensor]:
    """Train to ``args.steps`` on ``global_batch(step)`` (the same on every rank); rank 0 prints each loss.
    Returns the full state on rank 0 (empty elsewhere)."""
    rank = dist.get_rank()
    resumed = program.resume(args.checkpoint_dir) if args.checkpoint_dir else None
    first = program.steps  # 0, or the step the checkpoint was saved after
    if resumed is not None and rank == 0:
        print(f"resumed from {resumed} at step {first}", flush=True)
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for step in range(first, args.steps):
        if step == args.fail_at_step and restarts == 0 and rank == 1:
            os._exit(1)  # a rank fails; torchrun --max-restarts starts the job again
        ids, target = global_batch(step)  # a resumed run continues the same data stream
        loss = program.step(program.local_batch(ids), target=program.local_batch(target))
        if rank == 0:
            print(f"step {step}: loss {loss!r}", flush=True)
        if args.checkpoint_dir and (step + 1) % args.every == 0:
            program.save(f"{args.checkpoint_dir}/step-{step + 1}")
    state = program.full_state_dict()  # the shards joined on rank 0, in the model's own shapes
    if rank == 0:
        print(f"parameter sum {sum(float(v.double().sum()) for v in state.values())!r}", flush=True)
    return state
