"""Pipeline-parallel training of a small GPT with autoshard, one process per rank.

    torchrun --nproc-per-node 4 examples/train_pp.py --pp 2 --schedule 1f1b --microbatches 4
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 4 --max-restarts 3 \
        examples/train_pp.py --pp 2 --checkpoint-dir ckpt

The mesh is dp x pp = world size. autoshard cuts the model into pp stages of balanced cost, each
rank runs its stage's graph in the schedule's order, and activations and their gradients travel
between neighbouring ranks. Rank 0 prints the plan, the stages and the schedule as a table.

With --checkpoint-dir it saves every --every steps and resumes from the latest checkpoint there
by itself when started again (by torchrun after a rank failed, or by hand).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from training_loop import add_loop_args, batches, train

import autoshard
from autoshard.demo import TinyGPT, next_token_loss
from autoshard.launch import init_from_torchrun
from autoshard.spec.plan import SCHEDULES


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (ranks per pipeline)")
    parser.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    parser.add_argument("--microbatches", type=int, default=4)
    add_loop_args(parser)
    args = parser.parse_args()

    device = init_from_torchrun()  # NCCL and cuda:LOCAL_RANK with GPUs, gloo on CPU
    world = dist.get_world_size()
    if world % args.pp:
        raise SystemExit(f"--pp {args.pp} does not divide the world size {world}")
    torch.manual_seed(0)
    virtual = 2 if args.schedule in ("interleaved_1f1b", "zbv") else 1  # zbv: two stages a rank, as a V
    model = TinyGPT(layers=2 * args.pp * virtual).to(device)

    global_batch = batches(args, device)
    ids, target = global_batch(0)
    program = autoshard.compile(
        model,
        autoshard.Mesh(dp=world // args.pp, pp=args.pp),
        example_inputs=(ids,),
        loss_fn=next_token_loss,
        example_target=target,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
        plan={"schedule": args.schedule, "microbatches": args.microbatches, "virtual_stages": virtual},
    )
    if dist.get_rank() == 0:
        text = program.explain()
        print(text.split("\n\ncandidates:")[0], flush=True)
        print(text[text.index("pipeline stages:") : text.index("\n\npasses:")], flush=True)
    state = train(program, global_batch, args)
    if dist.get_rank() == 0:
        print(f"trained {len(state)} tensors across {args.pp} stages")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
