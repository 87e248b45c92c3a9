"""3D-parallel training (dp x tp x pp) of a GPT-2-shaped model with autoshard, one process per rank.

    torchrun --nproc-per-node 8 examples/train_3d.py                      # dp=2 x tp=2 x pp=2
    torchrun --nproc-per-node 4 examples/train_3d.py --tp 2 --pp 2        # dp=1

Each pipeline stage runs its blocks tensor-parallel (Megatron's layout, found by autoshard), each
stage's replicas reduce gradients over dp, and the 1F1B schedule runs --microbatches microbatches.
Rank 0 prints the plan, the schedule, the loss every step and a progress line (program.metrics:
tokens/s, TFLOP/s, MFU, the step split into compute, communication and bubble) every 5 steps; with
--report it writes the HTML report after training, with --trace a Chrome trace of steps 2-3.
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.distributed as dist
from training_loop import add_loop_args, batches, train

import autoshard
from autoshard.demo import TinyGPT, next_token_loss
from autoshard.launch import init_from_torchrun


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--report", help="write the HTML report here after training")
    parser.add_argument("--trace", help="write a Chrome trace of two steps here (one file per rank)")
    add_loop_args(parser)
    args = parser.parse_args()

    device = init_from_torchrun()
    world = dist.get_world_size()
    if world % (args.tp * args.pp):
        raise SystemExit(f"tp x pp = {args.tp * args.pp} does not divide the world size {world}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)
    model = TinyGPT(layers=4).to(device)
    global_batch = batches(args, device)
    ids, target = global_batch(0)
    program = autoshard.compile(
        model,
        autoshard.Mesh(dp=world // (args.tp * args.pp), tp=args.tp, pp=args.pp),
        example_inputs=(ids,),
        loss_fn=next_token_loss,
        example_target=target,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
        plan={"schedule": "1f1b", "microbatches": args.microbatches},
        log_every=5,
    )
    if dist.get_rank() == 0:
        print(f"plan: {program.plan}", flush=True)
        print(program.schedule.table(), flush=True)
    if args.trace:
        program.profile(args.trace, steps=2)
    train(program, global_batch, args)
    if args.report:
        program.report(args.report)  # every rank: each sends its measurements to rank 0
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
